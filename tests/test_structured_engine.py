"""Structured outputs in the engine (offline API, the shipped model): every constrained output is in the
grammar's language, unconstrained neighbours in the same batch are untouched, compilation never holds
the step loop, and n-gram speculative decoding stays lossless under a grammar."""

from __future__ import annotations

import json
import re
import threading

import jsonschema
import pytest
import torch
from conftest import assert_pages_returned

from atlas import LLM, SamplingParams
from atlas.config import EngineConfig
from atlas.engine.core import EngineCore
from atlas.errors import InvalidRequestError
from atlas.runtime.sampler import apply_token_bitmask
from atlas.sampling_params import StructuredOutputsParams
from atlas.structured import grammar as grammar_module

ENGINE = dict(kv_cache_memory="64MiB", max_model_len=512)
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "kind": {"enum": ["module", "class", "function"]},
        "tags": {"type": "array", "items": {"enum": ["os", "sys", "re"]}, "maxItems": 3},
        "size": {"type": "integer", "minimum": 0, "maximum": 999},
    },
    "required": ["name", "kind", "tags", "size"],
    "additionalProperties": False,
}
PROMPTS = ["def f(x):\n", "import os\n", "class A:\n", "# The end\n"]


@pytest.fixture(scope="module")
def llm():
    return LLM(**ENGINE)


def test_sampler_masks_only_constrained_rows():
    logits = torch.randn(3, 70)
    bitmask = torch.zeros(2, 3, dtype=torch.int32)
    bitmask[0, 1] = 1 << 4  # row 0: token 36 only
    bitmask[1, 2] = (1 << 0) | (1 << 5)  # row 2: tokens 64 and 69
    out = apply_token_bitmask(logits, bitmask, torch.tensor([0, 2]))
    assert torch.equal(out[1], logits[1])  # the unconstrained row is untouched
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == [36]
    assert torch.isfinite(out[2]).nonzero().flatten().tolist() == [64, 69]
    assert out[2, 64] == logits[2, 64]
    assert torch.equal(apply_token_bitmask(logits[[0, 2]], bitmask, None), out[[0, 2]])  # every row, in order
    words = torch.randint(-2**31, 2**31 - 1, (4, 9), dtype=torch.int32)  # the byte table against plain shifts
    shifted = ((words[:, :, None] >> torch.arange(32, dtype=torch.int32)) & 1).bool().reshape(4, -1)[:, :280]
    assert torch.equal(torch.isfinite(apply_token_bitmask(torch.zeros(4, 280), words, None)), shifted)
    # Nothing the grammar allows is left (it allows only a banned token): the grammar's tokens stay.
    banned = logits.clone()
    banned[0, 36] = float("-inf")
    out = apply_token_bitmask(banned, bitmask, torch.tensor([0, 2]))
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == [36]


def test_a_failing_mask_kernel_falls_back_once_with_a_warning(monkeypatch, caplog):
    """The kernel is only used on CUDA; should it fail there (compile or launch), the PyTorch path takes
    over for the rest of the process after one warning, and the caller's logits are left unchanged."""
    pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[test]')")
    from atlas.kernels import token_mask_triton
    from atlas.runtime import sampler

    calls = []

    def broken(logits, bitmask, rows):
        calls.append(1)
        logits.fill_(7.0)  # (on the sampler's copy: must not reach the caller's tensor)
        raise RuntimeError("no kernel here")

    monkeypatch.setattr(sampler, "_MASK_KERNEL_BROKEN", False)
    monkeypatch.setattr(sampler, "_mask_kernel_usable",
                        lambda *a: not sampler._MASK_KERNEL_BROKEN)  # as if on CUDA
    monkeypatch.setattr(token_mask_triton, "apply_token_bitmask_triton_", broken, raising=False)
    logits = torch.randn(3, 70)
    before = logits.clone()
    bitmask = torch.randint(-2**31, 2**31 - 1, (2, 3), dtype=torch.int32)
    rows = torch.tensor([2, 0])
    expected = sampler._apply_token_bitmask_torch(logits, bitmask, rows)
    with caplog.at_level("WARNING", logger="atlas.runtime.sampler"):
        assert torch.equal(apply_token_bitmask(logits, bitmask, rows), expected)
        assert torch.equal(apply_token_bitmask(logits, bitmask, rows), expected)
    assert calls == [1] and torch.equal(logits, before)
    assert len([r for r in caplog.records if "token-mask kernel failed" in r.getMessage()]) == 1


