"""Offline benchmarks: `atlas bench decode` (Atlas against Hugging Face transformers on the same device,
and the memory-bandwidth roofline) and `atlas bench spec` (speculative methods against plain decoding).

Every figure is measured in the same run as its peer, and each run writes JSON next to its text table.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from atlas.bench.common import (
    copy_bandwidth,
    engine_kwargs,
    machine,
    random_prompts,
    release,
    sync,
    write_report,
)
from atlas.bench.roofline import ModelShape
from atlas.config import DFLASH_ONLY_OPTIONS, OPTION_ALSO_FOR, EngineConfig
from atlas.heap import frozen_heap
from atlas.outputs import mean_acceptance_length

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------- prompts
def heldout_code_prompts(tokenizer, num: int, input_len: int, seed: int = 0, stdlib_dir: str | None = None
                         ) -> list[list[int]]:
    """Prefixes of held-out standard-library files (the split the default model never trained on):
    the first window of every file, then the second, and so on, until `num` prompts."""
    from atlas.training.corpus import CorpusConfig, build_corpus

    corpus = build_corpus(CorpusConfig(seed=seed, chat=False, pydoc_topics=False, stdlib_dir=stdlib_dir))
    docs = sorted((d for d in corpus.documents if d.split == "test" and d.kind == "code"), key=lambda d: d.source)
    encoded = [tokenizer.encode(d.text, add_special_tokens=False) for d in docs]
    stride = input_len + 256  # windows far enough apart to be different prompts
    prompts: list[list[int]] = []
    for k in range(max((len(ids) // stride for ids in encoded), default=0) + 1):
        for ids in encoded:
            start = k * stride
            if len(prompts) < num and start + input_len + 32 <= len(ids):
                prompts.append(ids[start: start + input_len])
    if len(prompts) < num:
        raise SystemExit(f"the held-out files give only {len(prompts)} prompts of --input-len {input_len}")
    return prompts


def load_prompts(kind: str, llm, num: int, input_len: int, stdlib_dir: str | None = None) -> list[list[int]]:
    tokenizer = llm.get_tokenizer()
    if kind == "heldout-code" and tokenizer is not None:
        return heldout_code_prompts(tokenizer, num, input_len, stdlib_dir=stdlib_dir)
    if kind == "random" or tokenizer is None:
        return random_prompts(llm.engine.model_config.vocab_size, num, input_len)
    lines = [ln for ln in Path(kind).read_text().splitlines() if ln.strip()]
    return [tokenizer.encode(json.loads(ln)["prompt"] if ln.startswith("{") else ln)[:input_len]
            for ln in lines[:num]]

# ---------------------------------------------------------------------------------------- timing
@dataclass
class RunResult:
    name: str
    concurrency: int
    requests: int
    output_tokens: int
    seconds: float
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds


def run_pass(llm, prompts: list[list[int]], concurrency: int, params, schedule: str = "waves") -> list:
    """Generate for every prompt, at most `concurrency` requests at a time. "waves": groups of `concurrency`
    prompts, each group to its end before the next starts (a static batch). "continuous": a new request
    starts as soon as one ends, as a client with that many requests in flight sees it (vLLM's
    `--max-concurrency`). `params`: one SamplingParams for all, or one per prompt. -> outputs in prompt order."""
    per_prompt = params if isinstance(params, list) else [params] * len(prompts)
    if schedule == "waves":
        outputs = []
        for i in range(0, len(prompts), concurrency):
            outputs += llm.generate([{"prompt_token_ids": p} for p in prompts[i: i + concurrency]],
                                    per_prompt[i: i + concurrency])
        return outputs
    engine = llm.engine
    order: dict[str, int] = {}
    outputs: list = [None] * len(prompts)
    queued = iter(enumerate(prompts))

    def admit(free: int) -> None:
        for _ in range(free):
            nxt = next(queued, None)
            if nxt is None:
                return
            order[engine.add_request({"prompt_token_ids": nxt[1]}, per_prompt[nxt[0]])] = nxt[0]

    admit(concurrency)
    done = 0
    with frozen_heap():  # (as LLM.generate)
        while done < len(prompts):
            ended = [out for out in engine.step(final_only=True) if out.finished]
            for out in ended:
                outputs[order.pop(out.request_id)] = out
            done += len(ended)
            admit(len(ended))
    return outputs


@dataclass
class Timing:
    """Timed passes of one engine over one set of prompts; engine counters taken around them."""
    llm: Any
    name: str
    concurrency: int
    paired: bool = False  # (its passes alternated with another engine's: see cmd_spec --interleave)
    passes: list[float] = field(default_factory=list)
    outputs: list = field(default_factory=list)
    counters: tuple[int, ...] = ()

    @staticmethod
    def _read(engine) -> tuple[int, ...]:
        s = engine.stats
        return (s.spec_num_draft_tokens, s.spec_num_accepted_tokens, s.spec_num_verify_steps, s.num_steps,
                s.spec_num_drafted_steps)

    def start(self, prompts: list[list[int]], params) -> Timing:
        # Warm-up with the measured shapes, so that kernel compilation stays out of the timing.
        run_pass(self.llm, prompts[:self.concurrency], self.concurrency, params)
        self.counters = self._read(self.llm.engine)
        return self

    def time_pass(self, prompts: list[list[int]], params, schedule: str) -> None:
        device = self.llm.engine.device
        sync(device)
        t0 = time.perf_counter()
        self.outputs = run_pass(self.llm, prompts, self.concurrency, params, schedule)
        sync(device)
        self.passes.append(time.perf_counter() - t0)

    def result(self) -> tuple[RunResult, list]:
        """The median pass (engine counters: per pass)."""
        repeats = len(self.passes)
        now = self._read(self.llm.engine)
        drafted, accepted, verifies, steps, drafted_steps = (
            (a - b) // repeats for a, b in zip(now, self.counters, strict=True))
        extra: dict[str, Any] = {"engine_steps": steps, "drafted_steps": drafted_steps}
        if repeats > 1:
            extra["pass_seconds"] = list(self.passes)
        if verifies:
            extra.update(draft_tokens=drafted, accepted_tokens=accepted, verify_steps=verifies,
                         acceptance_length=mean_acceptance_length(accepted, verifies),
                         acceptance_rate=accepted / max(drafted, 1))
        tokens = [o.outputs[0].token_ids for o in self.outputs]
        seconds = sorted(self.passes)[len(self.passes) // 2]
        return RunResult(self.name, self.concurrency, len(self.outputs), sum(len(t) for t in tokens), seconds,
                         extra), tokens


def greedy_params(output_len: int):
    from atlas import SamplingParams

    return SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)


def time_atlas(llm, prompts: list[list[int]], concurrency: int, output_len: int, name: str, repeats: int = 1,
               schedule: str = "waves") -> tuple[RunResult, list]:
    """All prompts, `concurrency` at a time (run_pass), greedy, fixed output length; timed `repeats` times, the
    median pass reported (engine counters: per pass)."""
    params = greedy_params(output_len)
    timing = Timing(llm, name, concurrency).start(prompts, params)
    for _ in range(repeats):
        timing.time_pass(prompts, params, schedule)
    return timing.result()


def time_transformers(model_path: Path, prompts: list[list[int]], concurrency: int, output_len: int,
                      device: torch.device, dtype: torch.dtype) -> RunResult:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(device).eval()
    kwargs = dict(max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        warm = torch.tensor(prompts[:concurrency], device=device)
        model.generate(warm, attention_mask=torch.ones_like(warm), **kwargs)  # warm-up, same shapes
        sync(device)
        t0 = time.perf_counter()
        total = 0
        for i in range(0, len(prompts), concurrency):
            batch = torch.tensor(prompts[i: i + concurrency], device=device)  # equal lengths: no padding
            out = model.generate(batch, attention_mask=torch.ones_like(batch), **kwargs)
            total += (out.shape[1] - batch.shape[1]) * batch.shape[0]
        sync(device)
        seconds = time.perf_counter() - t0
    del model
    release()
    return RunResult("transformers generate", concurrency, len(prompts), total, seconds)


# ---------------------------------------------------------------------------------------- commands
def cmd_decode(args: argparse.Namespace) -> int:
    """Atlas vs transformers `generate` at each concurrency, plus the batch-1 roofline."""
    from atlas import LLM

    llm = LLM(**engine_kwargs(args))
    engine = llm.engine
    device, dtype = engine.device, engine.runner.dtype
    weight_bytes = sum(p.numel() * p.element_size() for p in engine.runner.model.parameters())
    # What one batch-1 decode step reads: of an MoE only the routed experts a token reaches (and the
    # shared ones); the input embedding is looked up, not read whole (ModelShape counts it as the model does).
    shape = ModelShape.from_config(engine.model_config.raw, Path(engine.model_path))  # (--hf-overrides' changes in)
    element = next(engine.runner.model.parameters()).element_size()
    read_bytes = shape.weight_read_params(1) * element
    rows = []
    for c in args.concurrency:
        prompts = load_prompts(args.prompts, llm, c * args.waves, args.input_len, args.stdlib_dir)
        result, _ = time_atlas(llm, prompts, c, args.output_len, "atlas")
        rows.append({"engine": "atlas", "concurrency": c, "tok/s": result.tokens_per_s,
                     "ms/step": 1000 * result.seconds / (args.waves * args.output_len)})
    model_path = engine.model_path
    del llm, engine
    release()
    bandwidth = copy_bandwidth(device)
    if args.peer == "transformers":
        for c in args.concurrency:
            prompts = _reload_prompts(args, model_path, c * args.waves)
            r = time_transformers(model_path, prompts, c, args.output_len, device, dtype)
            rows.append({"engine": "transformers", "concurrency": c, "tok/s": r.tokens_per_s,
                         "ms/step": 1000 * r.seconds / (args.waves * args.output_len)})
    for row in rows:
        peer = next((p for p in rows if p["engine"] == "transformers" and p["concurrency"] == row["concurrency"]), None)
        row["x transformers"] = row["tok/s"] / peer["tok/s"] if peer else None
        if bandwidth and row["concurrency"] == 1:
            # Each decode step reads its weights once; copy bandwidth counts bytes read + written,
            # the same convention as the published H200 figures.
            roofline = bandwidth / read_bytes
            row["% roofline"] = 100 * row["tok/s"] / roofline
    meta = {"machine": machine(), "model": str(model_path), "dtype": str(dtype), "weight_bytes": weight_bytes,
            "weight_read_bytes_per_step": read_bytes, "copy_bandwidth_bytes_per_s": bandwidth, "input_len": args.input_len, "output_len": args.output_len,
            "waves": args.waves, "command": args.command_line}
    write_report(args.output_json, f"decode: {args.input_len} in / {args.output_len} out, greedy", rows, meta)
    return 0


def _reload_prompts(args: argparse.Namespace, model_path: Path, num: int) -> list[list[int]]:
    """Prompts again without an engine (its memory is released before the peer loads)."""
    from atlas.engine.tokenizer import Tokenizer

    class _View:  # what load_prompts reads
        def __init__(self):
            self.tokenizer = (Tokenizer(model_path, trust_remote_code=args.trust_remote_code)
                              if not args.skip_tokenizer_init else None)

        def get_tokenizer(self):
            return self.tokenizer

    view = _View()
    if view.tokenizer is None or args.prompts == "random":
        from atlas.config import ModelConfig

        return random_prompts(ModelConfig.from_path(model_path).vocab_size, num, args.input_len)
    return load_prompts(args.prompts, view, num, args.input_len, args.stdlib_dir)


def _differences(tokens: list[list[int]], base: list[list[int]]) -> str | None:
    """Where outputs differ from plain decoding's: how many, and the earliest token index that differs."""
    firsts = []
    for got, want in zip(tokens, base, strict=True):
        if got != want:
            firsts.append(next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b),
                               min(len(got), len(want))))
    if not firsts:
        return None
    return f"{len(firsts)}/{len(base)} outputs, first at token {min(firsts)}"


