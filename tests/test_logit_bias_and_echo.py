"""OpenAI's logit_bias and vLLM's allowed_token_ids and bad_words (offline, in the sampler, with speculative decoding
and over HTTP), vLLM's truncate_prompt_tokens and its chat `echo`, through the official `openai` client."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch
from conftest import VOCAB, assert_pages_returned, hf_model
from serving import start_server

from atlas import LLM, SamplingParams
from atlas.errors import InvalidRequestError

PROMPT = [11, 45, 230, 7, 19, 88, 3]
# (float32 and a fifth of a GPU each, where the tests run on one: the offline ones run there too)
ENGINE = dict(kv_cache_memory="16MiB", max_model_len=256, dtype="float32", gpu_memory_utilization=0.2)


def greedy(max_tokens: int = 12, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def llm(qwen3_dir):
    return LLM(str(qwen3_dir), **ENGINE)


@pytest.fixture(scope="module")
def plain(llm) -> list[int]:
    """The unbiased greedy continuation of PROMPT."""
    return llm.generate({"prompt_token_ids": PROMPT}, greedy())[0].outputs[0].token_ids


def tokens(llm, params: SamplingParams, prompt=None) -> list[int]:
    return llm.generate({"prompt_token_ids": prompt or PROMPT}, params)[0].outputs[0].token_ids


# ---------------------------------------------------------------------------------- offline and sampler
def test_a_plus_100_bias_makes_greedy_pick_the_token_every_step(llm, plain):
    chosen = next(t for t in (42, 43, 44) if t not in plain)
    assert tokens(llm, greedy(logit_bias={chosen: 100})) == [chosen] * 12
    assert tokens(llm, greedy(logit_bias={str(chosen): 100.0})) == [chosen] * 12  # (JSON's string keys too)
    # Sampling too: n choices at temperature 1, each one all `chosen`.
    out = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(temperature=1.0, n=3, seed=3, max_tokens=8,
                                                                    ignore_eos=True, logit_bias={chosen: 100}))[0]
    assert [c.token_ids for c in out.outputs] == [[chosen] * 8] * 3
    assert_pages_returned(llm)


def test_a_minus_100_bias_removes_the_greedy_token(llm, plain):
    banned = plain[0]
    got = tokens(llm, greedy(logit_bias={banned: -100}))
    assert got[0] != banned and banned not in got
    # A zero bias changes nothing (and is dropped: the request keeps the plain greedy path).
    params = greedy(logit_bias={banned: 0})
    assert params.logit_bias is None and tokens(llm, params) == plain


def test_bias_is_added_to_the_logits_exactly(llm, qwen3_dir, no_tf32):
    """Greedy under moderate biases equals the argmax of transformers' logits plus the bias, step by step, and
    the logprobs returned stay the raw model's (as with penalties)."""
    hf = hf_model(qwen3_dir, device=llm.engine.device)
    bias = {5: 3.5, 17: -2.0, 200: 4.25, 352: -6.0, 186: 1.5}
    dense = torch.zeros(VOCAB)
    for t, b in bias.items():
        dense[t] = b
    ref: list[int] = []
    raw: list[float] = []
    for _ in range(10):
        with torch.no_grad():
            logits = hf(torch.tensor([PROMPT + ref], device=llm.engine.device)).logits[0, -1].float().cpu()
        token = int((logits + dense).argmax())
        raw.append(float(logits.log_softmax(-1)[token]))
        ref.append(token)
    out = llm.generate({"prompt_token_ids": PROMPT}, greedy(10, logit_bias=bias, logprobs=0))[0].outputs[0]
    assert out.token_ids == ref
    assert [lp[t].logprob for lp, t in zip(out.logprobs, ref, strict=True)] == pytest.approx(raw, abs=1e-4)


