"""`atlas bench latency`: one batch of equal requests at a time (vLLM's latency benchmark and flags), with
the time to first token, the decode step time, their rooflines, and a plain-PyTorch peer measured in
the same run.

For each --batch-size B: B random-token prompts of --input-len tokens go through the engine together
(greedy, ignore_eos, exactly --output-len tokens each). TTFT is the time of an `LLM.generate` of the same
batch with max_tokens=1 (the prefill of the whole batch); the decode step time is timed inside the full
run, from the step at which every request is past its prefill to the end, per token each request made
in it. Every call gets fresh prompts, so the prefix cache never shortens a prefill. Floors: see
atlas/bench/roofline.py. The peer (atlas/bench/peer.py) runs first and frees its memory before Atlas
plans its own; for a checkpoint it does not model (MLA, MoE) the bench runs without it, with a note.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import logging
import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from atlas.bench.common import (
    copy_bandwidth,
    engine_kwargs,
    machine,
    random_prompts,
    step_until_decoding,
    sync,
    write_report,
)
from atlas.bench.kernel_profile import format_summary, run_profiled, summarize
from atlas.bench.peer import unsupported_reason
from atlas.bench.roofline import (
    ModelShape,
    decode_step_bytes,
    decode_step_flops,
    device_peak_flops,
    floor_seconds,
    mean_decode_context,
    prefill_flops,
)
from atlas.config import HubAccess, ModelConfig

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

PERCENTILES = (10, 25, 50, 75, 90, 99)


# ---------------------------------------------------------------------------------------- set-up
def checkpoint_path(model: str | None, revision: str | None = None, load_format: str = "auto",
                    hub: HubAccess | None = None) -> Path:
    """The checkpoint folder the engine will load (the peer reads the same files)."""
    if model is None:
        import atlas

        return Path(atlas.__file__).resolve().parent / "assets" / "default-model"
    from atlas.models.loader import resolve_model_path

    # (A missing folder or a bad hub id: the engine's clear error.)
    return resolve_model_path(model, revision, weights=load_format != "dummy", hub=hub)


def bench_device(args: argparse.Namespace) -> torch.device:
    import torch
    cuda = args.device != "cpu" and torch.cuda.is_available()
    return torch.device("cuda" if cuda else "cpu")


def expected_dtype(args: argparse.Namespace, cfg: dict[str, Any], device: torch.device) -> torch.dtype:
    """The dtype the engine picks for this checkpoint (README: --dtype auto)."""
    import torch
    if args.dtype != "auto":
        return getattr(torch, args.dtype)
    if device.type != "cuda":
        return torch.float32
    name = cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"
    return torch.bfloat16 if name == "float32" else getattr(torch, name)


def free_device_memory() -> None:
    import torch
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def percentiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    out = {}
    for p in PERCENTILES:
        k = (len(ordered) - 1) * p / 100
        lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
        out[str(p)] = ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)
    return out


def model_bytes(model: torch.nn.Module, shape: ModelShape, tp: int = 1) -> dict[str, Any]:
    """Weight bytes in memory (this rank's, under tensor parallelism), and what one decode step at batch 1
    reads of them (the input embedding only for the rows it looks up, unless it is also the LM head; of an
    MoE layer's routed experts, the top-k; each rank holds 1/tp of the embedding and of the experts). The
    rows take each batch's own figure (ModelShape.weight_read_params). Sizes are the tensors' own: FP8 experts count
    a byte a weight plus their scales, whatever the activations' dtype."""
    from atlas.layers.moe import FusedExperts

    params = list(model.parameters())
    total = sum(p.numel() * p.element_size() for p in params)
    floating = [p for p in params if p.is_floating_point() and p.element_size() > 1]  # (not the FP8 weights)
    elt = floating[0].element_size() if floating else 2
    read = total - (0 if shape.tied else shape.embedding_params * elt / tp)  # (the embedding is never 8-bit)
    expert_bytes = shape.expert_params * elt / tp  # (one routed expert of one layer, this rank's part)
    experts = [m for m in model.modules() if isinstance(m, FusedExperts)]
    if experts:
        held = sum(p.numel() * p.element_size() for m in experts for p in m.parameters())
        # (an expert-parallel rank holds whole experts, 1/tp of them: its average share of one is 1/tp of it)
        expert_bytes = held / sum(m.num_local_experts for m in experts) / (tp if experts[0].expert_parallel else 1)
    if shape.num_experts:
        read -= shape.moe_layers * (shape.num_experts - shape.experts_read(1)) * expert_bytes
    return {"weight_bytes": total, "weight_read_bytes_per_step": round(read), "dtype_bytes": elt,
            "expert_bytes": expert_bytes}


# ---------------------------------------------------------------------------------------- the peer
def run_peer(path: Path, device: torch.device, dtype: torch.dtype, compiled: bool, args: argparse.Namespace,
             shape: ModelShape, seeds: itertools.count, profiles: dict[int, dict[str, Any]]) -> dict[int, dict]:
    import torch

    from atlas.bench.peer import PeerDecoder

    name = "pytorch-compile" if compiled else "pytorch"
    t0 = time.perf_counter()
    peer = PeerDecoder(path, device, dtype, compile=compiled)
    logger.info("peer %s: weights loaded in %.1fs (CUDA graph: %s)", name, time.perf_counter() - t0, peer.use_graph)
    steps = args.output_len - 1
    results: dict[int, dict] = {}
    try:
        for b in args.batch_size:
            t0 = time.perf_counter()
            peer.prepare(b, args.input_len + args.output_len)
            logger.info("peer %s batch %d: cache and step ready in %.1fs", name, b, time.perf_counter() - t0)
            ttfts, decodes = [], []
            for it in range(args.num_iters_warmup + args.num_iters):
                ids = torch.tensor(random_prompts(shape.vocab, b, args.input_len, seed=next(seeds)), device=device)
                sync(device)
                t0 = time.perf_counter()
                token = peer.prefill(ids)
                sync(device)
                t1 = time.perf_counter()
                for s in range(steps):
                    token = peer.decode(token, args.input_len + s)
                sync(device)
                t2 = time.perf_counter()
                if it >= args.num_iters_warmup:
                    ttfts.append(t1 - t0)
                    decodes.append(t2 - t1)
            ttft, decode = statistics.median(ttfts), statistics.median(decodes)
            results[b] = {"engine": name, "batch_size": b, "ttft_s": ttfts, "latencies": [a + c for a, c in
                          zip(ttfts, decodes, strict=True)], "decode_s": decodes, "ttft": ttft,
                          "step": decode / steps, "total": ttft + decode}
            logger.info("peer %s batch %d: TTFT %.2f ms, %.3f ms/step", name, b, 1000 * ttft, 1000 * decode / steps)
            if args.profile:
                n = min(args.profile_steps, steps)
                ids = torch.tensor(random_prompts(shape.vocab, b, args.input_len, seed=next(seeds)), device=device)
                first = peer.prefill(ids)

                def loop(first=first, n=n, peer=peer):
                    token = first
                    for s in range(n):
                        token = peer.decode(token, args.input_len + s)

                try:
                    events, _, table = run_profiled(loop, device)
                except Exception:  # the timings stand without it
                    logger.exception("profile of peer %s at batch %d failed", name, b)
                    continue
                profiles.setdefault(b, {})[name] = (summarize(events, n, shape.layers, decode / steps, device), table)
    finally:
        del peer
        if compiled:
            torch._dynamo.reset()  # compiled code holds the peer (and its weights) otherwise
    return results


# ---------------------------------------------------------------------------------------- Atlas
def run_atlas(llm, b: int, args: argparse.Namespace, shape: ModelShape, seeds: itertools.count,
              device: torch.device) -> dict:
    from atlas import SamplingParams

    full = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    first = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)

    def timed(params) -> tuple[float, int]:
        prompts = [{"prompt_token_ids": p} for p in random_prompts(shape.vocab, b, args.input_len, seed=next(seeds))]
        steps_before = llm.engine.stats.num_steps
        sync(device)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        sync(device)
        seconds = time.perf_counter() - t0
        short = [len(o.outputs[0].token_ids) for o in outs if len(o.outputs[0].token_ids) != params.max_tokens]
        if short:
            logger.warning("batch %d: %d requests did not produce %d tokens", b, len(short), params.max_tokens)
        return seconds, llm.engine.stats.num_steps - steps_before

    def timed_decode() -> tuple[float, float, int]:
        """(seconds of the whole batch, seconds a decode token from the moment every request is past its prefill to
        the end, engine steps). Timed inside the run rather than as (whole - one-token run): a prefill whose time
        varies by more than the decode takes (long prompts, large batches) made that difference meaningless."""
        engine = llm.engine
        for p in random_prompts(shape.vocab, b, args.input_len, seed=next(seeds)):
            engine.add_request({"prompt_token_ids": p}, full)
        steps_before = engine.stats.num_steps
        sync(device)
        t0 = time.perf_counter()
        step_until_decoding(engine)
        done = min((r.num_output_tokens for r in engine.scheduler.running), default=args.output_len)
        sync(device)
        t1 = time.perf_counter()
        while engine.has_unfinished():
            engine.step(final_only=True)
        sync(device)
        t2 = time.perf_counter()
        return t2 - t0, (t2 - t1) / max(1, args.output_len - done), engine.stats.num_steps - steps_before

    for _ in range(args.num_iters_warmup):
        timed(first)
        timed_decode()
    ttfts, totals, decode_steps, steps = [], [], [], []
    for it in range(args.num_iters):
        ttfts.append(timed(first)[0])
        total, step, n = timed_decode()
        totals.append(total)
        decode_steps.append(step)
        steps.append(n)
        logger.info("atlas batch %d, iteration %d/%d: TTFT %.2f ms, total %.3f s, %.3f ms a decode step, %d engine "
                    "steps", b, it + 1, args.num_iters, 1000 * ttfts[-1], total, 1000 * step, n)
    ttft, total = statistics.median(ttfts), statistics.median(totals)
    return {"engine": "atlas", "batch_size": b, "ttft_s": ttfts, "latencies": totals, "engine_steps": steps,
            "decode_step_s": decode_steps, "ttft": ttft, "step": statistics.median(decode_steps), "total": total}


def profile_atlas(llm, b: int, args: argparse.Namespace, shape: ModelShape, seeds: itertools.count,
                  device: torch.device, step_s: float) -> tuple[dict[str, Any], str]:
    """Profile pure decode steps of b requests (kernel_profile.profile_running): the window opens once every
    request is past its prefill, so no prefill kernel is counted."""
    from atlas import SamplingParams
    from atlas.bench.kernel_profile import profile_running

    n = max(1, min(args.profile_steps, (args.output_len - 4) // 2))
    engine = llm.engine

    def add_requests() -> None:
        params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
        for p in random_prompts(shape.vocab, b, args.input_len, seed=next(seeds)):
            engine.add_request({"prompt_token_ids": p}, params)

    return profile_running(engine, add_requests, n, shape.layers, device)


def profile_prefill(llm, b: int, args: argparse.Namespace, shape: ModelShape, seeds: itertools.count,
                    device: torch.device) -> tuple[dict[str, Any], str]:
    """Profile the prefill of b prompts (generating one token each): its engine steps are the chunks of at most
    --max-num-batched-tokens prompt tokens, so the figures a step are those of one prefill chunk."""
    from atlas import SamplingParams
    from atlas.bench.kernel_profile import run_profiled, summarize

    prompts = [{"prompt_token_ids": p} for p in random_prompts(shape.vocab, b, args.input_len, seed=next(seeds))]
    before = llm.engine.stats.num_steps
    events, wall, table = run_profiled(
        lambda: llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)), device)
    steps = max(1, llm.engine.stats.num_steps - before)
    return summarize(events, steps, shape.layers, wall / steps, device), table


# ---------------------------------------------------------------------------------------- command
def cmd_latency(args: argparse.Namespace) -> int:
    import torch

    from atlas import LLM

    if args.output_len < 2:
        raise SystemExit("--output-len must be at least 2: the first token is the TTFT, the rest are decode steps")
    device = bench_device(args)
    path = checkpoint_path(args.model, args.revision, args.load_format,
                           HubAccess(args.download_dir, args.hf_token))
    cfg = ModelConfig.from_path(path, args.hf_overrides).raw  # (the config the engine runs)
    shape = ModelShape.from_config(cfg, path)
    dtype = expected_dtype(args, cfg, device)
    seeds = itertools.count(args.seed * 1_000_003)
    logger.info("latency: %s on %s, batch sizes %s, %d in / %d out", path, device, args.batch_size, args.input_len,
                args.output_len)
    bandwidth = copy_bandwidth(device)
    peak = device_peak_flops(device)
    free_device_memory()
    if bandwidth:
        logger.info("copy bandwidth %.0f GB/s, bf16 matmul peak %.0f TFLOP/s", bandwidth / 1e9, (peak or 0) / 1e12)

    profiles: dict[int, dict[str, Any]] = {}
    peer_results: dict[str, dict[int, dict]] = {}
    errors: dict[str, str] = {}
    peer_note = unsupported_reason(cfg) if args.peer == "pytorch" else None
    if args.peer == "pytorch" and args.load_format == "dummy":
        peer_note = "--load-format dummy: the plain-PyTorch peer reads the checkpoint's weights, which this run has none of"
    if args.peer == "pytorch" and args.hf_overrides:
        peer_note = "--hf-overrides: the plain-PyTorch peer runs the checkpoint's own config.json, not the changed one"
    if peer_note:
        logger.warning("no peer: %s", peer_note)
    if args.peer == "pytorch" and not peer_note:
        for compiled in (False, True) if args.peer_compile else (False,):
            name = "pytorch-compile" if compiled else "pytorch"
            try:
                peer_results[name] = run_peer(path, device, dtype, compiled, args, shape, seeds, profiles)
            except ValueError as exc:  # a checkpoint the plain peer does not run (e.g. scaled RoPE)
                logger.warning("no peer: %s", exc)
                errors[name] = str(exc)
                break
            except Exception as exc:  # a failed peer must not cost the Atlas figures
                logger.exception("peer %s failed", name)
                errors[name] = f"{type(exc).__name__}: {exc}"
    free_device_memory()
    if device.type == "cuda" and torch.cuda.memory_allocated() > 1 << 30:
        logger.warning("%.1f GiB still allocated after the peer", torch.cuda.memory_allocated() / 2**30)

    elt = torch.empty((), dtype=dtype).element_size()  # until Atlas's own weights are counted
    params = shape.non_embedding_params + shape.embedding_params * (1 if shape.tied else 2)
    sizes = {"weight_bytes": params * elt, "weight_read_bytes_per_step": round(shape.weight_read_params(1) * elt),
             "dtype_bytes": elt,
             # (an 8-bit cache reads a byte an element: the floors count the bytes that this run's cache holds)
             "kv_dtype_bytes": 1 if getattr(args, "kv_cache_dtype", "auto") != "auto" else elt}
    atlas_results: dict[int, dict] = {}
    state: dict[str, Any] = {"dtype": None, "plan": None}

    def report(final: bool) -> None:
        rows, runs = build_rows(args, shape, sizes, peak, bandwidth, atlas_results, peer_results)
        meta = {
            "machine": machine(), "model": str(path), "device": str(device), "dtype": state["dtype"],
            "peer_dtype": str(dtype) if peer_results else None, "input_len": args.input_len,
            "output_len": args.output_len, "num_iters": args.num_iters, "num_iters_warmup": args.num_iters_warmup,
            "copy_bandwidth_bytes_per_s": bandwidth, "matmul_peak_flops_per_s": peak,
            "model_shape": shape.to_dict(), **sizes,
            "kv_bytes_per_token": shape.kv_elements_per_token() * sizes["kv_dtype_bytes"],
            "peer_note": peer_note,
            "mean_decode_context": mean_decode_context(args.input_len, args.output_len),
            "kv_pool": plan_dict(state["plan"]), "errors": errors, "complete": final, "command": args.command_line,
        }
        title = (f"latency: {args.input_len} in / {args.output_len} out, greedy, random prompts; "
                 f"median of {args.num_iters}" + ("" if final else " (so far)"))
        write_report(args.output_json, title, rows, meta, extra={"runs": runs})
        if args.profile and profiles:
            write_profiles(Path(args.profile), profiles, args, shape.layers)

    try:
        llm = LLM(**engine_kwargs(args))
    except BaseException:
        report(final=False)  # the peer's figures survive an engine that does not start
        raise
    model = llm.engine.runner.model
    measured = model_bytes(model, shape, args.tensor_parallel_size)
    if args.pipeline_parallel_size > 1:  # (the driver holds its stage; a step reads every stage's weights in turn)
        measured.update(weight_bytes=sizes["weight_bytes"] // args.tensor_parallel_size,
                        weight_read_bytes_per_step=sizes["weight_read_bytes_per_step"] // args.tensor_parallel_size)
    sizes = {**measured, "kv_dtype_bytes": llm.engine.runner.kv_dtype.itemsize}
    state["dtype"] = str(next(model.parameters()).dtype)
    if state["dtype"] != str(dtype) and peer_results:
        logger.warning("the peer ran in %s but Atlas runs in %s", dtype, state["dtype"])
    state["plan"] = plan = getattr(llm.engine, "plan", None)
    for b in args.batch_size:
        if b > args.max_num_seqs:
            logger.warning("batch %d > --max-num-seqs %d: the batch runs in several waves", b, args.max_num_seqs)
        capacity = getattr(plan, "token_capacity", None)
        if capacity is not None and capacity < b * (args.input_len + args.output_len):
            logger.warning("batch %d needs %d KV tokens but the pool holds %d: expect preemption", b,
                           b * (args.input_len + args.output_len), capacity)
    for b in args.batch_size:
        atlas_results[b] = r = run_atlas(llm, b, args, shape, seeds, device)
        logger.info("atlas batch %d: TTFT %.2f ms, %.3f ms/step", b, 1000 * r["ttft"], 1000 * r["step"])
        if args.profile:
            try:
                profiles.setdefault(b, {})["atlas"] = profile_atlas(llm, b, args, shape, seeds, device, r["step"])
                profiles[b]["atlas-prefill"] = profile_prefill(llm, b, args, shape, seeds, device)
            except Exception as exc:
                logger.exception("profile of atlas at batch %d failed", b)
                errors[f"profile atlas batch {b}"] = f"{type(exc).__name__}: {exc}"
        if b != args.batch_size[-1]:
            report(final=False)  # what is measured survives a later failure or a time limit
    del llm, model
    free_device_memory()
    report(final=True)
    return 0


def build_rows(args: argparse.Namespace, shape: ModelShape, sizes: dict[str, Any], peak: float | None,
               bandwidth: float | None, atlas_results: dict[int, dict], peer_results: dict[str, dict[int, dict]]
               ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """One row per engine and batch size (the text table), and the detail of each run."""
    ctx = mean_decode_context(args.input_len, args.output_len)
    # Floors of one rank of each stage (pipeline stages run a step one after the other, as one device would):
    # under tensor parallelism its share of the weights, of the FLOPs and of a GQA cache (KV heads split over
    # the ranks, or one each when there are fewer; MLA's latent cache is whole on every rank).
    tp = max(1, args.tensor_parallel_size)
    kv_share = 1.0 if shape.attention == "mla" else max(1, shape.kv_heads // tp) / shape.kv_heads
    kv_bytes_token = shape.kv_elements_per_token() * sizes["kv_dtype_bytes"] * kv_share
    # (a hybrid model's recurrent state, its heads split over the ranks like attention heads)
    state_bytes = shape.recurrent_state_bytes(sizes["dtype_bytes"]) / tp
    peak = peak * tp if peak else peak

    def weights_read(tokens: int) -> float:
        # The batch-1 figure holds one token's top-k routed experts; more tokens reach more of them
        # (ModelShape.experts_read). Dense models read every weight whatever the batch.
        more = shape.experts_read(tokens) - shape.experts_read(1)
        expert = sizes.get("expert_bytes", shape.expert_params * sizes["dtype_bytes"] / tp)
        return sizes["weight_read_bytes_per_step"] + shape.moe_layers * more * expert

    rows, runs = [], []
    for results in [atlas_results, *peer_results.values()]:
        for b, r in results.items():
            f = {"decode": floor_seconds(decode_step_flops(shape, b, ctx), decode_step_bytes(
                     weights_read(b), shape, sizes["kv_dtype_bytes"] * kv_share, b, ctx, state_bytes), peak,
                     bandwidth),
                 "ttft": floor_seconds(prefill_flops(shape, b, args.input_len), weights_read(b * args.input_len)
                                       + b * (args.input_len * kv_bytes_token + 2 * state_bytes), peak, bandwidth)}
            peer = peer_results.get("pytorch", {}).get(b)
            rows.append({
                "engine": r["engine"], "batch_size": b,
                "ttft_ms": 1000 * r["ttft"],
                "ttft_floor_ms": _ms(f["ttft"]["floor_s"]),
                "ttft_roofline_fraction": _ratio(f["ttft"]["floor_s"], r["ttft"]),
                "ms_per_step": 1000 * r["step"],
                "decode_floor_ms": _ms(f["decode"]["floor_s"]),
                "decode_roofline_fraction": _ratio(f["decode"]["floor_s"], r["step"]),
                "decode_tok_per_s": b / r["step"],
                "output_tok_per_s": b * args.output_len / r["total"],
                "latency_s": r["total"],
                "decode_x_peer": _ratio(peer["step"], r["step"]) if peer else None,
                "ttft_x_peer": _ratio(peer["ttft"], r["ttft"]) if peer else None,
            })
            runs.append({"engine": r["engine"], "batch_size": b, "avg_latency": statistics.mean(r["latencies"]),
                         "latencies": r["latencies"], "percentiles": percentiles(r["latencies"]),
                         "ttft_s": r["ttft_s"], "decode_step_s": r["step"], "engine_steps": r.get("engine_steps"),
                         "floors": f})
    return rows, runs


def plan_dict(plan) -> dict[str, Any] | None:
    """The KV pool of the engine's memory plan (atlas/runtime/memory.py MemoryPlan), as plain numbers."""
    if plan is None:
        return None
    out = {}
    for key in ("device", "num_pages", "block_size", "page_bytes", "kv_bytes", "token_capacity", "source",
                "breakdown"):
        value = getattr(plan, key, None)
        if value is not None:
            out[key] = dict(value) if isinstance(value, dict) else value
    return out


def write_profiles(root: Path, profiles: dict[int, dict[str, Any]], args: argparse.Namespace, layers: int) -> None:
    root.mkdir(parents=True, exist_ok=True)
    text = []
    for b, engines in profiles.items():
        stem = f"latency_b{b}_in{args.input_len}"
        summary = {name: s for name, (s, _) in engines.items()}
        (root / f"{stem}.json").write_text(json.dumps(
            {"batch_size": b, "input_len": args.input_len, "num_hidden_layers": layers, **summary}, indent=2))
        for name, (s, table) in engines.items():
            (root / f"{stem}_{name}_table.txt").write_text(table)
            text.append(format_summary(f"batch {b}, {args.input_len} in: {name}", s))
    (root / f"latency_in{args.input_len}_summary.txt").write_text("\n\n".join(text) + "\n")
    print("\n\n".join(text))
    logger.info("profiles written to %s", root)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else 1000 * seconds


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if not a or not b else a / b
