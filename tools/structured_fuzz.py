"""Random engine configurations serving constrained requests (JSON schema, JSON object, regex, choice, EBNF grammar)
beside unconstrained ones, on the shipped model and its tokenizer (CPU): the grammar's state through preemption,
prefix-cache hits, n > 1 siblings, chunked prompts, asynchronous steps, aborted neighbours and n-gram / DFlash drafts.

Each configuration draws engine flags (as tools/config_fuzz.py does: the pool, max_num_seqs, the token budget,
prefix caching, asynchronous scheduling, the static-buffer path, the priority policy, a proposer when greedy) and a
workload of text prompts, a constraint on most requests. It checks that every completion equals the one-slot plain
engine's under the same constraint, that every completion ended by the grammar ("stop") is in the constraint's
language (json.loads + jsonschema, re.fullmatch, the choices), and that every KV page is back afterwards. Greedy
by default; --sampled draws seeded samples (speculation off). Exit status 1 if any configuration fails.

    python tools/structured_fuzz.py [--seed 0] [--configs 40] [--sampled] [--aborts] [--only K]
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import traceback
from pathlib import Path

import jsonschema

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "tools")]

import config_fuzz  # noqa: E402
from test_structured_engine import SCHEMA  # noqa: E402

from atlas import LLM, SamplingParams  # noqa: E402

MAX_LEN = 512
SMALL_SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer"}},
                "required": ["ok"], "additionalProperties": False}
# (a constraint, and the check of a text that the grammar ended)
CONSTRAINTS = [
    ({"json": SCHEMA}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
    ({"json": SMALL_SCHEMA}, lambda t: jsonschema.validate(json.loads(t), SMALL_SCHEMA) is None),
    ({"json_object": True}, lambda t: isinstance(json.loads(t), dict)),
    ({"regex": r"[0-9]{3}-[a-z]{2}"}, lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2}", t) is not None),
    ({"regex": r"(ab|cd)+x"}, lambda t: re.fullmatch(r"(ab|cd)+x", t) is not None),
    ({"choice": ["yes", "no", "maybe"]}, lambda t: t in ("yes", "no", "maybe")),
    ({"grammar": 'root ::= "x = " [0-9] [0-9]? "\\n"'}, lambda t: re.fullmatch(r"x = [0-9][0-9]?\n", t) is not None),
]
PROMPTS = ["def f(x):\n", "import os\n", "class A:\n", "# The end\n", "config = ", 'data = {"name": ',
           "for i in range(10):\n    ", "x = 1\ny = 2\nz = "]


def engine_flags(r: random.Random, sampled: bool) -> dict:
    bs = r.choice([8, 16])
    pages = MAX_LEN // bs
    flags = dict(max_model_len=MAX_LEN, block_size=bs, enable_prefix_caching=r.random() < 0.6,
                 num_gpu_blocks_override=r.choice([pages + 1, pages + 3, 3 * pages, 400]),
                 max_num_seqs=r.choice([1, 2, 3, 8, 64]), max_num_batched_tokens=r.choice([16, 33, 64, 2048]),
                 async_scheduling=r.random() < 0.7)
    proposer = r.choice([None] if sampled else [None, "ngram", "dflash"])
    if proposer:
        flags.update(speculative=proposer, speculative_policy=r.choice(["adaptive", "always"]),
                     num_draft_tokens=r.choice([1, 2, 4] if proposer == "ngram" else [3, 7]))
    if r.random() < 0.3:
        flags["tuning"] = {"static_steps": True}
    if r.random() < 0.3:
        flags["scheduling_policy"] = "priority"
    if r.random() < 0.3:
        flags["long_prefill_token_threshold"] = r.choice([8, 20])
    return flags


def workload(r: random.Random, sampled: bool, priorities: bool) -> tuple[list, list, list]:
    """Prompts, their parameters and their constraints' checks (None: unconstrained)."""
    prompts, params, checks = [], [], []
    for _ in range(r.randint(3, 10)):
        p = r.choice(PROMPTS)
        if r.random() < 0.3:  # (a longer prompt: chunked prefill, prefix-cache hits on the repeats)
            p = "".join(r.choice(PROMPTS) for _ in range(r.randint(2, 12)))
        kw = dict(max_tokens=r.randint(1, 120), n=r.choice([1, 1, 1, 2, 3]), temperature=0.0,
                  ignore_eos=r.random() < 0.1)
        if sampled:
            kw.update(temperature=r.choice([0.7, 1.0, 1.3]), seed=r.randint(0, 10**6), top_k=r.choice([0, 5, 50]),
                      top_p=r.choice([1.0, 0.9]))
        check = None
        if r.random() < 0.8:
            constraint, check = r.choice(CONSTRAINTS)
            kw["structured_outputs"] = constraint
            kw["max_tokens"] = r.choice([kw["max_tokens"], 150])  # (most long enough to end in the grammar)
        x = r.random()
        if x < 0.1:
            kw["repetition_penalty"] = 1.3
        elif x < 0.2:
            kw.update(presence_penalty=0.8, frequency_penalty=0.3)
        elif x < 0.3:
            kw["logprobs"] = 2
        if priorities and r.random() < 0.3:
            kw["priority"] = r.randint(-2, 2)
        prompts.append(p)
        params.append(SamplingParams(**kw))
        checks.append(check)
    return prompts, params, checks


