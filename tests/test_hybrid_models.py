"""Hybrid linear-attention models (Qwen3-Next, Qwen3.5, Qwen3.5-MoE) against transformers in float32 on the CPU:
the reference kernels against transformers' own torch functions, greedy tokens in mixed prefill/decode steps,
chunked prefill across chunk boundaries, preemption and resume; recurrent-state slots all free after every request;
the refusals (tensor and pipeline parallelism: tests/test_hybrid_parallel.py)."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from conftest import VOCAB, _randomize, assert_pages_returned, hf_greedy, hf_model, tool_module

from atlas import LLM, SamplingParams
from atlas.errors import OutOfMemoryPlanError
from atlas.kernels import gated_delta_rule as gdr

_COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
               head_dim=16, linear_conv_kernel_dim=3, linear_key_head_dim=16, linear_value_head_dim=16,
               linear_num_key_heads=2, linear_num_value_heads=4, max_position_embeddings=512, rms_norm_eps=1e-6,
               bos_token_id=None, eos_token_id=0, tie_word_embeddings=False)
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
# 4 layers: 3 Gated DeltaNet + 1 gated full attention (full_attention_interval 4, transformers' default).
HYBRID_CONFIGS = {
    # MoE every second layer (decoder_sparse_step 2), dense SwiGLU in the others.
    "qwen3_next": dict(model_type="qwen3_next", intermediate_size=128, decoder_sparse_step=2, norm_topk_prob=True,
                       **_MOE),
    "qwen3_5": dict(model_type="qwen3_5_text", intermediate_size=128),
    "qwen3_5_moe": dict(model_type="qwen3_5_moe_text", **_MOE),
}
HYBRIDS = list(HYBRID_CONFIGS)
PROMPTS = [[5, 17, 42, 99, 3], list(range(100, 137)), [7] * 12, list(range(200, 221)), [9]]  # (one of 1 token)


def build_hybrid(root: Path, name: str, tokenizer_dir: Path | None, seed: int = 0, tag: str = "", **overrides) -> Path:
    """overrides: config fields over HYBRID_CONFIGS[name]'s (tag names the checkpoint's directory apart)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = {**_COMMON, **HYBRID_CONFIGS[name], **overrides}
    cfg = AutoConfig.for_model(spec.pop("model_type"), **spec)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    _randomize(model, seed)
    out = root / f"{name}{tag}-{seed}"
    model.save_pretrained(out)
    if tokenizer_dir is not None:
        for f in tokenizer_dir.iterdir():
            shutil.copy(f, out / f.name)
    return out


@pytest.fixture(scope="module")
def hybrid_dirs(tmp_path_factory, tokenizer_dir) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hybrid")
    return {name: build_hybrid(root, name, tokenizer_dir) for name in HYBRIDS}


@pytest.fixture(scope="module")
def expected(hybrid_dirs) -> dict[str, list[list[int]]]:
    """transformers' greedy tokens (24 new) of PROMPTS, per model."""
    out = {}
    for name, path in hybrid_dirs.items():
        model = hf_model(path)
        out[name] = [hf_greedy(model, p, 24) for p in PROMPTS]
    return out


def assert_slots_returned(llm) -> None:
    """Every KV page and every recurrent-state slot is back, nothing queued."""
    engine = llm.engine
    assert_pages_returned(llm)
    slots = engine.scheduler.state_slots
    assert slots is not None and slots.num_free == slots.num_slots == engine.config.max_num_seqs


def greedy(llm, prompts, n=24, **kw) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, **kw))
    return [o.outputs[0].token_ids for o in outs]


# ---------------------------------------------------------------------------------------------- kernels
def _hf_functions():
    from transformers.models.qwen3_next import modeling_qwen3_next as m

    return m


