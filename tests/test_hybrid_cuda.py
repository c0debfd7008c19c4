"""Hybrid linear-attention models (Qwen3-Next, Qwen3.5, Qwen3.5-MoE) on a CUDA GPU: the Triton decode step of the
gated delta rule against its reference (one row a sequence and three), fp32 models equal to transformers' greedy
tokens with decode and verify steps replayed from CUDA graphs (the state slots in their static buffers) and mixed
steps eager, bf16 tokens the reference's argmax, and the Qwen3.5-9B shape under --load-format dummy. Skipped without a GPU; run on the GPU machine with
`python -m pytest -m cuda tests/test_hybrid_cuda.py`."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import CUDA_KV, hf_model
from gated_delta_rule_cases import check, check_conv_varlen, check_mixed_rows, check_snapshot_tails
from test_deepseek_cuda import GREEDY, _assert_reference_argmax, _prompts
from test_hybrid_models import HYBRIDS, assert_slots_returned, build_hybrid

from atlas import LLM

ROOT = Path(__file__).resolve().parents[1]

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.usefixtures("no_tf32")]


@pytest.fixture(scope="module")
def hybrid_dirs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("hybrid-cuda")
    return {name: build_hybrid(root, name, None) for name in HYBRIDS}


def hf_greedy_torch_path(path, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """transformers' fp32 greedy tokens through its PyTorch delta rule (hf_greedy_torch_path.py, in a process whose
    path leaves out the folders flash-linear-attention and causal-conv1d import from: this one's may hold them)."""
    dropped = set()
    for name in ("fla", "causal_conv1d"):
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.origin:
            dropped.add(str(Path(spec.origin).resolve().parents[1]))
    torch_root = str(Path(torch.__file__).resolve().parents[1])
    if torch_root in dropped:
        pytest.skip("flash-linear-attention or causal-conv1d is installed beside torch: transformers' reference would "
                    "run their TF32 kernels")
    path_entries = [p for p in [str(ROOT), *sys.path] if p and str(Path(p).resolve()) not in dropped]
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("hf_greedy_torch_path.py")), str(path),
                           str(max_tokens), json.dumps(prompts)], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(path_entries)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _llm(path, **kw) -> LLM:
    return LLM(str(path), device="cuda", kv_cache_memory=CUDA_KV, max_model_len=256, skip_tokenizer_init=True,
               max_num_seqs=16, **kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_recurrent_decode_matches_reference(dtype):
    """Every head packing of the cases script, the last two at Qwen3.5-9B's heads (16 key, 32 value, 128 dims)."""
    for seed in range(8):
        check(seed, "cuda", dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_varlen_convolution_matches_reference(dtype):
    """An eager step's short convolution (prompts among decodes, snapshots inside a prompt) through the Triton
    kernels against the reference path."""
    for seed in range(4):
        check_conv_varlen(seed, "cuda", dtype)


@pytest.mark.parametrize("dtype, prefill", [(torch.float32, "atlas"), (torch.bfloat16, "atlas"),
                                            (torch.bfloat16, "auto")])
def test_rows_after_an_in_step_snapshot_through_the_recurrent_kernel(dtype, prefill):
    """The delta rule of an eager step with snapshots inside prompts: the rows before them chunked (Atlas's form, or
    flash-linear-attention's where it imports), the rows after them through the recurrent kernel, against the
    reference path (flash-linear-attention in bf16 only: it computes float32 inputs in TF32)."""
    from atlas.kernels import settings

    # (check_snapshot_tails turns --tuning gdn_snapshot_tail on around its call)
    with settings.tuned(gdn_prefill=prefill):
        for seed in range(4):
            check_snapshot_tails(seed, "cuda", dtype)


@pytest.mark.parametrize("eager", [False, True])
@pytest.mark.parametrize("name", HYBRIDS)
def test_fp32_on_cuda_equals_transformers_generate(name, eager, hybrid_dirs, caplog):
    """The defaults: mixed prefill/decode steps under a 32-token budget (chunked prompts) from the mixed-step graphs,
    decode steps from the CUDA graphs (padded batches: the scratch slot); or with --enforce-eager every step eager
    (the Triton decode kernel over the host's rows)."""
    path = hybrid_dirs[name]
    with caplog.at_level(logging.INFO, logger="atlas"):
        # (Atlas's own prompt path: flash-linear-attention's kernel, the default where it imports, computes in TF32)
        llm = _llm(path, dtype="float32", max_num_batched_tokens=32, enforce_eager=eager,
                   tuning={"gdn_prefill": "atlas"})
    runner = llm.engine.runner
    assert "CUDA graphs are off" not in caplog.text
    assert bool(runner.step_graphs) != eager and (runner.mixed_graphs is None) == eager
    prompts = _prompts(6, seed=3)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy_torch_path(path, prompts, GREEDY.max_tokens)
    assert eager or (runner.step_graphs[1].steps_run > 0 and runner.mixed_graphs.steps_run > 0)
    assert_slots_returned(llm)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_step_rows_through_the_triton_kernels_match_reference(dtype):
    """The mixed-step graphs' linear-attention pieces (RecurrentRows: the varlen convolution, its states written
    into the pool in two launches, the recurrent kernel with row counts and in-step snapshots) against the
    reference, on the GPU."""
    for seed in range(6):
        check_mixed_rows(seed, "cuda", dtype)


@pytest.mark.parametrize("name", ["qwen3_next", "qwen3_5"])
def test_mixed_steps_from_cuda_graphs_equal_transformers(name, hybrid_dirs):
    """--tuning mixed_graph_recurrent_rows=32: mixed steps (prompt chunks under a 32-token budget beside other
    requests' decodes) replay CUDA graphs, the linear-attention layers token by token from static buffers, prefix
    caching on (snapshots inside prompt chunks, 8-token pages): fp32 tokens equal transformers', every slot back."""
    path = hybrid_dirs[name]
    llm = _llm(path, dtype="float32", max_num_batched_tokens=32, block_size=8,
               tuning={"gdn_prefill": "atlas", "mixed_graph_recurrent_rows": "32"})
    mixed = llm.engine.runner.mixed_graphs
    assert mixed is not None and mixed.graphs and mixed.states is not None
    prompts = _prompts(6, seed=3)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy_torch_path(path, prompts, GREEDY.max_tokens)
    assert mixed.steps_run > 0
    assert_slots_returned(llm)
    again = llm.generate([{"prompt_token_ids": p} for p in prompts[:3]], GREEDY)  # (prefix hits on snapshots)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in outs[:3]]
    assert llm.engine.kv.stats.hits > 0
    assert_slots_returned(llm)


def _assert_speculation_prompts_follow_transformers(llm, path) -> None:
    """The CPU speculation tests' prompts (their continuations repeat, so drafts are kept and rejected), 24 greedy
    tokens each: transformers' fp32 tokens."""
    from test_hybrid_speculation import PROMPTS

    from atlas import SamplingParams

    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy_torch_path(path, PROMPTS, 24)


@pytest.mark.parametrize("mixed_rows", ["0", "32"])
def test_ngram_verify_steps_from_cuda_graphs_equal_transformers(tmp_path, mixed_rows):
    """N-gram drafts (K = 2) verified in steps replayed from CUDA graphs (three rows a sequence through the state),
    backups and restores around them, on the echoing model of the CPU speculation tests (drafts kept and
    rejected): transformers' tokens, fp32. mixed_rows 32: the mixed steps (prompts beside verify rows) replay graphs
    too (--tuning mixed_graph_recurrent_rows), keeping the verifying rows' inputs for the replays."""
    from test_hybrid_prefix_cache import assert_all_returned
    from test_hybrid_speculation import build_echo_hybrid, record_restores

    path = build_echo_hybrid(tmp_path, "qwen3_next", None)
    llm = _llm(path, dtype="float32", speculative="ngram", speculative_policy="always", ngram_min=1,
               num_draft_tokens=2, tuning={"gdn_prefill": "atlas", "mixed_graph_recurrent_rows": mixed_rows})
    restores = record_restores(llm)
    _assert_speculation_prompts_follow_transformers(llm, path)
    verify = llm.engine.runner.step_graphs[3]
    assert verify.graphs and verify.steps_run > 0
    states = llm.engine.runner.states
    assert states.replay_graphs and states.graphed_replays > 0  # (the kept rows replayed from their graphs)
    assert llm.engine.scheduler.stats.spec_num_accepted_tokens > 0 and restores
    mixed = llm.engine.runner.mixed_graphs
    assert (mixed is not None and mixed.graphs and mixed.steps_run > 0) if mixed_rows != "0" else mixed is None
    assert_all_returned(llm)


@pytest.mark.parametrize("method", ["dflash", "draft_model"])
def test_drafters_with_their_own_cache_from_cuda_graphs_equal_transformers(method, tmp_path, tokenizer_dir):
    """A Qwen3.5 target with drafters that keep their own KV cache (a DFlash block drafter reading target layers 1
    and 3, random; a Qwen3 draft model that repeats its last token, so some drafts are kept): drafts stay on the
    device, verify steps replay from CUDA graphs, rejections restore the state from its backup; fp32 tokens equal
    transformers'."""
    from test_dflash import write_drafter
    from test_hybrid_prefix_cache import assert_all_returned
    from test_hybrid_speculation import build_echo_hybrid, record_restores, repeating_drafter

    (tmp_path / "target").mkdir()
    path = build_echo_hybrid(tmp_path / "target", "qwen3_5", tokenizer_dir)
    drafter = (write_drafter(tmp_path / "dflash", hidden=64, layer_ids=[1, 3], mask_token_id=383, block_size=4)
               if method == "dflash" else repeating_drafter(tmp_path, tokenizer_dir))
    llm = _llm(path, dtype="float32", speculative=method, draft_model=str(drafter), num_draft_tokens=3,
               speculative_policy="always", max_num_batched_tokens=64)
    restores = record_restores(llm)
    _assert_speculation_prompts_follow_transformers(llm, path)
    verify = llm.engine.runner.step_graphs[4]
    assert verify.graphs and verify.steps_run > 0
    stats = llm.engine.scheduler.stats
    assert restores and stats.spec_num_draft_tokens > stats.spec_num_accepted_tokens
    if method == "draft_model":
        assert stats.spec_num_accepted_tokens > 0
    assert_all_returned(llm)


@pytest.mark.parametrize("name", HYBRIDS)
def test_bf16_tokens_are_the_references_argmax(name, hybrid_dirs):
    path = hybrid_dirs[name]
    llm = _llm(path, dtype="bfloat16", tuning={"gdn_prefill": "atlas"})
    prompts = _prompts(6, seed=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    _assert_reference_argmax(hf_model(path, dtype=torch.float32, device="cuda"), prompts, outs,
                             hf_model(path, dtype=torch.bfloat16, device="cuda"))
    assert_slots_returned(llm)


@pytest.mark.parametrize("name", HYBRIDS)
def test_fla_prefill_tokens_are_the_references_argmax(name, hybrid_dirs):
    """--tuning gdn_prefill=fla: prompt chunks (under a 32-token budget: chunks continuing from a state) through
    flash-linear-attention's chunk kernel, bf16: tokens the reference's argmax as the default kernel's are."""
    pytest.importorskip("fla", reason="flash-linear-attention is not installed (carry its wheel: tools/fetch_server_wheels.sh)")
    path = hybrid_dirs[name]
    llm = _llm(path, dtype="bfloat16", max_num_batched_tokens=32, tuning={"gdn_prefill": "fla"})
    prompts = _prompts(6, seed=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    _assert_reference_argmax(hf_model(path, dtype=torch.float32, device="cuda"), prompts, outs,
                             hf_model(path, dtype=torch.bfloat16, device="cuda"))
    assert_slots_returned(llm)


def test_qwen35_9b_shape_runs_with_dummy_weights(tmp_path):
    """The published Qwen3.5-9B shape (tools/make_random_checkpoint.py --config-only) under --load-format dummy:
    the memory plan counts 257 state slots of 49 MiB first, and a few steps run."""
    import importlib.util
    from pathlib import Path

    from atlas import SamplingParams

    tool_path = Path(__file__).resolve().parents[1] / "tools" / "make_random_checkpoint.py"
    spec = importlib.util.spec_from_file_location("make_random_checkpoint", tool_path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    out = tmp_path / "qwen3.5-9b"
    assert tool.main(["--shape", "qwen3.5-9b", "--out", str(out), "--config-only"]) == 0
    llm = LLM(str(out), device="cuda", load_format="dummy", skip_tokenizer_init=True, max_model_len=4096,
              kv_cache_memory="20GiB")  # (the recurrent state of 257 sequences, 12.3 GiB, 64 snapshots, pages)
    plan = llm.engine.plan
    assert plan.breakdown["recurrent state"] == 257 * 24 * (8192 * 3 * 2 + 32 * 128 * 128 * 4)
    outs = llm.generate([{"prompt_token_ids": list(range(1, 300))}, {"prompt_token_ids": [5] * 20}],
                        SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in outs] == [8, 8]
    assert_slots_returned(llm)