def test_sampler_applies_the_bias_first_on_every_path():
    """The distribution and the greedy pick both see the bias, before penalties (vLLM's order), and rows
    without a bias are untouched."""
    from atlas.runtime.sampler import Sampler, SamplingRow

    logits = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))

    def row(**kw):
        base = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0, presence_penalty=0.0,
                    frequency_penalty=0.0, generator=None, num_logprobs=None, prompt_token_ids=[1],
                    output_token_ids=[], banned_token_ids=[])
        return SamplingRow(**{**base, **kw})

    bias = {3: 2.0, 9: -1.5, 63: 0.75, 64: 5.0}  # (an id past the logits' width is skipped)
    rows = [row(logit_bias=bias), row(), row(logit_bias=bias, repetition_penalty=1.7, prompt_token_ids=[3, 9])]
    probs = Sampler().probabilities(logits, rows)
    biased = logits.clone()
    for t, b in bias.items():
        if t < 64:
            biased[[0, 2], t] += b
    rep = biased[2].clone()
    for t in (3, 9):
        rep[t] = rep[t] / 1.7 if rep[t] > 0 else rep[t] * 1.7
    torch.testing.assert_close(probs[0], biased[0].softmax(-1))
    torch.testing.assert_close(probs[1], logits[1].softmax(-1))
    torch.testing.assert_close(probs[2], rep.softmax(-1))
    low = int(logits[0].argmin())  # greedy picks the least likely token under +100
    assert Sampler()(logits[:1], [row(temperature=0.0, logit_bias={low: 100})]).tolist() == [low]
    assert torch.equal(logits, torch.randn(3, 64, generator=torch.Generator().manual_seed(0)))  # (not written to)


def test_a_biased_request_leaves_the_unbiased_one_in_its_batch_alone(llm, plain):
    chosen = next(t for t in (42, 43, 44) if t not in plain)
    other = [3, 99, 150, 22, 8]
    solo_other = tokens(llm, greedy(), other)
    solo_biased = tokens(llm, greedy(logit_bias={chosen: 100, plain[0]: -100}))
    both = llm.generate([{"prompt_token_ids": PROMPT}, {"prompt_token_ids": other}],
                        [greedy(logit_bias={chosen: 100, plain[0]: -100}), greedy()])
    assert both[0].outputs[0].token_ids == solo_biased == [chosen] * 12
    assert both[1].outputs[0].token_ids == solo_other
    same_prompt = llm.generate([{"prompt_token_ids": PROMPT}] * 2, [greedy(logit_bias={plain[0]: -100}), greedy()])
    assert same_prompt[1].outputs[0].token_ids == plain
    assert same_prompt[0].outputs[0].token_ids == tokens(llm, greedy(logit_bias={plain[0]: -100}))
    assert_pages_returned(llm)


def test_speculative_verification_applies_the_bias(qwen3_dir, llm, plain):
    """n-gram drafts are checked against the biased target: the output is the plain engine's, biased."""
    from atlas.config import EngineConfig

    # (every step drafts, where the engine has a policy that would otherwise stop drafting on a random model)
    always = {"speculative_policy": "always"} if "speculative_policy" in EngineConfig.__dataclass_fields__ else {}
    spec = LLM(str(qwen3_dir), speculative="ngram", num_draft_tokens=4, ngram_min=1, ngram_max=2, **always, **ENGINE)
    repetitive = [50, 51, 52, 53] * 4
    for bias in ({plain[0]: -100}, {plain[1]: 3.0, plain[2]: -2.5}, {42: 100}):
        for prompt in (PROMPT, repetitive):
            assert tokens(spec, greedy(24, logit_bias=bias), prompt) == tokens(llm, greedy(24, logit_bias=bias),
                                                                                prompt), bias
    assert spec.engine.stats.spec_num_accepted_tokens > 0  # (the +100 run's drafts, at least, were accepted)
    assert_pages_returned(spec)


