"""Every schema of the official JSON Schema Test Suite (draft 2020-12 and draft 7, tests/data/) through the
structured-outputs engine, with two oracles:

- the suite's own instances: each is written in the engine's JSON layout, tokenized and fed to the schema's
  grammar; an instance the suite marks invalid must never be a complete string of the grammar (one that is
  would be an output Atlas lets through); `valid complete` counts the valid ones that are (not all: a
  grammar writes a number or an escape one way only);
- sampling: a few temperature-1 samples per schema from a tiny random model (without the mask, its output
  is almost never JSON), each finished one validated with `jsonschema` under the schema's draft (`unchecked`:
  a pattern that Python's `re`, which jsonschema uses, cannot run).

A schema is refused (a 400 naming what is not supported) or enforced; `run` counts, per suite file,
enforced / refused, finished / truncated samples and the violations of either oracle, which must be 0.

`python tests/json_schema_suite.py [--backend llguidance|xgrammar] [--model PATH]` prints the table.
"""

from __future__ import annotations

import argparse
import json
import re
from collections import Counter
from decimal import Decimal
from fractions import Fraction
from pathlib import Path

SUITE = Path(__file__).parent / "data" / "json-schema-test-suite"
DRAFTS = ("draft2020-12", "draft7")
SEPARATORS = (", ", ": ")  # the engine's JSON layout


def load_cases() -> list[dict]:
    """One entry per suite schema that needs no remote document: {file, draft, description, schema, tests}."""
    cases = []
    for draft in DRAFTS:
        for path in sorted((SUITE / draft).glob("*.json")):
            for group in json.loads(path.read_text()):
                if "localhost:1234" in json.dumps(group["schema"]):  # (the suite's remote-reference server)
                    continue
                cases.append({"file": f"{draft}/{path.stem}", "draft": draft, "description": group["description"],
                              "schema": group["schema"], "tests": group["tests"]})
    return cases


class JSONFloat(float):
    """A float parsed from an output, with the text the output wrote it as (json.loads(..., parse_float=...))."""

    def __new__(cls, text: str):
        value = super().__new__(cls, text)
        value.text = text
        return value


def _exact_multiple_of(validator, divisor, instance, schema):
    """multipleOf in exact arithmetic on the numbers as JSON writes them: jsonschema divides floats, so
    23.4 is "not a multiple of 0.0001" there (23.4 / 0.0001 = 233999.99999999997); and an output's number is
    read as written (1959325640280555322873.5 is a multiple of 1.5, the nearest float is not)."""
    if not validator.is_type(instance, "number"):
        return
    written = getattr(instance, "text", None) or repr(instance)
    if Fraction(Decimal(written)) % Fraction(Decimal(repr(divisor))) != 0:
        yield jsonschema_error(f"{written} is not a multiple of {divisor!r}")


def jsonschema_error(message: str):
    import jsonschema

    return jsonschema.ValidationError(message)


def validator(case: dict):
    import jsonschema

    base = jsonschema.Draft202012Validator if case["draft"] == "draft2020-12" else jsonschema.Draft7Validator
    cls = jsonschema.validators.extend(base, {"multipleOf": _exact_multiple_of})
    return cls(case["schema"], format_checker=base.FORMAT_CHECKER)


def _complete(matcher, token_ids: list[int], stop: int) -> bool:
    """Whether the token string is a complete string of the grammar (its tokens then the stop token)."""
    for t in [*token_ids, stop]:
        if matcher.count_accepted([t]) != 1:
            return False
        matcher.accept_token(t)
    return True


