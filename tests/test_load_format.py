"""--load-format dummy: a checkpoint folder with config.json alone runs with random weights drawn on the device,
for measuring shapes whose weights are not at hand (tools/make_random_checkpoint.py --config-only)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import assert_pages_returned, tool_module

from atlas import LLM, SamplingParams
from atlas.cli import main
from atlas.errors import ConfigError, ModelLoadError

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (5, 17, 9)]
ENGINE = dict(skip_tokenizer_init=True, kv_cache_memory="16MiB", max_model_len=256)


def _config_only(tmp_path: Path, shape: str, **extra) -> Path:
    tool = tool_module("make_random_checkpoint")
    out = tmp_path / shape
    assert tool.main(["--shape", shape, "--out", str(out), "--config-only", "--dflash-drafter"]) == 0
    if extra:
        cfg = json.loads((out / "config.json").read_text())
        (out / "config.json").write_text(json.dumps({**cfg, **extra}))
    assert not list(out.rglob("*.safetensors"))
    return out


def _tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]


def test_a_config_only_folder_runs_with_dummy_weights(tmp_path):
    path = _config_only(tmp_path, "tiny")
    llm = LLM(str(path), load_format="dummy", **ENGINE)
    params = list(llm.engine.runner.model.parameters())
    assert params and all(p.abs().max() <= 1e-3 and p.abs().max() > 0 for p in params)
    first = _tokens(llm)
    assert [len(t) for t in first] == [12, 12, 12]
    assert_pages_returned(llm)
    # The same values every start (a seed per parameter): benchmarks of a shape are repeatable.
    assert _tokens(LLM(str(path), load_format="dummy", **ENGINE)) == first


def test_without_weights_the_error_names_the_dummy_format(tmp_path):
    path = _config_only(tmp_path, "tiny")
    with pytest.raises(ModelLoadError, match="no \\*.safetensors weights .*--load-format dummy"):
        LLM(str(path), **ENGINE)
    with pytest.raises(ConfigError, match="--load-format must be one of auto, safetensors, dummy"):
        LLM(str(path), load_format="pickle", **ENGINE)


def test_dflash_over_dummy_weights_keeps_plain_greedy(tmp_path):
    """The drafter is drawn too (its folder holds a config.json alone); the target's values are the plain
    engine's, so speculative greedy equals plain greedy."""
    path = _config_only(tmp_path, "tiny")
    plain = _tokens(LLM(str(path), load_format="dummy", **ENGINE))
    llm = LLM(str(path), load_format="dummy", speculative="dflash", draft_model=str(path / "dflash-drafter"), **ENGINE)
    assert _tokens(llm) == plain
    assert llm.engine.stats.spec_num_draft_tokens > 0
    assert_pages_returned(llm)


def test_a_deepseek_shape_with_mtp_runs_with_dummy_weights(tmp_path):
    """MLA, routed experts and the MTP module, all drawn: the MTP module's own parameters only (the target's
    embedding, which it shares, keeps the target's values: greedy equals the plain engine's)."""
    path = _config_only(tmp_path, "deepseek-tiny", num_nextn_predict_layers=1)
    plain = _tokens(LLM(str(path), load_format="dummy", **ENGINE))
    llm = LLM(str(path), load_format="dummy", speculative="mtp", **ENGINE)
    assert _tokens(llm) == plain
    assert llm.engine.stats.spec_num_draft_tokens > 0
    assert_pages_returned(llm)


def _latency(path: Path, out: Path, *extra: str) -> dict:
    assert main(["--log-level", "warning", "bench", "latency", "--model", str(path), "--load-format", "dummy",
                 "--skip-tokenizer-init", "--batch-size", "1", "--input-len", "8", "--output-len", "4",
                 "--num-iters", "1", "--num-iters-warmup", "1", "--kv-cache-memory", "8MiB", "--num-cpu-threads", "1",
                 "--output-json", str(out), *extra]) == 0
    return json.loads(out.read_text())


def test_bench_latency_runs_a_dummy_shape_with_floors_of_one_rank(tmp_path, monkeypatch):
    """The peer reads weights, so a dummy run has none; under tensor parallelism the floors are one rank's:
    its share of the weights, of the FLOPs and of the KV heads (a 2-rank floor about half a 1-rank one)."""
    monkeypatch.setattr("atlas.bench.latency.copy_bandwidth", lambda device: 1e10)
    monkeypatch.setattr("atlas.bench.latency.device_peak_flops", lambda device: 1e9)
    path = _config_only(tmp_path, "tiny")
    one = _latency(path, tmp_path / "tp1.json")
    two = _latency(path, tmp_path / "tp2.json", "-tp", "2")
    for report in (one, two):
        assert [(r["engine"], r["batch_size"]) for r in report["rows"]] == [("atlas", 1)]
        assert report["rows"][0]["ms_per_step"] > 0 and "dummy" in report["meta"]["peer_note"]
    assert 0.45 < two["meta"]["weight_read_bytes_per_step"] / one["meta"]["weight_read_bytes_per_step"] < 0.55
    for floor in ("ttft_floor_ms", "decode_floor_ms"):
        assert 0.45 < two["rows"][0][floor] / one["rows"][0][floor] < 0.55, floor


def test_tensor_parallel_ranks_draw_their_own_shards(tmp_path):
    """Each rank of a tensor-parallel engine fills the shards it holds (nothing is read on any rank)."""
    path = _config_only(tmp_path, "tiny")
    llm = LLM(str(path), load_format="dummy", tensor_parallel_size=2, num_cpu_threads=1, distributed_timeout=10.0,
              **ENGINE)
    try:
        assert [len(t) for t in _tokens(llm)] == [12, 12, 12]
        assert_pages_returned(llm)
    finally:
        llm.shutdown()


def test_bench_throughput_counts_every_gpu_in_its_compute_floor(tmp_path, monkeypatch):
    monkeypatch.setattr("atlas.bench.throughput.device_peak_flops", lambda device: 1e9)
    path = _config_only(tmp_path, "tiny")
    floors = []
    for extra in ([], ["-tp", "2"]):
        out = tmp_path / f"tput{len(extra)}.json"
        assert main(["--log-level", "warning", "bench", "throughput", "--model", str(path), "--load-format", "dummy",
                     "--skip-tokenizer-init", "--num-prompts", "6", "--input-len", "16", "--output-len", "8",
                     "--kv-cache-memory", "8MiB", "--num-cpu-threads", "1", "--output-json", str(out), *extra]) == 0
        [row] = json.loads(out.read_text())["rows"]
        assert row["output_tok_per_s"] > 0
        floors.append(row["compute_floor_s"])
    assert floors[1] == pytest.approx(floors[0] / 2)
