"""The DeepSeek family (MLA with a paged latent cache, grouped MoE) against transformers' DeepseekV3 /
DeepseekV2 on tiny random checkpoints (fp32, CPU): logits of prefill, chunked prefill and decode; greedy
tokens; prefix-cache hits that must attend over the cached latents; batching, chunking and preemption;
routing and grouped experts against transformers' modules; the latent-cache attention against the
unabsorbed per-head formula."""

from __future__ import annotations

import pytest
import torch
from conftest import DEEPSEEK_CONFIGS, assert_pages_returned, hf_greedy, hf_model, tool_module
from test_models import atlas_logits, hf_logits

from atlas import LLM, SamplingParams
from atlas.kernels.mla_attention_ref import mla_attention_ref
from atlas.layers.moe import FusedExperts, RouterConfig, select_experts

NAMES = list(DEEPSEEK_CONFIGS)
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def _llm(path, **kw) -> LLM:
    kw = {"kv_cache_memory": "8MiB", "block_size": 8, "skip_tokenizer_init": True, **kw}
    return LLM(str(path), **kw)


@pytest.fixture(scope="module")
def llms(deepseek_checkpoints):
    return {name: _llm(path) for name, path in deepseek_checkpoints.items()}


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 384, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("name", NAMES)
def test_prefill_chunked_and_decode_logits_match_transformers(name, deepseek_checkpoints, llms):
    """One prefill, then chunks that start mid-page over the cached latents, then decode steps."""
    ids = _ids(70, 1)
    expected = hf_logits(deepseek_checkpoints[name], ids)
    torch.testing.assert_close(atlas_logits(llms[name], ids, [70]), expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(atlas_logits(llms[name], ids, [13, 21, 19] + [1] * 17), expected, rtol=1e-4,
                               atol=1e-4)


@pytest.mark.parametrize("name", NAMES)
def test_greedy_tokens_match_transformers_generate(name, deepseek_checkpoints, llms):
    llm = llms[name]
    prompts = [[5, 17, 42, 99, 3], list(range(100, 137))]
    model = hf_model(deepseek_checkpoints[name])
    expected = [hf_greedy(model, p, 24) for p in prompts]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert_pages_returned(llm)


def test_the_cache_holds_one_latent_row_per_token(llms):
    llm = llms["v3"]
    cfg = DEEPSEEK_CONFIGS["v3"]
    row = cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]
    runner = llm.engine.runner
    assert all(c.shape[1:] == (8, row) for c in runner.kv_caches)
    assert runner.page_bytes == cfg["num_hidden_layers"] * row * 4 * 8  # layers x row x fp32 x block
    assert runner.program_heads == (cfg["num_attention_heads"], 1)


def _suffix_logits_over_cached_prefix(llm, ids: list[int], prefix: int) -> torch.Tensor:
    """Logits of ids[prefix:], computed as a prefix-cache hit computes them: the prefix's latent rows are
    in the paged cache (written by another request), the suffix is one prefill chunk over them."""
    return atlas_logits(llm, ids, [prefix, len(ids) - prefix])[prefix:]


