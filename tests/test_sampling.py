"""Sampling: seeds, filters, penalties, logprobs and every stop condition, against references."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import assert_pages_returned, build_checkpoint, hf_model

from atlas import LLM, SamplingParams

PROMPT = [11, 45, 230, 7, 19, 88, 3]


@pytest.fixture(scope="module")
def llm(qwen3_dir):
    return LLM(str(qwen3_dir), kv_cache_memory="32MiB", block_size=8)


@pytest.fixture(scope="module")
def hf(qwen3_dir):
    return hf_model(qwen3_dir)


def _next_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0, -1].float()


def test_seeded_sampling_is_reproducible_whatever_the_batch(llm):
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=20, ignore_eos=True)
    alone = llm.generate({"prompt_token_ids": PROMPT}, params)[0].outputs[0].token_ids
    noise = SamplingParams(temperature=1.3, max_tokens=30, ignore_eos=True)
    prompts = [{"prompt_token_ids": [i + 1] * (i + 3)} for i in range(5)]
    batch = llm.generate(prompts[:2] + [{"prompt_token_ids": PROMPT}] + prompts[2:],
                         [noise, noise, params, noise, noise, noise])
    assert batch[2].outputs[0].token_ids == alone
    other_seed = llm.generate({"prompt_token_ids": PROMPT},
                              SamplingParams(temperature=0.9, top_p=0.95, seed=99, max_tokens=20, ignore_eos=True))
    assert other_seed[0].outputs[0].token_ids != alone
    assert_pages_returned(llm)


def test_top_k_one_is_greedy(llm):
    greedy = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    top1 = llm.generate({"prompt_token_ids": PROMPT},
                        SamplingParams(temperature=1.5, top_k=1, max_tokens=20, ignore_eos=True))
    assert top1[0].outputs[0].token_ids == greedy[0].outputs[0].token_ids


def test_underflowing_parameters_keep_the_most_likely_token(llm):
    """A positive top_p that is 0 in float32 (1e-46) used to mask every token: NaN probabilities, an empty
    reply ending in EOS. The most likely token always survives the filters."""
    from atlas.runtime.sampler import Sampler, SamplingRow

    logits = torch.randn(3, 384, generator=torch.Generator().manual_seed(0))

    def row(**kw):
        base = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0, presence_penalty=0.0,
                    frequency_penalty=0.0, generator=None, num_logprobs=None, prompt_token_ids=[],
                    output_token_ids=[], banned_token_ids=[])
        return SamplingRow(**{**base, **kw})

    rows = [row(top_p=1e-46), row(top_p=5e-324, top_k=7), row(min_p=1.0, top_p=1e-46)]
    probs = Sampler().probabilities(logits, rows)
    assert torch.isfinite(probs).all()
    assert torch.equal(probs.argmax(-1), logits.argmax(-1)) and torch.allclose(probs.max(-1).values, torch.ones(3))
    assert torch.equal(Sampler()(logits, rows), logits.argmax(-1))

    greedy = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    for top_p in (1e-46, 5e-324):
        out = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(temperature=1.0, top_p=top_p, max_tokens=20,
                                                                        ignore_eos=True, seed=5))
        assert out[0].outputs[0].token_ids == greedy[0].outputs[0].token_ids


@pytest.mark.parametrize("field,value", [
    ("temperature", float("nan")), ("temperature", float("inf")), ("temperature", 1e300),
    ("top_p", float("nan")), ("min_p", float("nan")), ("repetition_penalty", float("nan")),
    ("repetition_penalty", 1e-46), ("repetition_penalty", 1e30), ("presence_penalty", float("inf")),
])
def test_parameters_float32_cannot_carry_are_refused(field, value):
    """Values that would turn the sampler's float32 rows into infinities or NaNs (garbage tokens) are
    refused with a message naming the field."""
    from atlas.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**{field: value})
    assert info.value.param == field


def test_extreme_but_valid_parameters_sample_finite_distributions():
    """At the edges of the accepted ranges (with banned tokens and every penalty) rows stay finite."""
    from atlas.runtime.sampler import Sampler, SamplingRow
    from atlas.sampling_params import GREEDY_TEMPERATURE, MAX_TEMPERATURE, REPETITION_PENALTY_RANGE

    logits = 30 * torch.randn(4, 384, generator=torch.Generator().manual_seed(1))
    low, high = REPETITION_PENALTY_RANGE
    settings = [dict(temperature=MAX_TEMPERATURE, repetition_penalty=high),
                dict(temperature=GREEDY_TEMPERATURE * 1.01, repetition_penalty=low, frequency_penalty=-2.0),
                dict(temperature=GREEDY_TEMPERATURE * 1.01, repetition_penalty=high, presence_penalty=2.0),
                dict(temperature=MAX_TEMPERATURE, repetition_penalty=low, min_p=1.0, top_p=1e-46)]
    rows = []
    for kw in settings:
        p = SamplingParams(**kw)
        rows.append(SamplingRow(p.temperature, p.top_k, p.top_p, p.min_p, p.repetition_penalty, p.presence_penalty,
                                p.frequency_penalty, None, None, list(range(0, 384, 2)), list(range(1, 384, 3)) * 50,
                                [0, 5, 9]))
    probs = Sampler().probabilities(logits, rows)
    assert torch.isfinite(probs).all() and torch.allclose(probs.sum(-1), torch.ones(4))
    assert (probs[:, [0, 5, 9]] == 0).all()  # banned tokens stay banned


def _empirical(llm, settings: dict, draws: int) -> torch.Tensor:
    """Frequencies of the first sampled token over `draws` samples (requests with n = 100)."""
    per = 100
    params = SamplingParams(n=per, max_tokens=1, ignore_eos=True, **settings)
    outs = llm.generate([{"prompt_token_ids": PROMPT}] * (draws // per), params)
    counts = torch.zeros(384)
    for o in outs:
        for c in o.outputs:
            counts[c.token_ids[0]] += 1
    return counts / counts.sum()


def _filtered_probs(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0,
                    min_p: float = 0.0) -> torch.Tensor:
    """Reference: the distribution the sampler must draw from, computed the slow, obvious way."""
    probs = (logits / temperature).softmax(-1)
    keep = torch.ones_like(probs, dtype=torch.bool)
    if min_p:
        keep &= probs >= min_p * probs.max()
    order = probs.argsort(descending=True).tolist()
    if top_k:
        for t in order[top_k:]:
            keep[t] = False
    if top_p < 1:
        kept = [t for t in order if keep[t]]
        mass = probs[kept] / probs[kept].sum()
        acc = 0.0
        for t, p in zip(kept, mass.tolist(), strict=True):
            if acc >= top_p:
                keep[t] = False
            acc += p
    out = torch.where(keep, probs, torch.zeros_like(probs))
    return out / out.sum()


SETTINGS = [
    dict(temperature=0.7),
    dict(temperature=1.0, top_k=6),
    dict(temperature=1.2, top_p=0.6),
    dict(temperature=1.0, min_p=0.3),
    dict(temperature=0.8, top_k=40, top_p=0.9, min_p=0.05),
]


def _chi_square(counts: torch.Tensor, expected: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic, pooling outcomes expected fewer than 5 times into one bin."""
    draws = counts.sum()
    e = expected * draws
    big = e >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([e[big], e[~big].sum()[None]])
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    return stat, int(keep.sum()) - 1