def run(llm, samples: int = 2, max_tokens: int = 48, seed: int = 0) -> dict:
    """-> {"files": {file: Counter}, "violations": [..]}; the engine's backend is the LLM's."""
    from atlas import SamplingParams
    from atlas.structured import GrammarCompileError

    engine = llm.engine
    manager = engine.structured
    tokenizer = llm.get_tokenizer()
    stop = engine.eos_token_ids[0]
    files: dict[str, Counter] = {}
    violations: list[str] = []
    enforced: list[tuple[dict, object]] = []
    for case in load_cases():
        counts = files.setdefault(case["file"], Counter())
        counts["schemas"] += 1
        satisfiable = any(t["valid"] for t in case["tests"])
        counts["satisfiable"] += satisfiable
        spec = {"json": case["schema"]}
        try:
            compiled = manager.compile_sync(_params(spec))
        except GrammarCompileError:
            counts["refused"] += 1
            continue
        counts["enforced"] += 1
        counts["enforced satisfiable"] += satisfiable
        for t in case["tests"]:
            text = json.dumps(t["data"], separators=SEPARATORS, ensure_ascii=False)
            complete = _complete(manager.backend.matcher(compiled), tokenizer.encode(text, add_special_tokens=False),
                                 stop)
            if t["valid"]:  # (that valid instances are complete outputs shows the oracle can say yes)
                counts["valid instances"] += 1
                counts["valid complete"] += complete
            elif complete:
                counts["violations"] += 1
                violations.append(f"{case['file']}: {case['description']!r}: the invalid instance {text} "
                                  f"({t['description']}) is a complete output")
        enforced.append((case, spec))
    params = [SamplingParams(n=samples, temperature=1.0, seed=seed + i, max_tokens=max_tokens,
                             structured_outputs=spec) for i, (_, spec) in enumerate(enforced)]
    outs = llm.generate([{"prompt_token_ids": [stop]}] * len(enforced), params, use_tqdm=False)
    for (case, _), out in zip(enforced, outs, strict=True):
        counts = files[case["file"]]
        check = validator(case)
        for c in out.outputs:
            if c.finish_reason != "stop":
                counts["truncated" if c.finish_reason == "length" else c.finish_reason] += 1
                continue
            counts["finished"] += 1
            try:
                value = json.loads(c.text, parse_float=JSONFloat)
            except ValueError:
                value = _NOT_JSON
            try:
                errors = ["not JSON"] if value is _NOT_JSON else [e.message for e in check.iter_errors(value)]
            except re.error:  # (a pattern in ECMA-262 syntax that Python's re cannot run, e.g. \p{Letter})
                counts["unchecked"] += 1
                continue
            if errors:
                counts["violations"] += 1
                violations.append(f"{case['file']}: {case['description']!r}: output {c.text!r}: {errors[0]}")
    return {"files": files, "violations": violations}


_NOT_JSON = object()


def _params(spec: dict):
    from atlas.sampling_params import StructuredOutputsParams

    return StructuredOutputsParams(**spec)


COLUMNS = ("schemas", "satisfiable", "enforced", "refused", "valid instances", "valid complete", "finished",
           "truncated", "unchecked", "violations")


def table(result: dict) -> str:
    rows = ["| file | " + " | ".join(COLUMNS) + " |", "|---" * (len(COLUMNS) + 1) + "|"]
    total = Counter()
    for name in sorted(result["files"]):
        counts = result["files"][name]
        total.update(counts)
        rows.append(f"| {name} | " + " | ".join(str(counts[c]) for c in COLUMNS) + " |")
    rows.append("| **all** | " + " | ".join(f"**{total[c]}**" for c in COLUMNS) + " |")
    coverage = total["enforced satisfiable"] / max(1, total["satisfiable"])
    rows.append(f"\ncoverage (satisfiable schemas enforced): {total['enforced satisfiable']} / "
                f"{total['satisfiable']} = {coverage:.1%}")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--model", default=None, help="checkpoint (default: the shipped model)")
    ap.add_argument("--samples", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--json", default=None, help="also write the counts here")
    args = ap.parse_args()
    from atlas import LLM

    llm = LLM(model=args.model, structured_outputs_backend=args.backend, kv_cache_memory="512MiB",
              max_model_len=256)
    result = run(llm, args.samples, args.max_tokens)
    print(table(result))
    for v in result["violations"][:20]:
        print("VIOLATION", v)
    if args.json:
        Path(args.json).write_text(json.dumps({"backend": args.backend, "files": result["files"],
                                               "violations": result["violations"]}, indent=1))


if __name__ == "__main__":
    main()