#: K of the replay proposer when --num-draft-tokens is unset
REPLAY_DRAFT_TOKENS = 7


def replay_proposer(num_draft_tokens: int):
    """A proposer for benchmarks only: it drafts the tokens plain greedy decoding produced for the same prompt
    (`record` them first), so every draft is accepted: the mechanical ceiling of speculation, apart from any
    drafter's quality. (Made here so that `atlas bench --help` does not import torch.)"""
    from atlas.speculative.proposer import Draft, DraftProposer

    class ReplayDrafts(DraftProposer):
        def __init__(self, k: int):
            self.num_draft_tokens = k
            self.table: dict[tuple[int, ...], list[int]] = {}
            self.of_request: dict[str, list[int]] = {}

        def record(self, prompts: list[list[int]], outputs: list[list[int]]) -> None:
            self.table.update((tuple(p), list(o)) for p, o in zip(prompts, outputs, strict=True))

        def on_request_start(self, req) -> None:
            self.of_request[req.request_id] = self.table.get(tuple(req.prompt_token_ids), [])

        def on_request_finish(self, req) -> None:
            self.of_request.pop(req.request_id, None)

        def propose(self, requests) -> list[Draft]:
            k = self.num_draft_tokens
            drafts = []
            for r in requests:
                m = r.num_output_tokens
                drafts.append(Draft(self.of_request.get(r.request_id, [])[m: m + k]))
            return drafts

    return ReplayDrafts(num_draft_tokens)


