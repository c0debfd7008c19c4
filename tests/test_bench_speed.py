"""Speed benchmarks on the CPU: the plain-PyTorch peer against transformers, `atlas bench latency` and
`atlas bench throughput` end to end on a tiny model, the random-checkpoint tool, and the roofline and
profile arithmetic."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import (
    DEEPSEEK_CONFIGS,
    build_checkpoint,
    build_deepseek_checkpoint,
    checkpoint_tool,
    hf_greedy,
    hf_model,
)

from atlas.bench.kernel_profile import DeviceEvent, busy_us, classify, summarize
from atlas.bench.peer import PeerDecoder, unsupported_reason
from atlas.bench.roofline import (
    ModelShape,
    decode_step_bytes,
    floor_seconds,
    matmul_peak,
    mean_decode_context,
    prefill_flops,
)
from atlas.cli import main

LATENCY_ROW_KEYS = {"engine", "batch_size", "ttft_ms", "ttft_floor_ms", "ttft_roofline_fraction", "ms_per_step",
                    "decode_floor_ms", "decode_roofline_fraction", "decode_tok_per_s", "output_tok_per_s",
                    "latency_s", "decode_x_peer", "ttft_x_peer"}
PROFILE_KEYS = {"device_events", "steps", "kernels_per_step", "kernels_per_layer", "kernel_ms_per_step",
                "busy_ms_per_step", "wall_ms_per_step", "host_gap_ms_per_step", "by_kind", "top_kernels"}


def run_bench(out: Path, *args: str, log_level: str = "warning") -> dict:
    """`atlas bench ARGS --output-json OUT`: it must exit 0; -> the JSON report it wrote."""
    assert main(["--log-level", log_level, "bench", *args, "--output-json", str(out)]) == 0
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("random-ckpt") / "tiny"
    assert checkpoint_tool().main(["--shape", "tiny", "--out", str(out), "--dflash-drafter"]) == 0
    return out


# ---------------------------------------------------------------------------------------- the peer
@pytest.mark.parametrize("arch", ["Qwen3ForCausalLM", "LlamaForCausalLM", "Qwen2ForCausalLM"])
def test_peer_greedy_equals_transformers(tmp_path, arch):
    path = build_checkpoint(tmp_path, arch, None, rope_scaling=None)  # plain RoPE (the fixtures scale it)
    prompts = torch.randint(10, 384, (3, 9), generator=torch.Generator().manual_seed(1)).tolist()
    peer = PeerDecoder(path, device="cpu", dtype=torch.float32, use_graph=False)
    hf = hf_model(path)
    assert peer.generate(prompts, 16) == [hf_greedy(hf, p, 16) for p in prompts]


def test_peer_refuses_scaled_rope(tmp_path):
    path = build_checkpoint(tmp_path, "LlamaForCausalLM", None)  # llama3 RoPE scaling
    with pytest.raises(ValueError, match="plain RoPE"):
        PeerDecoder(path, device="cpu", dtype=torch.float32)


# ---------------------------------------------------------------------------------------- the checkpoint tool
def test_random_checkpoint_loads_in_transformers_and_atlas(tiny):
    from transformers import AutoModelForCausalLM

    from atlas import LLM, SamplingParams

    cfg = json.loads((tiny / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3ForCausalLM"] and (tiny / "generation_config.json").is_file()
    model, info = AutoModelForCausalLM.from_pretrained(tiny, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    shape = ModelShape.from_config(cfg)
    assert sum(p.numel() for p in model.parameters()) == shape.non_embedding_params + 2 * shape.embedding_params
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    out = LLM(str(tiny), skip_tokenizer_init=True, kv_cache_memory="8MiB").generate([[5, 6, 7, 8]], params)
    assert len(out[0].outputs[0].token_ids) == 6

    drafter = json.loads((tiny / "dflash-drafter" / "config.json").read_text())
    assert drafter["architectures"] == ["DFlashDraftModel"]
    assert drafter["dflash_config"]["target_layer_ids"] == [1] and drafter["block_size"] == 4
    llm = LLM(str(tiny), skip_tokenizer_init=True, kv_cache_memory="8MiB", speculative="dflash", speculative_policy="always",
              draft_model=str(tiny / "dflash-drafter"))
    out = llm.generate([[5, 6, 7, 8]], params)
    assert len(out[0].outputs[0].token_ids) == 6 and llm.engine.stats.spec_num_verify_steps > 0


def test_published_drafter_layout():
    tool = checkpoint_tool()
    cfg = tool.drafter_config(tool.SHAPES["qwen3-8b"], 5, 16, "bfloat16")
    assert cfg["dflash_config"] == {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]}
    assert cfg["num_target_layers"] == 36 and cfg["num_hidden_layers"] == 5
    names = dict(tool.drafter_tensors(cfg))
    assert len(names) == 58 and names["fc.weight"] == (4096, 5 * 4096)
    assert not any(n.startswith(("embed_tokens", "lm_head")) for n in names)
    target = tool.target_tensors(tool.SHAPES["qwen3-8b"])
    shape = ModelShape.from_config(tool.model_config(tool.SHAPES["qwen3-8b"], "bfloat16"))
    assert sum(torch.Size(s).numel() for _, s in target) == 8_190_735_360
    assert shape.non_embedding_params + 2 * shape.embedding_params == 8_190_735_360


# ---------------------------------------------------------------------------------------- the commands
def test_bench_latency_end_to_end(tiny, tmp_path, monkeypatch):
    # Stand-in device ceilings, so that the CPU run fills in the roofline columns too. (Three iterations: the step
    # time is the median whole run less the median one-token run, and one one-token run that a busy host held up
    # made it negative.)
    monkeypatch.setattr("atlas.bench.latency.copy_bandwidth", lambda device: 1e10)
    monkeypatch.setattr("atlas.bench.latency.device_peak_flops", lambda device: 1e11)
    out = tmp_path / "latency.json"
    report = run_bench(out, "latency", "--model", str(tiny), "--skip-tokenizer-init", "--batch-size", "1,2",
                       "--input-len", "8", "--output-len", "16", "--num-iters", "3", "--num-iters-warmup", "1",
                       "--kv-cache-memory", "8MiB", "--profile", str(tmp_path / "profile"), "--profile-steps", "2")
    assert out.with_suffix(".txt").read_text().startswith("latency: 8 in / 16 out")
    assert {(r["engine"], r["batch_size"]) for r in report["rows"]} == {
        (e, b) for e in ("atlas", "pytorch") for b in (1, 2)}
    for row in report["rows"]:
        assert set(row) == LATENCY_ROW_KEYS
        assert row["ttft_ms"] > 0 and row["ms_per_step"] > 0 and row["decode_roofline_fraction"] > 0
        assert row["ttft_roofline_fraction"] > 0 and row["decode_x_peer"] > 0
    meta = report["meta"]
    assert meta["complete"] is True and meta["errors"] == {}
    assert meta["copy_bandwidth_bytes_per_s"] == 1e10 and meta["kv_pool"]["num_pages"] > 0
    assert meta["weight_read_bytes_per_step"] < meta["weight_bytes"]  # untied: the embedding is looked up
    atlas_runs = [r for r in report["runs"] if r["engine"] == "atlas"]
    # 1 prefill + 15 decodes each iteration (15 steps against the one-token run: the step time stays positive on a
    # busy machine, where 3 once did not)
    assert all(steps == [16] * 3 for steps in (r["engine_steps"] for r in atlas_runs))
    for b in (1, 2):
        profile = json.loads((tmp_path / "profile" / f"latency_b{b}_in8.json").read_text())
        for engine in ("atlas", "pytorch"):
            assert set(profile[engine]) >= PROFILE_KEYS and profile[engine]["kernels_per_step"] > 0
            assert (tmp_path / "profile" / f"latency_b{b}_in8_{engine}_table.txt").is_file()
        # Atlas's window holds decode steps alone, timed a second time without the profiler.
        ours = profile["atlas"]
        assert ours["window"].startswith("steady decode") and ours["unprofiled_wall_ms_per_step"] > 0
        assert ours["host_stages_unprofiled"]["launch"]["calls_per_step"] == 1
        assert ours["host_stages"]["schedule"]["calls_per_step"] == 1
        # The prefill of b prompts of 8 tokens: one chunk, its kernels counted once.
        prefill = profile["atlas-prefill"]
        assert set(prefill) >= PROFILE_KEYS and prefill["steps"] == 1 and prefill["kernels_per_step"] > 0
    assert (tmp_path / "profile" / "latency_in8_summary.txt").is_file()


def test_bench_throughput_end_to_end(tiny, tmp_path):
    out = tmp_path / "throughput.json"
    args = ["throughput", "--model", str(tiny), "--skip-tokenizer-init", "--kv-cache-memory", "8MiB",
            "--num-prompts-warmup", "2"]
    report = run_bench(out, *args, "--num-prompts", "6", "--input-len", "10", "--output-len", "6",
                       "--random-range-ratio", "0.5")
    row = report["rows"][0]
    assert {"num_prompts", "requests_per_s", "output_tok_per_s", "total_tok_per_s", "elapsed_s", "prompt_tokens",
            "output_tokens", "compute_floor_s", "roofline_fraction", "peak_allocated_gib", "kv_pool_tokens"} <= set(row)
    assert row["num_prompts"] == 6 and 6 * 5 <= row["prompt_tokens"] <= 6 * 15 and 6 * 3 <= row["output_tokens"] <= 6 * 9
    assert {"elapsed_time", "num_requests", "total_num_tokens", "requests_per_second", "tokens_per_second",
            "memory", "kv_pool", "engine_steps", "host_pauses"} <= set(report)
    assert set(report["host_pauses"]) == {"gc", "cuda_allocator"}
    assert report["kv_pool"]["token_capacity"] == row["kv_pool_tokens"] > 0

    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text('{"prompt_token_ids": [5, 6, 7], "output_len": 3}\n{"prompt_token_ids": [8, 9], "max_tokens": 5}\n')
    report = run_bench(out, *args, "--num-prompts", "3", "--dataset", str(dataset), "--step-timeline")
    row = report["rows"][0]
    assert row["prompt_tokens"] == 3 + 2 + 3 and row["output_tokens"] == 3 + 5 + 3  # cycled
    # The timeline: every prompt token in steps that carry prompt tokens, every later token in a decode row
    # (the first output token of each request comes from its prefill step).
    timeline = report["step_timeline"]
    assert timeline["steps_with_prompt_tokens"]["prompt_tokens"] == 3 + 2 + 3
    decode_rows = timeline["steps_with_prompt_tokens"]["decode_rows"] + timeline["decode_steps"]["tokens"]
    assert decode_rows == (3 - 1) + (5 - 1) + (3 - 1)
    assert timeline["steps_with_prompt_tokens"]["steps"] + timeline["decode_steps"]["steps"] == report["engine_steps"]
    assert report["elapsed_time"] >= timeline["steps_with_prompt_tokens"]["seconds"] + timeline["decode_steps"]["seconds"] > 0


# ---------------------------------------------------------------------------------------- arithmetic
def test_roofline_arithmetic():
    shape = ModelShape(layers=2, hidden=8, heads=2, kv_heads=1, head_dim=4, intermediate=16, vocab=10, tied=False)
    assert shape.layer_params == 8 * (2 * 8 + 2 * 4) + 3 * 8 * 16 + 2 * 8
    # 2 x params x tokens + causal attention (4 x layers x heads x head_dim x pairs) + the LM head once
    assert prefill_flops(shape, 3, 5) == 3 * (2 * shape.non_embedding_params * 5 + 4 * 2 * 2 * 4 * 15 + 2 * 80)
    assert mean_decode_context(100, 5) == 102.5  # keys 101..104
    assert decode_step_bytes(1000, shape, 2, 4, 10.0) == 1000 + 4 * 10 * (2 * 2 * 1 * 4) * 2
    assert floor_seconds(10.0, 100.0, 5.0, 20.0) == {"compute_s": 2.0, "memory_s": 5.0, "floor_s": 5.0}
    assert floor_seconds(10.0, 100.0, None, None)["floor_s"] is None
    assert matmul_peak(torch.device("cpu"), n=64, dtype=torch.float32, iters=3, warmup=1) > 0


def test_profile_summary():
    names = {"nvjet_tst_64x8": "matmul", "fmha_cutlassF_bf16_aligned": "attention", "Memcpy DtoD": "copy",
             "_paged_attention_kernel": "attention", "void at::native::vectorized_elementwise_kernel<add>":
             "elementwise_reduction", "_rms_norm_kernel": "elementwise_reduction", "my_kernel": "other",
             "aten::addmm": "matmul", "aten::copy_": "copy", "_gemv_kernel": "matmul",
             "_paged_attention_combine_kernel": "attention",
             "_ZN7cutlass13device_kernelIN2at4cuda6detail25enable_3x_kernel_for_sm9xINS_4gemm6kernel13GemmUniversal"
             "IN4cute4CopyINS_17SM90_TMA_LOADEEE": "matmul",
             "void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda>": "copy"}
    assert {n: classify(n) for n in names} == names
    events = [DeviceEvent("nvjet_a", 0, 10), DeviceEvent("fmha_b", 5, 10), DeviceEvent("Memset (Device)", 30, 2),
              DeviceEvent("nvjet_a", 40, 10)]
    assert busy_us(events) == 15 + 2 + 10
    s = summarize(events, steps=2, num_layers=2, wall_s_per_step=0.1, device=torch.device("cuda"))
    assert s["kernels_per_step"] == 2 and s["kernels_per_layer"] == 1
    assert s["by_kind"]["matmul"]["kernels_per_step"] == 1 and s["by_kind"]["matmul"]["ms_per_step"] == 0.01
    assert s["kernel_ms_per_step"] == pytest.approx(0.016) and s["busy_ms_per_step"] == pytest.approx(0.0135)
    assert s["host_gap_ms_per_step"] == pytest.approx(100 - 0.016)
    assert s["top_kernels"][0] == {"name": "nvjet_a", "kind": "matmul", "calls_per_step": 1, "ms_per_step": 0.01}
    # Idle: 15 us after fmha_b (it ends last) before the memset, 8 us after the memset before nvjet_a.
    assert s["idle_ms_per_step"] == pytest.approx(0.0115)
    assert [(g["after"], g["before"]) for g in s["idle_gaps"]] == [("fmha_b", "Memset (Device)"),
                                                                   ("Memset (Device)", "nvjet_a")]


def test_bench_latency_without_a_peer_for_scaled_rope(tmp_path):
    path = build_checkpoint(tmp_path, "LlamaForCausalLM", None)  # llama3 RoPE: the plain peer refuses it
    out = tmp_path / "latency.json"
    report = run_bench(out, "latency", "--model", str(path), "--skip-tokenizer-init", "--batch-size", "1",
                       "--input-len", "4", "--output-len", "2", "--num-iters", "1", "--num-iters-warmup", "0",
                       "--kv-cache-memory", "8MiB", log_level="error")
    assert [r["engine"] for r in report["rows"]] == ["atlas"] and report["rows"][0]["decode_x_peer"] is None
    assert "plain RoPE" in report["meta"]["errors"]["pytorch"]


def test_bench_latency_with_hf_overrides_runs_the_changed_config_and_no_peer(tmp_path):
    """--hf-overrides: the engine and the roofline's shape take the changed config; the plain peer, which reads the
    checkpoint's own, is left out with the reason."""
    path = build_checkpoint(tmp_path, "Qwen2ForCausalLM", None)
    out = tmp_path / "latency.json"
    report = run_bench(out, "latency", "--model", str(path), "--skip-tokenizer-init", "--batch-size", "1",
                       "--input-len", "4", "--output-len", "2", "--num-iters", "1", "--num-iters-warmup", "0",
                       "--kv-cache-memory", "8MiB", "--hf-overrides", '{"num_hidden_layers": 1}', log_level="error")
    assert [r["engine"] for r in report["rows"]] == ["atlas"]
    assert "--hf-overrides" in report["meta"]["peer_note"]