@pytest.mark.parametrize("settings", SETTINGS)
def test_sampler_distribution_matches_reference(hf, settings):
    """50k draws from the sampler on a real model's logits: the empirical distribution fits the
    reference distribution (chi-square at about 5 standard deviations), and never leaves its support."""
    from atlas.runtime.sampler import Sampler, SamplingRow

    logits = _next_logits(hf, PROMPT)
    expected = _filtered_probs(logits, **settings)
    row = SamplingRow(settings["temperature"], settings.get("top_k", 0), settings.get("top_p", 1.0),
                      settings.get("min_p", 0.0), 1.0, 0.0, 0.0, None, None, PROMPT, [], [])
    torch.manual_seed(0)
    draws = 50_000
    tokens = Sampler()(logits.repeat(draws, 1), [row] * draws)
    counts = torch.bincount(tokens, minlength=384).float()
    assert float(counts[expected == 0].sum()) == 0.0
    stat, df = _chi_square(counts, expected)
    assert stat < df + 5 * math.sqrt(2 * df), (stat, df)


def test_engine_samples_within_the_filtered_support(llm, hf):
    settings = dict(temperature=1.0, top_k=6)
    expected = _filtered_probs(_next_logits(hf, PROMPT), **settings)
    got = _empirical(llm, settings, 2000)
    assert float(got[expected == 0].sum()) == 0.0
    stat, df = _chi_square(got * 2000, expected)
    assert stat < df + 5 * math.sqrt(2 * df), (stat, df)
    assert_pages_returned(llm)