def test_allowed_token_ids_restrict_greedy_to_the_argmax_over_them_and_sampling_to_them(llm, plain, qwen3_dir,
                                                                                        no_tf32):
    """Greedy under allowed_token_ids is transformers' argmax over the allowed ids, step by step (logprobs the raw
    model's); sampled choices hold only allowed ids; a request beside it is untouched; n-gram speculation verifies
    its drafts against the restricted target."""
    hf = hf_model(qwen3_dir, device=llm.engine.device)
    allowed = sorted({plain[1], plain[3], 5, 17, 200, 352} - {plain[0]})
    assert plain[0] not in allowed
    ref: list[int] = []
    raw: list[float] = []
    for _ in range(10):
        with torch.no_grad():
            logits = hf(torch.tensor([PROMPT + ref], device=llm.engine.device)).logits[0, -1].float().cpu()
        token = allowed[int(logits[allowed].argmax())]
        raw.append(float(logits.log_softmax(-1)[token]))
        ref.append(token)
    other = [3, 99, 150, 22, 8]
    both = llm.generate([{"prompt_token_ids": PROMPT}, {"prompt_token_ids": other}],
                        [greedy(10, allowed_token_ids=allowed, logprobs=0), greedy(10)])
    out = both[0].outputs[0]
    assert out.token_ids == ref
    assert [lp[t].logprob for lp, t in zip(out.logprobs, ref, strict=True)] == pytest.approx(raw, abs=1e-4)
    assert both[1].outputs[0].token_ids == tokens(llm, greedy(10), other)
    sampled = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(temperature=1.0, n=4, seed=1, max_tokens=16,
                                                                        ignore_eos=True, allowed_token_ids=allowed))[0]
    assert all(set(c.token_ids) <= set(allowed) for c in sampled.outputs)
    assert len({t for c in sampled.outputs for t in c.token_ids}) > 1
    spec = LLM(str(qwen3_dir), speculative="ngram", num_draft_tokens=4, ngram_min=1, ngram_max=2,
               speculative_policy="always", **ENGINE)
    for prompt in (PROMPT, [50, 51, 52, 53] * 4):
        assert tokens(spec, greedy(24, allowed_token_ids=allowed), prompt) == tokens(
            llm, greedy(24, allowed_token_ids=allowed), prompt)
    assert_pages_returned(llm)
    for bad, message in (([], "non-empty"), ([-1], "non-negative"), ([True], "non-negative"), ("5", "list")):
        with pytest.raises(InvalidRequestError, match=message) as info:
            SamplingParams(allowed_token_ids=bad)
        assert info.value.param == "allowed_token_ids"
    with pytest.raises(InvalidRequestError, match=str(VOCAB)):
        llm.generate({"prompt_token_ids": PROMPT}, greedy(allowed_token_ids=[VOCAB]))


def test_allowed_token_ids_over_http(client, llm, qwen3_dir):
    model = str(qwen3_dir)
    prompt = "def wrap(text, width=70):"
    ref = llm.generate(prompt, greedy(8))[0].outputs[0].token_ids
    allowed = [ref[1], ref[2], 42, 43]
    want = llm.generate(prompt, greedy(8, allowed_token_ids=allowed))[0].outputs[0]
    got = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0,
                                    extra_body={"ignore_eos": True, "return_token_ids": True,
                                                "allowed_token_ids": allowed}).choices[0]
    assert got.token_ids == want.token_ids and set(got.token_ids) <= set(allowed)
    for bad in ([], [VOCAB], [-2]):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=model, max_tokens=2, messages=[{"role": "user", "content": "x"}],
                                           extra_body={"allowed_token_ids": bad})
        assert info.value.body["param"] == "allowed_token_ids", info.value.body


def _contains(tokens: list[int], word: list[int]) -> bool:
    return any(tokens[i: i + len(word)] == word for i in range(len(tokens) - len(word) + 1))