def out_of_language(outs: list, checks: list) -> tuple[list[str], int]:
    """The completions that the grammar ended ("stop") whose text is not in the constraint's language, and how many
    such completions were checked."""
    bad, checked = [], 0
    for i, (out, check) in enumerate(zip(outs, checks, strict=True)):
        for _tokens, text, reason in out or []:
            if check is None or reason != "stop":
                continue
            checked += 1
            try:
                ok = check(text)
            except (ValueError, jsonschema.ValidationError):
                ok = False
            if not ok:
                bad.append(f"request {i}: {text!r}")
    return bad, checked


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--configs", type=int, default=40)
    ap.add_argument("--sampled", action="store_true", help="Seeded sampling (speculation off) instead of greedy.")
    ap.add_argument("--aborts", action="store_true", help="Abort some requests part-way (the rest must not change).")
    ap.add_argument("--only", type=int, default=None, help="Run configuration K of this seed alone.")
    args = ap.parse_args()
    # The reference: nothing shared between sequences, nothing preempted, no speculation; the priority policy so that
    # it accepts every request (with room for all, priorities change no output).
    reference = LLM(kv_cache_memory="64MiB", max_model_len=MAX_LEN, enable_prefix_caching=False,
                    async_scheduling=False, scheduling_policy="priority")
    rng = random.Random(args.seed)
    failed = 0
    for k in range(args.configs):
        r = random.Random(rng.random())
        if args.only is not None and k != args.only:
            continue
        flags = engine_flags(r, args.sampled)
        prompts, params, checks = workload(r, args.sampled, flags.get("scheduling_policy") == "priority")
        try:
            llm = LLM(**flags)
            aborts = {i: r.randint(0, 30) for i in range(len(prompts)) if args.aborts and r.random() < 0.3}
            want, got, failures = config_fuzz.check_configuration(
                reference, llm, prompts, params, aborts, flags["enable_prefix_caching"],
                record=lambda c: (list(c.token_ids), c.text, c.finish_reason))
            (bad_want, n_want), (bad_got, n_got) = out_of_language(want, checks), out_of_language(got, checks)
            failures += [f"   out of the language: {line}" for line in (bad_want + bad_got)[:3]]
            failed += config_fuzz.finish(str(k), flags, failures, llm,
                                         f"({n_want + n_got} grammar-ended completions checked)")
        except Exception:
            failed += 1
            print(k, "ERROR", json.dumps(flags), flush=True)
            traceback.print_exc()
    print(f"{failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