def _random_inputs(B, L, hk, hv, dk, dv, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(B, L, hk, dk, generator=g), torch.randn(B, L, hk, dk, generator=g)
    v = torch.randn(B, L, hv, dv, generator=g)
    decay = -torch.rand(B, L, hv, generator=g) * 0.7
    beta = torch.rand(B, L, hv, generator=g)
    state = torch.randn(B, hv, dk, dv, generator=g)
    return q, k, v, decay, beta, state


@pytest.mark.parametrize("with_state", [False, True])
def test_gated_delta_rule_matches_transformers(with_state):
    """Chunked (150 tokens: three chunks of 64, the last padded) and recurrent forms against transformers'
    torch_chunk_gated_delta_rule / torch_recurrent_gated_delta_rule; grouped heads (2 key heads, 4 value heads)."""
    m = _hf_functions()
    q, k, v, decay, beta, state = _random_inputs(2, 150, 2, 4, 8, 16)
    state = state if with_state else None
    kw = dict(initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True)
    ref_o, ref_s = m.torch_chunk_gated_delta_rule(q, k, v, decay, beta, **kw)
    o, s = gdr.gated_delta_rule_chunked(q, k, v, decay, beta, state)
    torch.testing.assert_close(o, ref_o, rtol=0, atol=1e-6)
    torch.testing.assert_close(s, ref_s, rtol=0, atol=1e-6)
    ref_o, ref_s = m.torch_recurrent_gated_delta_rule(q, k, v, decay, beta, **kw)
    o, s = gdr.gated_delta_rule_recurrent(q, k, v, decay, beta, state)
    torch.testing.assert_close(o, ref_o, rtol=0, atol=1e-6)
    torch.testing.assert_close(s, ref_s, rtol=0, atol=1e-6)
    # the two forms are the same recurrence
    o_chunked, s_chunked = gdr.gated_delta_rule_chunked(q, k, v, decay, beta, state, chunk=16)
    torch.testing.assert_close(o_chunked, o, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s_chunked, s, rtol=1e-5, atol=1e-5)


def test_conv1d_and_norms_match_transformers():
    m = _hf_functions()
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(2, 12, 7, generator=g), torch.randn(12, 4, generator=g)
    out, state = gdr.causal_conv1d_ref(x, w)
    torch.testing.assert_close(out, m.causal_conv1d_fn(x, w, None, activation="silu"), rtol=0, atol=1e-6)
    torch.testing.assert_close(state, x[:, :, -3:])
    # one decode step from a state (transformers keeps K columns of state, Atlas the K - 1 that are read)
    hf_state = torch.randn(2, 12, 4, generator=g)
    ours = hf_state[:, :, 1:].clone()
    x1 = torch.randn(2, 12, 1, generator=g)
    ref = m.causal_conv1d_update(x1, hf_state, w, None, "silu")
    out, ours = gdr.causal_conv1d_ref(x1, w, ours)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-6)
    torch.testing.assert_close(ours, hf_state[:, :, 1:])
    # the Gated DeltaNet output norm and the (1 + w) RMSNorm
    norm = m.Qwen3NextRMSNormGated(16, eps=1e-6)
    norm.weight.data = torch.randn(16, generator=g)
    h, z = torch.randn(5, 16, generator=g), torch.randn(5, 16, generator=g)
    torch.testing.assert_close(gdr.rms_norm_gated_ref(h, z, norm.weight.data, 1e-6), norm(h, z), rtol=0, atol=0)
    from atlas.layers.norm import ZeroCenteredRMSNorm

    ref_norm, ours_norm = m.Qwen3NextRMSNorm(16, eps=1e-6), ZeroCenteredRMSNorm(16, 1e-6)
    ref_norm.weight.data = ours_norm.weight.data = torch.randn(16, generator=g) * 0.1
    with torch.no_grad():
        torch.testing.assert_close(ours_norm(h), ref_norm(h), rtol=0, atol=0)


def test_triton_recurrent_decode_in_the_interpreter():
    """The Triton decode step (kernels/gated_delta_rule_triton.py) against the reference, on CPU through Triton's
    interpreter (the CUDA tests run more head shapes, in bf16 too)."""
    from conftest import run_in_triton_interpreter

    assert "4 gated delta rule decode cases match" in run_in_triton_interpreter("gated_delta_rule_cases.py", "4")


