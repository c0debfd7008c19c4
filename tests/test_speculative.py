"""Speculative decoding is lossless: greedy outputs are identical, sampled outputs are distributed
exactly as without it, and every page comes back."""

from __future__ import annotations

import math
import random

import pytest
import torch
from conftest import assert_pages_returned
from spec_stats import TINY_VOCAB, assert_samples_follow, exact_sequence_distribution, tiny_vocab_target

from atlas import LLM, SamplingParams
from atlas.errors import ConfigError
from atlas.runtime.verify import accept_one_hot, accept_with_probs
from atlas.speculative.ngram import NgramIndex, ngram_lookup
from atlas.speculative.proposer import flat_device_drafts

GREEDY = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)


def _repetitive_prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Prompts with repeated segments, so prompt lookup finds matches (and some drafts are wrong)."""
    g = torch.Generator().manual_seed(seed)
    prompts = []
    for _ in range(n):
        seg = torch.randint(1, 384, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g).tolist()
        reps = int(torch.randint(2, 6, (1,), generator=g))
        tail = torch.randint(1, 384, (int(torch.randint(0, 20, (1,), generator=g)),), generator=g).tolist()
        prompts.append(tail + seg * reps)
    return prompts


def test_ngram_lookup_prefers_longest_and_latest_match():
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3]
    assert ngram_lookup(tokens, 2, 3, 2) == [7, 5]  # latest earlier occurrence of [1, 2, 3]
    assert ngram_lookup([4, 5, 6, 4, 5], 1, 3, 3) == [6, 4, 5]
    assert ngram_lookup([1, 2, 3, 4], 2, 3, 3) == []
    assert ngram_lookup([8, 8], 1, 1, 4) == [8]


def _ngram_lookup_by_windows(tokens, min_n, max_n, k):
    """The definition, spelled out: for n from the longest down, the latest earlier window equal to the last n
    tokens (windows may overlap the suffix but not be it), and the k tokens after it."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start: start + n] == tokens[len(tokens) - n:]:
                return tokens[start + n: start + n + k]
    return []


def test_ngram_lookup_matches_the_window_definition_on_random_sequences():
    rng = random.Random(0)
    for _ in range(3000):
        vocab = rng.choice([2, 3, 5, 20])
        tokens = [rng.randrange(vocab) for _ in range(rng.randint(0, 40))]
        min_n = rng.randint(1, 4)
        max_n, k = rng.randint(min_n, 6), rng.randint(1, 8)
        assert ngram_lookup(tokens, min_n, max_n, k) == _ngram_lookup_by_windows(tokens, min_n, max_n, k), (
            tokens, min_n, max_n, k)


def test_ngram_index_follows_a_growing_sequence():
    """The proposer's per-request index, fed the sequence as it grows by a few tokens a step, drafts what a scan of
    the whole sequence drafts at every step (and starts over if handed a shorter sequence)."""
    rng = random.Random(1)
    for _ in range(300):
        vocab, min_n = rng.choice([2, 3, 5, 20]), rng.randint(1, 3)
        max_n = rng.randint(min_n, 5)
        index, tokens = NgramIndex(min_n, max_n), [rng.randrange(vocab) for _ in range(rng.randint(0, 6))]
        for _ in range(10):
            k = rng.randint(1, 6)
            assert index.lookup(tokens, k) == _ngram_lookup_by_windows(tokens, min_n, max_n, k)
            tokens = tokens + [rng.randrange(vocab) for _ in range(rng.randint(1, 5))]
        tokens = tokens[: len(tokens) // 2]
        assert index.lookup(tokens, 3) == _ngram_lookup_by_windows(tokens, min_n, max_n, 3)


@pytest.fixture(scope="module")
def plain_outputs(qwen3_dir):
    llm = LLM(str(qwen3_dir), kv_cache_memory="32MiB", max_model_len=160, enable_prefix_caching=False)
    prompts = _repetitive_prompts(12)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    return prompts, [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("k", [1, 4, 7])
def test_ngram_greedy_equals_plain_under_pressure(qwen3_dir, plain_outputs, k):
    """Batched, prefix caching on, chunked prefill and forced preemption."""
    prompts, expected = plain_outputs
    llm = LLM(str(qwen3_dir), speculative="ngram", speculative_policy="always", num_draft_tokens=k, ngram_min=1, ngram_max=3,
              num_gpu_blocks_override=30, block_size=8, max_num_batched_tokens=48, max_num_seqs=6, max_model_len=160)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == expected
    for _ in range(2):  # the second run reads the first one's pages from the prefix cache
        again = llm.generate({"prompt_token_ids": prompts[0]}, GREEDY)[0]
        assert again.outputs[0].token_ids == expected[0]
    assert again.num_cached_tokens > 0
    stats = llm.engine.stats
    assert stats.spec_num_verify_steps > 0 and 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.kv.stats.hits > 0
    m = outs[0].metrics
    assert m.spec_num_verify_steps > 0 and m.spec_mean_acceptance_length >= 1.0
    assert_pages_returned(llm)
    assert not llm.engine.proposer._indexes  # (each finished request's n-gram index went with it)


def test_stops_inside_an_accepted_run_cut_where_plain_decoding_would(qwen3_dir, plain_outputs):
    prompts, expected = plain_outputs
    llm = LLM(str(qwen3_dir), speculative="ngram", speculative_policy="always", num_draft_tokens=6, ngram_min=1, kv_cache_memory="16MiB")
    plain = LLM(str(qwen3_dir), kv_cache_memory="16MiB")
    for prompt, tokens in zip(prompts[:6], expected[:6], strict=True):
        stop = tokens[len(tokens) // 2]
        for params in (SamplingParams(max_tokens=32, temperature=0, stop_token_ids=[stop]),
                       SamplingParams(max_tokens=7, temperature=0, ignore_eos=True),
                       SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, logprobs=2)):
            got = llm.generate({"prompt_token_ids": prompt}, params)[0].outputs[0]
            ref = plain.generate({"prompt_token_ids": prompt}, params)[0].outputs[0]
            assert got.token_ids == ref.token_ids
            assert got.finish_reason == ref.finish_reason and got.stop_reason == ref.stop_reason
            if params.logprobs:
                assert [list(e) for e in got.logprobs] == [list(e) for e in ref.logprobs]
                assert got.cumulative_logprob == pytest.approx(ref.cumulative_logprob, abs=1e-4)
    assert llm.engine.stats.spec_num_accepted_tokens > 0
    assert_pages_returned(llm)


def test_stop_string_inside_an_accepted_run(qwen3_dir):
    llm = LLM(str(qwen3_dir), speculative="ngram", speculative_policy="always", num_draft_tokens=5, ngram_min=1, kv_cache_memory="16MiB")
    plain = LLM(str(qwen3_dir), kv_cache_memory="16MiB")
    prompt = "self.width = width\n        self.width = width\n        self."
    full = plain.generate(prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0].outputs[0].text
    stop = full[12:15]
    got = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=40, stop=stop))[0].outputs[0]
    ref = plain.generate(prompt, SamplingParams(temperature=0, max_tokens=40, stop=stop))[0].outputs[0]
    assert (got.text, got.token_ids, got.stop_reason) == (ref.text, ref.token_ids, ref.stop_reason)
    assert_pages_returned(llm)