def _label(method: str | None) -> str:
    """A row's name: `--methods plain` is a second plain engine timed like the speculative ones, whose speed-up over
    the first is the run's own noise floor (with --interleave: what pairing two equal engines gives)."""
    return "plain (control)" if method == "plain" else method or "plain"


def _spec_llm(args: argparse.Namespace, method: str | None):
    from atlas import LLM

    if method == "plain":  # (the control: a second plain engine)
        method = None
    overrides: dict[str, Any] = {"speculative": method}
    if method != "dflash":  # (--draft-model stays for draft_model)
        overrides.update(dict.fromkeys(o for o in DFLASH_ONLY_OPTIONS if method not in OPTION_ALSO_FOR.get(o, ())))
    if method is None:
        overrides["num_draft_tokens"] = None
    if method == "ngram" and args.num_draft_tokens is None:
        overrides["num_draft_tokens"] = args.ngram_k
    if method == "replay":  # (an n-gram engine, for its K + 1 verify graphs, then the replay proposer in its place)
        overrides.update(speculative="ngram", num_draft_tokens=args.num_draft_tokens or REPLAY_DRAFT_TOKENS)
    llm = LLM(**engine_kwargs(args, **overrides))
    if method == "replay":
        llm.engine.proposer = replay_proposer(overrides["num_draft_tokens"])
    return llm


