"""The DeepSeek family on a CUDA GPU: the Triton MLA and routed-expert kernels against their references,
bf16 and fp32 models against transformers, CUDA-graph decode and verify steps against eager ones, and
MTP drafting lossless. Skipped without a GPU; run on the GPU machine with
`python -m pytest -m cuda tests/test_deepseek_cuda.py`."""

from __future__ import annotations

import pytest
import torch
from conftest import CUDA_KV, DEEPSEEK_CONFIGS, assert_pages_returned, hf_greedy, hf_model
from mla_attention_cases import random_case, run_case
from paged_attention_cases import captured_decode_step, check, random_page_tables

from atlas import LLM, SamplingParams
from atlas.kernels import settings

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.usefixtures("no_tf32")]

GREEDY = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
NAMES = list(DEEPSEEK_CONFIGS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_mla_attention_matches_reference(dtype):
    assert check("cuda", dtype, range(40), random_case, run_case) == []


@pytest.mark.parametrize("splits", [1, 4, 32])
def test_triton_mla_decode_at_deepseek_v3_heads(splits):
    """DeepSeek-V3's 128 heads (the widest head block, 64 rows a program) over a 576-wide latent row in bf16,
    decode steps of 1 and 8 requests, split and unsplit, against the float32 reference."""
    for num_reqs in (1, 8):
        g = torch.Generator().manual_seed(num_reqs)
        page, heads, latent, rope = 16, 128, 512, 64
        seq_lens = torch.randint(1, 3000, (num_reqs,), generator=g).tolist()
        tables = random_page_tables(seq_lens, page, g)
        pages_per = [-(-s // page) for s in seq_lens]
        case = dict(q_latent=(torch.randn(num_reqs, heads, latent, generator=g) / latent ** 0.25).bfloat16().cuda(),
                    q_pe=torch.randn(num_reqs, heads, rope, generator=g).bfloat16().cuda(),
                    cache=torch.randn(sum(pages_per), page, latent + rope, generator=g).bfloat16().cuda(),
                    qsl=list(range(num_reqs + 1)), seq_lens=seq_lens, page_tables=tables.cuda(),
                    scale=(128 + rope) ** -0.5, splits=splits)
        got, ref = run_case(case)
        assert (got - ref).abs().max().item() < 2e-2


@pytest.mark.parametrize("heads", [16, 128])
def test_mla_split_decode_inside_a_cuda_graph(heads):
    """The engine's MLA decode as StepGraphs captures it (split-KV by default: static buffers, program map
    preset, the partials' scratch made during capture) replayed for lengths the capture never saw, short
    ones leaving splits empty, against the float32 reference."""
    from atlas.kernels.mla_attention import mla_attention
    from atlas.kernels.mla_attention_ref import mla_attention_ref
    from atlas.kernels.paged_attention import num_kv_splits, sm_count

    dev, dtype = "cuda", torch.bfloat16
    B, latent, rope, page, max_len = 3, 512, 64, 16, 2500
    assert num_kv_splits(B, 1, sm_count(torch.cuda.current_device())) > 1
    g = torch.Generator().manual_seed(heads)
    per_seq = -(-max_len // page)
    num_pages = B * per_seq + 3
    cache = torch.randn(num_pages, page, latent + rope, generator=g).to(dev, dtype)
    tables = torch.randperm(num_pages, generator=g)[: B * per_seq].view(B, per_seq).to(dev, torch.int32)
    q_latent = torch.zeros(B, heads, latent, dtype=dtype, device=dev)
    q_pe = torch.zeros(B, heads, rope, dtype=dtype, device=dev)
    scale = (128 + rope) ** -0.5
    step = captured_decode_step(lambda meta: mla_attention(q_latent, q_pe, cache, meta, scale), B, tables, page, dev)
    for lens in ([1, 7, 2], [33, 300, 17], [max_len, 515, 1024], [64, 1, max_len]):
        step.seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        q_latent.copy_((torch.randn(q_latent.shape, generator=g) / latent ** 0.25).to(dtype))
        q_pe.copy_(torch.randn(q_pe.shape, generator=g).to(dtype))
        step.graph.replay()
        torch.cuda.synchronize()
        ref = mla_attention_ref(q_latent.float(), q_pe.float(), cache.float(), list(range(B + 1)), lens, tables, scale)
        err = (step.out.float() - ref).abs().max().item()
        assert err < 2e-2, (lens, err)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_moe_kernels_match_reference(dtype):
    """Both modes of the routed-expert matmuls against the float32 reference, and FusedExperts' Triton
    path against its grouped path (which forward really takes at these token counts); the fused pairs kernels and
    the one-kernel router choice (which select_experts takes on CUDA) against theirs, and the gate|up kernel that
    makes that choice itself against the two apart."""
    from moe_cases import check as check_moe
    from moe_cases import check_experts, check_fused, check_routed_gate_up, check_routing

    assert check_moe("cuda", dtype, range(48)) == []
    assert check_experts("cuda", dtype, range(12)) == []
    assert check_fused("cuda", dtype, range(24)) == []
    if dtype == torch.float32:
        assert check_routing("cuda", range(40)) == []
        assert check_routed_gate_up("cuda", range(40)) == []


@pytest.mark.parametrize("tokens,seed,scoring", [(1, 0, "softmax"), (1, 1, "sigmoid"), (3, 2, "softmax"),
                                                 (4, 0, "sigmoid")])
def test_experts_choosing_in_their_gate_up_kernel_equal_the_router_then_the_experts(tokens, seed, scoring):
    """FusedExperts.forward_routed at V2-Lite's expert shape (64 experts, top-6, bf16; plain SiLU, gpt-oss's clamped
    SwiGLU with biases, DeepSeek-V4's clamped SiLU by seed): with moe_route_in_experts on (off by default), the gate|up kernel
    chooses the experts from the router's logits (softmax, or sigmoid with a correction bias and renormalized); off,
    the router's kernel chooses and forward runs. The same output (the routing weights within float32 rounding, so
    within bf16's), in a CUDA graph too."""
    from moe_cases import experts_case

    from atlas.layers.moe import RouterConfig, TopKRouter

    c = experts_case(seed, "cuda", torch.bfloat16, num_experts=64, hidden=2048, intermediate=1408, top_k=6,
                     tokens=tokens)
    experts, x = c["experts"], c["x"]
    cfg = RouterConfig(64, 6, scoring_func=scoring, topk_method="greedy", norm_topk_prob=scoring == "sigmoid",
                       routed_scaling_factor=2.5 if scoring == "sigmoid" else 1.0)
    router = TopKRouter(2048, cfg, correction_bias=scoring == "sigmoid").cuda().requires_grad_(False)
    g = torch.Generator(device="cuda").manual_seed(seed)
    router.weight.copy_(torch.randn(router.weight.shape, generator=g, device="cuda") * 0.05)
    if router.e_score_correction_bias is not None:
        router.e_score_correction_bias.copy_(torch.randn(64, generator=g, device="cuda") * 0.1)
    with torch.no_grad():
        with settings.tuned(moe_route_in_experts=False):
            assert not experts._routes_in_gate_up(x)
            want = experts.forward_routed(x, router)
            assert torch.equal(want, experts(x, *router(x)))
        with settings.tuned(moe_route_in_experts=True):
            assert experts._routes_in_gate_up(x)
            got = experts.forward_routed(x, router)
            err = ((got.float() - want.float()).abs() / (1 + want.float().abs())).max().item()
            assert got.shape == want.shape and err <= 1e-2, err
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = experts.forward_routed(x, router)
        x.copy_(torch.randn(x.shape, generator=g, device="cuda"))
        graph.replay()
        with settings.tuned(moe_route_in_experts=False):
            want = experts.forward_routed(x, router)
        err = ((out.float() - want.float()).abs() / (1 + want.float().abs())).max().item()
        assert err <= 1e-2, err


@pytest.mark.parametrize("tokens", [1, 3, 8, 64])
def test_triton_experts_match_grouped_gemm_at_v2_lite_shapes(tokens):
    """DeepSeek-V2-Lite's routed experts (64 experts, 2048 -> 2 x 1408 -> 2048, top-6, bf16): the Triton
    path (pairs at 1 and 3 tokens, grouped at 8 and 64, where one expert gets every token) against the
    grouped GEMM, then captured in a CUDA graph and replayed on new routing and inputs (no host sync)."""
    from moe_cases import experts_case

    shape = dict(num_experts=64, hidden=2048, intermediate=1408, top_k=6, tokens=tokens)
    c = experts_case(tokens, "cuda", torch.bfloat16, **shape)
    experts, x, weights, ids = c["experts"], c["x"], c["weights"], c["ids"]

    def assert_close(got, ref):
        assert got.dtype == torch.bfloat16 and got.shape == x.shape
        err = (got.float() - ref.float()).abs().max() / ref.float().abs().max()
        assert err.item() < 2e-2, err.item()

    got = experts.forward_triton(x, weights, ids)
    assert_close(got, experts.forward_grouped(x, weights, ids))
    if tokens <= settings.tuning.moe_triton_max_tokens:
        assert torch.equal(experts(x, weights, ids), got)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        experts.forward_triton(x, weights, ids)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = experts.forward_triton(x, weights, ids)
    g = torch.Generator(device="cuda").manual_seed(1)
    new_weights, new_ids = torch.rand(tokens, 64, generator=g, device="cuda").topk(6, dim=-1)
    x.copy_(torch.randn(x.shape, generator=g, device="cuda"))
    weights.copy_(new_weights.softmax(-1))
    ids.copy_(new_ids)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, experts.forward_triton(x, weights, ids))
    assert_close(out, experts.forward_grouped(x, weights, ids))


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 384, (int(torch.randint(3, 90, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def _llm(path, **kw) -> LLM:
    return LLM(str(path), device="cuda", kv_cache_memory=CUDA_KV, max_model_len=256, skip_tokenizer_init=True, **kw)


@pytest.mark.parametrize("name", NAMES)
def test_fp32_on_cuda_equals_transformers_generate(name, deepseek_checkpoints):
    """The Triton MLA kernel; fp32 experts run one matmul per expert (no grouped GEMM), so no graphs."""
    path = deepseek_checkpoints[name]
    llm = _llm(path, dtype="float32")
    assert not llm.engine.runner.step_graphs
    prompts = _prompts(4, seed=2)
    ref = hf_model(path, dtype=torch.float32, device="cuda")
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(ref, p, 32) for p in prompts]
    assert_pages_returned(llm)


def _gaps(ref, prompts, token_lists) -> list[float]:
    """Teacher-forced on each token list: how far below the fp32 reference's best logit each chosen token
    falls, in units of the logits' standard deviation (0 where it is the argmax)."""
    gaps = []
    for prompt, tokens in zip(prompts, token_lists, strict=True):
        with torch.no_grad():
            logits = ref(torch.tensor([prompt + tokens], device="cuda")).logits[0, len(prompt) - 1: -1].float()
        chosen = logits.gather(1, torch.tensor(tokens, device="cuda")[:, None]).squeeze(1)
        gaps += ((logits.max(-1).values - chosen) / logits.std()).tolist()
    return gaps


OFF = 0.05  # a token more than this many standard deviations below the argmax is "off" the reference


def _assert_reference_argmax(ref, prompts, outs, ref_bf16) -> None:
    """Atlas's tokens are the fp32 reference's argmax up to bf16 noise, measured against what the reference
    itself does in bf16 on the same prompts (its greedy tokens). Two bounds: the share of tokens off the
    argmax (systematic error: a kernel reading the wrong rows puts most tokens off), at most twice the bf16
    reference's share plus 5 points; and the worst token's gap, below 1.5 standard deviations or twice the
    reference's worst (a random token of these vocabularies falls about 3 below). One token's gap is an
    extreme value: with grouped sigmoid routing, bf16 flips near-tied expert choices and moves the logits
    by up to about a standard deviation (transformers' own bf16 tokens fall up to ~0.8 below the fp32 argmax
    on the DeepSeek-V3 tiny config), so any change of summation order moves it."""
    tokens = [o.outputs[0].token_ids for o in outs]
    assert all(len(t) == GREEDY.max_tokens for t in tokens)
    gaps = _gaps(ref, prompts, tokens)
    own = _gaps(ref, prompts, [hf_greedy(ref_bf16, p, GREEDY.max_tokens) for p in prompts])
    share, own_share = (sum(g > OFF for g in x) / len(x) for x in (gaps, own))
    stats = dict(share_off=round(share, 3), reference_share_off=round(own_share, 3), worst=round(max(gaps), 3),
                 reference_worst=round(max(own), 3))
    print("bf16 tokens against the fp32 argmax:", stats)
    assert share <= 2 * own_share + 0.05, stats
    assert max(gaps) < max(1.5, 2 * max(own)), stats


# (and the V2-Lite-shaped model, greedy softmax router, choosing its experts inside the gate|up kernel)
@pytest.mark.parametrize("name,tuning", [(n, {}) for n in NAMES] + [("v2-lite", {"moe_route_in_experts": "1"})])
def test_bf16_tokens_are_the_references_argmax(name, tuning, deepseek_checkpoints):
    path = deepseek_checkpoints[name]
    llm = _llm(path, dtype="bfloat16", tuning=tuning)
    if torch.cuda.get_device_capability() >= (9, 0):  # the grouped GEMM: decode steps replay CUDA graphs
        assert llm.engine.runner.step_graphs
    prompts = _prompts(6, seed=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    _assert_reference_argmax(hf_model(path, dtype=torch.float32, device="cuda"), prompts, outs,
                             hf_model(path, dtype=torch.bfloat16, device="cuda"))
    assert_pages_returned(llm)


def test_mtp_catch_up_graphs_keep_the_references_argmax(deepseek_checkpoints):
    """The MTP module's pass over committed rows captured in CUDA graphs (the default;
    --tuning mtp_catch_up_graphs=0 runs it eagerly), queued right behind the verify steps."""
    path = deepseek_checkpoints["v3"]
    prompts = _prompts(10, seed=3)
    ref = hf_model(path, dtype=torch.float32, device="cuda")
    ref_bf16 = hf_model(path, dtype=torch.bfloat16, device="cuda")
    llm = _llm(path, dtype="bfloat16", speculative="mtp", speculative_policy="always", num_draft_tokens=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    _assert_reference_argmax(ref, prompts, outs, ref_bf16)
    assert llm.engine.proposer.catch_up.steps_run > 0 and llm.engine.stats.spec_num_accepted_tokens > 0
    assert llm.engine.proposer.blocks_behind > 0  # (its pass and chain queued right behind the verify steps)
    assert_pages_returned(llm)


def test_graph_steps_prefix_hits_and_drafting_keep_the_references_argmax(deepseek_checkpoints):
    """bf16 (graphs on sm90+) with MTP or n-gram drafting (verify steps), twice (prefix-cache hits)."""
    path = deepseek_checkpoints["v3"]
    prompts = _prompts(10, seed=3)
    ref = hf_model(path, dtype=torch.float32, device="cuda")
    ref_bf16 = hf_model(path, dtype=torch.bfloat16, device="cuda")
    for kw in ({}, {"speculative": "mtp", "num_draft_tokens": 2}, {"speculative": "ngram", "num_draft_tokens": 3}):
        llm = _llm(path, dtype="bfloat16", **kw)
        for _ in range(2):
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
            _assert_reference_argmax(ref, prompts, outs, ref_bf16)
        assert llm.engine.kv.stats.hits > 0
        assert_pages_returned(llm)
