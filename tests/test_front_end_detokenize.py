"""Output text made in the front end (`atlas serve --detokenize-in front-end`, the default with two or more front
ends): the engine sends token ids only and the front end's EngineClient detokenizes each step's tokens in one batch.
The text must be exactly the engine's own: a stop token has none, a sequence that ends flushes a partial character,
n > 1 sequences end at different steps, and tokens the engine takes back are taken back from the text too.
(Over HTTP, tests/test_server_process.py compares two front ends, which make the text, with the in-process server.)"""

from __future__ import annotations

import asyncio

import pytest

from atlas import LLM, SamplingParams
from atlas.engine import wire
from atlas.engine.engine_client import ClientStream, EngineClient
from atlas.engine.tokenizer import Tokenizer
from atlas.errors import InvalidRequestError


@pytest.fixture(scope="module")
def llm(qwen3_dir):
    return LLM(str(qwen3_dir), kv_cache_memory="4MiB", max_model_len=256)


@pytest.fixture(scope="module")
def tokenizer(qwen3_dir):
    return Tokenizer(qwen3_dir)


def _replay(tokenizer: Tokenizer, prompt_ids: list[int], params: SamplingParams, outputs, per_step: int
            ) -> list[str]:
    """The outputs' tokens sent to a front end as the engine sends them when the front end makes the text
    (`per_step` tokens a step, no text, the finish reason with the last tokens and then on every later step of
    the request) -> the text of each sequence as the front end made it."""
    loop = asyncio.new_event_loop()
    try:
        client = EngineClient(info=None, address="", tokenizer=tokenizer)
        stream = ClientStream(client, "r", loop, prompt_ids, params, tokenizer)
        assert stream.detokenizers is not None
        client._streams["r"] = stream
        longest = max(len(c.token_ids) for c in outputs)
        for start in range(0, longest, per_step):
            seqs = []
            for c in outputs:
                tokens = list(c.token_ids[start:start + per_step])
                ended = start + per_step >= len(c.token_ids)
                seqs.append(wire.SeqDelta(c.index, min(start, len(c.token_ids)), tokens, 0, "", None, None,
                                          c.finish_reason if ended else None, c.stop_reason if ended else None))
            client._on_step(wire.Step([wire.RequestDelta("r", seqs, start + per_step >= longest)]))
        return [s.text for s in stream.seqs]
    finally:
        loop.close()


@pytest.mark.parametrize("per_step", [1, 3])
@pytest.mark.parametrize("specials", ["skipped", "kept"])
def test_front_end_text_equals_the_engines(llm, tokenizer, per_step, specials):
    """Sampled outputs of a byte-level tokenizer (characters split over tokens, sequences ended by a stop token
    at different steps, others cut at max_tokens) get the engine's text, one token a step and several (a
    speculative step); with special tokens kept, and stop tokens that are ordinary text, a stop token's text is
    left out as the engine leaves it out."""
    prompts = ["def f(x):", "import os", "a", "The"]
    extra = dict(skip_special_tokens=False, stop_token_ids=list(range(100, 108))) if specials == "kept" else {}
    # (the first seed whose samples end both ways: some on a stop token, some at max_tokens)
    for seed in range(11, 41):
        params = SamplingParams(n=3, temperature=1.0, seed=seed, max_tokens=20, **extra)
        refs = llm.generate(prompts, params)
        if {c.finish_reason for r in refs for c in r.outputs} == {"stop", "length"}:
            break
    else:
        pytest.fail("no seed from 11 to 40 gave outputs ending both on a stop token and at max_tokens")
    for prompt, ref in zip(prompts, refs, strict=True):
        texts = _replay(tokenizer, ref.prompt_token_ids, params, ref.outputs, per_step)
        assert texts == [c.text for c in ref.outputs], prompt


def test_tokens_taken_back_are_taken_out_of_the_text(tokenizer):
    """A delta that starts before the tokens the front end has (the engine took some back) rebuilds the text
    from the tokens kept."""
    loop = asyncio.new_event_loop()
    try:
        params = SamplingParams(max_tokens=8)
        prompt = tokenizer.encode("x = ")
        client = EngineClient(info=None, address="", tokenizer=tokenizer)
        stream = ClientStream(client, "r", loop, prompt, params, tokenizer)
        client._streams["r"] = stream
        first, second = tokenizer.encode("hello world"), tokenizer.encode(" there")
        client._on_step(wire.Step([wire.RequestDelta("r", [wire.SeqDelta(0, 0, first, 0, "")], False)]))
        assert stream.seqs[0].text == "hello world"
        kept = first[:1]
        client._on_step(wire.Step([wire.RequestDelta("r", [wire.SeqDelta(0, 1, second, 0, "", None, None,
                                                                         "length")], True)]))
        assert stream.seqs[0].token_ids == kept + second
        assert stream.seqs[0].text == tokenizer.decode(kept + second)
    finally:
        loop.close()


def test_detokenize_false(llm):
    """SamplingParams(detokenize=False): the same tokens without text; stop strings, matched in the text, refuse it
    by name."""
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    plain = llm.generate(["def f(x):"], params)[0].outputs[0]
    params.detokenize = False
    bare = llm.generate(["def f(x):"], params)[0].outputs[0]
    assert plain.text and bare.text == "" and bare.token_ids == plain.token_ids
    with pytest.raises(InvalidRequestError, match="detokenize"):
        llm.generate(["a"], SamplingParams(stop=["\n"], detokenize=False))
