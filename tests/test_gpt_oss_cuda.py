"""gpt-oss on a CUDA GPU: the Triton attention kernel with sinks against its reference (prefill chunks, verify rows,
decodes, split-KV decodes; at gpt-oss's heads too), the tiny model in float32 equal to transformers' greedy tokens
(eager: float32 experts have no grouped GEMM, so no CUDA graphs), in bf16 with CUDA graphs the fp32 reference's
argmax, n-gram speculation equal to plain greedy, and the gpt-oss-20b shape under --load-format dummy. Skipped without
a GPU; run on the GPU machine with `python -m pytest -m cuda tests/test_gpt_oss_cuda.py`."""

from __future__ import annotations

import logging

import pytest
import torch
from conftest import CUDA_KV, assert_pages_returned, checkpoint_tool, hf_greedy, hf_model
from paged_attention_cases import random_page_tables
from sink_attention_cases import check, run_sink_case
from test_deepseek_cuda import GREEDY, _assert_reference_argmax, _prompts
from test_gpt_oss import build_gpt_oss_checkpoint

from atlas import LLM, SamplingParams

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.usefixtures("no_tf32")]


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    # The published clamp (7.0), not the CPU tests' 1.5: transformers before 5.2x (the GPU machine has 5.17) fixes
    # its experts' alpha and limit at 1.702 and 7.0 whatever the config says, and it is the reference here.
    return build_gpt_oss_checkpoint(tmp_path_factory.mktemp("gpt-oss-cuda"), swiglu_limit=7.0)


def _llm(path, **kw) -> LLM:
    return LLM(str(path), device="cuda", kv_cache_memory=CUDA_KV, max_model_len=256, skip_tokenizer_init=True,
               **kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_sink_attention_matches_reference(dtype):
    """sink_attention_cases: 24 unsplit steps (prefill chunks over cached prefixes, verify rows, decodes; windows,
    GQA groups) and 24 split-KV decodes (the combine adds each sink once)."""
    assert check({"step": 24, "split": 24}, "cuda", dtype) == []


@pytest.mark.parametrize("splits", [1, 4, 32])
@pytest.mark.parametrize("window", [None, 128])
def test_triton_sink_decode_at_gpt_oss_heads(splits, window):
    """gpt-oss's 64 query heads over 8 KV heads of 64 in bf16, decodes of 1 and 8 requests of up to 3000 tokens, a
    prefill chunk of 200 rows beside them, against the float32 reference."""
    for num_reqs in (1, 8):
        g = torch.Generator().manual_seed(num_reqs)
        page, kv_heads, heads, dim = 16, 8, 64, 64
        seq_lens = torch.randint(1, 3000, (num_reqs,), generator=g).tolist()
        q_lens = [1] * num_reqs
        if splits == 1:  # (split-KV serves decode-only steps)
            seq_lens.append(400)
            q_lens.append(200)
        tables = random_page_tables(seq_lens, page, g)
        pages_per = [-(-s // page) for s in seq_lens]
        qsl = [0]
        for n in q_lens:
            qsl.append(qsl[-1] + n)
        case = dict(q=torch.randn(sum(q_lens), heads, dim, generator=g).bfloat16().cuda(),
                    kv=torch.randn(2, sum(pages_per), page, kv_heads, dim, generator=g).bfloat16().cuda(),
                    qsl=qsl, seq_lens=seq_lens, page_tables=tables.cuda(), scale=dim ** -0.5, causal=True,
                    window=window, num_splits=splits,
                    sinks=(2 * torch.randn(heads, generator=g)).bfloat16().cuda())
        got, ref = run_sink_case(case)
        assert (got - ref).abs().max().item() < 2e-2, (num_reqs, splits, window)


def test_fp32_on_cuda_equals_transformers_generate(path, caplog):
    """Mixed prefill/decode steps under a 32-token budget (chunks across the window), eager (logged)."""
    with caplog.at_level(logging.WARNING, logger="atlas"):
        llm = _llm(path, dtype="float32", max_num_batched_tokens=32)
    assert not llm.engine.runner.step_graphs
    prompts = _prompts(6, seed=3)
    ref = hf_model(path, dtype=torch.float32, device="cuda")
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(ref, p, GREEDY.max_tokens) for p in prompts]
    assert_pages_returned(llm)


def test_bf16_with_cuda_graphs_gives_the_references_argmax(path):
    llm = _llm(path, dtype="bfloat16")
    if torch.cuda.get_device_capability() >= (9, 0):  # the grouped GEMM: decode steps replay CUDA graphs
        assert llm.engine.runner.step_graphs
    prompts = _prompts(6, seed=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    _assert_reference_argmax(hf_model(path, dtype=torch.float32, device="cuda"), prompts, outs,
                             hf_model(path, dtype=torch.bfloat16, device="cuda"))
    assert_pages_returned(llm)


def test_ngram_speculation_equals_plain_greedy_fp32(path):
    prompts = [[3, 4, 5, 6] * 6, [9, 10, 11] * 5 + [12], _prompts(1, seed=4)[0]]
    plain = _llm(path, dtype="float32")
    spec = _llm(path, dtype="float32", speculative="ngram", speculative_policy="always", num_draft_tokens=3,
                ngram_min=1, ngram_max=3)
    want = [o.outputs[0].token_ids for o in plain.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)]
    assert [o.outputs[0].token_ids for o in spec.generate([{"prompt_token_ids": p} for p in prompts],
                                                          GREEDY)] == want
    assert spec.engine.stats.spec_num_draft_tokens > 0
    assert_pages_returned(spec)


def test_gpt_oss_20b_shape_runs_with_dummy_weights(tmp_path, caplog):
    """The published gpt-oss-20b shape (tools/make_random_checkpoint.py --config-only; MXFP4 in its config)
    under --load-format dummy in bf16: the experts drawn as MXFP4 codes (logged; uint8 on the GPU, read by the
    Triton expert kernels), CUDA graphs on sm90+, a few steps."""
    out = tmp_path / "gpt-oss-20b"
    assert checkpoint_tool().main(["--shape", "gpt-oss-20b", "--out", str(out), "--config-only"]) == 0
    with caplog.at_level(logging.INFO, logger="atlas.models.loader"):
        llm = LLM(str(out), device="cuda", load_format="dummy", dtype="bfloat16", kv_cache_memory=CUDA_KV,
                  max_model_len=1024, skip_tokenizer_init=True)
    assert "MXFP4 expert weights (quant_method mxfp4), drawn at random (--load-format dummy) in MXFP4" in (
        caplog.text)
    from atlas.layers.moe import FusedExperts

    experts = [m for m in llm.engine.runner.model.modules() if isinstance(m, FusedExperts)]
    assert experts and all(m.mxfp4 and m.w13.dtype == torch.uint8 and m.w13.is_cuda for m in experts)
    if torch.cuda.get_device_capability() >= (9, 0):
        assert llm.engine.runner.step_graphs
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": list(range(100, 100 + n))} for n in (5, 300)], params)
    assert [len(o.outputs[0].token_ids) for o in outs] == [16, 16]
    assert_pages_returned(llm)