def test_json_schema_greedy_and_sampled_outputs_validate(llm):
    greedy = SamplingParams(max_tokens=120, temperature=0, structured_outputs={"json": SCHEMA})
    sampled = [SamplingParams(max_tokens=120, temperature=1.0, seed=s, structured_outputs={"json": SCHEMA})
               for s in range(len(PROMPTS))]
    outs = llm.generate(PROMPTS + PROMPTS, [greedy] * len(PROMPTS) + sampled)
    texts = set()
    for out in outs:
        c = out.outputs[0]
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), SCHEMA)
        texts.add(c.text)
    assert len(texts) > 2  # sampling explored the schema


def test_regex_choice_grammar_and_unconstrained_neighbour(llm):
    plain = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    alone = llm.generate([PROMPTS[0]], plain)[0].outputs[0].token_ids
    so = [StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]{2}"), StructuredOutputsParams(choice=["yes", "no"]),
          StructuredOutputsParams(grammar='root ::= "x = " [0-9] [0-9]? "\\n"')]
    outs = llm.generate([PROMPTS[0]] + PROMPTS[1:4],
                        [plain] + [SamplingParams(max_tokens=12, temperature=0.8, seed=1, structured_outputs=s)
                                   for s in so])
    assert outs[0].outputs[0].token_ids == alone
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", outs[1].outputs[0].text)
    assert outs[2].outputs[0].text in ("yes", "no")
    assert re.fullmatch(r"x = [0-9][0-9]?\n", outs[3].outputs[0].text)


def test_bad_constraint_is_refused_before_anything_runs(llm):
    for spec, word in (({"json": {"type": "objec"}}, "objec"), ({"regex": "a(b"}, "regex"),
                       ({"grammar": "root ::= nothing"}, "grammar")):
        with pytest.raises(InvalidRequestError, match=word):
            llm.generate(["x"], SamplingParams(structured_outputs=spec))
    with pytest.raises(InvalidRequestError, match="exactly one"):
        SamplingParams(structured_outputs={"regex": "a", "choice": ["b"]})
    assert not llm.engine.has_unfinished()


def _hold_compiles(monkeypatch) -> threading.Event:
    """Every compile waits until the returned event is set."""
    release = threading.Event()
    real = grammar_module.StructuredOutputManager._compile_now

    def slow(self, spec):
        assert release.wait(60)
        return real(self, spec)

    monkeypatch.setattr(grammar_module.StructuredOutputManager, "_compile_now", slow)
    return release


