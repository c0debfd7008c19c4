"""gpt-oss (models/gpt_oss.py) against transformers on tiny random checkpoints (float32, CPU): attention sinks in the
reference kernel (against dense attention and transformers' eager attention) and in the Triton kernel (Triton's
interpreter), the experts' layout, biases and clamped SwiGLU, logits and greedy tokens under mixed batches, chunked
prefill across the window, preemption, prefix caching and n-gram speculation, MXFP4 expert weights loaded as their
exact dequantized values, and what is refused."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import (
    _build,
    assert_pages_returned,
    build_checkpoint,
    checkpoint_tool,
    hf_greedy,
    hf_model,
    run_in_triton_interpreter,
)
from test_models import atlas_logits, hf_logits

from atlas import LLM, SamplingParams
from atlas.errors import ModelLoadError, UnsupportedModelError
from atlas.kernels.paged_attention_ref import paged_attention_ref
from atlas.models.quantization import FP4_E2M1_VALUES, refuse_quantized

WINDOW = 8
BS = 4
# Alternating sliding (window 8) and full layers, 8 experts top-2 of width 24 (so that no expert tensor is square and
# a transposed layout cannot pass), YaRN with truncate false as published, a small swiglu_limit so that the clamps
# bind, q/k/v/o biases.
CONFIG = dict(architectures=["GptOssForCausalLM"], model_type="gpt_oss", num_hidden_layers=4, num_local_experts=8,
              num_experts_per_tok=2, intermediate_size=24, sliding_window=WINDOW,
              layer_types=["sliding_attention", "full_attention"] * 2, swiglu_limit=1.5, attention_bias=True,
              rms_norm_eps=1e-5, rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
                                                  "beta_slow": 1.0, "truncate": False,
                                                  "original_max_position_embeddings": 128, "rope_theta": 10000.0})
MAX_TOKENS = 24


def _sinks(model: torch.nn.Module, seed: int) -> None:
    """Sink logits of the size of the attention scores (they take a fair share of each row's weight)."""
    g = torch.Generator().manual_seed(seed + 11)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("sinks"):
                p.copy_(1.5 * torch.randn(p.shape, generator=g))


def build_gpt_oss_checkpoint(root: Path, tokenizer_dir: Path | None = None, seed: int = 0, **overrides) -> Path:
    return _build(root, f"gpt-oss-{seed}", CONFIG, tokenizer_dir, seed, overrides, randomize=_sinks)


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory, tokenizer_dir):
    path = build_gpt_oss_checkpoint(tmp_path_factory.mktemp("gpt-oss"), tokenizer_dir)
    return path, hf_model(path)


PROMPTS = [list(range(5, 10)), [(7 * i) % 380 + 1 for i in range(37)], list(range(200, 220)),
           [(11 * i) % 383 + 1 for i in range(30)], [17, 4] * 9, list(range(60, 90))]


@pytest.fixture(scope="module")
def expected(gpt_oss):
    return [hf_greedy(gpt_oss[1], p, MAX_TOKENS) for p in PROMPTS]


