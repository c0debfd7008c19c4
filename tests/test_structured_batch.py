"""A step's grammar masks filled for the whole batch at once (StructuredOutputManager.fill_step_bitmask and the
backends' fill_batch) are exactly each sequence's own masks, in the rows the sampler reads; finished sequences and
sequences without a grammar get none; a state with no continuation among live ones ends only its own sequence."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from atlas import LLM, SamplingParams
from atlas.config import ConfigError, EngineConfig
from atlas.sampling_params import StructuredOutputsParams
from atlas.structured import StructuredOutputManager

MODEL = Path(__file__).resolve().parent.parent / "atlas" / "assets" / "default-model"
VOCAB = 8192
RECORDS = {"type": "array", "minItems": 1, "items": {
    "type": "object",
    "properties": {"name": {"type": "string"}, "kind": {"enum": ["module", "class", "function"]},
                   "line": {"type": "integer", "minimum": 0}, "public": {"type": "boolean"}},
    "required": ["name", "kind", "line", "public"], "additionalProperties": False}}
PATTERNED = json.loads(json.dumps(RECORDS))
# (`pattern` is outside xgrammar's subset: auto gives this one to llguidance)
PATTERNED["items"]["properties"]["name"]["pattern"] = "^[a-z]+$"
DOC = json.dumps([{"name": "wrap", "kind": "module", "line": 12, "public": True},
                  {"name": "x", "kind": "class", "line": 7, "public": False}])
# Prefixes that leave the grammar in different states: the start, inside a key, inside a string value, after a
# key's colon, inside an integer, between records.
CUTS = ["", '[{"na', '[{"name": "wr', '[{"name": "wrap", "kind": ', '[{"name": "wrap", "kind": "module", '
        '"line": 1', DOC[: DOC.index("}, ") + 3]]


@pytest.fixture(scope="module")
def hf():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(MODEL))


def _manager(hf, backend, threads=None):
    return StructuredOutputManager(hf, VOCAB, [hf.eos_token_id], backend=backend, mask_threads=threads)


def _grammar(manager, hf, schema, text, extra=()):
    g = manager.request_grammar(StructuredOutputsParams(json=schema))
    g.compiled.result()
    g.start()
    tokens = [*hf.encode(text, add_special_tokens=False), *extra]
    assert g.accept(tokens) == len(tokens) and g.error is None, g.error
    return g


def _own_mask(grammar) -> torch.Tensor:
    row = torch.full((1, (VOCAB + 31) // 32), -1, dtype=torch.int32)
    grammar.matcher.fill_bitmask(row, 0)
    return row[0]


@pytest.mark.parametrize("backend,threads", [("llguidance", None), ("llguidance", 0), ("llguidance", 2),
                                             ("xgrammar", None), ("auto", 2)])
def test_a_batch_of_masks_is_each_sequences_own_mask(hf, backend, threads):
    manager = _manager(hf, backend, threads)
    schemas = [RECORDS if backend == "xgrammar" or i % 2 else PATTERNED for i in range(len(CUTS))]
    live = [_grammar(manager, hf, s, cut) for s, cut in zip(schemas, CUTS, strict=True)]
    finished = _grammar(manager, hf, RECORDS, DOC, extra=[hf.eos_token_id])
    assert not finished.active
    chunk = _grammar(manager, hf, RECORDS, "")  # (a prefill chunk short of the prompt's end: no sample row)
    verify = _grammar(manager, hf, RECORDS, '[{"name": "a')
    drafts = hf.encode('b", "kind"', add_special_tokens=False)[:2]
    seqs = [SimpleNamespace(grammar=g, spec_token_ids=[]) for g in live[:3]]
    seqs += [SimpleNamespace(grammar=None, spec_token_ids=[]), SimpleNamespace(grammar=finished, spec_token_ids=[]),
             SimpleNamespace(grammar=chunk, spec_token_ids=[]), SimpleNamespace(grammar=verify, spec_token_ids=drafts)]
    seqs += [SimpleNamespace(grammar=g, spec_token_ids=[]) for g in live[3:]]
    batch = SimpleNamespace(requests=seqs, num_sample_rows=[1, 1, 1, 1, 1, 0, 3] + [1] * len(live[3:]),
                            num_drafts=[0] * 6 + [2] + [0] * len(live[3:]))
    bitmask, rows, constrained = manager.fill_step_bitmask(batch.requests, batch.num_sample_rows, batch.num_drafts)

    # sample rows: 0-2 the first live ones, 3 unconstrained, 4 finished, none for the chunk, 5-7 the verify
    assert rows == [0, 1, 2, 5, 6, 7, *range(8, 8 + len(live[3:]))]
    assert constrained == frozenset({0, 1, 2, 6, *range(7, 7 + len(live[3:]))})
    expected = [_own_mask(g) for g in live[:3]]
    expected += [_own_mask(_grammar(manager, hf, RECORDS, '[{"name": "a', extra=drafts[:j])) for j in range(3)]
    expected += [_own_mask(g) for g in live[3:]]
    assert bitmask.shape[0] == len(expected)
    for r, mask in enumerate(expected):
        assert torch.equal(bitmask[r], mask), f"bitmask row {r}"
    assert len({tuple(m.tolist()) for m in expected}) >= 5  # (different states: a row swap would show)
    assert all(g.error is None for g in [*live, verify])
    # The fill left every state as it was: the masks again are the same.
    again, _, _ = manager.fill_step_bitmask(batch.requests, batch.num_sample_rows, batch.num_drafts)
    assert torch.equal(again, bitmask)


def test_a_state_with_no_continuation_in_a_batch_ends_only_its_own_sequence(hf):
    """llguidance's error state writes an EOS-only row (not an empty one), xgrammar's dead state an empty row: both
    found in a batch filled at once, and only that sequence gets an error; its sampled token is refused."""
    manager = _manager(hf, "llguidance", 2)
    live = [_grammar(manager, hf, RECORDS, cut) for cut in CUTS[:4]]
    dead = _grammar(manager, hf, RECORDS, '[{"name": ')
    bad = hf.encode("7", add_special_tokens=False)[0]
    assert not dead.matcher._m.consume_token(bad)  # (a token from outside the mask: llguidance's error state)
    grammars = [live[0], dead, *live[1:]]
    batch = SimpleNamespace(requests=[SimpleNamespace(grammar=g, spec_token_ids=[]) for g in grammars],
                            num_sample_rows=[1] * len(grammars), num_drafts=[0] * len(grammars))
    _, rows, constrained = manager.fill_step_bitmask(batch.requests, batch.num_sample_rows, batch.num_drafts)
    assert rows == list(range(len(grammars))) and constrained == frozenset(range(len(grammars)))
    n = len(hf.encode('[{"name": ', add_special_tokens=False))
    assert f"allows no token after the first {n} output token(s)" in dead.error
    assert all(g.error is None and g.active for g in live)
    assert dead.accept([hf.eos_token_id]) == 0 and not dead.active
    _, rows, constrained = manager.fill_step_bitmask(batch.requests, batch.num_sample_rows, batch.num_drafts)
    assert 1 not in constrained and rows == [0, 2, 3, 4]

    x = _manager(hf, "xgrammar")
    spec = StructuredOutputsParams(regex=r"a[^\s\S]b")
    stuck = x.request_grammar(spec)
    stuck.start()
    fine = [_grammar(x, hf, RECORDS, cut) for cut in CUTS[:2]]
    assert stuck.accept(hf.encode("a", add_special_tokens=False)) == 1
    batch = SimpleNamespace(requests=[SimpleNamespace(grammar=g, spec_token_ids=[]) for g in (fine[0], stuck, fine[1])],
                            num_sample_rows=[1, 1, 1], num_drafts=[0, 0, 0])
    bitmask, _, _ = x.fill_step_bitmask(batch.requests, batch.num_sample_rows, batch.num_drafts)
    assert not bitmask[1].any() and bitmask[0].any() and bitmask[2].any()
    assert "allows no token after the first 1 output token(s)" in stuck.error
    assert all(g.error is None for g in fine)


def test_one_token_accept_refuses_by_index_and_past_the_end_takes_all(hf):
    manager = _manager(hf, "llguidance", 0)
    g = _grammar(manager, hf, RECORDS, '[{"name": "a", "kind": ')
    assert g.accept(hf.encode("7", add_special_tokens=False)[:1]) == 0
    assert "refused output token" in g.error and not g.active
    done = _grammar(manager, hf, RECORDS, DOC, extra=[hf.eos_token_id])
    assert done.accept([5]) == 1 and done.accept([5, 6]) == 2 and done.error is None  # (ignore_eos: past the end)


def test_mask_threads_keep_outputs_and_are_checked(qwen3_dir):
    """The same constrained batch (greedy, and seeded temperature 1) gives the same tokens with llguidance's masks
    computed on its pool of threads and on the step's thread."""
    with pytest.raises(ConfigError, match="mask-threads"):
        EngineConfig(structured_outputs_mask_threads=-1)
    schema = {"type": "object", "properties": {"n": {"type": "string", "maxLength": 3}}, "required": ["n"],
              "additionalProperties": False}
    params = [SamplingParams(max_tokens=20, temperature=t, seed=s, structured_outputs={"json": schema})
              for s, t in enumerate([0.0, 1.0, 1.0, 0.0, 1.0, 1.0])]
    prompts = [[5, 6, 7], [8], [9, 10], [11, 12, 13, 14], [5], [6, 6]]
    llm = LLM(model=str(qwen3_dir), kv_cache_memory="64MiB", max_model_len=256, structured_outputs_backend="llguidance",
              structured_outputs_mask_threads=0)
    backend = llm.engine.structured.backend
    outs = {}
    for threads in (0, 3):
        backend.mask_threads = threads  # (the pool is made on its first use)
        outs[threads] = [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in llm.generate(prompts, params)]
    assert backend._executor is not None  # (the pool did fill the masks of the second run)
    assert outs[0] == outs[3]
    assert sum(reason == "stop" for _, reason in outs[0]) >= 2
    for token_ids, reason in outs[0]:
        if reason == "stop":
            text = llm.get_tokenizer().decode(token_ids)
            assert len(json.loads(text)["n"]) <= 3


def test_the_engine_gives_llguidance_a_quarter_of_the_cpus_for_masks(monkeypatch):
    from atlas.engine import cpu_threads

    assert cpu_threads.grammar_mask_threads(5) == 5 and cpu_threads.grammar_mask_threads(0) == 0
    for cpus, threads in ((1, 0), (2, 0), (3, 0), (4, 1), (16, 4), (64, 8)):
        monkeypatch.setattr(cpu_threads, "available_cpus", lambda cpus=cpus: cpus)
        assert cpu_threads.grammar_mask_threads(None) == threads
