"""Mixed steps (sequences with different query lengths: a new prompt's chunk beside decodes or verify rows)
through the static buffers their CUDA graphs replay. On a CPU the forward runs eagerly over those buffers
(padding sequence, empty sequences, padded program map and sample rows), so the layout is tested here; the
CUDA test at the end replays the captured graphs."""

from __future__ import annotations

import pytest
import torch
from conftest import CUDA_KV, assert_pages_returned, continuous_arrivals

from atlas import LLM, SamplingParams
from atlas.config import TuningConfig
from atlas.runtime.mixed_graphs import mixed_token_sizes

GREEDY = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = int(torch.randint(3, 70, (1,), generator=g))
        base = torch.randint(1, 384, (max(2, length // 3),), generator=g).tolist()
        out.append((base * 3)[:length] if i % 2 else torch.randint(1, 384, (length,), generator=g).tolist())
    return out


def _static(llm, q_lens: list[int], max_num_seqs: int):
    """The mixed-step graphs' buffers without capturing; each forward over them checks that the device buffers
    the Triton kernel reads say what the host lists the reference attention reads say."""
    runner = llm.engine.runner
    runner.capture_step_graphs(max_num_seqs, q_lens, use_graphs=False)
    mixed = runner.mixed_graphs
    assert mixed is not None
    forward = mixed._run_forward

    def checked(size, qsl, lens):
        attn = mixed.attn
        assert attn.query_start_loc.tolist() == qsl and attn.seq_lens.tolist() == lens and qsl[-1] == size
        # Programs: every non-empty sequence's query blocks in order, then the empty sequence's.
        programs = -(-size // attn.block_q) + attn.num_slots
        req, q0 = attn.prog_req[:programs].tolist(), attn.prog_q0[:programs].tolist()
        want = [(r, start) for r in range(len(lens)) for start in range(0, qsl[r + 1] - qsl[r], attn.block_q)]
        assert list(zip(req, q0, strict=True))[: len(want)] == want
        assert set(req[len(want):]) <= {attn.empty_seq} and lens[attn.empty_seq] == 0
        assert max(mixed.sample_idx.tolist()) < max(1, qsl[attn.pad_seq])  # (sampled rows are the step's own)
        return forward(size, qsl, lens)

    mixed._run_forward = checked
    return mixed


@pytest.mark.parametrize("speculative", [None, "ngram"])
def test_mixed_steps_through_static_buffers_give_the_eager_tokens(qwen3_dir, speculative):
    """Continuous arrivals with chunked prompts (budget 24 tokens a step): the mixed steps replayed through
    the static buffers give exactly the tokens of the eager forward, and every page comes back."""
    prompts = _prompts(9, seed=3)
    lengths = [5 + 3 * i for i in range(len(prompts))]
    kwargs = dict(kv_cache_memory="8MiB", skip_tokenizer_init=True, max_num_seqs=3, max_num_batched_tokens=24,
                  speculative=speculative, speculative_policy="always")
    eager = LLM(str(qwen3_dir), enforce_eager=True, **kwargs)  # (eager on a GPU too, where graphs are the default)
    assert eager.engine.runner.mixed_graphs is None
    expected = continuous_arrivals(eager, prompts, lengths)
    llm = LLM(str(qwen3_dir), **kwargs)
    q_lens = [1] + ([llm.engine.proposer.num_draft_tokens + 1] if speculative else [])
    mixed = _static(llm, q_lens, 3)
    assert continuous_arrivals(llm, prompts, lengths) == expected
    assert mixed.steps_run > 5
    assert_pages_returned(llm)
    if speculative:
        assert llm.engine.stats.spec_num_accepted_tokens > 0


def test_mla_and_moe_mixed_steps_through_static_buffers_give_the_eager_tokens(deepseek_checkpoints):
    """The DeepSeek layout (latent attention, routed experts, YaRN) through the mixed-step buffers, with a largest
    graph longer than the model's context (the padding rows must stay inside its rotary table)."""
    path = deepseek_checkpoints["v3"]
    prompts = _prompts(7, seed=6)
    lengths = [4 + 2 * i for i in range(len(prompts))]
    kwargs = dict(kv_cache_memory="8MiB", skip_tokenizer_init=True, max_num_seqs=3, max_num_batched_tokens=600,
                  max_model_len=256)
    expected = continuous_arrivals(LLM(str(path), **kwargs), prompts, lengths)
    llm = LLM(str(path), **kwargs)
    mixed = _static(llm, [1], 3)
    assert mixed.max_tokens == 600 > llm.engine.max_model_len
    # The step the largest graph is captured over: every row the padding sequence's.
    mixed._stage(600, 0, 0, 0)
    with torch.inference_mode():
        mixed._run_forward(600, *mixed.attn.host_lists(600, [0], []))
    assert continuous_arrivals(llm, prompts, lengths) == expected
    assert mixed.steps_run > 3
    assert_pages_returned(llm)


def test_mixed_steps_beyond_the_graphs_run_eagerly(qwen3_dir):
    """A step larger than the largest mixed graph, or one that asks for prompt logprobs (they need every row's
    hidden state), takes the eager forward; the others the static buffers."""
    llm = LLM(str(qwen3_dir), kv_cache_memory="8MiB", skip_tokenizer_init=True, max_num_seqs=4,
              max_num_batched_tokens=2048)
    mixed = _static(llm, [1], 4)
    assert mixed.max_tokens == 1024 and mixed_token_sizes(100) == [32, 64, 96, 100]
    assert mixed_token_sizes(100, (8, 64)) == [8, 32, 64, 96, 100]
    runs = mixed.steps_run
    # Three prompts of 400 and one of 3 tokens in the first step: 1,203 rows, more than the largest graph.
    long_prompts = [{"prompt_token_ids": [(7 * i + j) % 300 + 1 for j in range(400)]} for i in range(3)]
    outs = llm.generate(long_prompts + [{"prompt_token_ids": [5, 6, 7]}], GREEDY)
    assert mixed.steps_run == runs and [len(o.outputs[0].token_ids) for o in outs] == [20] * 4
    with_lp = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, prompt_logprobs=2)
    out = llm.generate({"prompt_token_ids": [5, 6, 7, 8]}, with_lp)[0]
    assert mixed.steps_run == runs and len(out.prompt_logprobs) == 4
    # Two prompts of different lengths: one mixed step through the buffers.
    eager = LLM(str(qwen3_dir), kv_cache_memory="8MiB", skip_tokenizer_init=True, max_num_seqs=4)
    pair = [{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": list(range(9, 40))}]
    assert ([o.outputs[0].token_ids for o in llm.generate(pair, GREEDY)]
            == [o.outputs[0].token_ids for o in eager.generate(pair, GREEDY)])
    assert mixed.steps_run == runs + 1
    assert_pages_returned(llm)


def test_the_memory_plan_counts_every_graph_pool(qwen3_dir, monkeypatch):
    """The estimate the memory plan reserves for CUDA graphs grows by the mixed-step pool (activations of its
    largest step, logits of its sampled rows) unless --tuning mixed_graphs=0, and counts a pool for each query
    length (decode and verify graphs do not share one), each with one logits buffer for its largest step."""
    llm = LLM(str(qwen3_dir), kv_cache_memory="8MiB", skip_tokenizer_init=True, max_num_seqs=4)
    runner = llm.engine.runner
    monkeypatch.setattr(type(runner.graph_plan), "enabled", property(lambda self: True))
    with_mixed = runner.graph_memory_estimate(4, [1])
    monkeypatch.setattr(runner.config, "tuning", TuningConfig(mixed_graphs=False))
    assert runner.mixed_graph_tokens == 0
    without = runner.graph_memory_estimate(4, [1])
    cfg = llm.engine.model_config
    assert with_mixed - without >= 2 * 1024 * (12 * cfg.hidden_size + 4 * cfg.intermediate_size) * 4
    verify = runner.graph_memory_estimate(4, [5])
    kept_logits = 4 * 5 * cfg.vocab_size * 4  # (the largest step's 4 x 5 rows, which every size writes; fp32 on CPU)
    assert runner.graph_memory_estimate(4, [1, 5]) == without + verify
    assert verify >= kept_logits + 2 * 4 * 20 * (12 * cfg.hidden_size + 4 * cfg.intermediate_size + cfg.vocab_size)


def test_every_size_of_a_set_of_graphs_writes_its_logits_into_one_buffer(qwen3_dir):
    """A graph's outputs stay alive in its pool, so each captured size keeping logits of its own would hold the
    sum of every size's rows: the uniform steps' sizes (1, 2, 4) and the mixed steps' write the head of one
    buffer per set, and the logits there are the eager forward's."""
    llm = LLM(str(qwen3_dir), kv_cache_memory="8MiB", skip_tokenizer_init=True, max_num_seqs=4)
    runner = llm.engine.runner
    runner.capture_step_graphs(4, [1], use_graphs=False)
    graphs, mixed = runner.step_graphs[1], runner.mixed_graphs
    with torch.inference_mode():
        logits = {size: graphs._run_forward(size)[1] for size in graphs.sizes}
        mixed._stage(32, 0, 0, 0)
        mixed_logits = [mixed._run_forward(size, *mixed.attn.host_lists(size, [0], []))[1] for size in (32, 64)]
    assert graphs.sizes == [1, 2, 4]
    assert len({t.data_ptr() for t in logits.values()}) == 1 and logits[4].shape[0] == 4
    assert mixed_logits[0].data_ptr() == mixed_logits[1].data_ptr()
    assert mixed_logits[0].data_ptr() not in {t.data_ptr() for t in logits.values()}
    # The rows the size-4 step left in the buffer are what the eager forward and LM head make of its inputs.
    meta = graphs.attn.meta(4)
    with torch.inference_mode():
        hidden, _ = runner.model(graphs.input_ids[:4], graphs.positions[:4], runner.kv_caches, meta)
        torch.testing.assert_close(logits[4], runner.model.compute_logits(hidden), rtol=0, atol=0)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.usefixtures("no_tf32")
@pytest.mark.parametrize("speculative", [None, "ngram"])
def test_mixed_step_graphs_on_cuda_give_the_eager_tokens(qwen3_dir, speculative):
    """float32 on the GPU: continuous arrivals with chunked prompts, mixed steps replayed from their CUDA graphs
    against the same engine with them off (--tuning mixed_graphs=0): the same tokens."""
    prompts = _prompts(9, seed=4)
    lengths = [5 + 3 * i for i in range(len(prompts))]
    kwargs = dict(device="cuda", dtype="float32", kv_cache_memory=CUDA_KV, skip_tokenizer_init=True,
                  max_num_seqs=3, max_num_batched_tokens=24, max_model_len=256, speculative=speculative, speculative_policy="always")
    eager = LLM(str(qwen3_dir), tuning={"mixed_graphs": False}, **kwargs)
    assert eager.engine.runner.mixed_graphs is None
    expected = continuous_arrivals(eager, prompts, lengths)
    del eager
    llm = LLM(str(qwen3_dir), **kwargs)
    mixed = llm.engine.runner.mixed_graphs
    assert mixed is not None and mixed.graphs
    assert continuous_arrivals(llm, prompts, lengths) == expected
    assert mixed.steps_run > 5
    assert_pages_returned(llm)


def test_an_fp8_model_captures_a_mixed_step_at_the_fp8_kernels_boundary(qwen3_dir, tmp_path):
    """With FP8 linear layers the mixed-step sizes include fp8_linear.SMALL_M (the row count above which they
    quantize their activations), so a 3-token step pads to SMALL_M rows and keeps its eager run's kernels; the
    tokens through the buffers equal the eager forward's. A bf16 model's sizes start at 32."""
    from test_fp8_linear import write_pair

    from atlas.kernels.fp8_linear import SMALL_M

    fp8 = write_pair(qwen3_dir, tmp_path, "fp8-block")[0]
    kwargs = dict(kv_cache_memory="8MiB", skip_tokenizer_init=True, max_num_seqs=4)
    prompts = [{"prompt_token_ids": p} for p in _prompts(3, seed=5)]
    want = [o.outputs[0].token_ids for o in LLM(str(fp8), **kwargs).generate(prompts, GREEDY)]
    llm = LLM(str(fp8), **kwargs)
    mixed = _static(llm, [1], 4)
    assert mixed.sizes[0] == SMALL_M < 32
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)] == want and mixed.steps_run > 0
    plain = LLM(str(qwen3_dir), **kwargs)
    assert _static(plain, [1], 4).sizes[0] == 32