def test_bench_spec_cost_end_to_end(tiny, tmp_path):
    """Plain, verify-K and DFlash-K steps of the tiny model and its random drafter: every step kind is
    timed, verify steps really verify K drafts, and the tau speed-ups follow from the step times; with
    --profile, each kind of step's kernels and host gap."""
    out = tmp_path / "spec_cost.json"
    rows = run_bench(out, "spec-cost", "--model", str(tiny), "--skip-tokenizer-init", "--kv-cache-memory", "8MiB",
                     "--draft-model", str(tiny / "dflash-drafter"), "--draft-lengths", "2,3", "--input-len", "8",
                     "--output-len", "6", "--num-iters", "1", "--profile", str(tmp_path / "prof"),
                     "--profile-steps", "3")["rows"]
    for stem in ("plain_b1", "verify2_b1", "dflash3_b1"):
        summary = json.loads((tmp_path / "prof" / f"spec_cost_{stem}.json").read_text())
        assert summary["kernels_per_step"] > 0 and summary["host_gap_ms_per_step"] is not None
        # The host stages of every step, timed from profiler ranges (a verify step's drafts are proposed)
        stages = summary["host_stages"]
        assert {"schedule", "launch", "prepare_inputs", "update_from_output"} <= set(stages)
        assert stages["launch"]["calls_per_step"] == 1 and stages["launch"]["ms_per_step"] > 0
        assert ("propose" in stages) == (stem != "plain_b1")
        assert summary["host_stages_unprofiled"]["launch"]["calls_per_step"] == 1
    assert (tmp_path / "prof" / "spec_cost_summary.txt").read_text().count("spec-cost ") == 5
    assert [(r["step"], r["K"]) for r in rows] == [("plain", None), ("verify", 2), ("verify", 3), ("dflash", 2),
                                                  ("dflash", 3)]
    plain = rows[0]["ms_per_step"]
    for r in rows:
        assert r["ms_per_step"] > 0 and r["x_plain"] == pytest.approx(r["ms_per_step"] / plain)
        if r["step"] != "plain":
            assert r["acceptance_length"] is not None and r["acceptance_length"] >= 1
            assert r["speedup_tau5"] == pytest.approx(5 * plain / r["ms_per_step"])


