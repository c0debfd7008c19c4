"""--logprobs-mode (vLLM's): what a sampled token's logprobs are. raw_logprobs (the default) and raw_logits are the
model's; processed_logprobs / processed_logits those of the distribution the token was drawn from (logit bias, then
a sampled row's temperature and top-k), checked against transformers' logits in float32 at every generated position;
filtered tokens are -inf offline and -9999.0 over HTTP; beam search refuses a mode other than raw_logprobs."""

from __future__ import annotations

import math

import httpx
import pytest
import torch
from conftest import hf_model
from serving import start_server

from atlas import LLM, SamplingParams
from atlas.errors import ConfigError, InvalidRequestError
from atlas.sampling_params import BeamSearchParams

ENGINE = dict(dtype="float32", kv_cache_memory="16MiB", max_model_len=128, skip_tokenizer_init=True)
PROMPT = [5, 17, 40, 41, 99, 7]
BIAS = {3: 4.0, 11: -2.0}


def _positions(qwen3_dir, prompt: list[int], generated: list[int]) -> torch.Tensor:
    """transformers' logits at each generated token's position [n, V]."""
    with torch.no_grad():
        logits = hf_model(qwen3_dir)(torch.tensor([prompt + generated])).logits[0]
    return logits[len(prompt) - 1: len(prompt) - 1 + len(generated)]


def _biased(logits: torch.Tensor) -> torch.Tensor:
    out = logits.clone()
    for token, bias in BIAS.items():
        out[:, token] += bias
    return out


def _top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    kth = logits.topk(k, dim=-1).values[:, -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def _run(qwen3_dir, mode: str, params: SamplingParams):
    out = LLM(str(qwen3_dir), logprobs_mode=mode, **ENGINE).generate({"prompt_token_ids": PROMPT}, params)[0]
    completion = out.outputs[0]
    return completion.token_ids, completion.logprobs, _positions(qwen3_dir, PROMPT, completion.token_ids)


@pytest.mark.parametrize("mode", ["processed_logprobs", "processed_logits"])
def test_processed_values_are_those_of_the_distribution_sampled_from(qwen3_dir, mode):
    params = SamplingParams(max_tokens=8, temperature=0.7, top_k=4, seed=3, logprobs=6, logit_bias=BIAS,
                            ignore_eos=True)
    tokens, entries, raw = _run(qwen3_dir, mode, params)
    want = _top_k(_biased(raw) / 0.7, 4)
    if mode == "processed_logprobs":
        want = want.log_softmax(-1)
    for i, (token, entry) in enumerate(zip(tokens, entries, strict=True)):
        assert entry[token].logprob == pytest.approx(float(want[i, token]), abs=1e-4)
        finite = {t: e.logprob for t, e in entry.items() if math.isfinite(e.logprob)}
        assert len(finite) == 4 and all(v == pytest.approx(float(want[i, t]), abs=1e-4) for t, v in finite.items())
        # (six asked for, four kept by top_k: the other two are filtered out of the distribution)
        assert sum(1 for e in entry.values() if e.logprob == float("-inf")) == 2


def test_a_greedy_rows_processed_logprobs_take_no_temperature_and_no_filter(qwen3_dir):
    """As vLLM drops a greedy request's filters: logit bias applies, top_k and temperature do not."""
    params = SamplingParams(max_tokens=6, temperature=0, top_k=2, logprobs=3, logit_bias=BIAS, ignore_eos=True)
    tokens, entries, raw = _run(qwen3_dir, "processed_logprobs", params)
    want = _biased(raw).log_softmax(-1)
    assert tokens == want.argmax(-1).tolist()
    for i, (token, entry) in enumerate(zip(tokens, entries, strict=True)):
        assert all(e.logprob == pytest.approx(float(want[i, t]), abs=1e-4) for t, e in entry.items())
        assert entry[token].rank == 1
    plain = SamplingParams(max_tokens=6, temperature=0, logprobs=2, ignore_eos=True)  # (the fast greedy path)
    tokens, entries, raw = _run(qwen3_dir, "processed_logprobs", plain)
    assert [e[t].logprob for t, e in zip(tokens, entries, strict=True)] == pytest.approx(
        raw.log_softmax(-1).gather(1, torch.tensor(tokens)[:, None]).squeeze(1).tolist(), abs=1e-4)


@pytest.mark.parametrize("mode", ["raw_logprobs", "raw_logits"])
def test_raw_values_are_the_models(qwen3_dir, mode):
    params = SamplingParams(max_tokens=6, temperature=0.8, top_k=3, seed=1, logprobs=2, logit_bias=BIAS,
                            ignore_eos=True)
    tokens, entries, raw = _run(qwen3_dir, mode, params)
    want = raw.log_softmax(-1) if mode == "raw_logprobs" else raw
    for i, (token, entry) in enumerate(zip(tokens, entries, strict=True)):
        assert all(e.logprob == pytest.approx(float(want[i, t]), abs=1e-4) for t, e in entry.items())
        assert entry[token].rank == int((raw[i] > raw[i, token]).sum()) + 1


def test_beam_search_and_unknown_modes_are_refused(qwen3_dir):
    llm = LLM(str(qwen3_dir), logprobs_mode="processed_logprobs", **ENGINE)
    with pytest.raises(InvalidRequestError, match="--logprobs-mode"):
        llm.beam_search([{"prompt_token_ids": PROMPT}], BeamSearchParams(beam_width=2, max_tokens=3))
    with pytest.raises(ConfigError, match="--logprobs-mode must be one of"):
        LLM(str(qwen3_dir), logprobs_mode="final_logprobs", **ENGINE)


def test_filtered_tokens_are_written_as_vllm_writes_them_over_http(qwen3_dir):
    server = start_server(str(qwen3_dir), logprobs_mode="processed_logprobs", kv_cache_memory="16MiB",
                          max_model_len=128)
    try:
        body = {"prompt": PROMPT, "max_tokens": 3, "temperature": 0.9, "top_k": 2, "seed": 5, "logprobs": 4}
        reply = httpx.post(server.url + "/v1/completions", json=body, timeout=30).json()
        for top in reply["choices"][0]["logprobs"]["top_logprobs"]:
            assert sorted(top.values()).count(-9999.0) == 2 and all(v > -9999.0 for v in sorted(top.values())[2:])
        beams = httpx.post(server.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "n": 2,
                                                                 "use_beam_search": True}, timeout=30)
        assert beams.status_code == 400 and "--logprobs-mode" in beams.json()["error"]["message"]
    finally:
        server.stop()


def test_speculation_keeps_the_processed_logprobs_of_plain_decoding(qwen3_dir):
    """A verify step scores each accepted draft in its own row: the same processed logprobs as plain decoding."""
    prompt = [11, 12, 13, 14, 11, 12, 13, 14, 11, 12]
    params = SamplingParams(max_tokens=12, temperature=0, logprobs=3, logit_bias=BIAS, ignore_eos=True)

    def run(**kw):
        out = LLM(str(qwen3_dir), logprobs_mode="processed_logprobs", **ENGINE, **kw).generate(
            {"prompt_token_ids": prompt}, params)[0].outputs[0]
        return out.token_ids, [{t: e.logprob for t, e in entry.items()} for entry in out.logprobs]

    (tokens, got), (want_tokens, want) = run(speculative="ngram", num_draft_tokens=3, speculative_policy="always"), run()
    assert tokens == want_tokens
    for g, w in zip(got, want, strict=True):
        assert g.keys() == w.keys() and all(g[t] == pytest.approx(w[t], abs=1e-4) for t in w)