def test_compiling_holds_only_its_own_request(monkeypatch):
    core = EngineCore(EngineConfig.from_kwargs(**ENGINE))
    release = _hold_compiles(monkeypatch)
    slow_id = core.add_request(PROMPTS[0], SamplingParams(max_tokens=40, temperature=0,
                                                          structured_outputs={"choice": ["alpha", "beta"]}))
    fast_id = core.add_request(PROMPTS[1], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    finished = {}

    def step_until(request_id: str, max_steps: int) -> None:
        for _ in range(max_steps):
            finished.update((o.request_id, o) for o in core.step() if o.finished)
            if request_id in finished:
                return

    step_until(fast_id, 100)
    assert fast_id in finished and slow_id not in finished
    assert core._awaiting_grammar == [slow_id]
    release.set()
    step_until(slow_id, 200)
    assert finished[slow_id].outputs[0].text in ("alpha", "beta")
    assert core.kv.num_free_pages == core.kv.num_pages


def test_a_compile_past_its_timeout_is_refused_and_its_result_kept(monkeypatch):
    """--structured-outputs-compile-timeout: a request whose constraint takes longer to compile is refused (offline:
    GrammarCompileError naming the flag; a request queued straight into the engine ends with finish_reason error),
    while the compile goes on and a later request with the same constraint uses its result."""
    llm = LLM(structured_outputs_compile_timeout=0.3, **ENGINE)
    release = _hold_compiles(monkeypatch)
    params = SamplingParams(max_tokens=8, temperature=0, structured_outputs={"choice": ["alpha", "beta"]})
    with pytest.raises(InvalidRequestError, match="did not compile within 0.3 s .*--structured-outputs-compile-timeout"):
        llm.generate([PROMPTS[0]], params)
    core = llm.engine
    queued = core.add_request(PROMPTS[1], params)
    outs = []
    while core.has_unfinished():
        outs += core.step()
    assert outs[-1].request_id == queued and outs[-1].outputs[0].finish_reason == "error"
    assert "did not compile within" in outs[-1].outputs[0].error
    release.set()
    # (the compile the refused requests started goes on: wait for it, then a request uses its cached result)
    core.structured.compile(params.structured_outputs).result(timeout=60)
    assert llm.generate([PROMPTS[0]], params)[0].outputs[0].text in ("alpha", "beta")
    assert_pages_returned(llm)


def test_ngram_drafts_are_checked_against_the_grammar(monkeypatch):
    """The prompt repeats a document whose array is longer than the schema allows: n-gram drafts run into
    the fourth item, the grammar cuts them, and greedy output equals plain constrained decoding."""
    schema = {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["os", "sys", "re"]},
                                                        "maxItems": 3}, "name": {"enum": ["os", "sys"]}},
              "required": ["tags", "name"], "additionalProperties": False}
    doc = '{"tags": ["os", "os", "os", "sys"], "name": "os"}'
    prompt = f"a = {doc}\nb = {doc}\nc = {doc}\nd = "
    params = SamplingParams(max_tokens=40, temperature=0, structured_outputs={"json": schema})
    plain = LLM(**ENGINE).generate([prompt], params)[0].outputs[0]
    cuts = []
    real = grammar_module.RequestGrammar.check_drafts

    def counting(self, drafts):
        n = real(self, drafts)
        if n < len(drafts):
            cuts.append((list(drafts), n))
        return n

    monkeypatch.setattr(grammar_module.RequestGrammar, "check_drafts", counting)
    spec_llm = LLM(speculative="ngram", speculative_policy="always", num_draft_tokens=4, **ENGINE)
    out = spec_llm.generate([prompt], params)[0]
    assert out.outputs[0].token_ids == plain.token_ids
    jsonschema.validate(json.loads(plain.text), schema)
    assert cuts, "no draft ran into the grammar"
    assert out.metrics.spec_num_accepted_tokens > 0
    sampled = spec_llm.generate([prompt] * 3, [SamplingParams(max_tokens=40, temperature=1.0, seed=s,
                                                              structured_outputs={"json": schema}) for s in range(3)])
    for o in sampled:
        jsonschema.validate(json.loads(o.outputs[0].text), schema)


def test_grammar_reads_drafts_left_on_the_device():
    """DFlash drafts left on the device (the default) are read back for the grammar's check of a
    constrained request: greedy output under a JSON schema equals plain decoding's, and is valid."""
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"}},
              "required": ["name", "n"], "additionalProperties": False}
    params = SamplingParams(max_tokens=40, temperature=0, structured_outputs={"json": schema})
    prompt = PROMPTS[0]
    plain = LLM(**ENGINE).generate([prompt], params)[0].outputs[0]
    spec_llm = LLM(speculative="dflash", speculative_policy="always", **ENGINE)
    assert spec_llm.engine.proposer.device_drafts
    out = spec_llm.generate([prompt, PROMPTS[1]], [params, SamplingParams(max_tokens=24, temperature=0)])
    assert out[0].outputs[0].token_ids == plain.token_ids
    jsonschema.validate(json.loads(plain.text), schema)
    assert spec_llm.engine.stats.spec_num_accepted_tokens > 0


def test_cost_benchmark_measures_both_runs(llm):
    from atlas.bench.structured import measure

    prompts = [llm.get_tokenizer().encode(p) for p in PROMPTS[:2]]
    plain, constrained = measure(llm, prompts, concurrency=2, output_len=6, repeats=1)
    assert (plain["run"], constrained["run"]) == ("unconstrained", "json schema")
    assert plain["steps"] == constrained["steps"] == 6  # every constrained request ran to the output length
    assert constrained["bitmask ms/step"] > 0 and constrained["mask apply ms/step"] > 0
    assert constrained["overhead"].endswith("%")