def _record_replay(llm, prompts: list[list[int]], plain_tokens: list[list[int]] | None, concurrency: int,
                   params, schedule: str = "waves", settle: int = 0) -> int:
    """Give a replay engine's proposer plain greedy decoding's outputs for these prompts (from `plain_tokens`, or
    made with `llm` itself, drafting off, when they are not known yet). Then up to `settle` untimed passes of the
    replay engine itself, each recording its own outputs for the next, until a pass gives what it replayed: in
    bf16 a verify step's matmul shapes can round a sequence onto another path than plain decoding's (README,
    speculative decoding), after which plain decoding's tokens would no longer be drafts of it, and the ceiling
    (every draft accepted) would not be what is measured. -> the settling passes run."""
    proposer = llm.engine.proposer
    if plain_tokens is None:
        llm.engine.proposer = None
        plain_tokens = [o.outputs[0].token_ids for o in run_pass(llm, prompts, concurrency, params)]
        llm.engine.proposer = proposer
    proposer.record(prompts, plain_tokens)
    recorded = plain_tokens
    for done in range(settle):
        own = [o.outputs[0].token_ids for o in run_pass(llm, prompts, concurrency, params, schedule)]
        if own == recorded:
            return done + 1
        proposer.record(prompts, own)
        recorded = own
    return settle