def test_repetition_penalty_matches_transformers(llm, hf):
    ids = list(range(50, 60)) * 3
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False, repetition_penalty=1.8,
                          eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
    got = llm.generate({"prompt_token_ids": ids},
                       SamplingParams(temperature=0, repetition_penalty=1.8, max_tokens=24, ignore_eos=True))
    assert got[0].outputs[0].token_ids == ref


def test_presence_and_frequency_penalties_match_reference(llm, hf):
    ids = list(PROMPT)
    out: list[int] = []
    for _ in range(16):
        logits = _next_logits(hf, ids + out)
        counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=384).float() if out else torch.zeros(384)
        logits = logits - 0.9 * counts - 0.5 * (counts > 0).float()
        out.append(int(logits.argmax()))
    got = llm.generate({"prompt_token_ids": ids}, SamplingParams(
        temperature=0, frequency_penalty=0.9, presence_penalty=0.5, max_tokens=16, ignore_eos=True))
    assert got[0].outputs[0].token_ids == out


def test_logprobs_match_transformers(llm, hf):
    got = llm.generate({"prompt_token_ids": PROMPT},
                       SamplingParams(temperature=0, max_tokens=6, logprobs=3, ignore_eos=True))[0].outputs[0]
    assert len(got.logprobs) == 6
    total = 0.0
    for k, token in enumerate(got.token_ids):
        ref = _next_logits(hf, PROMPT + got.token_ids[:k]).log_softmax(-1)
        entry = got.logprobs[k]
        assert entry[token].rank == 1  # greedy picks the most likely token
        assert entry[token].logprob == pytest.approx(float(ref[token]), abs=1e-4)
        top_ids = ref.topk(3).indices.tolist()
        assert list(entry) == top_ids  # the sampled token, then the other top ones in order
        total += entry[token].logprob
    assert got.cumulative_logprob == pytest.approx(total, abs=1e-4)
    sampled = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(temperature=1.0, seed=5, max_tokens=8,
                                                                        logprobs=0, ignore_eos=True))[0].outputs[0]
    for k, token in enumerate(sampled.token_ids):
        ref = _next_logits(hf, PROMPT + sampled.token_ids[:k]).log_softmax(-1)
        assert list(sampled.logprobs[k]) == [token]
        assert sampled.logprobs[k][token].rank == int((ref > ref[token]).sum()) + 1


def test_stop_token_ids_and_min_tokens(llm):
    greedy = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(temperature=0, max_tokens=30,
                                                                       ignore_eos=True))[0].outputs[0].token_ids
    stop = greedy[4]
    first = greedy.index(stop)
    out = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(temperature=0, max_tokens=30,
                                                                    stop_token_ids=[stop]))[0].outputs[0]
    assert out.token_ids == greedy[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    later = [i for i, t in enumerate(greedy) if t == stop and i + 1 >= 12]
    out = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(
        temperature=0, max_tokens=30, stop_token_ids=[stop], min_tokens=12, ignore_eos=True))[0].outputs[0]
    # With min_tokens the stop token cannot be chosen early, so greedy continues differently.
    assert len(out.token_ids) >= 12
    assert stop not in out.token_ids[:11]
    if out.finish_reason == "stop":
        assert out.token_ids[-1] == stop
    assert later or out.finish_reason in ("stop", "length")


def test_eos_from_config_stops_unless_ignored(qwen3_dir, tokenizer_dir, tmp_path, llm):
    greedy = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(temperature=0, max_tokens=20,
                                                                       ignore_eos=True))[0].outputs[0].token_ids
    eos = greedy[3]
    ckpt = build_checkpoint(tmp_path, "Qwen3ForCausalLM", tokenizer_dir, eos_token_id=eos)
    eos_llm = LLM(str(ckpt), kv_cache_memory="8MiB")
    out = eos_llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(temperature=0, max_tokens=20))[0].outputs[0]
    assert out.token_ids == greedy[: greedy.index(eos) + 1]
    assert out.finish_reason == "stop" and out.stop_reason is None
    ignored = eos_llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(temperature=0, max_tokens=20,
                                                                           ignore_eos=True))[0].outputs[0]
    assert ignored.token_ids == greedy and ignored.finish_reason == "length"
    assert_pages_returned(eos_llm)