def test_preempted_constrained_requests_resume_their_grammar(llm):
    """A KV pool too small for the batch preempts requests mid-document; recomputed, they go on from the
    grammar state of the tokens they kept, and greedy outputs equal those of a pool that fits."""
    params = SamplingParams(max_tokens=100, temperature=0, structured_outputs={"json": SCHEMA})
    expected = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    small = LLM(kv_cache_memory="1MiB", max_model_len=160)  # 10 pages of 16 tokens for 4 documents
    outs = small.generate(PROMPTS, params)
    assert small.engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == expected


def test_constrained_steps_overlap_the_grammar_work_and_keep_their_outputs(llm, monkeypatch):
    """With asynchronous scheduling, a constrained decode step is launched before the previous one is read
    back, its sampling deferred until the grammars have taken that step's tokens: the outputs (greedy and
    seeded sampling, next to an unconstrained request) equal those of synchronous steps."""
    params = ([SamplingParams(max_tokens=60, temperature=0, structured_outputs={"json": SCHEMA})]
              + [SamplingParams(max_tokens=60, temperature=0.9, seed=s, structured_outputs={"json": SCHEMA})
                 for s in (3, 4)]
              + [SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)])
    prompts = PROMPTS[:3] + [PROMPTS[3]]
    runner = llm.engine.runner
    deferred = []
    launch = runner.launch

    def counting(batch):  # (a spy on the real launch)
        deferred.append(batch.masks_deferred)
        return launch(batch)

    monkeypatch.setattr(runner, "launch", counting)
    assert llm.engine.async_scheduling
    overlapped = [o.outputs[0] for o in llm.generate(prompts, params)]
    assert sum(deferred) > 10  # decode steps of constrained requests were launched ahead
    monkeypatch.setattr(llm.engine, "async_scheduling", False)
    deferred.clear()
    synchronous = [o.outputs[0] for o in llm.generate(prompts, params)]
    assert not any(deferred)
    assert [c.token_ids for c in overlapped] == [c.token_ids for c in synchronous]
    for c in overlapped[:3]:
        jsonschema.validate(json.loads(c.text), SCHEMA)


# The schema of the report: a bounded string, which xgrammar wrote as [^"\\\r\n]{0,12} (control characters
# allowed), so that a random model at temperature 1 wrote raw \x00-\x1f into the string; Atlas now writes that
# rule itself (xgrammar_backend.exact_string_lengths).
NAME_SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}}, "required": ["name"],
               "additionalProperties": False}


