"""`atlas bench serve`'s engine-side split of TTFT, read from a real server's /metrics."""

from __future__ import annotations

import httpx
import pytest

from atlas.bench.serve_load import engine_phase_means, engine_phase_totals
from tests.serving import start_server

pytest.importorskip("prometheus_client")


def test_engine_phase_means_cover_only_the_requests_between_two_scrapes():
    server = start_server("atlas/assets/default-model", max_num_seqs=4)
    try:
        body = {"prompt": "def f(", "max_tokens": 3, "temperature": 0}
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).raise_for_status()
        before = engine_phase_totals(server.url, None)
        assert set(before) == {"ttft", "queue", "handover", "prefill"} and before["ttft"][1] == 1
        for _ in range(2):
            httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).raise_for_status()
        after = engine_phase_totals(server.url, None)
        assert after["ttft"][1] == 3
        means = engine_phase_means(before, after)
        expected = (after["ttft"][0] - before["ttft"][0]) / 2
        assert means["ttft"] == pytest.approx(expected) and means["ttft"] > 0
        # the first token comes after the request's first step, which comes after its arrival
        assert means["ttft"] >= means["queue"] and means["ttft"] >= means["prefill"]
        # the hand-over (arrival until the engine core took the request in) is part of the queue
        assert 0 <= means["handover"] <= means["queue"]
        assert engine_phase_means(after, after) is None  # nothing finished between the two
    finally:
        server.stop()


def test_no_engine_figures_from_a_server_without_metrics():
    assert engine_phase_totals("http://127.0.0.1:9", None) is None  # (nothing listens on the discard port)
    assert engine_phase_means(None, {"ttft": (1.0, 1)}) is None


def test_the_offline_peer_splits_its_ttft_as_the_server_engine_does():
    """The peer's queue and prefill means (the split the server's engine reports in /metrics) add up to its TTFT
    mean, with two requests in flight of four."""
    import argparse

    from atlas.bench.serve_load import add_serve_benchmark, offline_peer

    parser = argparse.ArgumentParser()
    add_serve_benchmark(parser.add_subparsers())
    args = parser.parse_args(["serve", "--model", "atlas/assets/default-model", "--num-requests", "4",
                              "--concurrency", "2", "--max-tokens", "4"])
    peer = offline_peer(args, ["def f(", "x = [1,"])
    assert peer["requests"] == 4 and peer["output_tokens"] == 16
    means = peer["engine_side_means_s"]
    assert set(means) == {"ttft", "queue", "handover", "prefill"} and min(means.values()) >= 0
    assert means["handover"] <= means["queue"]
    assert means["queue"] + means["prefill"] == pytest.approx(means["ttft"], abs=1e-3)
    assert means["ttft"] == pytest.approx(peer["ttft_s"]["mean"])


def test_engine_flags_pass_list_and_json_flags_to_the_server_as_it_parses_them():
    """The server `atlas bench serve` starts gets the bench's engine flags back in a form `atlas serve` parses to
    the same config (lists as several values, objects as JSON)."""
    from atlas.bench.serve_load import engine_flags
    from atlas.cli import build_parser, parse_args
    from atlas.config import EngineConfig

    argv = ["--enable-lora", "--lora-modules", "a=/x", "b=/y", "--hf-overrides", '{"rope_theta": 5.0}',
            "--max-model-len", "256"]
    bench = parse_args(build_parser(), ["bench", "serve", *argv])
    served = parse_args(build_parser(), ["serve", *engine_flags(bench)])
    assert EngineConfig.from_cli_args(served) == EngineConfig.from_cli_args(bench)
    assert list(EngineConfig.from_cli_args(served).lora_modules) == ["a=/x", "b=/y"]


def test_vllm_bench_serve_names_mean_the_same_load():
    """`vllm bench serve`'s --num-prompts, --max-concurrency, --random-input-len and --random-output-len are the
    same settings as Atlas's own names."""
    from atlas.cli import build_parser, parse_args

    def load(argv):
        args = parse_args(build_parser(), ["bench", "serve", *argv])
        return args.num_requests, args.concurrency, args.input_len, args.max_tokens

    assert load(["--num-prompts", "64", "--max-concurrency", "8", "--random-input-len", "128",
                 "--random-output-len", "32"]) == load(["--num-requests", "64", "--concurrency", "8", "--input-len",
                                                        "128", "--max-tokens", "32"]) == (64, 8, 128, 32)