def test_bench_spec_cost_with_a_token_map(tiny, tmp_path):
    """--speculative-token-map reaches the DFlash engine only (the plain and verify engines run without it)."""
    token_map = tmp_path / "map.json"
    token_map.write_text(json.dumps(list(range(0, 64))))
    rows = run_bench(tmp_path / "spec_cost.json", "spec-cost", "--model", str(tiny), "--skip-tokenizer-init",
                     "--kv-cache-memory", "8MiB", "--draft-model", str(tiny / "dflash-drafter"), "--draft-lengths", "2",
                     "--speculative-token-map", str(token_map), "--input-len", "8", "--output-len", "6",
                     "--num-iters", "1")["rows"]
    assert [(r["step"], r["K"]) for r in rows] == [("plain", None), ("verify", 2), ("dflash", 2)]
    assert all(r["ms_per_step"] > 0 for r in rows)


def test_bench_spec_cost_times_the_drafter_speculative_names(tiny, tmp_path):
    """--speculative draft_model: the drafter rows are that drafter's steps (the tiny model drafting for itself, so
    its drafts are accepted, where the verify rows' fixed drafts are not)."""
    rows = run_bench(tmp_path / "spec_cost.json", "spec-cost", "--model", str(tiny), "--skip-tokenizer-init",
                     "--kv-cache-memory", "8MiB", "--speculative", "draft_model", "--draft-model", str(tiny),
                     "--draft-lengths", "2", "--input-len", "8", "--output-len", "12", "--num-iters", "1")["rows"]
    assert [(r["step"], r["K"]) for r in rows] == [("plain", None), ("verify", 2), ("draft_model", 2)]
    assert rows[2]["acceptance_length"] > 2.5 and rows[2]["ms_per_step"] > 0