def test_byte_level_tokenizer_at_temperature_one_never_leaves_the_schema(qwen3_dir):
    """A random model with a byte-level BPE tokenizer (every byte a token, control bytes included) sampled at
    temperature 1, with top-k / top-p / penalties on some rows: every output is a valid document."""
    llm = LLM(model=str(qwen3_dir), kv_cache_memory="64MiB", max_model_len=256)
    # (auto gives both strings to xgrammar, the open object to llguidance)
    unbounded = {**NAME_SCHEMA, "properties": {"name": {"type": "string"}}}
    open_ints = {**NAME_SCHEMA, "additionalProperties": {"type": "integer"}}
    route = llm.engine.structured.backend.compile
    assert [route(StructuredOutputsParams(json=s))[0] for s in (NAME_SCHEMA, unbounded, open_ints)] == [
        "xgrammar", "xgrammar", "llguidance"]
    schemas = [(NAME_SCHEMA, unbounded, open_ints)[s % 3] for s in range(48)]
    params = [SamplingParams(max_tokens=64, temperature=1.0, seed=s, structured_outputs={"json": schemas[s]},
                             **[{}, {"top_k": 20, "top_p": 0.9}, {"repetition_penalty": 1.3, "min_p": 0.01}][s // 16])
              for s in range(48)]
    outs = llm.generate([[5, 6, 7]] * len(params), params)
    finished = [(o.outputs[0], schemas[s]) for s, o in enumerate(outs) if o.outputs[0].finish_reason == "stop"]
    assert len(finished) >= 24 and len({id(schema) for _, schema in finished}) == 3
    for c, schema in finished:
        jsonschema.validate(json.loads(c.text), schema)
    assert_pages_returned(llm)


def test_xgrammar_backend_refuses_what_it_does_not_enforce(qwen3_dir):
    llm = LLM(model=str(qwen3_dir), kv_cache_memory="64MiB", max_model_len=256, structured_outputs_backend="xgrammar")
    for schema, word in (({"type": "string", "pattern": "^a"}, "pattern"),
                         ({"type": "string", "format": "email"}, "format"),
                         ({"type": "array", "uniqueItems": True}, "uniqueItems"), ({"not": {"type": "string"}}, "'not'")):
        with pytest.raises(InvalidRequestError, match=word):
            llm.generate(["x"], SamplingParams(structured_outputs={"json": schema}))
    out = llm.generate([[5]], SamplingParams(max_tokens=40, temperature=1.0, seed=0, structured_outputs={
        "json": {"type": "object", "properties": {"n": {"type": "integer", "minimum": 3}}, "required": ["n"],
                 "additionalProperties": False}}))[0].outputs[0]
    if out.finish_reason == "stop":
        assert json.loads(out.text)["n"] >= 3


def test_unsupported_keywords_and_empty_languages_are_refused_by_name(llm):
    for spec, words in (({"json": {"type": "string", "not": {"const": "a"}}}, "not"),
                        ({"json": {"type": "array", "uniqueItems": True}}, "uniqueItems"),
                        ({"json": {"oneOf": [{"type": "integer"}, {"minimum": 2}]}}, "oneOf"),
                        ({"json": False}, "false"),
                        ({"regex": r"a[^\s\S]b"}, "admits no output"),
                        # (one that took a server 120 s and more with xgrammar: bounded by llguidance's limits)
                        ({"regex": "((.{0,100}){0,100}){0,100}"}, "too complex to enforce")):
        with pytest.raises(InvalidRequestError, match=words):
            llm.generate(["x"], SamplingParams(structured_outputs=spec))
    assert not llm.engine.has_unfinished()


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_a_grammar_state_with_no_token_ends_the_request_with_an_error(qwen3_dir, ignore_eos):
    """xgrammar compiles a[^\\s\\S]b and allows "a", after which nothing: the request ends there with
    finish_reason "error" and a message, never with token 0 as a stop or with unconstrained text after it."""
    llm = LLM(model=str(qwen3_dir), kv_cache_memory="64MiB", max_model_len=256, structured_outputs_backend="xgrammar")
    tok = llm.get_tokenizer()
    out, plain = llm.generate([[5, 6], [5, 6]], [
        SamplingParams(max_tokens=16, temperature=1.0, seed=1, ignore_eos=ignore_eos,
                       structured_outputs={"regex": r"a[^\s\S]b"}),
        SamplingParams(max_tokens=8, temperature=0)])
    c = out.outputs[0]
    assert c.finish_reason == "error"
    assert "allows no token after the first 1 output token" in c.error
    assert tok.decode(c.token_ids) == "a"
    assert plain.outputs[0].finish_reason == "length"  # its neighbour went on
    assert_pages_returned(llm)


def test_a_schema_of_ten_thousand_tools_is_refused_not_compiled_for_minutes(llm):
    """An array of 10,000 forced tools (issue 43: xgrammar compiled it for minutes while the request hung) goes to
    llguidance, being large, whose limits refuse it by name; a large schema inside xgrammar's subset is routed to
    llguidance too."""
    tools = [{"type": "object", "properties": {"name": {"const": f"tool_{i}"}, "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
        "additionalProperties": False}}, "required": ["name", "parameters"], "additionalProperties": False}
        for i in range(10_000)]
    with pytest.raises(InvalidRequestError, match="too large"):
        llm.generate(["x"], SamplingParams(structured_outputs={"json": {"type": "array", "items": {"anyOf": tools}}}))
    backend = llm.engine.structured.backend
    small = StructuredOutputsParams(json={"type": "array", "items": {"anyOf": tools[:10]}})
    large = StructuredOutputsParams(json={"type": "array", "items": {"anyOf": tools[:500]}})
    assert backend.compile(small)[0] == "xgrammar" and backend.compile(large)[0] == "llguidance"


def test_xgrammar_failed_checks_read_as_their_reason():
    """xgrammar's failed internal checks ("Check failed: (<C++ condition>) is false: ...") reach the client as
    the reason alone."""
    xgr = pytest.importorskip("xgrammar")
    from atlas.structured.xgrammar_backend import _clean

    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo([f"t{i}" for i in range(8)]))
    with pytest.raises(Exception) as failed:  # noqa: PT011 - xgrammar's own RuntimeError, whose words are the point
        compiler.compile_structural_tag(json.dumps({"type": "structural_tag", "format": {"type": "bogus"}}))
    assert "Check failed" in str(failed.value)
    message = _clean(failed.value)
    assert "Check failed" not in message and "std::" not in message and "bogus" in message, message