def _spec_row(method: str | None, timing: Timing, base: tuple[RunResult, list, list[float]] | None
              ) -> tuple[dict, tuple[RunResult, list, list[float]]]:
    result, tokens = timing.result()
    row = {"method": _label(method), "concurrency": timing.concurrency, "tok/s": result.tokens_per_s,
           "acceptance length": result.extra.get("acceptance_length"),
           "acceptance rate": result.extra.get("acceptance_rate"), "steps": result.extra["engine_steps"],
           # (the share of steps that drafted: the speculation policy's choice)
           "drafted steps": result.extra["drafted_steps"] / max(1, result.extra["engine_steps"])}
    if len(timing.passes) > 1:  # (every pass's speed, slowest to fastest)
        row["passes tok/s"] = "/".join(f"{result.output_tokens / s:.0f}" for s in sorted(timing.passes, reverse=True))
    if base is None:
        row.update({"speed-up": 1.0, "lossless": True, "differences": None})
        return row, (result, tokens, timing.passes)
    base_result, base_tokens, base_passes = base
    row["speed-up"] = result.tokens_per_s / base_result.tokens_per_s
    if len(base_passes) == len(timing.passes) > 1 and timing.paired:
        # Pass i of each engine ran one after the other: the median of their ratios cancels a drift of the host.
        ratios = sorted(b / s for b, s in zip(base_passes, timing.passes, strict=True))
        row["paired speed-up"] = ratios[len(ratios) // 2]
    row["lossless"] = tokens == base_tokens
    row["differences"] = _differences(tokens, base_tokens)
    return row, (result, tokens, timing.passes)


def cmd_spec(args: argparse.Namespace) -> int:
    """Plain decoding against each speculative method, same prompts, same run; outputs must be equal."""
    methods = [None] + [m for m in args.methods if m != "none"]
    params = greedy_params(args.output_len)
    rows = []
    if args.interleave:
        # Every engine at once; pass i of each runs before pass i + 1 of any.
        llms = [_spec_llm(args, m) for m in methods]
        for c in args.concurrency:
            prompts = load_prompts(args.prompts, llms[0], max(c * args.waves, args.min_prompts), args.input_len,
                                   args.stdlib_dir)
            for m, llm in zip(methods, llms, strict=True):
                if m == "replay":
                    _record_replay(llm, prompts, None, c, params, args.schedule, args.replay_settle)
            timings = [Timing(llm, _label(m), c, paired=True).start(prompts, params) for m, llm in zip(
                methods, llms, strict=True)]
            for r in range(args.repeats):
                # A B, then B A, ...: a cost that falls on whichever engine runs second in a pair, or a drift
                # within the run, falls on every engine alike over an even number of passes.
                for timing in (timings if r % 2 == 0 else timings[::-1]):
                    timing.time_pass(prompts, params, args.schedule)
            base = None
            for m, timing in zip(methods, timings, strict=True):
                row, done = _spec_row(m, timing, base)
                base = base or done
                rows.append(row)
        del llms, timings
        release()
    else:
        baseline: dict[int, tuple[RunResult, list, list[float]]] = {}
        for method in methods:
            llm = _spec_llm(args, method)
            for c in args.concurrency:
                prompts = load_prompts(args.prompts, llm, max(c * args.waves, args.min_prompts), args.input_len,
                                       args.stdlib_dir)
                if method == "replay":
                    _record_replay(llm, prompts, baseline[c][1] if c in baseline else None, c, params, args.schedule,
                                   args.replay_settle)
                timing = Timing(llm, _label(method), c).start(prompts, params)
                for _ in range(args.repeats):
                    timing.time_pass(prompts, params, args.schedule)
                row, done = _spec_row(method, timing, baseline.get(c))
                baseline.setdefault(c, done)
                rows.append(row)
            del llm, timing
            release()
    rows.sort(key=lambda r: args.concurrency.index(r["concurrency"]))  # (stable: plain first in each)
    meta = {"machine": machine(), "model": args.model or "default", "draft_model": args.draft_model,
            "input_len": args.input_len, "output_len": args.output_len, "prompts": args.prompts,
            "schedule": args.schedule, "interleave": args.interleave, "command": args.command_line}
    write_report(args.output_json, f"speculative decoding: {args.input_len} in / {args.output_len} out, greedy, "
                 f"{args.schedule}", rows, meta)
    return 0 if all(r["lossless"] for r in rows) else 1


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def add_offline_benchmarks(sub: argparse._SubParsersAction) -> None:
    import sys

    common = argparse.ArgumentParser(add_help=False)
    g = common.add_argument_group("workload")
    g.add_argument("--concurrency", type=_ints, default=[1, 16], help="Comma-separated request concurrencies.")
    g.add_argument("--input-len", type=int, default=128)
    g.add_argument("--output-len", type=int, default=128)
    g.add_argument("--waves", type=int, default=2, help="Groups of `concurrency` requests per measurement.")
    g.add_argument("--prompts", default="heldout-code",
                   help="heldout-code (held-out stdlib files), random, or a text/JSONL file of prompts.")
    g.add_argument("--stdlib-dir", default=None,
                   help="For heldout-code: this Python standard library (default: the running Python's).")
    g.add_argument("--output-json", default=None, help="Write the results here (and a .txt beside it).")
    EngineConfig.add_cli_args(common)
    common.set_defaults(command_line="atlas " + " ".join(sys.argv[1:]))

    p = sub.add_parser("decode", parents=[common], help="Decode speed: Atlas vs transformers generate vs roofline.")
    p.add_argument("--peer", choices=["transformers", "none"], default="transformers")
    p.set_defaults(func=cmd_decode)

    p = sub.add_parser("spec", parents=[common], help="Speculative decoding vs plain decoding (same outputs).")
    p.add_argument("--methods", type=lambda s: s.split(","), default=["ngram", "dflash"],
                   help="Comma-separated: ngram, dflash, mtp, replay (benchmarks only: drafts plain greedy decoding's "
                        "own outputs, so every draft is accepted: the ceiling the verify step allows; K = "
                        "--num-draft-tokens, default 7), plain (a second plain engine: the run's noise floor).")
    p.add_argument("--replay-settle", type=int, default=2,
                   help="replay: untimed passes of the replay engine that record its own outputs as the next drafts, "
                        "until they repeat (a bf16 verify step can round a sequence off plain decoding's path; "
                        "its drafts would then be rejected from there on); 0 = plain decoding's outputs only.")
    p.add_argument("--ngram-k", type=int, default=4, help="Draft tokens for ngram when --num-draft-tokens is unset.")
    p.add_argument("--min-prompts", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3,
                   help="Timed passes over the prompts per row; the median is reported (a small model's pass is a "
                        "fraction of a second, which one pause of the host swings).")
    p.add_argument("--schedule", choices=["waves", "continuous"], default="waves",
                   help="waves: groups of --concurrency requests, each to its end before the next (a static batch); "
                        "continuous: a new request starts as soon as one ends (--concurrency in flight, as a "
                        "server's clients keep them).")
    p.add_argument("--interleave", action="store_true",
                   help="Load every engine at once and alternate their timed passes, the order reversed every other "
                        "pass (A B, B A, ...), so that a drift of the host's speed or a cost of running second falls "
                        "on all alike (the engines share the device: give each its share of "
                        "--gpu-memory-utilization). Rows then also give the median of the passes' paired ratios.")
    # (8 waves: a small model's plain row takes a fraction of a second, and 2 waves swung it by 20-40 %)
    p.set_defaults(func=cmd_spec, waves=8)
