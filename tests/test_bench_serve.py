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
        assert set(before) == {"ttft", "queue", "prefill"} and before["ttft"][1] == 1
        for _ in range(2):
            httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).raise_for_status()
        after = engine_phase_totals(server.url, None)
        assert after["ttft"][1] == 3
        means = engine_phase_means(before, after)
        expected = (after["ttft"][0] - before["ttft"][0]) / 2
        assert means["ttft"] == pytest.approx(expected) and means["ttft"] > 0
        # the first token comes after the request's first step, which comes after its arrival
        assert means["ttft"] >= means["queue"] and means["ttft"] >= means["prefill"]
        assert engine_phase_means(after, after) is None  # nothing finished between the two
    finally:
        server.stop()


def test_no_engine_figures_from_a_server_without_metrics():
    assert engine_phase_totals("http://127.0.0.1:9", None) is None  # (nothing listens on the discard port)
    assert engine_phase_means(None, {"ttft": (1.0, 1)}) is None