def test_llguidance_open_objects_at_temperature_one_never_spell_a_listed_name(qwen3_dir):
    """The byte-level random model at temperature 1 under llguidance, nudged towards escapes (logit_bias on '\\',
    'u' and a few hex digits): the listed names are the characters those escapes spell (\\u0061 is "a"), integers,
    every other name a string. llguidance's own rule for the other names let an escape spell a listed name past
    its schema; Atlas gives it the object closed with a pattern for the other names (json_schema.exact_other_names):
    every finished output validates."""
    llm = LLM(model=str(qwen3_dir), kv_cache_memory="64MiB", max_model_len=256, structured_outputs_backend="llguidance")
    tok = llm.get_tokenizer()
    digits = "01267ab"
    listed = {chr(int(x + y, 16)): {"type": "integer"} for x in digits[:5] for y in digits}
    schemas = [{"type": "object", "properties": listed, "additionalProperties": {"type": "string", "maxLength": 2}},
               {"type": "object", "allOf": [
                   {"properties": {c: {"type": "integer"} for c in "ab"}},
                   {"properties": {c: {"type": "integer"} for c in "a\x01"},
                    "additionalProperties": {"type": "string", "maxLength": 2}}]}]
    ids = {c: tok.encode(c, add_special_tokens=False) for c in '"\\u0' + digits}
    assert all(len(i) == 1 for i in ids.values())
    bias = {i[0]: {'"': 6.0, "\\": 6.0, "u": 4.0}.get(c, 4.0) for c, i in ids.items()}
    params = [SamplingParams(max_tokens=64, temperature=1.0, seed=s, logit_bias=bias,
                             structured_outputs={"json": schemas[s % 2]}) for s in range(64)]
    outs = llm.generate([[5, 6, 7]] * len(params), params)
    finished = [(o.outputs[0].text, schemas[s % 2]) for s, o in enumerate(outs) if o.outputs[0].finish_reason == "stop"]
    assert len(finished) >= 16
    escaped = 0
    for text, schema in finished:
        jsonschema.validate(json.loads(text), schema)
        escaped += '\\u' in text
    assert escaped >= 5  # (escapes were written: those of control characters, in names and in strings)
    assert_pages_returned(llm)
    # No spelling of a listed name takes another name's schema, byte by byte through this tokenizer (other names are
    # written raw but for the escapes of control characters, quotes and backslashes): \u0061 and
    # \u000A (json.dumps writes "a" and "\n") were other names to llguidance, so strings passed for integers.
    manager = llm.engine.structured
    for schema, names in zip(schemas, (set(listed), {"a", "b", "\x01"}), strict=True):
        grammar = manager.compile_sync(StructuredOutputsParams(json=schema))
        for name in ('"a"', '"\\u0061"', '"\\u000A"', '"\\u0001"', '"\\u0062"', '"\\u0003"', '"\\n\\n"'):
            ok = json.loads(name) not in names
            tokens = [t for c in f'{{{name}: "x"}}' for t in tok.encode(c, add_special_tokens=False)]
            tokens.append(llm.engine.eos_token_ids[0])
            assert (manager.backend.matcher(grammar).count_accepted(tokens) == len(tokens)) == ok, (name, schema)