# --------------------------------------------------------------------------- the acceptance rules
def _table_target(vocab: int, seed: int):
    """A synthetic target: a fixed random next-token distribution for every prefix."""
    g = torch.Generator().manual_seed(seed)
    cache: dict[tuple, torch.Tensor] = {}

    def target(prefix: tuple) -> torch.Tensor:
        if prefix not in cache:
            cache[prefix] = (torch.randn(vocab, generator=g) * 1.5).softmax(-1)
        return cache[prefix]

    return target


@pytest.mark.parametrize("with_probs", [False, True])
def test_acceptance_rule_preserves_the_target_distribution(with_probs):
    """Emitted sequences of 3 tokens, drawn through draft-then-verify with a poor drafter, follow the
    target's exact distribution (chi-square over all 64 sequences, 20k draws: a rule off by a few percent in one
    sequence's share lands several standard deviations out)."""
    vocab, length, k = 4, 3, 3
    target = _table_target(vocab, seed=0)
    q_fixed = torch.tensor([0.55, 0.25, 0.15, 0.05])  # the drafter's (wrong) distribution
    exact = exact_sequence_distribution(target, vocab, length)
    gen = torch.Generator().manual_seed(1)
    counts: dict[tuple, int] = dict.fromkeys(exact, 0)
    draws = 20_000
    stacked: dict[tuple, torch.Tensor] = {}  # (the target's rows for a run of prefixes: few distinct runs)
    q = q_fixed.repeat(k, 1)
    for _ in range(draws):
        seq: list[int] = []
        while len(seq) < length:
            if with_probs:
                drafts = torch.multinomial(q_fixed, k, replacement=True, generator=gen).tolist()
            else:
                drafts = [int(torch.randint(vocab, (1,), generator=gen))] * k
            key = tuple(seq + drafts)
            if key not in stacked:
                stacked[key] = torch.stack([target(tuple(seq + drafts[:j])) for j in range(k + 1)])
            p = stacked[key]
            if with_probs:
                bonus = int(torch.multinomial(p[k], 1, generator=gen))
                emitted = accept_with_probs(drafts, p, q, bonus, gen)
            else:  # (the target's sample at every position, each row drawn on its own, in one call)
                samples = torch.multinomial(p, 1, generator=gen).flatten().tolist()
                emitted = accept_one_hot(drafts, samples)
            seq.extend(emitted)
        counts[tuple(seq[:length])] += 1
    stat = sum((counts[s] - draws * p) ** 2 / (draws * p) for s, p in exact.items())
    df = len(exact) - 1
    assert stat < df + 5 * math.sqrt(2 * df), stat