def test_varlen_step_reads_and_writes_state_slots():
    """One flat step over a pool of slots (a decode, a continuing chunk, a fresh prompt whose slot holds another
    sequence's leftovers) equals each sequence run alone; the final states land in their slots."""
    q, k, v, decay, beta, _ = _random_inputs(1, 40, 2, 4, 8, 16, seed=5)
    q, k, v, decay, beta = (t[0] for t in (q, k, v, decay, beta))
    g = torch.Generator().manual_seed(6)
    pool = torch.randn(5, 4, 8, 16, generator=g)
    before = pool.clone()
    qsl, lens, slots = [0, 1, 14, 40], [30, 20, 26], [3, 0, 4]  # starts 29, 7 and 0
    out = gdr.gated_delta_rule_varlen(q, k, v, decay, beta, pool, qsl, lens, slots)
    for b, (slot, start) in enumerate(zip(slots, [29, 7, 0], strict=True)):
        a, e = qsl[b], qsl[b + 1]
        init = before[slot][None] if start else None
        o, s = gdr.gated_delta_rule_recurrent(*(t[a:e][None] for t in (q, k, v, decay, beta)), init)
        torch.testing.assert_close(out[a:e], o[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(pool[slot], s[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pool[[1, 2]], before[[1, 2]], rtol=0, atol=0)  # other slots untouched
    x, w = torch.randn(40, 6, generator=g), torch.randn(6, 3, generator=g)
    conv = torch.randn(5, 6, 2, generator=g)
    conv_before = conv.clone()
    y = gdr.causal_conv1d_varlen(x, w, conv, qsl, lens, slots)
    for b, (slot, start) in enumerate(zip(slots, [29, 7, 0], strict=True)):
        a, e = qsl[b], qsl[b + 1]
        ref, new = gdr.causal_conv1d_ref(x[a:e].t()[None], w, conv_before[slot][None] if start else None)
        torch.testing.assert_close(y[a:e], ref[0].t(), rtol=0, atol=1e-6)
        torch.testing.assert_close(conv[slot], new[0])


def test_snapshot_inside_a_step_is_the_state_after_its_rows():
    """A prefix-cache snapshot at a page boundary inside a prompt chunk (splits: sequence, rows, slot): the step's
    outputs and final states are those of the step without it, and the snapshot slot holds the state after the
    sequence's first rows, of the convolution and the delta rule alike (a fresh prompt split after 9 rows, a
    continuing chunk after 1, beside a decode)."""
    q, k, v, decay, beta, _ = _random_inputs(1, 40, 2, 4, 8, 16, seed=11)
    rows = (q, k, v, decay, beta) = tuple(t[0] for t in (q, k, v, decay, beta))
    g = torch.Generator().manual_seed(12)
    pool = torch.randn(7, 4, 8, 16, generator=g)
    before, plain_pool = pool.clone(), pool.clone()
    qsl, lens, slots = [0, 1, 14, 40], [30, 20, 26], [3, 0, 4]  # starts 29, 7 and 0
    splits = [(2, 9, 5), (1, 1, 6)]
    plain = gdr.gated_delta_rule_varlen(*rows, plain_pool, qsl, lens, slots)
    out = gdr.gated_delta_rule_varlen(*rows, pool, qsl, lens, slots, splits=splits)
    torch.testing.assert_close(out, plain, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pool[:5], plain_pool[:5], rtol=1e-5, atol=1e-5)
    _, fresh = gdr.gated_delta_rule_recurrent(*(t[14:23][None] for t in rows))
    _, one = gdr.gated_delta_rule_recurrent(*(t[1:2][None] for t in rows), before[0][None])
    torch.testing.assert_close(pool[5], fresh[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pool[6], one[0], rtol=1e-5, atol=1e-5)
    x, w = torch.randn(40, 6, generator=g), torch.randn(6, 3, generator=g)
    conv = torch.randn(7, 6, 2, generator=g)
    conv_before, plain_conv = conv.clone(), conv.clone()
    y_plain = gdr.causal_conv1d_varlen(x, w, plain_conv, qsl, lens, slots)
    y = gdr.causal_conv1d_varlen(x, w, conv, qsl, lens, slots, splits=splits)
    torch.testing.assert_close(y, y_plain, rtol=0, atol=1e-6)
    torch.testing.assert_close(conv[:5], plain_conv[:5])
    _, fresh_conv = gdr.causal_conv1d_ref(x[14:23].t()[None], w)
    _, one_conv = gdr.causal_conv1d_ref(x[1:2].t()[None], w, conv_before[0][None])
    torch.testing.assert_close(conv[5], fresh_conv[0])
    torch.testing.assert_close(conv[6], one_conv[0])


def test_uniform_step_reads_slots_and_lengths_from_device_tensors():
    """The CUDA graphs' form of a step (every sequence q rows; slots and lengths as tensors, no host list): equal to
    the host-driven step over the same slots (a sequence at its position 0 over a slot holding leftovers, a padding
    sequence on a scratch slot), final states in their slots."""
    q_len, starts, slots = 3, [5, 0, 2, 0], [3, 0, 4, 5]  # (the last: a padding sequence on scratch slot 5)
    n = len(slots)
    q, k, v, _, _, _ = _random_inputs(1, n * q_len, 2, 4, 8, 16, seed=7)
    q, k, v = (t[0] for t in (q, k, v))
    g = torch.Generator().manual_seed(8)
    a, b = torch.randn(n * q_len, 4, generator=g), torch.randn(n * q_len, 4, generator=g)  # (the raw projections)
    A_log, dt_bias = torch.randn(4, generator=g), torch.randn(4, generator=g)
    decay, beta = gdr.gates(a, b, A_log, dt_bias)
    pool, conv = torch.randn(6, 4, 8, 16, generator=g), torch.randn(6, 6, 2, generator=g)
    x, w = torch.randn(n * q_len, 6, generator=g), torch.randn(6, 3, generator=g)
    qsl, lens = list(range(0, (n + 1) * q_len, q_len)), [s + q_len for s in starts]
    pool_ref, conv_ref = pool.clone(), conv.clone()
    out_ref = gdr.gated_delta_rule_varlen(q, k, v, decay, beta, pool_ref, qsl, lens, slots)
    y_ref = gdr.causal_conv1d_varlen(x, w, conv_ref, qsl, lens, slots)
    slots_t, keep = torch.tensor(slots), torch.tensor(lens) > q_len
    out = gdr.gated_delta_rule_uniform(q, k, v, a, b, A_log, dt_bias, pool, slots_t, keep, q_len)
    y = gdr.causal_conv1d_uniform(x, w, conv, slots_t, keep, q_len)
    torch.testing.assert_close(out, out_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pool, pool_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y, y_ref, rtol=0, atol=1e-6)
    torch.testing.assert_close(conv, conv_ref, rtol=0, atol=0)
    one = gdr.causal_conv1d_uniform(x[:q_len], w, conv.clone(), slots_t[:1], keep[:1], q_len)
    assert one.stride() == (6, 1)  # (the kernels read rows of unit column stride, a single sequence's too)


@pytest.mark.parametrize("qsl, lens, slots, seqs", [
    ([0, 1, 14, 40], [30, 20, 26], [3, 0, 4], [1, 2]),  # (a decode, a continuing chunk, a fresh prompt: rows in one run)
    ([0, 13, 14, 40], [20, 30, 26], [0, 3, 4], [0, 2]),  # (the decode between them: rows gathered)
    ([0, 70, 71], [90, 30], [2, 1], [0]),  # (two chunks of the kernel's 64)
])
def test_fla_adapter_follows_the_varlen_contract(monkeypatch, qsl, lens, slots, seqs):
    """The adapter to flash-linear-attention's chunk kernel (kernels/gated_delta_rule._chunked_fla, CUDA only) on the
    CPU, over a stand-in that computes fla's documented varlen contract (rows back to back in one batch of 1,
    cu_seqlens and its host copy, the chunk map of (sequence, chunk) pairs, an initial state per sequence, L2 norm in
    the kernel) with the reference: it takes the prompt rows, starts each sequence from its slot or zeros, and
    writes outputs and final states as the default path does; a second layer of the step reuses its index tensors."""
    calls = []

    def varlen_reference(q, k, v, g, beta, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens,
                         cu_seqlens_cpu=None, chunk_indices=None, chunk_size=64):
        assert q.shape[0] == 1 and output_final_state and use_qk_l2norm_in_kernel
        assert cu_seqlens_cpu.device.type == "cpu" and cu_seqlens_cpu.tolist() == cu_seqlens.tolist()
        lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
        assert chunk_indices.tolist() == [[i, c] for i, n in enumerate(lengths) for c in range(-(-n // chunk_size))]
        calls.append((cu_seqlens.tolist(), id(cu_seqlens)))
        outs, finals = [], []
        for i in range(cu_seqlens.numel() - 1):
            a, e = int(cu_seqlens[i]), int(cu_seqlens[i + 1])
            o, f = gdr.gated_delta_rule_recurrent(*(x[:, a:e] for x in (q, k, v, g, beta)), state=initial_state[i][None])
            outs.append(o[0])
            finals.append(f[0])
        return torch.cat(outs)[None], torch.stack(finals)

    monkeypatch.setattr(gdr, "fla_chunk_kernel", lambda: varlen_reference)
    q, k, v, decay, beta, _ = _random_inputs(1, qsl[-1], 2, 4, 8, 16, seed=9)
    q, k, v, decay, beta = (t[0] for t in (q, k, v, decay, beta))
    pool = torch.randn(5, 4, 8, 16, generator=torch.Generator().manual_seed(10))
    ref_pool = pool.clone()
    ref = gdr.gated_delta_rule_varlen(q, k, v, decay, beta, ref_pool, qsl, lens, slots)
    spans = gdr._spans(qsl, lens)
    cache = {}
    for _ in range(2):  # (two layers of one step)
        out, layer_pool = torch.zeros_like(v), pool.clone()
        gdr._chunked_fla(q, k, v, decay, beta, layer_pool, spans, seqs, slots, out, cache)
        rows = [r for b in seqs for r in range(qsl[b], qsl[b + 1])]
        torch.testing.assert_close(out[rows], ref[rows], rtol=1e-5, atol=1e-5)
        others = [r for r in range(qsl[-1]) if r not in rows]
        assert not out[others].any()  # (the decode rows are not the adapter's)
        torch.testing.assert_close(layer_pool[[slots[b] for b in seqs]], ref_pool[[slots[b] for b in seqs]],
                                   rtol=1e-5, atol=1e-5)
    expected_cu = [0]
    for b in seqs:
        expected_cu.append(expected_cu[-1] + qsl[b + 1] - qsl[b])
    assert [c for c, _ in calls] == [expected_cu] * 2
    assert calls[0][1] == calls[1][1]  # (one cu_seqlens tensor for the step: the kernel's caches keyed on it hit)


# ---------------------------------------------------------------------------------------------- models
@pytest.mark.parametrize("name", HYBRIDS)
def test_greedy_matches_transformers_in_mixed_chunked_steps(name, hybrid_dirs, expected):
    """Four prompts at once under a 16-token budget: prompts split into chunks that cross page and chunk
    boundaries while the others decode, in the same steps; then the same with one prompt at a time."""
    llm = LLM(str(hybrid_dirs[name]), kv_cache_memory="8MiB", block_size=8, max_num_batched_tokens=16,
              max_num_seqs=8)
    assert greedy(llm, PROMPTS) == expected[name]
    assert_slots_returned(llm)
    assert llm.engine.kv.enable_prefix_caching  # (with recurrent-state snapshots: tests/test_hybrid_prefix_cache.py)
    assert greedy(llm, PROMPTS[1:2]) == expected[name][1:2]
    assert_slots_returned(llm)


@pytest.mark.parametrize("name", HYBRIDS)
def test_steps_through_the_cuda_graphs_static_inputs_equal_transformers(name, hybrid_dirs, expected):
    """Decode steps through the CUDA graphs' static buffers (uncaptured on a CPU: --tuning static_steps=1), where the
    linear-attention layers read their state slots and lengths from device tensors only and the padding sequences of
    a step padded to a captured size read and write the scratch slot: transformers' tokens. Mixed steps (chunked
    prompts) run eagerly here (mixed_graph_recurrent_rows=0: no mixed-step graphs; test_mixed_steps_through_the_graphs_*
    take them)."""
    llm = LLM(str(hybrid_dirs[name]), kv_cache_memory="8MiB", block_size=8, max_num_batched_tokens=16,
              max_num_seqs=8, tuning={"static_steps": "1", "mixed_graph_recurrent_rows": "0"})
    runner = llm.engine.runner
    graphs = runner.step_graphs[1]
    assert graphs.state_scratch_slot == runner.num_state_slots - 1 == llm.engine.config.max_num_seqs
    assert greedy(llm, PROMPTS) == expected[name]
    assert graphs.steps_run > 0 and runner.mixed_graphs is None
    assert_slots_returned(llm)


def test_the_fla_prefill_kernel_is_refused_by_name_where_it_does_not_import(hybrid_dirs):
    """--tuning gdn_prefill=fla (flash-linear-attention's chunk kernel for prompt chunks) where the package does not
    import: refused at start-up, naming it; an unknown kernel name too."""
    import importlib.util

    from atlas.config import TuningConfig
    from atlas.errors import ConfigError

    with pytest.raises(ConfigError, match="gdn_prefill must be one of auto, atlas, fla"):
        TuningConfig(gdn_prefill="triton")
    if importlib.util.find_spec("fla") is not None:
        pytest.skip("flash-linear-attention imports here (its kernel is tested on the GPU: tests/test_hybrid_cuda.py)")
    with pytest.raises(ConfigError, match="pip install flash-linear-attention"):
        LLM(str(hybrid_dirs["qwen3_5"]), kv_cache_memory="8MiB", tuning={"gdn_prefill": "fla"})


def test_greedy_matches_transformers_with_long_prefill_and_sync_steps(hybrid_dirs, expected):
    """Whole prompts in one step (the chunked delta rule over one sequence), synchronous scheduling."""
    llm = LLM(str(hybrid_dirs["qwen3_next"]), kv_cache_memory="8MiB", block_size=8, async_scheduling=False,
              max_num_seqs=4)
    assert greedy(llm, PROMPTS) == expected["qwen3_next"]
    assert_slots_returned(llm)


def test_preemption_recomputes_the_state(hybrid_dirs, expected):
    """Too few pages for every sequence: the newest is preempted (its slot freed) and recomputed from its first
    token in a fresh slot; greedy tokens still equal transformers'."""
    llm = LLM(str(hybrid_dirs["qwen3_5"]), num_gpu_blocks_override=9, block_size=8, max_model_len=64,
              max_num_seqs=4)
    assert greedy(llm, PROMPTS) == expected["qwen3_5"]
    assert llm.engine.scheduler.num_preemptions > 0
    assert_slots_returned(llm)


def test_n_samples_do_not_share_prompt_state(hybrid_dirs, expected):
    """n > 1 without prefix caching: each sequence computes its own prompt (siblings share no pages, which would not
    carry the state; with prefix caching they resume from a snapshot: tests/test_hybrid_prefix_cache.py)."""
    llm = LLM(str(hybrid_dirs["qwen3_5_moe"]), kv_cache_memory="8MiB", block_size=8, max_num_seqs=4,
              enable_prefix_caching=False)
    out = llm.generate([{"prompt_token_ids": PROMPTS[1]}],
                       SamplingParams(n=3, max_tokens=24, temperature=0, ignore_eos=True))[0]
    assert [c.token_ids for c in out.outputs] == [expected["qwen3_5_moe"][1]] * 3
    assert_slots_returned(llm)


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_fair_rows_keep_each_sequences_recurrent_state(hybrid_dirs, expected, prefix_caching):
    """A request of n = 6 over a share of 3 and a newcomer: while the newcomer runs, half of the big request's
    sequences skip each step (fair rows) and their state slots wait for them; every sequence still gets
    transformers' greedy tokens (with prefix caching, the preempted sample resumes from a snapshot), and every page
    and slot comes back."""
    llm = LLM(str(hybrid_dirs["qwen3_5_moe"]), kv_cache_memory="8MiB", block_size=8, max_num_seqs=6,
              enable_prefix_caching=prefix_caching)
    engine = llm.engine
    big = SamplingParams(n=6, max_tokens=24, temperature=0, ignore_eos=True)
    engine.add_request({"prompt_token_ids": PROMPTS[1]}, big, "big")
    for _ in range(4):
        engine.step()
    engine.add_request({"prompt_token_ids": PROMPTS[2]}, SamplingParams(max_tokens=24, temperature=0,
                                                                        ignore_eos=True), "small")
    tokens = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = [c.token_ids for c in out.outputs]
    assert engine.scheduler.num_fair_row_skips > 0
    assert tokens["big"] == [expected["qwen3_5_moe"][1]] * 6 and tokens["small"] == [expected["qwen3_5_moe"][2]]
    assert_slots_returned(llm)


def _vlm_layout(src: Path, dst: Path) -> Path:
    """The text checkpoint rewritten as Qwen3.5's published VLM layout: Qwen3_5ForConditionalGeneration with the
    language model's config under text_config and its weights under model.language_model., plus vision-tower and
    MTP tensors (which Atlas does not load)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    text = json.loads((src / "config.json").read_text())
    config = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
              "tie_word_embeddings": False, "text_config": {**text, "architectures": None},
              "vision_config": {"depth": 1, "hidden_size": 8}, "image_token_id": 300}
    (dst / "config.json").write_text(json.dumps(config))
    tensors = load_file(str(src / "model.safetensors"))
    renamed = {(k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k): v
               for k, v in tensors.items()}
    renamed["model.visual.patch_embed.proj.weight"] = torch.zeros(8, 3)
    renamed["mtp.fc.weight"] = torch.zeros(64, 128)
    save_file(renamed, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def _fused_experts_layout(src: Path, dst: Path) -> Path:
    """Expert weights stored fused ([E, 2I, H] gate|up, [E, H, I] down), as transformers holds them."""
    import re

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(str(src / "model.safetensors"))
    pattern = re.compile(r"(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight")
    experts: dict[str, dict] = {}
    out = {}
    for k, v in tensors.items():
        m = pattern.match(k)
        if m is None:
            out[k] = v
        else:
            experts.setdefault(m.group(1), {})[(int(m.group(2)), m.group(3))] = v
    for prefix, pieces in experts.items():
        n = max(e for e, _ in pieces) + 1
        out[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([pieces[(e, "gate")], pieces[(e, "up")]])
                                                     for e in range(n)])
        out[f"{prefix}.down_proj"] = torch.stack([pieces[(e, "down")] for e in range(n)])
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_published_layouts_load_the_same_model(hybrid_dirs, expected, tmp_path, caplog):
    """Qwen3.5's VLM layout (the vision tower and the MTP module skipped, each with a log line) and fused expert
    tensors give the same greedy tokens."""
    vlm = _vlm_layout(hybrid_dirs["qwen3_5"], tmp_path / "vlm")
    with caplog.at_level(logging.INFO, logger="atlas"):
        llm = LLM(str(vlm), kv_cache_memory="8MiB", block_size=8, max_num_seqs=4)
    assert "mtp.*" in caplog.text and "vision tower" in caplog.text
    assert "recurrent-state snapshots" in caplog.text
    assert greedy(llm, PROMPTS[:2]) == expected["qwen3_5"][:2]
    fused = _fused_experts_layout(hybrid_dirs["qwen3_5_moe"], tmp_path / "fused")
    llm = LLM(str(fused), kv_cache_memory="8MiB", block_size=8, max_num_seqs=4)
    assert greedy(llm, PROMPTS[:2]) == expected["qwen3_5_moe"][:2]


def test_dummy_weights_run(hybrid_dirs):
    llm = LLM(str(hybrid_dirs["qwen3_next"]), kv_cache_memory="8MiB", block_size=8, max_num_seqs=2,
              load_format="dummy")
    assert [len(t) for t in greedy(llm, PROMPTS[:2], n=4)] == [4, 4]
    assert_slots_returned(llm)


# ---------------------------------------------------------------------------------------------- memory
# (the drafters refused for these models: tests/test_hybrid_speculation.py)


def test_state_is_counted_before_kv_pages(hybrid_dirs):
    """The state slots of --max-num-seqs sequences come out of the KV budget first, with a clear error when they
    alone do not fit."""
    llm = LLM(str(hybrid_dirs["qwen3_5"]), kv_cache_memory="8MiB", block_size=8, max_num_seqs=8,
              enable_prefix_caching=False)  # (no state snapshots: tests/test_hybrid_prefix_cache.py counts those)
    runner = llm.engine.runner
    plan = llm.engine.plan
    per_seq = sum(spec.bytes_per_sequence(torch.float32) for spec in runner.state_specs)
    assert per_seq == 3 * (128 * 2 * 4 + 4 * 16 * 16 * 4)  # 3 linear layers: conv [C, K - 1] + state [H, Dk, Dv]
    assert plan.breakdown["recurrent state"] == per_seq * 9  # (8 slots and a scratch slot)
    assert plan.num_pages == (8 * 2**20 - per_seq * 9) // plan.page_bytes
    assert [tuple(c.shape) for c in runner.state_pools[0]] == [(9, 128, 2), (9, 4, 16, 16)]
    with pytest.raises(OutOfMemoryPlanError, match="recurrent state of --max-num-seqs"):
        LLM(str(hybrid_dirs["qwen3_5"]), kv_cache_memory="1MiB", block_size=8, max_num_seqs=256,
            enable_prefix_caching=False)


@pytest.mark.parametrize("shape, arch, params, linear, full", [
    ("qwen3.5-9b", "Qwen3_5ForCausalLM", 8_953_803_264, 24, 8),
    # (79,674,391,296: Qwen3-Next-80B-A3B's published parameter count without its MTP module)
    ("qwen3-next-80b-a3b", "Qwen3NextForCausalLM", 79_674_391_296, 36, 12),
    # (the published 35B counts its vision tower, about 0.4B, too)
    ("qwen3.6-35b-a3b", "Qwen3_5MoeForCausalLM", 34_660_610_688, 30, 10),
])
def test_random_checkpoint_tool_writes_the_published_hybrid_shapes(tmp_path, shape, arch, params, linear, full):
    """tools/make_random_checkpoint.py --config-only: configs that Atlas builds (on the meta device here) into the
    published models' shapes."""

    from atlas.config import ModelConfig
    from atlas.models.loader import constructing
    from atlas.models.registry import model_class

    tool = tool_module("make_random_checkpoint")
    with pytest.raises(SystemExit, match="config-only"):
        tool.main(["--shape", shape, "--out", str(tmp_path / "w")])
    assert tool.main(["--shape", shape, "--out", str(tmp_path / shape), "--config-only", "--dflash-drafter"]) == 0
    cfg = ModelConfig.from_path(tmp_path / shape)
    # (--dflash-drafter: a drafter config that Atlas takes for this target: the target's hidden size and vocabulary,
    #  5 layers reading target layers spread from 1 to N - 3, 16-token blocks)
    from atlas.models.dflash import DFlashConfig
    from atlas.speculative.dflash import check_against_target

    drafter = DFlashConfig.from_path(tmp_path / shape / "dflash-drafter", cfg.num_hidden_layers)
    assert check_against_target(drafter, cfg, None) == 15
    assert drafter.target_layer_ids[0] == 1 and drafter.target_layer_ids[-1] == cfg.num_hidden_layers - 3
    assert drafter.mask_token_id == cfg.vocab_size - 1 and drafter.num_hidden_layers == 5
    # (--fp8 block: the published -FP8 layout's quantization_config, which Atlas reads as 128x128 block scales)
    from atlas.models.quantization import fp8_scheme

    assert tool.main(["--shape", shape, "--out", str(tmp_path / "fp8"), "--config-only", "--fp8", "block"]) == 0
    assert fp8_scheme(ModelConfig.from_path(tmp_path / "fp8").raw, tmp_path / "fp8").block == (128, 128)
    cls = model_class(cfg)
    assert cls.__name__ == arch and cls.keeps_recurrent_state
    with constructing(torch.device("meta"), torch.bfloat16):
        model = cls(cfg, 1024)
    assert sum(p.numel() for p in model.parameters()) == params
    assert (len(model.state_specs()), len(model.kv_cache_specs())) == (linear, full)
    # (the bench's roofline reads the same model: its parameters, and the recurrent state a decode step reads and
    #  writes per sequence)
    from atlas.bench.roofline import ModelShape

    roof = ModelShape.from_config(json.loads((tmp_path / shape / "config.json").read_text()), tmp_path / shape)
    assert roof.non_embedding_params + 2 * roof.embedding_params == params
    assert roof.recurrent_state_bytes(2) == sum(s.bytes_per_sequence(torch.bfloat16) for s in model.state_specs())
    assert model.model.layers[3].self_attn.attn.head_dim == 256 and model.model.layers[3].self_attn.rotary.rotary_dim == 64


def test_varlen_convolution_kernels_compile_for_sm90():
    """The eager step's convolution kernels compiled for the H200 on this CPU (triton_compile.py), bf16 rows and
    state, Qwen3.5-9B's kernel width, with and without a state kept."""
    from triton_compile import compile_for_sm90

    from atlas.kernels.gated_delta_rule_triton import _conv_state_kernel, _conv_varlen_kernel

    bf16 = {name: "*bf16" for name in ("x_ptr", "w_ptr", "state_ptr", "out_ptr", "new_ptr")}
    longs = {name: "*i64" for name in ("row_seq_ptr", "starts_ptr", "slots_ptr", "keep_ptr", "consumed_ptr")}
    for has_state in (True, False):
        ptx = compile_for_sm90(_conv_varlen_kernel, bf16 | longs,
                               {"K": 4, "BLOCK_T": 16, "BLOCK_C": 128, "HAS_STATE": has_state, "LIBDEVICE": True})
        assert ".visible .entry _conv_varlen_kernel" in ptx
    for direct in (False, True):  # (True: the mixed-step graphs' form, written straight into the pool)
        assert ".visible .entry _conv_state_kernel" in compile_for_sm90(
            _conv_state_kernel, bf16 | longs | {"dest_ptr": "*i64"}, {"K": 4, "BLOCK_C": 256, "DIRECT": direct})


def test_recurrent_kernel_with_a_row_count_per_sequence_compiles_for_sm90():
    """The recurrent kernel's form with a row count per sequence (the rows after an in-step snapshot, a loop over
    counts[b]; with snapshots, the mixed-step graphs' form, the gates fused) and its unrolled form (decode and
    verify steps) compiled for the H200 at Qwen3.5-9B's heads."""
    from triton_compile import compile_for_sm90

    from atlas.kernels.gated_delta_rule_triton import _recurrent_decode_kernel

    types = {n: "*bf16" for n in ("q_ptr", "k_ptr", "v_ptr", "out_ptr")}
    types |= {"g_ptr": "*fp32", "beta_ptr": "*bf16", "state_ptr": "*fp32", "rows_ptr": "*i64", "slots_ptr": "*i64",
              "keep_ptr": "*i64", "counts_ptr": "*i64", "scale": "fp32", "eps": "fp32", "snap_rows_ptr": "*i64",
              "snap_slots_ptr": "*i64", "a_log_ptr": "*fp32", "dt_bias_ptr": "*fp32"}
    for counts, snaps in ((True, False), (False, False), (True, True)):
        ptx = compile_for_sm90(_recurrent_decode_kernel, types, {
            "RATIO": 2, "DK": 128, "DV": 128, "BLOCK_K": 128, "BLOCK_V": 32, "Q": 1, "FUSED_GATES": snaps,
            "LIBDEVICE": True, "COUNTS": counts, "SNAPS": snaps})
        assert ".visible .entry _recurrent_decode_kernel" in ptx