# ---------------------------------------------------------------------------------------- MLA and MoE
def _deepseek_v3_config() -> dict:
    """The tests' tiny DeepSeek-V3 (3 layers, the first dense; 8 routed experts, top-2, one shared), as
    transformers writes its config.json."""
    from transformers import AutoConfig

    spec = dict(DEEPSEEK_CONFIGS["v3"])
    model_type = spec.pop("model_type")
    return AutoConfig.for_model(model_type, vocab_size=384, hidden_size=64, intermediate_size=128,
                                max_position_embeddings=512, rms_norm_eps=1e-6, eos_token_id=0, **spec).to_dict()


def test_deepseek_v3_bytes_per_token():
    cfg = _deepseek_v3_config()
    shape = ModelShape.from_config(cfg)
    layers, hidden, heads = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"]
    latent, rope = cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]
    nope, v, q_lora, moe_i = cfg["qk_nope_head_dim"], cfg["v_head_dim"], cfg["q_lora_rank"], cfg["moe_intermediate_size"]
    # One latent row per token per layer: 3 x (32 + 8) values, where per-head K and V would take
    # 3 x 2 x 4 heads x 24 (nope + rope), or, read as GQA from num_key_value_heads, 3 x 2 x 4 x 8.
    assert shape.attention == "mla" and shape.kv_elements_per_token() == layers * (latent + rope) == 120
    assert shape.kv_elements_per_token() != 2 * layers * cfg["num_key_value_heads"] * shape.head_dim
    # MLA (q_lora): q_a | kv_a fused, their norms, q_b, kv_b, o_proj; two RMSNorms per layer.
    mla = (hidden * (q_lora + latent + rope) + q_lora + latent + q_lora * heads * (nope + rope)
           + latent * heads * (nope + v) + heads * v * hidden + 2 * hidden)
    expert = 3 * hidden * moe_i
    n, k, moe_layers = cfg["n_routed_experts"], cfg["num_experts_per_tok"], layers - cfg["first_k_dense_replace"]
    router = n * hidden + n  # weight and the correction bias
    dense_mlp = 3 * hidden * cfg["intermediate_size"]
    base = layers * mla + dense_mlp + moe_layers * (router + cfg["n_shared_experts"] * expert) + hidden
    assert (shape.expert_params, shape.moe_layers, shape.num_experts, shape.experts_per_token) == (expert, 2, n, k)
    assert shape.non_embedding_params == base + moe_layers * n * expert
    assert shape.active_non_embedding_params == base + moe_layers * k * expert
    # A batch-1 decode step reads the top-k routed + the shared experts, and the LM head.
    assert shape.experts_read(1) == k and shape.weight_read_params(1) == base + moe_layers * k * expert + 384 * hidden
    assert k < shape.experts_read(4) < shape.experts_read(64) <= n
    # Absorbed attention: q.k over latent + rope dims, p.v over the latent, per head.
    assert shape.attention_flops(10) == layers * 2 * heads * (2 * latent + rope) * 10
    reason = unsupported_reason(cfg)
    assert "multi-head latent attention" in reason and "mixture of experts" in reason
    assert unsupported_reason({"architectures": ["Qwen3ForCausalLM"], "num_key_value_heads": 2}) is None


