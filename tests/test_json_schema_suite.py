"""Structured outputs never let an invalid JSON document through: every schema of the official JSON Schema
Test Suite (draft 2020-12 and draft 7) is either refused or enforced exactly, by each grammar engine and by
`auto`, which routes each schema to one of them. A tiny
random model with a byte-level BPE tokenizer samples at temperature 1 (without the mask its output is almost
never JSON), and the suite's own invalid instances must never be complete outputs (tests/json_schema_suite.py)."""

from __future__ import annotations

import pytest
from json_schema_suite import load_cases, run, table

from atlas import LLM


def test_the_suite_copy_is_whole():
    cases = load_cases()
    assert len(cases) == 600
    assert {c["draft"] for c in cases} == {"draft2020-12", "draft7"}


@pytest.mark.parametrize("backend, min_coverage", [("auto", 0.55), ("llguidance", 0.55), ("xgrammar", 0.15)])
def test_every_schema_is_enforced_or_refused(qwen3_dir, backend, min_coverage):
    llm = LLM(model=str(qwen3_dir), structured_outputs_backend=backend, kv_cache_memory="256MiB",
              max_model_len=256)
    result = run(llm, samples=2, max_tokens=64)
    print(table(result))
    assert result["violations"] == []
    total = {k: sum(c[k] for c in result["files"].values())
             for k in ("enforced", "refused", "satisfiable", "enforced satisfiable", "finished", "valid instances",
                       "valid complete")}
    assert total["enforced"] + total["refused"] == 600
    # (not everything refused, and the sampling oracle saw finished documents)
    assert total["enforced satisfiable"] >= min_coverage * total["satisfiable"]
    assert total["finished"] >= 100
    # (the instance oracle can say yes: most valid instances are complete outputs; not those written otherwise
    # than the grammar writes them, 1.0 for 1, say)
    assert total["valid complete"] >= 0.7 * total["valid instances"]
    # (string length bounds are enforced by every engine, xgrammar through the rule Atlas writes for them)
    for name in ("minLength", "maxLength"):
        for draft in ("draft7", "draft2020-12"):
            counts = result["files"][f"{draft}/{name}"]
            assert counts["enforced"] == counts["schemas"] == 2, (draft, name, counts)
