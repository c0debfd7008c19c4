"""Beam search (vLLM's LLM.beam_search and the server's use_beam_search): the search on a toy model whose every
step is written out by hand, transformers' beam search on a tiny Qwen3, the prefix cache at work between steps, the
server over HTTP, and what is refused."""

from __future__ import annotations

import math

import httpx
import openai
import pytest
import torch
from conftest import assert_pages_returned, hf_model
from serving import assert_error, start_server

from atlas import LLM, BeamSearchParams
from atlas.engine.beam_search import BeamSearch
from atlas.errors import InvalidRequestError
from atlas.outputs import Logprob

ENGINE = dict(kv_cache_memory="16MiB", max_model_len=256, dtype="float32", block_size=8)
PROMPTS = [[11, 45, 230, 7, 19, 88, 3], [40, 41, 3, 99, 17, 5]]


def toy(table: dict[tuple[int, ...], dict[int, float]]):
    """A model as a table: the generated tokens so far -> next-token probabilities."""
    def entries(beam: list[int], prompt_len: int) -> dict[int, Logprob]:
        probs = table[tuple(beam[prompt_len:])]
        ranked = sorted(probs, key=lambda t: -probs[t])
        return {t: Logprob(math.log(probs[t]), ranked.index(t) + 1) for t in ranked}
    return entries


def run(search: BeamSearch, entries, prompt_len: int):
    while search.pending():
        search.advance([entries(b, prompt_len) for b in search.pending()])
    return search.output(None).sequences


def test_the_search_keeps_the_best_beams_and_ranks_ended_ones_by_length_penalised_score():
    EOS = 0
    # Step 1: 1 (0.5) or 2 (0.4). After 1: EOS (0.6) or 3 (0.4). After 2: 4 (0.9). After 1 3 / 2 4: 5 (1.0).
    table = {(): {1: 0.5, 2: 0.4, 9: 0.1}, (1,): {EOS: 0.6, 3: 0.4}, (2,): {4: 0.9, EOS: 0.1},
             (1, 3): {5: 1.0}, (2, 4): {5: 1.0}, (2, 4, 5): {6: 1.0}, (1, 3, 5): {6: 1.0}}
    prompt = [7, 7]
    def search(penalty: float):
        return run(BeamSearch(prompt, BeamSearchParams(beam_width=2, max_tokens=3, length_penalty=penalty), [EOS]),
                   toy(table), 2)

    # Step 2's best: 2 4 (0.36), then 1 EOS (0.30, ends), 1 3 (0.20); step 3: 2 4 5 and 1 3 5. Scores over the
    # generated tokens (the end token not counted): log 0.36 / 3, log 0.20 / 3 and log 0.30 / 1.
    got = search(1.0)
    assert [(s.output_token_ids, s.finish_reason) for s in got] == [([2, 4, 5], "length"), ([1, 3, 5], "length")]
    assert [s.cum_logprob for s in got] == pytest.approx([math.log(0.36), math.log(0.2)])
    # Without a length penalty the sums rank them: 2 4 5, then 1 EOS; with a negative one, shorter is better.
    assert [(s.output_token_ids, s.finish_reason) for s in search(0.0)] == [([2, 4, 5], "length"),
                                                                            ([1, EOS], "stop")]
    assert [s.output_token_ids for s in search(-1.0)] == [[1, EOS], [2, 4, 5]]
    # ignore_eos: the end token is an ordinary token.
    eos_ignored = run(BeamSearch(prompt, BeamSearchParams(beam_width=1, max_tokens=2, ignore_eos=True), [EOS]),
                      toy({**table, (1, EOS): {8: 1.0}}), 2)
    assert eos_ignored[0].output_token_ids == [1, EOS] and eos_ignored[0].finish_reason == "length"