def _greedy(n: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


# ---------------------------------------------------------------------------------------------- attention sinks

def _paged(seq_lens: list[int], q_lens: list[int], kv_heads: int, group: int, dim: int, page: int, seed: int):
    """Random queries and a paged cache (scattered pages) for requests of these lengths."""
    g = torch.Generator().manual_seed(seed)
    num_pages = sum(-(-n // page) for n in seq_lens) + 2
    perm = torch.randperm(num_pages, generator=g)
    tables = torch.zeros(len(seq_lens), 16, dtype=torch.int32)
    used = 0
    for b, n in enumerate(seq_lens):
        tables[b, : -(-n // page)] = perm[used: used + -(-n // page)].int()
        used += -(-n // page)
    kv = torch.randn(2, num_pages, page, kv_heads, dim, generator=g)
    q = torch.randn(sum(q_lens), kv_heads * group, dim, generator=g)
    qsl = [0]
    for n in q_lens:
        qsl.append(qsl[-1] + n)
    sinks = 1.5 * torch.randn(kv_heads * group, generator=g)
    return q, kv, qsl, tables, sinks


def _request_kv(kv: torch.Tensor, tables: torch.Tensor, b: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Request b's keys and values [K, Hkv, D] in position order."""
    page = kv.shape[2]
    pos = torch.arange(seq_len)
    slots = tables[b, pos // page].long() * page + pos % page
    return kv[0].reshape(-1, *kv.shape[3:])[slots], kv[1].reshape(-1, *kv.shape[3:])[slots]


def _dense_sink_attention(q, kv, qsl, seq_lens, tables, scale, window, sinks):
    """Each query row over its visible keys, its head's sink one more logit of the softmax (with no value)."""
    group = q.shape[1] // kv.shape[3]
    out = torch.empty_like(q)
    for b, seq_len in enumerate(seq_lens):
        k, v = (t.repeat_interleave(group, dim=1) for t in _request_kv(kv, tables, b, seq_len))
        pos = torch.arange(seq_len)
        rows = range(qsl[b], qsl[b + 1])
        for i, t in enumerate(rows):
            q_pos = seq_len - len(rows) + i
            seen = (pos <= q_pos) & ((pos > q_pos - window) if window else True)
            scores = torch.einsum("hd,khd->hk", q[t], k) * scale
            scores = scores.masked_fill(~seen[None, :], float("-inf"))
            weights = torch.cat([scores, sinks[:, None]], dim=1).softmax(-1)[:, :-1]
            out[t] = torch.einsum("hk,khd->hd", weights, v)
    return out


@pytest.mark.parametrize("window", [None, 5])
def test_sink_reference_equals_dense_attention(window):
    """Decodes, verify-sized rows and prefill chunks over cached prefixes (batched and per-request paths of the
    reference), GQA, with and without a window; the sinks change the output."""
    q_lens, seq_lens = [1, 1, 4, 37], [30, 3, 22, 60]
    q, kv, qsl, tables, sinks = _paged(seq_lens, q_lens, kv_heads=2, group=3, dim=8, page=4, seed=3)
    got = paged_attention_ref(q, kv, qsl, seq_lens, tables, 8 ** -0.5, True, window, sinks)
    want = _dense_sink_attention(q, kv, qsl, seq_lens, tables, 8 ** -0.5, window, sinks)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    plain = paged_attention_ref(q, kv, qsl, seq_lens, tables, 8 ** -0.5, True, window)
    assert (plain - got).abs().max() > 0.05


@pytest.mark.parametrize("window", [None, 6])
def test_sink_reference_equals_transformers_eager_attention(window):
    """transformers' gpt-oss eager attention (sinks concatenated to the masked scores) over one request: a prefill of
    20 positions, then the last 3 as a chunk over the cached 17."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    seq_len, kv_heads, group, dim = 20, 2, 2, 16
    q, kv, _, tables, sinks = _paged([seq_len], [seq_len], kv_heads, group, dim, page=4, seed=5)
    k, v = _request_kv(kv, tables, 0, seq_len)
    pos = torch.arange(seq_len)
    visible = (pos[None, :] <= pos[:, None]) & ((pos[None, :] > pos[:, None] - window) if window else True)
    mask = torch.zeros(seq_len, seq_len).masked_fill(~visible, torch.finfo(torch.float32).min)
    module = SimpleNamespace(num_key_value_groups=group, sinks=sinks, training=False)
    want, _ = eager_attention_forward(module, q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                      v.transpose(0, 1)[None], mask[None, None], scaling=dim ** -0.5)
    want = want[0]  # [S, Hq, D]
    got = paged_attention_ref(q, kv, [0, seq_len], [seq_len], tables, dim ** -0.5, True, window, sinks)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    chunk = paged_attention_ref(q[-3:], kv, [0, 3], [seq_len], tables, dim ** -0.5, True, window, sinks)
    torch.testing.assert_close(chunk, want[-3:], rtol=1e-5, atol=1e-5)


def test_triton_sink_kernel_in_the_interpreter():
    """The Triton kernel with sinks against the reference: unsplit steps (prefill chunks, verify rows, decodes;
    windows) and split-KV decodes, whose combine adds each sink once."""
    pytest.importorskip("triton")
    out = run_in_triton_interpreter("sink_attention_cases.py", "3", "3", timeout=300)
    assert "6 sink cases agree" in out


# ---------------------------------------------------------------------------------------------- experts

def test_experts_match_transformers_with_biases_and_clamps():
    """transformers' GptOssMLP (router, experts with interleaved gate|up columns, biases, clamped SwiGLU) against
    the router and FusedExperts loaded from its stacked tensors, on inputs large enough that both clamps bind; on
    the grouped path (the grouped GEMM or per-expert matmuls) and the Triton pairs path's composition."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    from atlas.kernels.moe import pairs_ref
    from atlas.layers.moe import FusedExperts
    from atlas.models.gpt_oss import GptOssRouter

    cfg = GptOssConfig(hidden_size=32, intermediate_size=24, num_local_experts=6, num_experts_per_tok=2,
                       swiglu_limit=2.0)
    g = torch.Generator().manual_seed(4)
    hf = GptOssMLP(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.3 if p.dim() > 1 else 0.5))
    x = 2 * torch.randn(40, 32, generator=g)
    router = GptOssRouter(32, 6, 2)
    experts = FusedExperts(6, 32, 24, "silu", bias=True, swiglu=(cfg.swiglu_alpha, cfg.swiglu_limit))
    e = hf.experts
    with torch.no_grad():
        router.weight.copy_(hf.router.weight)
        router.bias.copy_(hf.router.bias)
        for param, t in ((experts.w13, e.gate_up_proj.transpose(1, 2)), (experts.b13, e.gate_up_proj_bias),
                         (experts.w2, e.down_proj.transpose(1, 2)), (experts.b2, e.down_proj_bias)):
            param.weight_loader(param, t.detach(), "interleaved")
        assert not experts.missing_shards()
        want, _ = hf(x[None])
        weights, ids = router(x)
        got = experts(x, weights, ids)
        # The Triton "pairs" path's composition (one row per (token, choice)), through the kernel's reference.
        pair_experts = ids.reshape(-1)
        h = experts._activate(pairs_ref(x, experts.w13, ids, 2), pair_experts)
        pairs = experts._combine(experts._down_bias(pairs_ref(h, experts.w2, ids, 1), pair_experts), weights, x.dtype)
        gate_up = torch.einsum("td,edn->ten", x, e.gate_up_proj) + e.gate_up_proj_bias
    torch.testing.assert_close(got, want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pairs, want[0], rtol=1e-5, atol=1e-5)
    limit = cfg.swiglu_limit
    assert (gate_up[..., ::2] > limit).any() and (gate_up[..., 1::2].abs() > limit).any()  # (both clamps bind)


# ---------------------------------------------------------------------------------------------- against transformers

def _llm(path, **kw) -> LLM:
    """An engine over path (kw None: leave that setting out)."""
    kw = {"kv_cache_memory": "1MiB", "block_size": BS, "max_model_len": 128, **kw}
    return LLM(str(path), **{k: v for k, v in kw.items() if v is not None})


def test_logits_match_transformers(gpt_oss):
    """One prefill, then chunks that cross window and page boundaries over the cached K/V, then decodes: every
    position's logits within 1e-4 of transformers' in float32."""
    path, _ = gpt_oss
    llm = _llm(path)
    ids = torch.randint(0, 384, (50,), generator=torch.Generator().manual_seed(1)).tolist()
    want = hf_logits(path, ids)
    torch.testing.assert_close(atlas_logits(llm, ids, [50]), want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(atlas_logits(llm, ids, [11, 7, 13, 9] + [1] * 10), want, rtol=1e-4, atol=1e-4)
    windows = [layer.self_attn.attn.sliding_window for layer in llm.engine.runner.model.model.layers]
    assert windows == [WINDOW, None, WINDOW, None]
    assert llm.engine.kv.sliding_window is None  # (full layers: every page kept, as Gemma 3)


def test_mixed_batch_chunked_prefill_preemption_equal_transformers(gpt_oss, expected):
    """Six requests at once in a pool too small for them (24 pages of 4: preemption), a 16-token budget (prefill
    chunks that start and end across window boundaries, beside decodes)."""
    llm = _llm(gpt_oss[0], num_gpu_blocks_override=24, max_num_batched_tokens=16, max_num_seqs=6, max_model_len=96,
               kv_cache_memory=None)
    assert _tokens(llm.generate([{"prompt_token_ids": p} for p in PROMPTS], _greedy())) == expected
    assert llm.engine.scheduler.num_preemptions > 0
    assert_pages_returned(llm)


def test_prefix_caching_on_equals_off(gpt_oss, expected):
    prompts = [PROMPTS[3], PROMPTS[3], PROMPTS[3][:20] + [9, 8, 7], PROMPTS[1]]
    runs = {}
    for caching in (True, False):
        llm = _llm(gpt_oss[0], enable_prefix_caching=caching)
        runs[caching] = [llm.generate({"prompt_token_ids": p}, _greedy())[0].outputs[0].token_ids for p in prompts]
        assert_pages_returned(llm)
        if caching:
            assert llm.engine.kv.stats.hits > 0
    assert runs[True] == runs[False]
    assert runs[True][0] == expected[3] and runs[True][3] == expected[1]


def test_ngram_speculation_equals_plain_greedy(gpt_oss):
    prompts = [[3, 4, 5, 6] * 6, [9, 10, 11] * 5 + [12], PROMPTS[1]]
    plain = _llm(gpt_oss[0])
    spec = _llm(gpt_oss[0], speculative="ngram", speculative_policy="always", num_draft_tokens=3, ngram_min=1,
                ngram_max=3)
    want = _tokens(plain.generate([{"prompt_token_ids": p} for p in prompts], _greedy(32)))
    assert _tokens(spec.generate([{"prompt_token_ids": p} for p in prompts], _greedy(32))) == want
    assert spec.engine.stats.spec_num_draft_tokens > 0
    assert_pages_returned(spec)


# ---------------------------------------------------------------------------------------------- MXFP4

def _pack_mxfp4(codes: torch.Tensor, exponents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FP4 codes [E, N, K] (0..15) and E8M0 exponents [E, N, K / 32] -> (blocks [E, N, K / 32, 16], scales) as the
    published checkpoints store them: two codes a byte, the first in the low nibble."""
    e, n, k = codes.shape
    pairs = codes.view(e, n, k // 32, 16, 2).to(torch.uint8)
    return pairs[..., 0] | (pairs[..., 1] << 4), exponents.to(torch.uint8)


def _mxfp4_values(codes: torch.Tensor, exponents: torch.Tensor) -> torch.Tensor:
    """The values the codes and exponents mean, [E, N, K] float32, written out."""
    lut = torch.tensor(FP4_E2M1_VALUES)
    return lut[codes] * torch.pow(2.0, exponents.float() - 127).repeat_interleave(32, dim=-1)


@pytest.fixture(scope="module")
def mxfp4_pair(tmp_path_factory):
    """(an MXFP4 checkpoint, the float32 checkpoint of its dequantized values): a tiny gpt-oss (hidden 64,
    experts 64 wide: whole MXFP4 runs of 32 on one rank and on each of two) whose expert matrices are drawn as
    FP4 codes with E8M0 scales."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    root = tmp_path_factory.mktemp("mxfp4")
    plain = build_gpt_oss_checkpoint(root, None, seed=2, num_hidden_layers=2, num_local_experts=4,
                                     intermediate_size=64,
                                     layer_types=["sliding_attention", "full_attention"])
    tensors = load_file(str(plain / "model.safetensors"))
    quantized = {}
    g = torch.Generator().manual_seed(3)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        e, k, n = tensors[name].shape  # (x @ W: [E, in, out])
        codes = torch.randint(0, 16, (e, n, k), generator=g)
        exponents = torch.randint(121, 125, (e, n, k // 32), generator=g)
        blocks, scales = _pack_mxfp4(codes, exponents)
        values = _mxfp4_values(codes, exponents).transpose(1, 2).contiguous()
        # (transformers' own dequantizer reads the blocks as these values: the layout is the published one)
        assert torch.equal(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32), values)
        tensors[name] = values
        quantized[name + "_blocks"], quantized[name + "_scales"] = blocks, scales
    save_file(tensors, str(plain / "model.safetensors"), metadata={"format": "pt"})
    mxfp4 = root / "mxfp4"
    shutil.copytree(plain, mxfp4)
    kept = {k: v for k, v in tensors.items() if not k.endswith(("experts.gate_up_proj", "experts.down_proj"))}
    save_file({**kept, **quantized}, str(mxfp4 / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((mxfp4 / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (mxfp4 / "config.json").write_text(json.dumps(cfg))
    return mxfp4, plain


def _outputs(llm, prompts, n: int = 12):
    """Greedy: per prompt (n token ids, per position {token id: logprob} of the top 3)."""
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=3)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs])
            for o in outs]


def _experts(llm) -> list:
    from atlas.layers.moe import FusedExperts

    return [m for m in llm.engine.runner.model.modules() if isinstance(m, FusedExperts)]


def _assert_mxfp4_form(llm, hidden: int = 64, intermediate: int = 64, experts: int = 4) -> None:
    """Every routed-expert stack holds uint8 codes [E, 2I, D / 2], [E, D, I / 2] and E8M0 scales
    [E, 2I, D / 32], [E, D, I / 32] (I this rank's)."""
    stacks = _experts(llm)
    assert stacks
    for m in stacks:
        assert m.mxfp4 and m.w13.dtype == m.w2.dtype == m.w13_scales.dtype == m.w2_scales.dtype == torch.uint8
        assert tuple(m.w13.shape) == (experts, 2 * intermediate, hidden // 2)
        assert tuple(m.w2.shape) == (experts, hidden, intermediate // 2)
        assert tuple(m.w13_scales.shape) == (experts, 2 * intermediate, hidden // 32)
        assert tuple(m.w2_scales.shape) == (experts, hidden, intermediate // 32)


def test_mxfp4_experts_stay_mxfp4_and_give_the_dequantized_tokens_and_logprobs(mxfp4_pair, caplog):
    """On the CPU the MXFP4 checkpoint's experts stay uint8 codes with their scales (half a byte a weight)
    and forward dequantizes them per call: the same numbers as the float32 checkpoint of the dequantized
    values (every other parameter equal, the experts dequantized bit for bit), the same greedy tokens and
    logprobs, also in bf16 (FP4 x 2^k is exact in bf16)."""
    mxfp4, plain = mxfp4_pair
    with caplog.at_level(logging.INFO, logger="atlas.models.loader"):
        quantized = _llm(mxfp4, skip_tokenizer_init=True)
    assert "MXFP4 expert weights (quant_method mxfp4), kept in MXFP4" in caplog.text
    _assert_mxfp4_form(quantized)
    assert all(m.mxfp4_fold for m in _experts(quantized))  # (the fixture's scale codes, 121-124, are within 128)
    # the moe_l2_prefetch knob's links: each layer's experts to the next layer's q|k|v projection (the last layer's to
    # the next linear layer after it, if any)
    from atlas.layers.moe import link_l2_prefetch

    model = quantized.engine.runner.model
    linked = dict(link_l2_prefetch(model))
    layers, modules = len(_experts(quantized)), dict(model.named_modules())
    assert layers >= 2 and all(linked[f"model.layers.{i}.mlp.experts"] == f"model.layers.{i + 1}.self_attn.qkv_proj"
                               for i in range(layers - 1))
    assert modules["model.layers.0.mlp.experts"].l2_prefetch_source is modules["model.layers.1.self_attn.qkv_proj"]
    reference = _llm(plain, skip_tokenizer_init=True)
    ours, theirs = (dict(m.engine.runner.model.named_parameters()) for m in (quantized, reference))
    assert {n for n in ours if not n.endswith("_scales")} == theirs.keys()
    for name, p in ours.items():
        if ".experts.w" not in name:
            assert torch.equal(p, theirs[name]), name
    for name, m in quantized.engine.runner.model.named_modules():
        if hasattr(m, "mxfp4"):
            w13, w2 = m.dequantized(torch.float32)
            assert torch.equal(w13, theirs[f"{name}.w13"]) and torch.equal(w2, theirs[f"{name}.w2"]), name
    prompts = [PROMPTS[1], PROMPTS[2]]
    assert _outputs(quantized, prompts) == _outputs(reference, prompts)
    bf16 = _llm(mxfp4, skip_tokenizer_init=True, dtype="bfloat16")
    _assert_mxfp4_form(bf16)
    bf16_plain = _llm(plain, skip_tokenizer_init=True, dtype="bfloat16")
    for m, ref in zip(_experts(bf16), _experts(bf16_plain), strict=True):
        w13, w2 = m.dequantized(torch.bfloat16)
        assert torch.equal(w13, ref.w13) and torch.equal(w2, ref.w2)
    assert _outputs(bf16, prompts) == _outputs(bf16_plain, prompts)


def test_mxfp4_is_dequantized_as_it_loads_where_the_form_cannot_be_used(mxfp4_pair, caplog, monkeypatch):
    """Where layers/moe.mxfp4_unusable gives a reason (here forced: a split that would cut down's runs of 32),
    the experts are dequantized as they load, with a warning naming it: every parameter equal to the float32
    checkpoint's, the same greedy tokens."""
    import atlas.models.gpt_oss as gpt_oss_module
    from atlas.layers.moe import mxfp4_unusable

    assert "not a multiple of 32" in mxfp4_unusable(64, 16)
    assert "not a multiple of 32" in mxfp4_unusable(48, 64)
    assert mxfp4_unusable(64, 64, torch.device("meta")) is not None  # (parameter counts: the plain form)
    assert mxfp4_unusable(64, 64, torch.device("cpu")) is None
    monkeypatch.setattr(gpt_oss_module, "mxfp4_unusable", lambda *a: "a forced reason")
    mxfp4, plain = mxfp4_pair
    with caplog.at_level(logging.INFO):
        quantized = _llm(mxfp4, skip_tokenizer_init=True)
    assert "the MXFP4 experts are dequantized to float32 as they load: a forced reason" in caplog.text
    assert "dequantized exactly as they load to float32: memory and speed are those of the float32 model" in (
        caplog.text)
    reference = _llm(plain, skip_tokenizer_init=True)
    ours, theirs = (dict(m.engine.runner.model.named_parameters()) for m in (quantized, reference))
    assert ours.keys() == theirs.keys()
    for name, p in ours.items():
        assert torch.equal(p, theirs[name]), name
    assert not any(m.mxfp4 for m in _experts(quantized))
    prompts = [PROMPTS[1], PROMPTS[2]]
    assert _tokens(quantized.generate([{"prompt_token_ids": p} for p in prompts], _greedy(12))) == _tokens(
        reference.generate([{"prompt_token_ids": p} for p in prompts], _greedy(12)))


def test_mxfp4_experts_dequantized_as_they_load_when_the_knob_asks(mxfp4_pair, caplog):
    """`--tuning moe_mxfp4=0`: a user's choice of the dequantized experts (memory for speed), logged as a choice,
    not a warning; every parameter equal to the float32 checkpoint's."""
    mxfp4, plain = mxfp4_pair
    with caplog.at_level(logging.INFO):
        quantized = _llm(mxfp4, skip_tokenizer_init=True, tuning={"moe_mxfp4": "0"})
    record = next(r for r in caplog.records if "--tuning moe_mxfp4=0 asks for it" in r.getMessage())
    assert record.levelno == logging.INFO
    assert not any(m.mxfp4 for m in _experts(quantized))
    reference = _llm(plain, skip_tokenizer_init=True)
    ours, theirs = (dict(m.engine.runner.model.named_parameters()) for m in (quantized, reference))
    assert ours.keys() == theirs.keys() and all(torch.equal(p, theirs[n]) for n, p in ours.items())


def test_mxfp4_experts_refuse_what_the_dequantizing_load_refuses(mxfp4_pair, tmp_path):
    """The MXFP4 form checks at load what dequantize_mxfp4 checks: in float16 a scale whose values do not fit
    float16 exactly is refused (the kernels would round them), as is the E8M0 NaN code 255 in any dtype; the
    checkpoint as drawn (values up to 0.75) loads in float16 as MXFP4."""
    from safetensors.torch import load_file, save_file

    mxfp4, _ = mxfp4_pair
    _assert_mxfp4_form(_llm(mxfp4, skip_tokenizer_init=True, dtype="float16"))
    name = "model.layers.1.mlp.experts.gate_up_proj_scales"
    cases = ((127 + 16, "float16", UnsupportedModelError, "do not fit float16 exactly"),
             (255, "bfloat16", ModelLoadError, "E8M0 NaN code 255"))
    for code, dtype, error, match in cases:
        bad = tmp_path / f"scale-{code}"
        shutil.copytree(mxfp4, bad)
        tensors = load_file(str(bad / "model.safetensors"))
        tensors[name][1, 3, 0] = code  # (2^16: FP4 values of 1 and above exceed float16's 65504)
        save_file(tensors, str(bad / "model.safetensors"))
        with pytest.raises(error, match=match):
            _llm(bad, skip_tokenizer_init=True, dtype=dtype)


def test_unquantized_experts_under_an_mxfp4_config_load_as_plain_experts(mxfp4_pair, tmp_path, caplog):
    """A checkpoint whose config.json says mxfp4 but whose expert tensors are floating point (re-uploads in
    bf16 that kept the config): the MXFP4 experts turn plain before anything is loaded into them and hold the
    checkpoint's values, every parameter equal to the plain checkpoint's (and the log says so)."""
    mxfp4, plain = mxfp4_pair
    relabelled = tmp_path / "relabelled"
    shutil.copytree(plain, relabelled)
    shutil.copy(mxfp4 / "config.json", relabelled / "config.json")
    with caplog.at_level(logging.INFO, logger="atlas.models.loader"):
        llm = _llm(relabelled, skip_tokenizer_init=True)
    assert "quant_method mxfp4, but its expert tensors are floating point: loaded in float32" in caplog.text
    assert not llm.engine.runner.model.mxfp4_experts
    ours = dict(llm.engine.runner.model.named_parameters())
    theirs = dict(_llm(plain, skip_tokenizer_init=True).engine.runner.model.named_parameters())
    assert ours.keys() == theirs.keys()
    for name, p in ours.items():
        assert torch.equal(p, theirs[name]), name


def _cuda_tokens(llm) -> list[list[list[int]]]:
    """Greedy tokens of three prompts (3, 40 and 70 tokens: the pairs kernels, the grouped one, and a prefill
    above the moe_triton_max_tokens knob's 64), one request at a time and then together."""
    prompts = [[5, 6, 7], [(7 * i) % 380 + 1 for i in range(40)], [(3 * i) % 380 + 1 for i in range(70)]]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    alone = [llm.generate({"prompt_token_ids": p}, params)[0].outputs[0].token_ids for p in prompts]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [alone, [o.outputs[0].token_ids for o in outs]]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_mxfp4_on_cuda_eager_and_in_cuda_graphs_equal_the_dequantized_model(mxfp4_pair):
    """bf16 on CUDA: the MXFP4 experts stay uint8 on the GPU (the Triton kernels at every token count, no
    host sync: the model runs in CUDA graphs), the CUDA-graph engine gives the eager engine's tokens, and both
    give the dequantized checkpoint's (its experts bf16: the same kernels on the same bf16 weights up to 64
    tokens a step). The 70-token prompt's prefill, and the three prompts' together, are steps the plain model
    takes through the grouped GEMM instead: their first tokens only (later ones may part at near-ties)."""
    from atlas.bench.common import release

    mxfp4, plain = mxfp4_pair
    cuda = dict(device="cuda", kv_cache_memory="256MiB", max_model_len=256, skip_tokenizer_init=True,
                dtype="bfloat16")
    eager = LLM(str(mxfp4), enforce_eager=True, **cuda)
    _assert_mxfp4_form(eager)
    assert all(m.w13.is_cuda and m.graph_safe() for m in _experts(eager))
    want = _cuda_tokens(eager)
    del eager
    release()
    graphs = LLM(str(mxfp4), **cuda)
    assert graphs.engine.runner.graphs_enabled and graphs.engine.runner.model.supports_cuda_graphs(
        torch.bfloat16, torch.device("cuda"))
    assert _cuda_tokens(graphs) == want
    assert graphs.engine.runner.step_graphs  # (decode steps were captured)
    del graphs
    release()
    dequantized = _cuda_tokens(LLM(str(plain), enforce_eager=True, **cuda))
    alone, together = want
    assert alone[:2] == dequantized[0][:2]  # (every step up to 64 tokens: the same kernels)
    assert [t[:4] for t in alone[2:] + together] == [t[:4] for t in dequantized[0][2:] + dequantized[1]]


def test_mxfp4_is_refused_elsewhere(mxfp4_pair, tmp_path):
    """Other architectures (and drafters) keep refusing mxfp4 with the message every method gets; MXFP4 tensors in a
    gpt-oss checkpoint whose config.json does not declare them are refused by name; so is a half pair."""
    from safetensors.torch import load_file, save_file

    q = {"quant_method": "mxfp4"}
    refuse_quantized({"architectures": ["GptOssForCausalLM"], "quantization_config": q}, tmp_path, dequantizes=True)
    for arch, dequantizes in (("Qwen3MoeForCausalLM", True), ("MixtralForCausalLM", True),
                              ("GptOssForCausalLM", False)):
        with pytest.raises(UnsupportedModelError, match=r"is quantized \(mxfp4: MXFP4 weights.*does not implement"):
            refuse_quantized({"architectures": [arch], "quantization_config": q}, tmp_path, dequantizes=dequantizes)
    llama = build_checkpoint(tmp_path, "LlamaForCausalLM", None)
    cfg = json.loads((llama / "config.json").read_text())
    (llama / "config.json").write_text(json.dumps({**cfg, "quantization_config": q}))
    with pytest.raises(UnsupportedModelError, match=r"LlamaForCausalLM \S+ is quantized \(mxfp4"):
        LLM(str(llama), skip_tokenizer_init=True, kv_cache_memory="1MiB")

    mxfp4, _ = mxfp4_pair
    undeclared = tmp_path / "undeclared"
    shutil.copytree(mxfp4, undeclared)
    cfg = json.loads((undeclared / "config.json").read_text())
    del cfg["quantization_config"]
    (undeclared / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match=r"MXFP4 expert weights\) although its config.json has no"):
        _llm(undeclared, skip_tokenizer_init=True)
    half = tmp_path / "half"
    shutil.copytree(mxfp4, half)
    tensors = load_file(str(half / "model.safetensors"))
    del tensors["model.layers.1.mlp.experts.down_proj_scales"]
    save_file(tensors, str(half / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.mlp\.experts\.down_proj_blocks has no \S+_scales"):
        _llm(half, skip_tokenizer_init=True)


# ---------------------------------------------------------------------------------------------- the shapes tool

def test_published_gpt_oss_shapes_have_their_published_parameter_counts():
    """gpt-oss-20b and -120b as the engine builds them (meta device): 20.91B and 116.83B parameters in all, 3.61B and
    5.13B active (OpenAI's gpt-oss model card, which counts the unembedding among the active parameters and not the
    embedding)."""
    from atlas.bench.roofline import ModelShape

    tool = checkpoint_tool()
    for name, total, active in (("gpt-oss-20b", 20.91e9, 3.61e9), ("gpt-oss-120b", 116.83e9, 5.13e9)):
        shape = ModelShape.from_config(tool.CONFIG_ONLY[name])
        assert shape.non_embedding_params + 2 * shape.embedding_params == pytest.approx(total, rel=0.002), name
        assert shape.active_non_embedding_params + shape.embedding_params == pytest.approx(active, rel=0.005), name
        assert shape.experts_per_token == 4 and shape.moe_layers == shape.layers


def test_tool_config_only_shape_runs_with_dummy_weights(tmp_path, caplog):
    """The tool's tiny gpt-oss shape (its published config's fields, MXFP4 quantization_config included) written
    config-only runs with --load-format dummy, which draws MXFP4 experts (random codes, scales 2^-13)."""
    tool = checkpoint_tool()
    out = tmp_path / "gpt-oss-tiny"
    assert tool.main(["--shape", "gpt-oss-tiny", "--out", str(out), "--config-only"]) == 0
    with caplog.at_level(logging.INFO, logger="atlas.models.loader"):
        llm = _llm(out, load_format="dummy", skip_tokenizer_init=True)
    assert "MXFP4 expert weights (quant_method mxfp4), drawn at random (--load-format dummy) in MXFP4" in (
        caplog.text)
    stacks = _experts(llm)
    assert stacks and all(m.mxfp4 and int(m.w13_scales.min()) == int(m.w2_scales.max()) == 127 - 13
                          for m in stacks)
    assert all(m.mxfp4_fold for m in stacks)  # (scale codes within 128: the grouped kernel's one multiply a pair)
    assert [len(t) for t in _tokens(llm.generate([{"prompt_token_ids": [3, 4, 5]}], _greedy(6)))] == [6]
    assert_pages_returned(llm)


# ---------------------------------------------------------------------------------------------- tensor parallelism

@pytest.mark.parametrize("expert_parallel", [False, True])
def test_tensor_parallel_matches_one_device(gpt_oss, expert_parallel):
    """Two ranks on gloo (tests/test_parallel.py's comparison: logprobs, greedy tokens with preemption and prefix hits,
    seeded samples, n-gram drafts): heads and their sinks split, the biased o_proj reducing itself, every expert's
    intermediate dimension split (its down bias added on one rank), or with --enable-expert-parallel 4 whole experts
    a rank."""
    from test_parallel import ENGINE, PARALLEL, check_against_one_device

    from atlas.layers.moe import FusedExperts

    llm = LLM(str(gpt_oss[0]), tensor_parallel_size=2, enable_expert_parallel=expert_parallel, **ENGINE, **PARALLEL)
    try:
        moe = next(m for m in llm.engine.runner.model.modules() if isinstance(m, FusedExperts))
        assert moe.expert_parallel == expert_parallel
        check_against_one_device(llm, {"gpt-oss": gpt_oss[0]}, "gpt-oss")
    finally:
        llm.shutdown()


@pytest.mark.parametrize("split", ["tensor", "expert", "pipeline"])
def test_mxfp4_split_over_two_ranks_matches_one_device(mxfp4_pair, split):
    """The MXFP4 checkpoint on two ranks on gloo, still MXFP4, against one device (tests/test_parallel.py's
    comparison): tensor parallelism (each rank its rows of w13 and its whole runs of 32 columns of w2, bytes
    and scales together), --enable-expert-parallel (2 whole experts a rank), two pipeline stages (each its
    layer's experts)."""
    from test_parallel import ENGINE, PARALLEL, check_against_one_device

    mxfp4, _ = mxfp4_pair
    size = dict(pipeline_parallel_size=2) if split == "pipeline" else dict(
        tensor_parallel_size=2, enable_expert_parallel=split == "expert")
    llm = LLM(str(mxfp4), **size, **ENGINE, **PARALLEL)
    try:
        _assert_mxfp4_form(llm, intermediate=32 if split == "tensor" else 64,
                           experts=2 if split == "expert" else 4)
        check_against_one_device(llm, {"gpt-oss-mxfp4": mxfp4}, "gpt-oss-mxfp4")
    finally:
        llm.shutdown()