def test_bad_words_ban_each_words_last_token_where_the_output_ends_in_the_rest(llm, plain, qwen3_dir, no_tf32):
    """Greedy under bad words (given as token ids) is transformers' argmax with each word's last token banned where
    the output so far ends in the word's other tokens, step by step; no output holds a bad word; n-gram speculation
    verifies its drafts (and the drafts before each verify row) against the same rule."""
    hf = hf_model(qwen3_dir, device=llm.engine.device)
    words = [plain[2:4], [plain[0]], [plain[5], plain[6], plain[7]]]
    ref: list[int] = []
    for _ in range(16):
        with torch.no_grad():
            logits = hf(torch.tensor([PROMPT + ref], device=llm.engine.device)).logits[0, -1].float().cpu()
        for w in words:
            if len(w) == 1 or ref[len(ref) - len(w) + 1:] == w[:-1]:
                logits[w[-1]] = float("-inf")
        ref.append(int(logits.argmax()))
    got = tokens(llm, greedy(16, bad_words_token_ids=words))
    assert got == ref and got != plain[:16]
    assert not any(_contains(got, w) for w in words)
    spec = LLM(str(qwen3_dir), speculative="ngram", num_draft_tokens=4, ngram_min=1, ngram_max=2,
               speculative_policy="always", **ENGINE)
    repetitive = [50, 51, 52, 53] * 4
    rep_plain = tokens(llm, greedy(24), repetitive)
    rep_words = [rep_plain[1:3], rep_plain[6:9]]
    for prompt, ws in ((PROMPT, words), (repetitive, rep_words)):
        want = tokens(llm, greedy(24, bad_words_token_ids=ws), prompt)
        assert tokens(spec, greedy(24, bad_words_token_ids=ws), prompt) == want
        assert not any(_contains(want, w) for w in ws)
    assert spec.engine.stats.spec_num_accepted_tokens > 0
    assert_pages_returned(llm)
    assert_pages_returned(spec)


def test_bad_words_as_text_are_tokenized_as_they_start_the_text_and_after_a_space(llm, client, qwen3_dir):
    tok = llm.get_tokenizer()
    text = "def wrap(text, width=70):"
    out = llm.generate(text, greedy(12))[0].outputs[0]
    word = tok.decode(out.token_ids[1:3]).strip()
    ids = tok.bad_words_ids([word])
    assert ids[0] == tok.encode(word, add_special_tokens=False)
    assert all(w == tok.encode(" " + word, add_special_tokens=False) for w in ids[1:])
    want = llm.generate(text, greedy(12, bad_words=[word]))[0].outputs[0]
    assert want.token_ids == tokens(llm, greedy(12, bad_words_token_ids=ids), tok.encode(text))
    got = client.completions.create(model=str(qwen3_dir), prompt=text, max_tokens=12, temperature=0,
                                    extra_body={"ignore_eos": True, "return_token_ids": True, "bad_words": [word]})
    assert got.choices[0].token_ids == want.token_ids
    for bad in ([""], ["  "], ["x"] * 129):
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model=str(qwen3_dir), prompt="x", max_tokens=2, extra_body={"bad_words": bad})
        assert info.value.body["param"] == "bad_words", info.value.body


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(client, llm, qwen3_dir):
    model = str(qwen3_dir)
    long = [(7 * i) % 300 + 1 for i in range(300)]  # (longer than the 256-token context)
    want = llm.generate({"prompt_token_ids": long[-20:]}, greedy(6))[0].outputs[0].token_ids
    kw = dict(model=model, max_tokens=6, temperature=0)
    extra = {"ignore_eos": True, "return_token_ids": True, "truncate_prompt_tokens": 20}
    got = client.completions.create(prompt=long, extra_body=extra, **kw)
    assert got.choices[0].token_ids == want and got.usage.prompt_tokens == 20
    echoed = client.completions.create(prompt=long, echo=True, extra_body=extra, **kw).choices[0].text
    assert echoed.startswith(llm.get_tokenizer().decode(long[-20:]))
    with pytest.raises(openai.BadRequestError):  # (the same prompt whole does not fit)
        client.completions.create(prompt=long, extra_body={"ignore_eos": True}, **kw)
    same = client.completions.create(prompt=long[:30], extra_body={**extra, "truncate_prompt_tokens": -1}, **kw)
    assert same.usage.prompt_tokens == 30
    chat = client.chat.completions.create(messages=[{"role": "user", "content": "Wrap this line, please."}],
                                          extra_body={"ignore_eos": True, "truncate_prompt_tokens": 5}, **kw)
    assert chat.usage.prompt_tokens == 5
    for bad in (0, -2):
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(prompt="x", extra_body={"truncate_prompt_tokens": bad}, **kw)
        assert info.value.body["param"] == "truncate_prompt_tokens", info.value.body