def test_bench_latency_on_deepseek_v3_skips_the_peer(tmp_path, monkeypatch):
    """The plain peer refuses MLA / MoE; the bench runs Atlas alone, says why, and its cache bytes per
    token are the engine's latent rows."""
    path = build_deepseek_checkpoint(tmp_path, "v3")
    with pytest.raises(ValueError, match="multi-head latent attention"):
        PeerDecoder(path, device="cpu", dtype=torch.float32)
    monkeypatch.setattr("atlas.bench.latency.copy_bandwidth", lambda device: 1e10)
    monkeypatch.setattr("atlas.bench.latency.device_peak_flops", lambda device: 1e11)
    out = tmp_path / "latency.json"
    report = run_bench(out, "latency", "--model", str(path), "--skip-tokenizer-init", "--batch-size", "1,4",
                       "--input-len", "8", "--output-len", "3", "--num-iters", "1", "--num-iters-warmup", "0",
                       "--kv-cache-memory", "8MiB", "--block-size", "8")
    assert [(r["engine"], r["batch_size"]) for r in report["rows"]] == [("atlas", 1), ("atlas", 4)]
    meta = report["meta"]
    assert "multi-head latent attention" in meta["peer_note"] and meta["errors"] == {}
    cfg = DEEPSEEK_CONFIGS["v3"]
    row_bytes = cfg["num_hidden_layers"] * (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]) * 4  # fp32 on CPU
    assert meta["kv_bytes_per_token"] == row_bytes == meta["kv_pool"]["page_bytes"] // 8
    shape = meta["model_shape"]
    idle = shape["moe_layers"] * (shape["num_experts"] - shape["experts_per_token"]) * shape["expert_params"] * 4
    assert meta["weight_read_bytes_per_step"] == meta["weight_bytes"] - 384 * 64 * 4 - idle
    floors = {r["batch_size"]: r["floors"]["decode"]["memory_s"] for r in report["runs"]}
    assert floors[4] > floors[1]  # more tokens reach more experts (and more cache)