def _drop_cached_prefix(monkeypatch) -> None:
    """A deliberately broken MLA: each chunk attends only over its own new rows (what an MLA prefill that
    recomputes from its own tokens does), never over latents already in the cache."""
    import atlas.layers.mla as mla

    real = mla.mla_attention

    def own_rows_only(q_latent, q_pe, cache, meta, scale):
        qsl, lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
        q_lens = [b - a for a, b in zip(qsl, qsl[1:], strict=False)]
        tables = meta.page_tables
        out = []
        for b, (n, s) in enumerate(zip(q_lens, lens, strict=True)):
            # The request's rows as if its sequence started at this chunk: shift the page table.
            flat_slots = [int(tables[b, p // meta.block_size]) * meta.block_size + p % meta.block_size
                          for p in range(s - n, s)]
            sub = cache.view(-1, cache.shape[-1])[flat_slots]
            shadow = sub.view(n, 1, -1)
            out.append(mla_attention_ref(q_latent[qsl[b]: qsl[b] + n], q_pe[qsl[b]: qsl[b] + n], shadow, [0, n], [n],
                                         torch.arange(n, dtype=torch.int32)[None], scale))
        return torch.cat(out) if out else real(q_latent, q_pe, cache, meta, scale)

    monkeypatch.setattr(mla, "mla_attention", own_rows_only)


def test_prefix_hit_attends_over_the_cached_latents(deepseek_checkpoints, llms, monkeypatch):
    """The suffix computed over a cached prefix gives transformers' full-prompt logits; the same check
    fails for an MLA that leaves the cached prefix out of attention."""
    ids = _ids(57, 3)
    expected = hf_logits(deepseek_checkpoints["v3"], ids)[40:]
    got = _suffix_logits_over_cached_prefix(llms["v3"], ids, 40)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    _drop_cached_prefix(monkeypatch)
    broken = _suffix_logits_over_cached_prefix(llms["v3"], ids, 40)
    assert (broken - expected).abs().max() > 0.1


def test_prefix_cache_hits_batching_and_preemption_do_not_change_outputs(deepseek_checkpoints):
    path = deepseek_checkpoints["v3"]
    g = torch.Generator().manual_seed(5)
    shared = torch.randint(1, 384, (40,), generator=g).tolist()
    prompts = [shared + torch.randint(1, 384, (int(n),), generator=g).tolist()
               for n in torch.randint(1, 30, (8,), generator=g)]
    roomy = _llm(path, enable_prefix_caching=False, kv_cache_memory="16MiB")
    expected = [o.outputs[0].token_ids for o in roomy.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)]
    model = hf_model(path)
    assert hf_greedy(model, prompts[0], 24) == expected[0]
    # 20 pages of 8 tokens for 8 requests of up to 93 tokens: preemption is forced; 32-token steps
    # chunk the prefills; the shared 40-token prefix is served from the prefix cache.
    llm = _llm(path, num_gpu_blocks_override=20, max_num_batched_tokens=32, max_model_len=96, max_num_seqs=6)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.kv.stats.hits > 0
    again = llm.generate({"prompt_token_ids": prompts[3]}, GREEDY)[0]
    assert again.num_cached_tokens >= 40 and again.outputs[0].token_ids == expected[3]
    assert_pages_returned(llm)


# --------------------------------------------------------------------------- the pieces
def test_latent_attention_equals_the_per_head_formula():
    """Absorbed attention over scattered pages (variable query lengths, causal offsets) equals softmax
    over q_nope . k_nope + q_pe . k_pe with per-head K/V up-projected from the latents."""
    g = torch.Generator().manual_seed(0)
    heads, lkv, r, p, v, bs = 3, 16, 4, 8, 6, 4
    w_kvb = torch.randn(heads, p + v, lkv, generator=g) / lkv ** 0.5
    q_lens, seq_lens = [1, 5, 40, 3], [9, 5, 47, 20]
    num_pages = sum(-(-s // bs) for s in seq_lens) + 2
    perm = torch.randperm(num_pages, generator=g).tolist()
    cache = torch.randn(num_pages, bs, lkv + r, generator=g)
    tables, used = torch.zeros(len(q_lens), 12, dtype=torch.int32), 0
    for b, s in enumerate(seq_lens):
        n = -(-s // bs)
        tables[b, :n] = torch.tensor(perm[used: used + n])
        used += n
    qsl = [0]
    for n in q_lens:
        qsl.append(qsl[-1] + n)
    q_nope = torch.randn(qsl[-1], heads, p, generator=g)
    q_pe = torch.randn(qsl[-1], heads, r, generator=g)
    scale = 0.3
    q_lat = torch.einsum("thp,hpl->thl", q_nope, w_kvb[:, :p])
    o_lat = mla_attention_ref(q_lat, q_pe, cache, qsl, seq_lens, tables, scale)
    got = torch.einsum("thl,hvl->thv", o_lat, w_kvb[:, p:])
    for b, (n, s) in enumerate(zip(q_lens, seq_lens, strict=True)):
        slots = [int(tables[b, i // bs]) * bs + i % bs for i in range(s)]
        rows = cache.view(-1, lkv + r)[slots]
        c, k_pe = rows[:, :lkv], rows[:, lkv:]
        k_nope = torch.einsum("sl,hpl->hsp", c, w_kvb[:, :p])
        vals = torch.einsum("sl,hvl->hsv", c, w_kvb[:, p:])
        q = q_nope[qsl[b]: qsl[b] + n]
        scores = (torch.einsum("thp,hsp->hts", q, k_nope) + torch.einsum("thr,sr->hts", q_pe[qsl[b]: qsl[b] + n],
                                                                          k_pe)) * scale
        q_pos = torch.arange(s - n, s)
        scores = scores.masked_fill(torch.arange(s)[None, :] > q_pos[:, None], float("-inf"))
        expected = torch.einsum("hts,hsv->thv", scores.softmax(-1), vals)
        torch.testing.assert_close(got[qsl[b]: qsl[b] + n], expected, rtol=1e-5, atol=1e-5)


def _hf_router(kind: str):
    from transformers import DeepseekV2Config, DeepseekV3Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    g = torch.Generator().manual_seed(7)
    if kind == "noaux_tc":
        cfg = DeepseekV3Config(hidden_size=32, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
                               routed_scaling_factor=2.5, norm_topk_prob=True)
        router = DeepseekV3TopkRouter(cfg)
        router.e_score_correction_bias.copy_(0.3 * torch.randn(16, generator=g))
    else:
        cfg = DeepseekV2Config(hidden_size=32, n_routed_experts=16, num_experts_per_tok=3, n_group=4, topk_group=2,
                               routed_scaling_factor=16.0, topk_method=kind)
        router = DeepseekV2TopkRouter(cfg)
    with torch.no_grad():
        router.weight.copy_(torch.randn(16, 32, generator=g))
    ours = RouterConfig(num_experts=16, top_k=cfg.num_experts_per_tok, scoring_func="sigmoid" if kind == "noaux_tc"
                        else "softmax", topk_method=kind, n_group=4, topk_group=2,
                        norm_topk_prob=kind == "noaux_tc", routed_scaling_factor=cfg.routed_scaling_factor)
    return router, ours


@pytest.mark.parametrize("kind", ["noaux_tc", "greedy", "group_limited_greedy"])
def test_routing_matches_transformers(kind):
    router, ours = _hf_router(kind)
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        logits, hf_w, hf_ids = router(x)
    bias = getattr(router, "e_score_correction_bias", None)
    w, ids = select_experts(logits, ours, bias)
    order, hf_order = ids.argsort(-1), hf_ids.argsort(-1)
    assert torch.equal(ids.gather(1, order), hf_ids.gather(1, hf_order))
    torch.testing.assert_close(w.gather(1, order), hf_w.gather(1, hf_order))
    if bias is not None:  # the bias changes which experts are chosen, never their weights
        unbiased, _ = select_experts(logits, ours, None)
        assert not torch.equal(select_experts(logits, ours, None)[1].sort(-1).values, ids.sort(-1).values)
        assert unbiased.shape == w.shape
        torch.testing.assert_close(w, (logits.sigmoid().gather(1, ids) / logits.sigmoid().gather(1, ids).sum(
            -1, keepdim=True)) * ours.routed_scaling_factor)


def test_grouped_experts_match_transformers_experts():
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Experts

    g = torch.Generator().manual_seed(9)
    cfg = DeepseekV3Config(hidden_size=32, n_routed_experts=8, moe_intermediate_size=16)
    hf = DeepseekV3Experts(cfg)
    ours = FusedExperts(8, 32, 16, "silu")
    with torch.no_grad():
        hf.gate_up_proj.copy_(torch.randn(8, 32, 32, generator=g) / 32 ** 0.5)
        hf.down_proj.copy_(torch.randn(8, 32, 16, generator=g) / 4)
        for e in range(8):
            ours.w13.weight_loader(ours.w13, hf.gate_up_proj[e, :16], (e, "gate"))
            ours.w13.weight_loader(ours.w13, hf.gate_up_proj[e, 16:], (e, "up"))
            ours.w2.weight_loader(ours.w2, hf.down_proj[e], (e, "down"))
    assert not ours.missing_shards()
    x = torch.randn(50, 32, generator=g)
    ids = torch.stack([torch.randperm(8, generator=g)[:3] for _ in range(50)])
    ids[:10] = torch.tensor([0, 1, 2])  # some experts get many tokens, some none
    w = torch.rand(50, 3, generator=g)
    with torch.no_grad():
        torch.testing.assert_close(ours(x, w, ids), hf(x, ids, w), rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- refused, never loaded wrong
def _variant(src, dst, config=None, tensors=None):
    """A copy of checkpoint src with config.json fields set (None deletes) and tensors added."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    for k, v in (config or {}).items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (dst / "config.json").write_text(json.dumps(cfg))
    if tensors:
        weights = load_file(str(dst / "model.safetensors"))
        save_file({**weights, **tensors}, str(dst / "model.safetensors"))
    return dst


@pytest.mark.parametrize("config,tensors,error,message", [
    # (block-scaled FP8 with dynamic activations loads, dequantized: tests/test_quantization_refusal.py)
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "static"}},
     None, "Unsupported", r"quantized \(fp8, block \[128, 128\]"),
    (None, {"model.layers.1.self_attn.kv_b_proj.weight_scale_inv": torch.ones(1, 1)}, "Unsupported",
     "quantization scales.*FP8 block-quantized"),
    ({"index_topk": 4, "index_n_heads": 2}, None, "Unsupported", "DeepSeek sparse attention"),
    (None, {"model.layers.1.self_attn.indexer.wk.weight": torch.ones(4, 64)}, "Unsupported", "indexer weights"),
    (None, {"model.layers.0.self_attn.rotary.extra": torch.ones(2)}, "ModelLoad",
     "does not know how to use: model.layers.0.self_attn.rotary.extra"),
    ({"num_nextn_predict_layers": 0}, None, "ModelLoad", r"does not know how to use: model\.layers\.3\."),
    ({"topk_method": "seq_aux"}, None, "Unsupported", "topk_method='seq_aux' is not supported"),
    ({"mlp_bias": True}, None, "Unsupported", "mlp_bias"),
])
def test_unsupported_checkpoints_are_refused_at_start(deepseek_checkpoints, tmp_path, config, tensors, error, message):
    from atlas.errors import ModelLoadError, UnsupportedModelError

    kind = UnsupportedModelError if error == "Unsupported" else ModelLoadError
    path = _variant(deepseek_checkpoints["v3"], tmp_path / "m", config, tensors)
    with pytest.raises(kind, match=message):
        _llm(path)


def test_a_missing_expert_is_named(deepseek_checkpoints, tmp_path):
    from safetensors.torch import load_file, save_file

    from atlas.errors import ModelLoadError

    path = _variant(deepseek_checkpoints["v2"], tmp_path / "m")
    weights = load_file(str(path / "model.safetensors"))
    del weights["model.layers.2.mlp.experts.5.up_proj.weight"]
    save_file(weights, str(path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"missing weight\(s\) model\.layers\.2\.mlp\.experts\.5\.up_proj\.weight"):
        _llm(path)


def test_random_deepseek_checkpoint_tool(tmp_path):
    """tools/make_random_checkpoint.py writes DeepSeek-V2-Lite-shaped checkpoints (the GPU benchmarks use
    --shape deepseek-v2-lite): checked on its tiny sibling, which transformers and Atlas load completely."""

    from transformers import AutoModelForCausalLM

    module = tool_module("make_random_checkpoint")
    out = tmp_path / "ds"
    assert module.main(["--shape", "deepseek-tiny", "--out", str(out), "--std", "0.2"]) == 0
    _, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    llm = _llm(out)
    assert len(llm.generate([[5, 6, 7, 8]], GREEDY)[0].outputs[0].token_ids) == GREEDY.max_tokens
    assert sum(p.numel() for p in llm.engine.runner.model.parameters()) == sum(
        p.numel() for p in AutoModelForCausalLM.from_pretrained(out).parameters())


@pytest.mark.parametrize("name", ["v3", "v2-lite"])
def test_the_latent_norms_take_eps_1e_6_whatever_rms_norm_eps_says(name, tmp_path):
    """DeepSeek's reference (and transformers') builds the q_a / kv_a latent norms with the norm's default eps 1e-6,
    not rms_norm_eps (Moonlight's config says 1e-5): with latents small enough for eps to matter, the logits are
    transformers'."""
    from conftest import build_deepseek_checkpoint
    from safetensors.torch import load_file, save_file

    path = build_deepseek_checkpoint(tmp_path, name, rms_norm_eps=1e-5)
    state = load_file(str(path / "model.safetensors"))
    for key in state:  # (latent rows of RMS ~ 1e-3: their mean square is near the eps)
        if key.endswith(("q_a_proj.weight", "kv_a_proj_with_mqa.weight")):
            state[key] = state[key] * 3e-3
    save_file(state, str(path / "model.safetensors"))
    ids = _ids(30, 4)
    llm = _llm(path)
    assert llm.engine.runner.model.model.layers[0].self_attn.kv_a_layernorm.eps == 1e-6
    torch.testing.assert_close(atlas_logits(llm, ids, [30]), hf_logits(path, ids), rtol=1e-4, atol=1e-4)


def test_shared_experts_add_onto_the_routed_sum_through_the_down_projections_bias():
    """LlamaMLP.forward_onto (an MoE layer's shared experts onto its routed sum): a single row takes the routed sum
    as the down projection's bias (F.linear's here, the GEMV's on CUDA: one rounding, no add kernel), equal to the
    sum after within float32's rounding; more rows add after, bit for bit as before."""
    import torch.nn.functional as F

    from atlas.models.llama import LlamaMLP

    g = torch.Generator().manual_seed(3)
    mlp = LlamaMLP(48, 40, "silu", bias=False, reduce=False)
    for p in mlp.parameters():
        p.data = torch.randn(p.shape, generator=g) / 7
    x, onto = torch.randn(3, 48, generator=g), torch.randn(3, 48, generator=g)
    with torch.no_grad():
        assert torch.equal(mlp.forward_onto(x, onto), mlp(x) + onto)
        one = mlp.forward_onto(x[:1], onto[:1])
        h = mlp.gate_up_proj(x[:1], act=mlp.act)
        assert torch.equal(one, F.linear(h, mlp.down_proj.weight, onto[0]))
        torch.testing.assert_close(one, mlp(x[:1]) + onto[:1], rtol=1e-6, atol=1e-6)