@pytest.mark.parametrize("bias,message", [
    ({5: 100.5}, "[-100, 100]"), ({5: -101}, "[-100, 100]"), ({5: float("nan")}, "[-100, 100]"),
    ({-1: 1}, "token ids"), ({"x": 1}, "token ids"), ({"-3": 1}, "token ids"), ({True: 1}, "token ids"),
    ({5: "1"}, "[-100, 100]"), ({"5": 1, 5: 2}, "twice"), ([5], "map"),
])
def test_bad_biases_are_refused_naming_the_field(bias, message):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(logit_bias=bias)
    assert info.value.param == "logit_bias" and message in str(info.value)


def test_ids_outside_the_vocabulary_fail_generate(llm):
    with pytest.raises(InvalidRequestError) as info:
        llm.generate({"prompt_token_ids": PROMPT}, greedy(logit_bias={VOCAB: 1}))
    assert info.value.param == "logit_bias" and str(VOCAB) in str(info.value)
    assert_pages_returned(llm)


# ---------------------------------------------------------------------------------- over HTTP
@pytest.fixture(scope="module")
def server(qwen3_dir):
    srv = start_server(str(qwen3_dir), **ENGINE)
    yield srv
    srv.stop()


@pytest.fixture()
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0) as c:
        yield c


def test_logit_bias_over_http(client, llm, qwen3_dir):
    model = str(qwen3_dir)
    prompt = "def wrap(text, width=70):"
    ref = llm.generate(prompt, greedy(8))[0]
    first = ref.outputs[0].token_ids[0]
    chosen = next(t for t in (42, 43, 44) if t not in ref.outputs[0].token_ids)
    bias = {str(first): -100, str(chosen): 7.5}
    want = llm.generate(prompt, greedy(8, logit_bias={first: -100, chosen: 7.5}))[0].outputs[0]
    assert want.token_ids != ref.outputs[0].token_ids
    kw = dict(model=model, prompt=prompt, max_tokens=8, temperature=0, logit_bias=bias,
              extra_body={"ignore_eos": True, "return_token_ids": True})
    got = client.completions.create(**kw).choices[0]
    assert (got.text, got.token_ids) == (want.text, want.token_ids)
    streamed = "".join(c.choices[0].text for c in client.completions.create(**kw, stream=True) if c.choices)
    assert streamed == want.text
    # n > 1, sampled, streamed: every choice is the forced token.
    forced = client.completions.create(model=model, prompt=prompt, max_tokens=5, temperature=1.0, n=3,
                                       logit_bias={str(chosen): 100}, stream=True,
                                       extra_body={"ignore_eos": True, "return_token_ids": True})
    ids: dict[int, list[int]] = {0: [], 1: [], 2: []}
    for chunk in forced:
        for c in chunk.choices:
            ids[c.index] += c.token_ids or []
    assert ids == {i: [chosen] * 5 for i in range(3)}
    # Chat completions, plain and streamed, equal the offline engine under the same bias.
    messages = [{"role": "user", "content": "Wrap this line."}]
    chat_ref = llm.chat(messages, greedy(8))[0].outputs[0]
    chat_bias = {chat_ref.token_ids[0]: -100}
    chat_want = llm.chat(messages, greedy(8, logit_bias=chat_bias))[0].outputs[0].text
    ckw = dict(model=model, messages=messages, max_tokens=8, temperature=0,
               logit_bias={str(t): b for t, b in chat_bias.items()}, extra_body={"ignore_eos": True})
    assert client.chat.completions.create(**ckw).choices[0].message.content == chat_want
    two = client.chat.completions.create(**ckw, n=2, stream=True)
    texts = ["", ""]
    for chunk in two:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    assert texts == [chat_want] * 2


@pytest.mark.parametrize("bias", [{"5": 100.5}, {"5": -101}, {str(VOCAB): 1}, {"-1": 1}, {"x": 2}, {"5": "1"},
                                  {"5": True}])