def test_bench_decode_roofline_counts_the_weights_a_step_reads(tmp_path, monkeypatch):
    """`atlas bench decode` on an MoE model: its batch-1 roofline divides the bandwidth by the bytes a step
    reads (top-k routed experts, shared ones, no input-embedding table), not by every parameter."""
    path = build_deepseek_checkpoint(tmp_path, "v3")
    monkeypatch.setattr("atlas.bench.offline.copy_bandwidth", lambda device: 1e10)
    out = tmp_path / "decode.json"
    report = run_bench(out, "decode", "--model", str(path), "--skip-tokenizer-init", "--prompts", "random",
                       "--concurrency", "1", "--input-len", "8", "--output-len", "3", "--waves", "1", "--peer", "none",
                       "--kv-cache-memory", "8MiB")
    meta, (row,) = report["meta"], report["rows"]
    cfg = json.loads((path / "config.json").read_text())
    moe_layers = cfg["num_hidden_layers"] - cfg["first_k_dense_replace"]
    idle_experts = cfg["n_routed_experts"] - cfg["num_experts_per_tok"]
    idle = moe_layers * idle_experts * 3 * cfg["hidden_size"] * cfg["moe_intermediate_size"] * 4  # fp32 on CPU
    assert 0 < meta["weight_read_bytes_per_step"] <= meta["weight_bytes"] - idle
    assert row["% roofline"] == pytest.approx(100 * row["tok/s"] * meta["weight_read_bytes_per_step"] / 1e10)