def test_text_prompts_and_incremental_detokenization(llm):
    tok = llm.get_tokenizer()
    out = llm.generate("def wrap(text, width=70):\n", SamplingParams(temperature=0, max_tokens=60,
                                                                      ignore_eos=True))[0]
    assert out.prompt_token_ids == tok.encode("def wrap(text, width=70):\n")
    assert out.outputs[0].text == tok.decode(out.outputs[0].token_ids)
    sampled = llm.generate("import ", SamplingParams(temperature=1.0, seed=3, max_tokens=80, ignore_eos=True))[0]
    assert sampled.outputs[0].text == tok.decode(sampled.outputs[0].token_ids)


def test_stop_strings_cut_exactly(llm):
    prompt = "class TextWrapper:\n"
    full = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))[0].outputs[0].text
    assert len(full) > 20
    stop = full[10:14]
    expected = full[: full.index(stop)]
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=60, stop=[stop, "\x00never"]))[0].outputs[0]
    assert out.text == expected
    assert out.finish_reason == "stop" and out.stop_reason == stop
    kept = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=60, stop=stop,
                                               include_stop_str_in_output=True))[0].outputs[0]
    assert kept.text == expected + stop


def test_streamed_text_never_shows_a_stop_string(llm):
    engine = llm.engine
    prompt = "class TextWrapper:\n"
    full = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))[0].outputs[0].text
    stop = full[20:26]
    rid = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=60, stop=stop))
    seen = []
    while engine.has_unfinished():
        for out in engine.step():
            assert out.request_id == rid
            seen.append(out.outputs[0].text)
    assert all(stop not in s for s in seen)
    assert all(b.startswith(a) for a, b in zip(seen, seen[1:], strict=False))  # text only grows
    assert seen[-1] == full[: full.index(stop)]


def test_max_tokens_finishes_with_length(llm):
    out = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 5
    assert out[0].outputs[0].finish_reason == "length"


def test_chat_uses_the_template(llm):
    tok = llm.get_tokenizer()
    messages = [{"role": "user", "content": "hello"}]
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    text = "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    assert out.prompt_token_ids == tok.encode(text, add_special_tokens=False)


def test_prompt_logprobs_match_transformers(qwen3_dir, hf):
    """Across prefill chunks, with the prompt already in the prefix cache (which must not skip the
    positions that need scoring), and with n = 2."""
    prompt = list(range(40, 100))
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
    llm = LLM(str(qwen3_dir), kv_cache_memory="16MiB", block_size=8, max_num_batched_tokens=24)
    llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=2))  # fills the prefix cache
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(n=2, max_tokens=3, prompt_logprobs=2))[0]
    assert out.num_cached_tokens == 0
    entries = out.prompt_logprobs
    assert len(entries) == len(prompt) and entries[0] is None
    for p in range(1, len(prompt)):
        token = prompt[p]
        e = entries[p]
        assert e[token].logprob == pytest.approx(float(ref[p - 1, token]), abs=1e-4)
        assert e[token].rank == int((ref[p - 1] > ref[p - 1, token]).sum()) + 1
        top = ref[p - 1].topk(2).indices.tolist()
        assert [t for t in e if t != token] == [t for t in top if t != token]
    assert llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=2))[0].prompt_logprobs is None
    assert_pages_returned(llm)


def test_detokenizing_several_tokens_at_once_gives_the_texts_of_one_at_a_time():
    """A speculative step hands the output processor several tokens a request: decoded in one batched call,
    they must give the texts, offsets and held-back characters that adding them one by one gives, also where a
    character spans tokens (the default model's byte-level vocabulary splits these)."""
    import random

    from atlas.engine.core import default_model_path
    from atlas.engine.tokenizer import IncrementalDetokenizer, Tokenizer, detokenize_runs

    tok = Tokenizer(default_model_path())
    text_ids = tok.encode("def f(x):\n    return 'naïve café — 数据 🚀 ok'  # ünïcødé\n" * 2, add_special_tokens=False)
    rng = random.Random(0)
    for trial in range(60):
        seq = text_ids if trial % 2 else [rng.randrange(len(tok.hf)) for _ in range(60)]
        prompt_len = rng.randint(0, 10)
        one, many, other = (IncrementalDetokenizer(tok, seq[:prompt_len]) for _ in range(3))
        rest = seq[prompt_len:]
        want = [one.add(t) for t in rest]
        got, i = [], 0
        while i < len(rest):
            n = rng.randint(1, 6)
            got += detokenize_runs(tok, [many, other], [rest[i:i + n], rest[i + n: i + 2 * n]])[0]
            i += n
        assert got == want
        assert (many.prefix_offset, many.read_offset, many.tokens) == (one.prefix_offset, one.read_offset, one.tokens)
        assert many.flush() == one.flush()
    assert "" in want  # (a character split over tokens was among them)