def test_bad_logit_bias_is_a_400_naming_it(client, qwen3_dir, bias):
    for create in (lambda: client.completions.create(model=str(qwen3_dir), prompt="x", max_tokens=2,
                                                     logit_bias=bias),
                   lambda: client.chat.completions.create(model=str(qwen3_dir), max_tokens=2, logit_bias=bias,
                                                          messages=[{"role": "user", "content": "x"}])):
        with pytest.raises(openai.BadRequestError) as info:
            create()
        assert info.value.body["param"] == "logit_bias", info.value.body


# ---------------------------------------------------------------------------------- chat echo
CONTINUED = [{"role": "user", "content": "Wrap this line."}, {"role": "assistant", "content": "Sure, the"}]


def chat(client, model, messages, **kw):
    extra = {"ignore_eos": True, **kw.pop("extra_body", {})}
    return client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0,
                                          extra_body=extra, **kw)


def test_chat_echo_prefixes_the_continued_message(client, qwen3_dir, llm):
    model = str(qwen3_dir)
    reply = llm.chat(CONTINUED, greedy(8), add_generation_prompt=False)[0].outputs[0].text
    plain = chat(client, model, CONTINUED, extra_body={"add_generation_prompt": False}).choices[0].message
    assert (plain.role, plain.content) == ("assistant", reply)
    echoed = chat(client, model, CONTINUED, extra_body={"add_generation_prompt": False, "echo": True})
    assert echoed.choices[0].message.content == "Sure, the" + reply
    assert echoed.usage.completion_tokens == 8  # (the echoed text is not counted as generated)
    # Text parts are echoed as the template sees them (joined by newlines, as vLLM joins them); n > 1: every choice.
    parts = [CONTINUED[0], {"role": "assistant", "content": [{"type": "text", "text": "Sure,"},
                                                             {"type": "text", "text": "the"}]}]
    joined = llm.chat([CONTINUED[0], {"role": "assistant", "content": "Sure,\nthe"}], greedy(8),
                      add_generation_prompt=False)[0].outputs[0].text
    two = chat(client, model, parts, n=2, extra_body={"add_generation_prompt": False, "echo": True})
    assert [c.message.content for c in two.choices] == ["Sure,\nthe" + joined] * 2
    # Streaming: the role, then the echoed text as the first content delta, then the reply.
    chunks = list(chat(client, model, CONTINUED, n=2, stream=True,
                       extra_body={"add_generation_prompt": False, "echo": True}))
    for j in range(2):
        deltas = [choice.delta for c in chunks for choice in c.choices if choice.index == j]
        assert deltas[0].role == "assistant"
        assert [d.content for d in deltas[:2]] == ["", "Sure, the"]
        assert "".join(d.content or "" for d in deltas) == "Sure, the" + reply


def test_chat_echo_follows_vllms_role_rule(client, qwen3_dir, llm):
    """As vLLM: the reply's role is the assistant's with add_generation_prompt, else the last message's; echo
    repeats the last message only when it has that role."""
    model = str(qwen3_dir)
    user_last = [{"role": "user", "content": "Wrap this line."}]
    reply = llm.chat(user_last, greedy(8))[0].outputs[0].text
    answered = chat(client, model, user_last, extra_body={"echo": True}).choices[0].message
    assert (answered.role, answered.content) == ("assistant", reply)  # (a user message is not echoed)
    with_prompt = llm.chat(CONTINUED, greedy(8))[0].outputs[0].text
    assistant_last = chat(client, model, CONTINUED, extra_body={"echo": True}).choices[0].message
    assert assistant_last.content == "Sure, the" + with_prompt
    continued_user = llm.chat(user_last, greedy(8), add_generation_prompt=False)[0].outputs[0].text
    message = chat(client, model, user_last, extra_body={"echo": True, "add_generation_prompt": False}
                   ).choices[0].message
    assert (message.role, message.content) == ("user", "Wrap this line." + continued_user)
    stream = list(chat(client, model, user_last, stream=True, extra_body={"echo": False,
                                                                          "add_generation_prompt": False}))
    assert stream[0].choices[0].delta.role == "user"
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == continued_user


