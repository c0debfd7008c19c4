"""DeepSeek sparse attention (DeepSeek-V3.2, deepseek_v32) against transformers' DeepseekV32 on a tiny
random checkpoint (fp32, CPU) whose contexts exceed index_topk: the indexer and the sparse attention
against transformers' own modules, logits over chunks and a cached prefix, greedy tokens through chunked
prefill, mixed batches and preemption, prefix caching on equal to off, n-gram speculation equal to plain
greedy, and the random-checkpoint tool's V3.2 shapes (its MTP drafter: tests/test_dsa_mtp.py)."""

from __future__ import annotations

import pytest
import torch
from conftest import (
    DEEPSEEK_CONFIGS,
    _build,
    _correction_bias,
    assert_pages_returned,
    hf_greedy,
    hf_model,
    tool_module,
)
from test_models import atlas_logits, hf_logits

from atlas import LLM, SamplingParams
from atlas.kernels.dsa_attention_ref import dsa_attention_ref, indexer_scores, select_topk
from atlas.kernels.mla_attention_ref import mla_attention_ref

TOPK = 8
# V3 tiny (q_lora, noaux_tc routing, YaRN with mscale) plus the indexer; 16 indexer heads keep exact score ties
# (every head's ReLU at zero) rare, so the top-k has no tie for transformers and Atlas to break differently.
V32 = dict(DEEPSEEK_CONFIGS["v3"], architectures=["DeepseekV32ForCausalLM"], model_type="deepseek_v32",
           index_topk=TOPK, index_n_heads=16, index_head_dim=16, num_nextn_predict_layers=0)
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def _llm(path, **kw) -> LLM:
    kw = {"kv_cache_memory": "8MiB", "block_size": 8, "skip_tokenizer_init": True, **kw}
    return LLM(str(path), **kw)


def _ids(n: int, seed: int) -> list[int]:
    # (no token 0: hf_greedy passes pad_token_id=0, and transformers would mask it out of the prompt)
    return torch.randint(1, 384, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def v32(tmp_path_factory):
    return _build(tmp_path_factory.mktemp("dsa"), "v32", V32, None, 0, {}, randomize=_correction_bias)


@pytest.fixture(scope="module")
def llm(v32):
    return _llm(v32)


# --------------------------------------------------------------------------- the pieces
def _hf_attention(path):
    from transformers import AutoConfig
    from transformers.models.deepseek_v32.modeling_deepseek_v32 import DeepseekV32Attention

    cfg = AutoConfig.from_pretrained(path)
    cfg._attn_implementation = "eager"
    attn = DeepseekV32Attention(cfg, 0).float().eval()
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in attn.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g) if "norm" in name
                    else torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    return cfg, attn


