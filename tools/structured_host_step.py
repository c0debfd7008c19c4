"""The host work of a constrained decode step, per grammar engine (CPU, no model).

What the engine core does between two steps for B constrained sequences, through its own classes: the
StructuredOutputManager fills the step's bitmask (`fill_step_bitmask`, as EngineCore._step_masks calls it), then
every sequence's grammar takes the token it sampled (`RequestGrammar.accept`, as EngineCore._advance_grammars
calls it).
The tokens are those of valid documents of `atlas bench structured`'s schema (one document per sequence, each a
different array of records, tokenized by the tokenizer), each checked against its row of the mask outside the
timed part. One step = fill + accept, timed per step; the fastest of --repeats walks counts per step (median over
the steps), and the parts are timed alone too.

    PYTHONPATH=$PWD python tools/structured_host_step.py       # default model's tokenizer and a byte-level BPE
    PYTHONPATH=$PWD python tools/structured_host_step.py --batch 1,32 --steps 64 --repeats 5 --profile llguidance:32

`--profile ENGINE:B` prints a cProfile of that engine's walk at batch B instead of timing.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from atlas.bench.structured import SCHEMA
from atlas.sampling_params import StructuredOutputsParams
from atlas.structured import StructuredOutputManager


def schemas() -> dict[str, dict]:
    bounded = json.loads(json.dumps(SCHEMA))
    bounded["items"]["properties"]["name"]["maxLength"] = 16
    # (records open to other names: each sequence also has a DistinctKeys, distinct_keys.py)
    opened = json.loads(json.dumps(SCHEMA))
    del opened["items"]["additionalProperties"]
    return {"bench": SCHEMA, "bench+maxLength16": bounded, "bench+open": opened}


KINDS = ["module", "class", "function", "method"]


def document(seq: int, records: int = 400) -> str:
    items = [{"name": f"n{seq}_{i}_{'abcdefghij'[(seq + i) % 10] * (i % 7)}", "kind": KINDS[(seq + i) % 4],
              "line": (seq * 131 + i * 17) % 5000, "public": (seq + i) % 3 == 0} for i in range(records)]
    return json.dumps(items)  # (", " and ": ": the grammar's one layout)


def tokenizers(args) -> dict[str, tuple[object, int]]:
    from transformers import AutoTokenizer

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from compare_grammar_engines import default_tokenizer_path, train_big_tokenizer

    out = {}
    path = default_tokenizer_path()
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    out[f"default model ({vocab:,})"] = (AutoTokenizer.from_pretrained(str(path)), vocab)
    if args.byte_vocab:
        work = Path(args.work_dir) / f"bpe{args.byte_vocab}"
        if not (work / "tokenizer.json").exists():
            train_big_tokenizer(args.byte_vocab, work)
        hf = AutoTokenizer.from_pretrained(str(work))
        out[f"byte-level BPE ({args.byte_vocab:,})"] = (hf, len(hf))
    return out


def walk(manager, spec, streams, steps: int, check: bool = True):
    """(per-step seconds of fill + accept, of fill, of accept) over `steps` steps of len(streams) sequences."""
    grammars = [manager.request_grammar(spec) for _ in streams]
    for g in grammars:
        g.compiled.result()
        g.start()
    batch = SimpleNamespace(seqs=[SimpleNamespace(grammar=g, spec_token_ids=[]) for g in grammars],
                            num_sample_rows=[1] * len(grammars), num_drafts=[0] * len(grammars))
    total, fill, accept = [], [], []
    for s in range(steps):
        tokens = [[stream[s]] for stream in streams]
        t0 = time.perf_counter()
        masks = manager.fill_step_bitmask(batch)
        t1 = time.perf_counter()
        for g, t in zip(grammars, tokens, strict=True):  # (as EngineCore._advance_grammars does)
            g.accept(t)
        t2 = time.perf_counter()
        total.append(t2 - t0)
        fill.append(t1 - t0)
        accept.append(t2 - t1)
        if check:
            bitmask, rows, _ = masks
            for r, (g, [t]) in enumerate(zip(grammars, tokens, strict=True)):
                assert (int(bitmask[r, t // 32]) >> (t % 32)) & 1, f"step {s}: token {t} not in the mask"
                assert g.error is None, g.error
    return total, fill, accept


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", default="1,32")
    ap.add_argument("--steps", type=int, default=64, help="steps per walk (the bench's --output-len)")
    ap.add_argument("--repeats", type=int, default=5, help="walks per case; the fastest counts")
    ap.add_argument("--backends", default="xgrammar,llguidance")
    ap.add_argument("--schemas", default="bench,bench+maxLength16")
    ap.add_argument("--byte-vocab", type=int, default=32768, help="byte-level BPE size (0: none)")
    ap.add_argument("--work-dir", default="/tmp/atlas-grammar-bench")
    ap.add_argument("--mask-threads", default="default",
                    help="llguidance's mask threads, comma-separated values to compare (default: the engine's choice "
                         "here; 0: none)")
    ap.add_argument("--profile", default=None, help="ENGINE:B (cProfile that case instead)")
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    batches = [int(b) for b in args.batch.split(",")]
    all_schemas = schemas()
    rows = []
    for tok_name, (hf, vocab) in tokenizers(args).items():
        eos = hf.eos_token_id
        streams = [hf.encode(document(i), add_special_tokens=False) for i in range(max(batches))]
        assert min(len(s) for s in streams) > args.steps
        cases = [(b, None) for b in args.backends.split(",") if b != "llguidance"]
        if "llguidance" in args.backends.split(","):
            try:  # "default": the engine's choice for this machine
                from atlas.engine.cpu_threads import grammar_mask_threads
            except ImportError:  # (a tree from before it: llguidance's own default)
                grammar_mask_threads = None
            for t in args.mask_threads.split(","):
                if t != "default":
                    cases.append(("llguidance", int(t)))
                else:
                    cases.append(("llguidance", grammar_mask_threads(None) if grammar_mask_threads else None))
        for backend, threads in cases:
            try:
                manager = StructuredOutputManager(hf, vocab, [eos], backend=backend, mask_threads=threads)
            except TypeError:  # (a tree from before --structured-outputs-mask-threads)
                manager = StructuredOutputManager(hf, vocab, [eos], backend=backend)
            name = backend if backend != "llguidance" or threads is None else f"llguidance, {threads} threads"
            for schema_name in args.schemas.split(","):
                spec = StructuredOutputsParams(json=all_schemas[schema_name])
                try:
                    manager.compile_sync(spec)
                except Exception as exc:  # noqa: BLE001 - e.g. xgrammar refuses maxLength
                    rows.append({"tokenizer": tok_name, "backend": name, "schema": schema_name,
                                 "refused": str(exc)[:80]})
                    continue
                for b in batches:
                    if args.profile:
                        engine, pb = args.profile.split(":")
                        if engine != backend or int(pb) != b:
                            continue
                        prof = cProfile.Profile()
                        prof.enable()
                        for _ in range(args.repeats):
                            walk(manager, spec, streams[:b], args.steps, check=False)
                        prof.disable()
                        print(f"== {tok_name}, {backend}, {schema_name}, B={b}")
                        pstats.Stats(prof).sort_stats("tottime").print_stats(18)
                        continue
                    walk(manager, spec, streams[:b], args.steps)  # warm-up (and the mask check)
                    best = None
                    for _ in range(args.repeats):
                        total, fill, accept = walk(manager, spec, streams[:b], args.steps, check=False)
                        med = [statistics.median(x) * 1e6 for x in (total, fill, accept)]
                        if best is None or med[0] < best[0]:
                            best = med
                    rows.append({"tokenizer": tok_name, "backend": name, "schema": schema_name, "batch": b,
                                 "step_us": best[0], "fill_us": best[1], "accept_us": best[2]})
            manager.close()
    if args.profile:
        return 0
    ref = {(r["tokenizer"], r["schema"], r["batch"]): r["step_us"] for r in rows
           if r["backend"] == "xgrammar" and "step_us" in r}
    lines = ["| tokenizer | schema | B | backend | step µs (fill + accept) | fill µs | accept µs "
             "| step / xgrammar's |",
             "|---|---|---:|---|---:|---:|---:|---:|"]
    for r in rows:
        if "refused" in r:
            lines.append(f"| {r['tokenizer']} | {r['schema']} | | {r['backend']} | refused | | | |")
            continue
        x = ref.get((r["tokenizer"], r["schema"], r["batch"]))
        note = ""
        if x is None:  # (xgrammar refuses maxLength: against its step on the schema without it)
            x, note = ref.get((r["tokenizer"], "bench", r["batch"])), " (vs bench)"
        ratio = f"{r['step_us'] / x:.2f}{note}" if x else ""
        lines.append(f"| {r['tokenizer']} | {r['schema']} | {r['batch']} | {r['backend']} | {r['step_us']:.0f} | "
                     f"{r['fill_us']:.0f} | {r['accept_us']:.0f} | {ratio} |")
    text = "\n".join(lines)
    print(text)
    if args.output_json:
        Path(args.output_json).write_text(json.dumps({"rows": rows, "argv": sys.argv}, indent=1))
        Path(args.output_json).with_suffix(".txt").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