# ---------------------------------------------------------------------------------- continue_final_message
CONTINUE = {"add_generation_prompt": False, "continue_final_message": True}


def hf_continued(qwen3_dir, messages, chat_template=None) -> str:
    """transformers' rendering with the final message left open: the reference."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(qwen3_dir)).apply_chat_template(
        messages, chat_template=chat_template, tokenize=False, add_generation_prompt=False,
        continue_final_message=True)


def test_continue_final_message_leaves_the_last_message_open(client, server, qwen3_dir, llm):
    model = str(qwen3_dir)
    text = hf_continued(qwen3_dir, CONTINUED)
    assert text.endswith("<|im_start|>assistant\nSure, the")  # (no end of turn after the content)
    ids = server.core.tokenizer.encode(text, add_special_tokens=False)
    want = llm.generate({"prompt_token_ids": ids}, greedy(8))[0].outputs[0].text
    got = chat(client, model, CONTINUED, extra_body={**CONTINUE, "return_token_ids": True})
    assert got.prompt_token_ids == ids
    assert (got.choices[0].message.role, got.choices[0].message.content) == ("assistant", want)
    assert llm.chat(CONTINUED, greedy(8), add_generation_prompt=False, continue_final_message=True
                    )[0].outputs[0].text == want
    # The open message differs from the closed one (add_generation_prompt false alone keeps the end of turn).
    closed = chat(client, model, CONTINUED, extra_body={"add_generation_prompt": False, "return_token_ids": True})
    assert closed.prompt_token_ids[:len(ids)] == ids and len(closed.prompt_token_ids) > len(ids)
    # echo: the reply starts with the continued message (vLLM's), streamed too.
    echoed = chat(client, model, CONTINUED, extra_body={**CONTINUE, "echo": True}).choices[0].message
    assert echoed.content == "Sure, the" + want
    stream = list(chat(client, model, CONTINUED, stream=True, extra_body={**CONTINUE, "echo": True}))
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == "Sure, the" + want
    # /tokenize takes the field too.
    tokenized = httpx.post(server.url + "/tokenize", json={"messages": CONTINUED, **CONTINUE}, timeout=30)
    assert tokenized.json()["tokens"] == ids


@pytest.mark.parametrize("template", [None, "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] | trim }}"
                                            "<|im_end|>\n{% endfor %}"])
@pytest.mark.parametrize("content", ["Sure, the", "Sure, the ", "  Sure,\n the\n\n"])
def test_continued_rendering_equals_transformers(server, qwen3_dir, template, content):
    """The cut is transformers' whether the template keeps the content's whitespace or trims it."""
    messages = [CONTINUED[0], {"role": "assistant", "content": content}]
    got = server.core.tokenizer.apply_chat_template(messages, False, chat_template=template,
                                                    continue_final_message=True)
    assert got == hf_continued(qwen3_dir, messages, template)


def test_continue_final_message_refusals(client, qwen3_dir):
    model = str(qwen3_dir)
    user_last = [{"role": "user", "content": "Wrap this line."}]
    cases = [
        ("chat", CONTINUED, {"continue_final_message": True}, "add_generation_prompt"),  # (true by default)
        ("chat", CONTINUED, {"continue_final_message": True, "add_generation_prompt": True}, "add_generation_prompt"),
        ("chat", user_last, CONTINUE, "assistant"),
        ("completions", None, {"continue_final_message": True}, "chat"),
    ]
    for kind, messages, extra, words in cases:
        with pytest.raises(openai.BadRequestError) as info:
            if kind == "chat":
                chat(client, model, messages, extra_body=extra)
            else:
                client.completions.create(model=model, prompt="x", max_tokens=2, extra_body=extra)
        assert info.value.body["param"] == "continue_final_message", info.value.body
        assert words in info.value.body["message"], info.value.body
    # false is harmless everywhere
    assert client.completions.create(model=model, prompt="x", max_tokens=2,
                                     extra_body={"continue_final_message": False}).choices