# --------------------------------------------------------------------------- end to end, sampled
class _SampledDrafter:
    """A plug-in proposer that samples its drafts from a fixed skewed distribution and says so,
    so that the engine verifies them by full rejection sampling."""

    def __init__(self, vocab: int, k: int):
        from atlas.speculative.proposer import DraftProposer

        self.q = torch.tensor([0.5] + [0.5 / (vocab - 1)] * (vocab - 1))
        self.k = k
        self.gen = torch.Generator().manual_seed(3)
        proposer = self

        class Proposer(DraftProposer):
            num_draft_tokens = k

            def propose(self, requests):
                from atlas.speculative.proposer import Draft

                return [Draft(torch.multinomial(proposer.q, k, replacement=True, generator=proposer.gen).tolist(),
                              proposer.q.repeat(k, 1)) for _ in requests]

        self.proposer = Proposer()


@pytest.mark.parametrize("method", ["ngram", "sampled-drafter"])
def test_engine_sampling_with_speculation_matches_the_exact_distribution(tmp_path, method):
    """A 5-token vocabulary model: the distribution of 3-token continuations with speculation equals
    the exact one computed from transformers' logits."""
    ckpt, exact = tiny_vocab_target(tmp_path)
    kwargs = dict(skip_tokenizer_init=True, kv_cache_memory="16MiB")
    if method == "ngram":
        llm = LLM(str(ckpt), speculative="ngram", speculative_policy="always", num_draft_tokens=3, ngram_min=1, ngram_max=2, **kwargs)
    else:
        llm = LLM(str(ckpt), **kwargs)
        llm.engine.proposer = _SampledDrafter(TINY_VOCAB, 2).proposer
    assert_samples_follow(llm, exact)
    assert llm.engine.stats.spec_num_verify_steps > 0
    assert 0 < llm.engine.stats.spec_num_accepted_tokens < llm.engine.stats.spec_num_draft_tokens


def test_bad_speculative_setups_fail_at_startup(qwen3_dir):
    with pytest.raises(ConfigError, match="--draft-model needs --speculative"):
        LLM(str(qwen3_dir), draft_model="x")
    with pytest.raises(ConfigError, match="--num-draft-tokens must be in"):
        LLM(str(qwen3_dir), speculative="ngram", speculative_policy="always", num_draft_tokens=0)
    with pytest.raises(ConfigError, match="--draft-model is for --speculative dflash"):
        LLM(str(qwen3_dir), speculative="ngram", speculative_policy="always", draft_model="x")
    with pytest.raises(ConfigError, match="--speculative must be one of"):
        LLM(str(qwen3_dir), speculative="eagle")
    with pytest.raises(ConfigError, match="multi-token-prediction heads; Qwen3ForCausalLM has none"):
        LLM(str(qwen3_dir), speculative="mtp", speculative_policy="always", kv_cache_memory="8MiB")


def test_uniform_step_buffers_give_the_same_tokens(qwen3_dir, plain_outputs):
    """The static-buffer path that CUDA graphs replay (inputs copied into fixed buffers, batches padded
    with sequences confined to scratch pages), run eagerly on the CPU for decode (q = 1) and verify
    (q = 1 + K) steps: greedy tokens are unchanged and the padding never touches real pages."""
    prompts, expected = plain_outputs
    k = 3
    llm = LLM(str(qwen3_dir), speculative="ngram", speculative_policy="always", num_draft_tokens=k, ngram_min=1, kv_cache_memory="16MiB",
              max_model_len=160, max_num_seqs=5)
    runner = llm.engine.runner
    runner.capture_step_graphs(5, [1, k + 1], use_graphs=False)
    used: dict[int, int] = {}
    for q, graphs in runner.step_graphs.items():
        original = graphs.run

        def counted(*args, q=q, original=original):
            used[q] = used.get(q, 0) + 1
            return original(*args)

        graphs.run = counted
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert used.get(1, 0) > 0 and used.get(k + 1, 0) > 0  # both kinds of step went through the buffers
    assert_pages_returned(llm)


def test_flat_device_drafts_are_a_view_where_the_rows_lie_back_to_back():
    """A step's drafts left on the device, one flat tensor: a view of the block's rows when every request
    takes its whole row in order, else a concatenation; the values are the drafts either way."""
    block = torch.arange(40).view(5, 8).clone()
    rows = list(block.unbind(0))
    whole = flat_device_drafts(rows[1:4], [8, 8, 8])
    assert whole.data_ptr() == rows[1].data_ptr() and torch.equal(whole, block[1:4].flatten())
    cases = [(rows[1:4], [8, 5, 8]),  # a cut draft in the middle
             ([rows[2], rows[1]], [8, 8]),  # out of order
             ([rows[0], block.clone()[1]], [8, 8]),  # another tensor
             (rows[:3], [8, 8, 3])]  # a cut last draft: still back to back
    for parts, counts in cases:
        expected = torch.cat([p[:k] for p, k in zip(parts, counts, strict=True)])
        assert torch.equal(flat_device_drafts(parts, counts), expected)
    assert flat_device_drafts(rows[:3], [8, 8, 3]).data_ptr() == rows[0].data_ptr()
    assert torch.equal(flat_device_drafts([rows[4]], [2]), block[4, :2])