def test_beam_search_equals_transformers(qwen3_dir):
    """transformers' generate(num_beams=k, early_stopping=True) with the end token held back (min_new_tokens): the
    same k beams, in the same order, with the same summed logprobs; the steps after the first reuse the cached
    pages of the beams they extend."""
    hf = hf_model(qwen3_dir)
    llm = LLM(str(qwen3_dir), **ENGINE)
    width, steps = 3, 8
    outs = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS],
                           BeamSearchParams(beam_width=width, max_tokens=steps, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outs, strict=True):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), num_beams=width, num_return_sequences=width, do_sample=False,
                              max_new_tokens=steps, min_new_tokens=steps, early_stopping=True, length_penalty=1.0,
                              output_scores=True, return_dict_in_generate=True, pad_token_id=0)
        want = [row[len(prompt):].tolist() for row in ref.sequences]
        assert [s.output_token_ids for s in out.sequences] == want
        # (transformers' sequence score is the sum over the length; ours the sum)
        assert [s.cum_logprob / steps for s in out.sequences] == pytest.approx(ref.sequences_scores.tolist(),
                                                                               abs=1e-4)
        assert all(s.finish_reason == "length" and len(s.logprobs) == steps for s in out.sequences)
        assert out.sequences[0].text == llm.get_tokenizer().decode(out.sequences[0].output_token_ids)
    assert llm.engine.kv.stats.hits > 0  # (the beams' shared pages came from the prefix cache)
    assert_pages_returned(llm)
    with pytest.raises(InvalidRequestError, match="temperature"):
        BeamSearchParams(beam_width=2, max_tokens=4, temperature=0.7)
    with pytest.raises(InvalidRequestError, match="beam_width"):
        BeamSearchParams(beam_width=11, max_tokens=4)
    with pytest.raises(InvalidRequestError, match="context"):
        llm.beam_search({"prompt_token_ids": PROMPTS[0]}, BeamSearchParams(beam_width=2, max_tokens=250))


def test_use_beam_search_over_http(qwen3_dir):
    llm = LLM(str(qwen3_dir), **ENGINE)
    want = llm.beam_search("def wrap(text, width=70):", BeamSearchParams(beam_width=3, max_tokens=6,
                                                                         ignore_eos=True))[0].sequences
    server = start_server(str(qwen3_dir), **ENGINE)
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        kw = dict(model=str(qwen3_dir), max_tokens=6, temperature=0, n=3)
        got = client.completions.create(prompt="def wrap(text, width=70):", **kw,
                                        extra_body={"use_beam_search": True, "ignore_eos": True,
                                                    "return_token_ids": True})
        assert [c.token_ids for c in got.choices] == [s.output_token_ids for s in want]
        assert [c.text for c in got.choices] == [s.text for s in want]
        assert [c.index for c in got.choices] == [0, 1, 2] and got.usage.completion_tokens == 18
        chat = client.chat.completions.create(messages=[{"role": "user", "content": "Wrap this."}], **kw,
                                              extra_body={"use_beam_search": True, "ignore_eos": True})
        assert len(chat.choices) == 3 and all(c.message.content is not None for c in chat.choices)
        base = {"model": str(qwen3_dir), "prompt": "x", "max_tokens": 4, "n": 2, "use_beam_search": True}
        for extra, param in (({"stream": True}, "stream"), ({"logit_bias": {"5": 1}}, "logit_bias"),
                             ({"temperature": 0.8}, "temperature"), ({"n": 11}, "n"), ({"logprobs": 0}, "logprobs"),
                             ({"stop": ["a"]}, "stop"), ({"presence_penalty": 0.5}, "presence_penalty"),
                             ({"response_format": {"type": "json_object"}}, "response_format")):
            assert_error(httpx.post(server.url + "/v1/completions", json={**base, **extra}), 400, param)
        assert httpx.post(server.url + "/v1/completions", json={**base, "temperature": 0, "top_p": 1.0}
                          ).status_code == 200
    finally:
        server.stop()