def test_host_stages_leave_the_engine_as_it_was(tiny):
    """The profiler ranges around the engine's stages (and the perf_counter timers of the unprofiled pass)
    wrap its instances only while they run, and the outputs are those of an unprofiled run."""
    from atlas import LLM, SamplingParams
    from atlas.bench.kernel_profile import profile_decode

    llm = LLM(str(tiny), device="cpu", kv_cache_memory="8MiB", skip_tokenizer_init=True)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    prompt = [{"prompt_token_ids": [3, 4, 5, 6]}]
    expected = llm.generate(prompt, params)[0].outputs[0].token_ids
    seen = []

    def call(max_tokens: int):
        limited = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        return lambda: seen.append(llm.generate(prompt, limited)[0].outputs[0].token_ids)

    summary, _ = profile_decode(call, 3, 2, None, torch.device("cpu"), llm.engine)
    assert seen == [expected[:1], expected] * 2 and summary["host_stages"]["schedule"]["calls_per_step"] == 1
    timed = summary["host_stages_unprofiled"]
    assert timed["schedule"]["calls_per_step"] == 1 and timed["launch"]["ms_per_step"] > 0
    engine = llm.engine
    assert not {"schedule", "update_from_output", "prepare_drafts"} & set(vars(engine.scheduler))
    assert not {"launch", "prepare_inputs"} & set(vars(engine.runner)) and "_complete_inflight" not in vars(engine)