def test_indexer_and_sparse_attention_match_transformers_modules(v32):
    """Atlas' DSA layer, weights copied from transformers' DeepseekV32Attention, over a 30-token prefill in the
    paged cache: the indexer's top-k sets equal DeepseekV32Indexer's, the layer output equals the module's; and the
    sparsity matters (dense MLA over the same rows differs)."""
    from transformers.models.deepseek_v32.modeling_deepseek_v32 import DeepseekV32RotaryEmbedding

    from atlas.layers.attention_backend import attention_backend
    from atlas.models.deepseek import DeepseekV32ForCausalLM

    cfg, attn = _hf_attention(v32)
    n = 30
    x = torch.randn(1, n, cfg.hidden_size, generator=torch.Generator().manual_seed(4))
    pos = torch.arange(n)[None]
    cos_sin = DeepseekV32RotaryEmbedding(cfg)(x, pos)
    mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        expected, _ = attn(x, cos_sin, mask)
        q_resid = attn.q_a_layernorm(attn.q_a_proj(x))
        hf_topk = attn.indexer(x, q_resid, cos_sin, mask[:, 0], pos)[0]  # [n, TOPK]

    from atlas.config import ModelConfig

    model = DeepseekV32ForCausalLM(ModelConfig.from_path(v32), 64)
    ours = model.model.layers[0].self_attn
    sd = attn.state_dict()
    with torch.no_grad():
        ours.fused_qkv_a_proj.weight.copy_(torch.cat([sd["q_a_proj.weight"], sd["kv_a_proj_with_mqa.weight"]]))
        for name, p in ours.named_parameters():
            if name in sd:
                p.copy_(sd[name])
    block = 8
    pages = -(-n // block)
    cache = torch.zeros(ours.cache_spec().cache_shape(pages, block))
    meta = attention_backend([ours.cache_spec()], block).metadata([0, n], [n], [list(range(pages))], list(range(n)),
                                                                  torch.device("cpu"))
    with torch.no_grad():
        got = ours(pos[0], x[0], cache, meta)
        q_idx, k_idx, w = ours.indexer(pos[0], x[0], ours.q_a_layernorm(ours.fused_qkv_a_proj(x[0])[:, :32]))
    torch.testing.assert_close(got, expected[0], rtol=1e-4, atol=1e-4)
    visible = torch.ones(n, n, dtype=torch.bool).tril()
    selected = select_topk(indexer_scores(q_idx, w, k_idx, ours.indexer.scale), visible, TOPK)
    for t in range(n):
        want = set(hf_topk[t].tolist()) & set(range(t + 1))  # (rows with fewer keys: masked picks dropped)
        assert set(selected[t].nonzero()[:, 0].tolist()) == want
    assert selected.sum(-1).tolist() == [min(t + 1, TOPK) for t in range(n)]
    # The cache row is [c | k_pe | indexer key]; the indexer key part is what the indexer computed.
    torch.testing.assert_close(cache.view(-1, cache.shape[-1])[:n, -k_idx.shape[-1]:], k_idx)


def _random_step(seed: int, seq_lens: list[int], q_lens: list[int]):
    g = torch.Generator().manual_seed(seed)
    block, h, lkv, r, hi, d = 4, 3, 16, 4, 5, 8
    pages_per = max(-(-s // block) for s in seq_lens)
    tables = torch.randperm(len(seq_lens) * pages_per, generator=g).view(len(seq_lens), pages_per).int()
    cache = torch.randn(len(seq_lens) * pages_per, block, lkv + r + d, generator=g)
    t = sum(q_lens)
    qsl = [0]
    for n in q_lens:
        qsl.append(qsl[-1] + n)
    args = (torch.randn(t, h, lkv, generator=g), torch.randn(t, h, r, generator=g), torch.randn(t, hi, d, generator=g),
            torch.randn(t, hi, generator=g), cache, qsl, seq_lens, tables)
    return args


def test_sparse_attention_equals_dense_mla_when_every_row_fits_the_topk():
    """Contexts of at most index_topk rows: every visible row is selected, so DSA is dense MLA exactly."""
    q_lat, q_pe, q_idx, w, cache, qsl, seqs, tables = _random_step(1, [7, 12, 3], [7, 2, 1])
    dense = mla_attention_ref(q_lat, q_pe, cache[..., :20].contiguous(), qsl, seqs, tables, 0.3)
    sparse = dsa_attention_ref(q_lat, q_pe, q_idx, w, cache, qsl, seqs, tables, 0.3, 12, 8 ** -0.5)
    torch.testing.assert_close(sparse, dense, rtol=1e-5, atol=1e-5)
    # Past the top-k it is not: the longer request's later rows differ, the others do not.
    sparse = dsa_attention_ref(q_lat, q_pe, q_idx, w, cache, qsl, seqs, tables, 0.3, 6, 8 ** -0.5)
    assert (sparse[7:9] - dense[7:9]).abs().max() > 1e-3
    torch.testing.assert_close(sparse[9:], dense[9:])


def test_sparse_attention_is_the_masked_per_query_formula():
    """Each query row equals softmax attention over exactly the top-k rows the indexer picks for it."""
    q_lat, q_pe, q_idx, w, cache, qsl, seqs, tables = _random_step(2, [19, 11], [6, 1])
    out = dsa_attention_ref(q_lat, q_pe, q_idx, w, cache, qsl, seqs, tables, 0.25, 5, 8 ** -0.5)
    flat = cache.view(-1, cache.shape[-1])
    for b, (seq, start, end) in enumerate(zip(seqs, qsl[:-1], qsl[1:], strict=True)):
        slots = (tables[b].long()[:, None] * 4 + torch.arange(4)).view(-1)[:seq]
        rows = flat[slots]
        for i, t in enumerate(range(start, end)):
            p = seq - (end - start) + i
            scores = (w[t, :, None] * torch.relu(q_idx[t] @ rows[: p + 1, 20:].T * 8 ** -0.5)).sum(0)
            keep = scores.topk(min(5, p + 1)).indices
            logits = (torch.cat([q_lat[t], q_pe[t]], -1) @ rows[keep, :20].T) * 0.25
            torch.testing.assert_close(out[t], torch.softmax(logits, -1) @ rows[keep, :16], rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- the model
def test_the_cache_row_holds_the_latent_and_the_indexer_key(llm):
    row = V32["kv_lora_rank"] + V32["qk_rope_head_dim"] + V32["index_head_dim"]
    runner = llm.engine.runner
    assert all(c.shape[1:] == (8, row) for c in runner.kv_caches)
    assert runner.page_bytes == V32["num_hidden_layers"] * row * 4 * 8  # layers x row x fp32 x block


def test_logits_over_chunks_and_a_cached_prefix_match_transformers(v32, llm, monkeypatch):
    """40 tokens (5x index_topk): one prefill; chunks starting mid-page whose indexer reads the earlier chunks'
    keys from the cache; decode steps. And the top-k matters: dense MLA misses transformers' logits."""
    ids = _ids(40, 1)
    expected = hf_logits(v32, ids)
    torch.testing.assert_close(atlas_logits(llm, ids, [40]), expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(atlas_logits(llm, ids, [13, 11, 5] + [1] * 11), expected, rtol=1e-4, atol=1e-4)
    import atlas.kernels.dsa_attention_ref as ref

    monkeypatch.setattr(ref, "select_topk", lambda scores, visible, k: visible)
    assert (atlas_logits(llm, ids, [40]) - expected).abs().max() > 0.1


def check_greedy_matches_transformers(path, llm: LLM, params: SamplingParams) -> None:
    """Greedy tokens of three prompts (5, 30 and 37 tokens) in one batch equal transformers' generate; pages return.
    (Shared with the other MLA-family tests.)"""
    prompts = [[5, 17, 42, 99, 3], _ids(30, 2), _ids(37, 3)]
    model = hf_model(path)
    expected = [hf_greedy(model, p, params.max_tokens) for p in prompts]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert_pages_returned(llm)


def check_chunks_preemption_and_prefix_caching(path, params: SamplingParams, num_prompts: int) -> None:
    """Prompts of 20-40 tokens sharing a 16-token prefix: prefix caching off with room for everything, against
    prefix caching on with 12-token steps (chunked prefills beside decodes) and too few pages (preemption); the
    first output also equals transformers'. (Shared with the other MLA-family tests.)"""
    g = torch.Generator().manual_seed(5)
    shared = torch.randint(1, 384, (16,), generator=g).tolist()
    prompts = [shared + torch.randint(1, 384, (int(n),), generator=g).tolist()
               for n in torch.randint(4, 24, (num_prompts,), generator=g)]
    roomy = _llm(path, enable_prefix_caching=False, kv_cache_memory="16MiB")
    expected = [o.outputs[0].token_ids for o in roomy.generate([{"prompt_token_ids": p} for p in prompts], params)]
    assert hf_greedy(hf_model(path), prompts[0], params.max_tokens) == expected[0]
    tight = _llm(path, num_gpu_blocks_override=12, max_num_batched_tokens=12, max_model_len=56, max_num_seqs=4)
    outs = tight.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert tight.engine.scheduler.num_preemptions > 0
    assert tight.engine.kv.stats.hits > 0
    again = tight.generate({"prompt_token_ids": prompts[3]}, params)[0]
    assert again.num_cached_tokens >= 16 and again.outputs[0].token_ids == expected[3]
    assert_pages_returned(tight)
    assert_pages_returned(roomy)


def test_greedy_tokens_match_transformers(v32, llm):
    check_greedy_matches_transformers(v32, llm, GREEDY)


def test_chunking_mixed_batches_preemption_and_prefix_caching_do_not_change_outputs(v32):
    check_chunks_preemption_and_prefix_caching(v32, GREEDY, 6)


def test_ngram_speculation_equals_plain_greedy(v32, llm):
    """A verify step is a multi-token step through the same sparse path: n-gram speculation changes nothing."""
    # 160 distinct tokens: most tokens the model emits were seen before, so the 1-gram lookup drafts often.
    prompt = torch.randperm(383, generator=torch.Generator().manual_seed(7))[:160].add(1).tolist()
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    plain = llm.generate({"prompt_token_ids": prompt}, params)[0].outputs[0].token_ids
    spec = _llm(v32, speculative="ngram", speculative_policy="always", num_draft_tokens=3, ngram_min=1, ngram_max=3)
    assert spec.generate({"prompt_token_ids": prompt}, params)[0].outputs[0].token_ids == plain
    assert spec.engine.stats.spec_num_verify_steps > 0
    assert_pages_returned(spec)


def test_steps_through_the_cuda_graphs_static_inputs_per_context_bound(v32):
    """Decode and verify steps through the CUDA graphs' static buffers (uncaptured on a CPU: --tuning
    static_steps=1), a graph per batch size and bound on the step's longest context (index_topk, then doublings:
    the indexer's scores and top-k are that wide), the bound in the step's metadata: transformers' tokens, and with
    n-gram drafts the plain tokens. (The Triton path through them: dsa_attention_cases.py models all.)"""
    llm = _llm(v32, max_model_len=64, tuning={"static_steps": "1"})
    graphs = llm.engine.runner.step_graphs[1]
    assert graphs.context_buckets == [TOPK, 16, 32, 64, 128]  # (up to the page tables' 128 tokens)
    assert len(graphs.keys) == len(graphs.sizes) * 5 and llm.engine.runner.mixed_graphs is None
    check_greedy_matches_transformers(v32, llm, GREEDY)
    assert graphs.steps_run > 0
    # (test_ngram_speculation_equals_plain_greedy's prompt, where the 1-gram lookup drafts often)
    prompt = torch.randperm(383, generator=torch.Generator().manual_seed(7))[:160].add(1).tolist()
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    plain = _llm(v32).generate({"prompt_token_ids": prompt}, params)[0].outputs[0].token_ids
    spec = _llm(v32, max_model_len=192, tuning={"static_steps": "1"}, speculative="ngram",
                speculative_policy="always", num_draft_tokens=3, ngram_min=1, ngram_max=3)
    assert spec.generate({"prompt_token_ids": prompt}, params)[0].outputs[0].token_ids == plain
    assert spec.engine.runner.step_graphs[4].steps_run > 0
    assert_pages_returned(spec)


# --------------------------------------------------------------------------- the random-checkpoint tool
def test_random_checkpoint_tool_v32_shapes(tmp_path):
    """deepseek-v3.2-tiny: transformers loads every tensor the tool writes and nothing is missing; Atlas serves it,
    and its config alone with --load-format dummy. deepseek-v3.2-cut (config-only use): the real per-layer shapes."""
    import json

    from transformers import AutoModelForCausalLM

    module = tool_module("make_random_checkpoint")
    out = tmp_path / "v32"
    assert module.main(["--shape", "deepseek-v3.2-tiny", "--out", str(out), "--std", "0.2", "--device", "cpu"]) == 0
    _, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert len(_llm(out).generate([list(range(3, 30))], GREEDY)[0].outputs[0].token_ids) == GREEDY.max_tokens
    dummy = tmp_path / "v32-dummy"
    assert module.main(["--shape", "deepseek-v3.2-tiny", "--out", str(dummy), "--config-only"]) == 0
    llm = _llm(dummy, load_format="dummy")
    assert len(llm.generate([list(range(3, 30))], GREEDY)[0].outputs[0].token_ids) == GREEDY.max_tokens
    assert_pages_returned(llm)
    cut = tmp_path / "v32-cut"
    assert module.main(["--shape", "deepseek-v3.2-cut", "--out", str(cut), "--config-only"]) == 0
    cfg = json.loads((cut / "config.json").read_text())
    assert (cfg["index_topk"], cfg["index_n_heads"], cfg["index_head_dim"], cfg["hidden_size"], cfg["kv_lora_rank"],
            cfg["q_lora_rank"], cfg["num_attention_heads"]) == (2048, 64, 128, 7168, 512, 1536, 128)


def test_mlp_layer_types_and_layer_types_are_read_as_transformers_reads_them(tmp_path):
    """V3.2's dense / sparse MLP per layer is mlp_layer_types (else first_k_dense_replace dense layers, 3 where the
    config does not say), as transformers' DeepseekV32Config builds them; layer_types other than indexed_attention
    are refused by name."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from atlas.config import ModelConfig
    from atlas.errors import UnsupportedModelError
    from atlas.layers.moe import FusedExperts
    from atlas.models.registry import model_class

    base = {k: v for k, v in V32.items() if k != "first_k_dense_replace"}
    for fields in (dict(num_hidden_layers=4, mlp_layer_types=["sparse", "dense", "sparse", "dense"]),
                   dict(num_hidden_layers=5), dict(num_hidden_layers=4, first_k_dense_replace=1)):
        spec = {**base, **fields, "vocab_size": 64, "hidden_size": 64, "intermediate_size": 128,
                "max_position_embeddings": 512}
        hf_spec = {k: v for k, v in spec.items() if k != "model_type"}
        with torch.device("meta"):
            hf = AutoModelForCausalLM.from_config(AutoConfig.for_model("deepseek_v32", **hf_spec))
        hf_moe = [i for i, layer in enumerate(hf.model.layers) if hasattr(layer.mlp, "experts")]
        cfg = ModelConfig.from_dict(spec, tmp_path)
        with torch.device("meta"):
            ours = model_class(cfg)(cfg, 64)
        assert [i for i, layer in enumerate(ours.model.layers)
                if any(isinstance(m, FusedExperts) for m in layer.mlp.modules())] == hf_moe, fields
    cfg = ModelConfig.from_dict({**spec, "num_hidden_layers": 3,
                                 "layer_types": ["indexed_attention", "full_attention", "indexed_attention"]}, tmp_path)
    with pytest.raises(UnsupportedModelError, match="layer_types"):
        model_class(cfg)(cfg, 64)