def test_bench_spec_reports_the_median_pass(tiny, tmp_path):
    """`atlas bench spec --repeats 3`: each row is the median of three timed passes over the same prompts,
    with every pass's speed beside it and the engine's steps counted per pass; speculation keeps the outputs."""
    rows = run_bench(tmp_path / "spec.json", "spec", "--model", str(tiny), "--skip-tokenizer-init",
                     "--kv-cache-memory", "8MiB", "--methods", "ngram", "--concurrency", "2", "--waves", "1",
                     "--repeats", "3", "--min-prompts", "2", "--prompts", "random", "--input-len", "8", "--output-len", "6")["rows"]
    assert [(r["method"], r["concurrency"]) for r in rows] == [("plain", 2), ("ngram", 2)]
    for r in rows:
        passes = [float(x) for x in r["passes tok/s"].split("/")]
        assert len(passes) == 3 and passes == sorted(passes) and abs(r["tok/s"] - passes[1]) <= 0.5  # (passes are printed rounded)
        assert r["lossless"]
    assert rows[0]["steps"] == 6  # (one wave of 6 tokens: a step a token, in each pass)


def test_bench_spec_interleaves_in_a_b_b_a_order_and_times_a_plain_control(tiny, tmp_path, monkeypatch):
    """`atlas bench spec --interleave --methods plain,ngram`: the engines' passes alternate with the order reversed
    every other pass (a cost of running second falls on each alike), and `plain` adds a second plain engine, the
    run's noise floor, whose outputs equal the first's."""
    from atlas.bench import offline

    order = []
    time_pass = offline.Timing.time_pass

    def recording(self, *args):
        order.append(self.name)
        return time_pass(self, *args)

    monkeypatch.setattr(offline.Timing, "time_pass", recording)
    rows = run_bench(tmp_path / "spec.json", "spec", "--model", str(tiny), "--skip-tokenizer-init",
                     "--kv-cache-memory", "8MiB", "--methods", "plain,ngram", "--interleave", "--concurrency", "2",
                     "--waves", "1", "--repeats", "4", "--min-prompts", "2", "--prompts", "random", "--input-len", "8",
                     "--output-len", "6")["rows"]
    names = ["plain", "plain (control)", "ngram"]
    assert order == names + names[::-1] + names + names[::-1]
    assert [r["method"] for r in rows] == names
    control = rows[1]
    assert control["lossless"] and control["drafted steps"] == 0 and control["acceptance length"] is None
    assert control["paired speed-up"] > 0 and len(control["passes tok/s"].split("/")) == 4


def test_the_replay_proposer_settles_on_its_engines_own_outputs(tiny):
    """`atlas bench spec --methods replay`: drafts recorded off the engine's own path (as a bf16 verify step can round
    a sequence off plain decoding's) are replaced by the replay engine's own outputs in untimed settling passes, after
    which every draft is accepted; without settling the off-path drafts stay rejected."""
    from atlas import LLM, SamplingParams
    from atlas.bench.offline import _record_replay, replay_proposer, run_pass

    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = [[5, 9, 14, 3, 7, 21, 2, 8], [11, 4, 6, 30, 12, 1, 19, 5]]
    llm = LLM(str(tiny), skip_tokenizer_init=True, kv_cache_memory="8MiB", speculative="ngram", num_draft_tokens=3,
              speculative_policy="always")
    llm.engine.proposer = None
    plain = [o.outputs[0].token_ids for o in run_pass(llm, prompts, 2, params)]
    off_path = [list(plain[0][:4]) + [(t + 1) % 64 for t in plain[0][4:]], list(plain[1])]
    for settle, passes in ((0, 0), (2, 2)):
        llm.engine.proposer = replay_proposer(3)
        assert _record_replay(llm, prompts, off_path, 2, params, settle=settle) == passes
        stats = llm.engine.stats
        drafted, accepted = stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens
        assert [o.outputs[0].token_ids for o in run_pass(llm, prompts, 2, params)] == plain
        drafted, accepted = stats.spec_num_draft_tokens - drafted, stats.spec_num_accepted_tokens - accepted
        assert drafted > 0 and (accepted == drafted) == (settle > 0), (settle, drafted, accepted)
