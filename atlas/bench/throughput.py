"""`atlas bench throughput`: every prompt submitted to one `LLM.generate` (vLLM's offline throughput
benchmark and flags). Reports requests/s, output and total tokens/s, the elapsed time, the compute
floor of the whole job at the bf16 matmul peak measured in the same run (CUDA), the peak device memory
during the run and the KV pool of the engine's memory plan.

Datasets: `random` (vLLM's: each request's input and output lengths drawn uniformly from
[len * (1 - r), len * (1 + r)] with r = --random-range-ratio, token ids uniform), or a JSONL / text
file: one prompt per line, either plain text or a JSON object with "prompt" (text) or
"prompt_token_ids", and optionally "output_len" / "max_tokens" (else --output-len). A file with fewer
lines than --num-prompts is cycled.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from atlas.bench.common import engine_kwargs, machine, sync, write_report
from atlas.bench.latency import bench_device, checkpoint_path, free_device_memory, plan_dict
from atlas.bench.roofline import ModelShape, device_peak_flops
from atlas.config import HubAccess, ModelConfig

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class BenchRequest:
    prompt: str | list[int]
    output_len: int

    def as_input(self) -> str | dict:
        return self.prompt if isinstance(self.prompt, str) else {"prompt_token_ids": self.prompt}


def sample_random(num: int, input_len: int, output_len: int, ratio: float, vocab: int, seed: int
                  ) -> list[BenchRequest]:
    import torch
    if not 0 <= ratio < 1:
        raise SystemExit(f"--random-range-ratio must be in [0, 1), got {ratio}")
    g = torch.Generator().manual_seed(seed)

    def lengths(center: int) -> list[int]:
        lo, hi = max(int(center * (1 - ratio)), 1), max(int(center * (1 + ratio)), 1)
        return torch.randint(lo, hi + 1, (num,), generator=g).tolist()

    ins, outs = lengths(input_len), lengths(output_len)
    return [BenchRequest(torch.randint(10, vocab, (n,), generator=g).tolist(), o) for n, o in zip(ins, outs, strict=True)]


def load_file(path: str, num: int, output_len: int) -> list[BenchRequest]:
    lines = [ln for ln in Path(path).read_text().splitlines() if ln.strip()]
    if not lines:
        raise SystemExit(f"--dataset {path} holds no prompts")
    requests = []
    for ln in lines:
        record: Any = json.loads(ln) if ln.lstrip().startswith("{") else {"prompt": ln}
        prompt = record.get("prompt_token_ids", record.get("prompt"))
        if prompt is None:
            raise SystemExit(f"--dataset {path}: a line has neither 'prompt' nor 'prompt_token_ids': {ln[:80]}")
        requests.append(BenchRequest(prompt, int(record.get("output_len", record.get("max_tokens", output_len)))))
    if len(requests) < num:
        logger.info("--dataset %s has %d prompts: cycling them to %d", path, len(requests), num)
    return [requests[i % len(requests)] for i in range(num)]


class StepTimeline:
    """What each step of the timed run held and what it cost: wraps the runner's `launch` and, on CUDA, records
    an event on the stream right after each step is queued, so the device time from one step's end to the next
    one's is that step's (idle gaps included); on CPU the host time between launches stands in. Summed by kind,
    it splits the run into steps that carry prompt tokens and pure decode steps."""

    def __init__(self, runner, device: torch.device) -> None:
        self.runner, self.launch, self.cuda = runner, runner.launch, device.type == "cuda"
        self.rows: list[tuple[int, int]] = []  # (prompt tokens, decode rows)
        self.marks: list = []  # CUDA events or perf_counter times: the start, then each step's end
        self.marks.append(self._mark())
        runner.launch = self._launch

    def _mark(self):
        import torch
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _launch(self, batch):
        prompt = decode = 0
        for n, drafts in zip(batch.num_scheduled, batch.num_drafts or [0] * len(batch.num_scheduled), strict=True):
            if n == drafts + 1:
                decode += 1
            else:
                prompt += n
        self.rows.append((prompt, decode))
        handle = self.launch(batch)
        self.marks.append(self._mark())
        return handle

    def close(self) -> dict:
        import torch
        self.runner.launch = self.launch
        if self.cuda:
            torch.cuda.synchronize()
            seconds = [a.elapsed_time(b) / 1e3 for a, b in zip(self.marks, self.marks[1:], strict=False)]
        else:
            seconds = [b - a for a, b in zip(self.marks, self.marks[1:], strict=False)]
        prefill = {"steps": 0, "seconds": 0.0, "prompt_tokens": 0, "decode_rows": 0}
        decode: dict[int, list[float]] = {}
        each: list[list[float]] = []  # [prompt tokens, decode rows, ms] of every step with prompt tokens
        for (prompt, rows), s in zip(self.rows, seconds, strict=True):
            if prompt:
                each.append([prompt, rows, round(1e3 * s, 3)])
                prefill["steps"] += 1
                prefill["seconds"] += s
                prefill["prompt_tokens"] += prompt
                prefill["decode_rows"] += rows
            else:
                decode.setdefault(rows, []).append(s)
        decode_seconds = sum(sum(v) for v in decode.values())
        prefill["prompt_tok_per_s"] = prefill["prompt_tokens"] / prefill["seconds"] if prefill["seconds"] else None
        prefill["each_step"] = each
        by_rows = [{"rows": rows, "steps": len(v), "seconds": sum(v), "median_step_ms": 1e3 * sorted(v)[len(v) // 2]}
                   for rows, v in sorted(decode.items(), key=lambda kv: -sum(kv[1]))[:8]]
        return {"clock": "CUDA events after each step" if self.cuda else "host time between launches",
                "steps_with_prompt_tokens": prefill,
                "decode_steps": {"steps": sum(len(v) for v in decode.values()), "seconds": decode_seconds,
                                 "tokens": sum(r * len(v) for r, v in decode.items()), "by_rows_top8": by_rows}}


class HostPauses:
    """Python garbage collections during the timed run (gc.callbacks): how many by generation, their total and
    longest time; with the CUDA caching allocator's counters (device allocations, frees, retries after a failed
    allocation, which synchronize the device) over the same run. A long step in the timeline is either."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.by_gen: dict[int, list[float]] = {}
        self._t0 = 0.0
        self.allocator0 = self._allocator()
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.by_gen.setdefault(info["generation"], []).append(time.perf_counter() - self._t0)

    def _allocator(self) -> dict[str, int]:
        import torch
        if not self.cuda:
            return {}
        stats = torch.cuda.memory_stats()
        return {k: stats.get(k, 0) for k in ("num_device_alloc", "num_device_free", "num_alloc_retries",
                                              "num_sync_all_streams")}

    def close(self) -> dict:
        gc.callbacks.remove(self._callback)
        after = self._allocator()
        return {"gc": {str(g): {"count": len(v), "total_ms": 1e3 * sum(v), "max_ms": 1e3 * max(v)}
                       for g, v in sorted(self.by_gen.items())},
                "cuda_allocator": {k: after[k] - self.allocator0[k] for k in after}}


def job_flops(shape: ModelShape, prompt_lens: list[int], output_lens: list[int]) -> float:
    """Every prompt token and every generated token but the last through the layers; the LM head once per
    generated token; attention over the causal context of each."""
    attn = shape.attention_flops(1)
    total = 0.0
    for p, o in zip(prompt_lens, output_lens, strict=True):
        tokens = p + max(o - 1, 0)
        total += 2.0 * shape.active_non_embedding_params * tokens + 2.0 * shape.embedding_params * o
        total += attn * tokens * (tokens + 1) / 2
    return total


def cmd_throughput(args: argparse.Namespace) -> int:
    import torch

    from atlas import LLM, SamplingParams

    path = checkpoint_path(args.model, args.revision, args.load_format,
                           HubAccess(args.download_dir, args.hf_token))
    shape = ModelShape.from_config(ModelConfig.from_path(path, args.hf_overrides).raw, path)
    if args.dataset == "random":
        requests = sample_random(args.num_prompts, args.input_len, args.output_len, args.random_range_ratio,
                                 shape.vocab, args.seed)
    else:
        requests = load_file(args.dataset, args.num_prompts, args.output_len)
    peak = device_peak_flops(bench_device(args))  # before the engine takes its share of the memory
    free_device_memory()
    llm = LLM(**engine_kwargs(args))
    device = next(llm.engine.runner.model.parameters()).device

    def params(n: int) -> SamplingParams:
        return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)

    if args.num_prompts_warmup:  # kernel compilation and first-use costs stay out of the timing
        warm = requests[: args.num_prompts_warmup]
        llm.generate([r.as_input() for r in warm], [params(min(r.output_len, 16)) for r in warm])
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    steps_before = llm.engine.stats.num_steps
    logger.info("throughput: %d requests", len(requests))
    sync(device)
    timeline = StepTimeline(llm.engine.runner, device) if args.step_timeline else None
    pauses = HostPauses(device)
    t0 = time.perf_counter()
    try:
        outputs = llm.generate([r.as_input() for r in requests], [params(r.output_len) for r in requests],
                               use_tqdm=True)
        sync(device)
        elapsed = time.perf_counter() - t0
    finally:  # (the runner's launch and the gc callbacks restored however the run ends)
        host_pauses = pauses.close()
        steps = timeline.close() if timeline is not None else None
    prompt_lens = [len(o.prompt_token_ids) for o in outputs]
    output_lens = [len(o.outputs[0].token_ids) for o in outputs]
    prompt_tokens, output_tokens = sum(prompt_lens), sum(output_lens)
    memory = None
    if device.type == "cuda":
        memory = {"max_memory_allocated_bytes": torch.cuda.max_memory_allocated(),
                  "max_memory_reserved_bytes": torch.cuda.max_memory_reserved(),
                  "total_memory_bytes": torch.cuda.get_device_properties(device).total_memory}
    flops = job_flops(shape, prompt_lens, output_lens)
    # (Every GPU of a parallel engine shares the job: tensor-parallel ranks split each matmul, pipeline stages
    #  work on different micro-batches at once.)
    gpus = args.tensor_parallel_size * args.pipeline_parallel_size
    floor = flops / (peak * gpus) if peak else None
    row = {
        "num_prompts": len(requests),
        "requests_per_s": len(requests) / elapsed,
        "output_tok_per_s": output_tokens / elapsed,
        "total_tok_per_s": (prompt_tokens + output_tokens) / elapsed,
        "elapsed_s": elapsed,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "compute_floor_s": floor,
        "roofline_fraction": floor / elapsed if floor else None,
        "peak_allocated_gib": memory["max_memory_allocated_bytes"] / 2**30 if memory else None,
        "kv_pool_tokens": getattr(getattr(llm.engine, "plan", None), "token_capacity", None),
    }
    stats = llm.engine.stats
    meta = {
        "machine": machine(), "model": str(path), "device": str(device),
        "dtype": str(next(llm.engine.runner.model.parameters()).dtype), "dataset": args.dataset,
        "input_len": args.input_len, "output_len": args.output_len, "random_range_ratio": args.random_range_ratio,
        "num_prompts_warmup": args.num_prompts_warmup, "matmul_peak_flops_per_s": peak, "job_flops": flops,
        "model_shape": shape.to_dict(), "command": args.command_line,
    }
    extra = {
        # vLLM's throughput JSON keys
        "elapsed_time": elapsed, "num_requests": len(requests), "total_num_tokens": prompt_tokens + output_tokens,
        "requests_per_second": len(requests) / elapsed, "tokens_per_second": (prompt_tokens + output_tokens) / elapsed,
        "output_tokens_per_second": output_tokens / elapsed,
        "memory": memory, "kv_pool": plan_dict(getattr(llm.engine, "plan", None)),
        "engine_steps": stats.num_steps - steps_before,
        "step_timeline": steps,
        "host_pauses": host_pauses,
        "engine_stats": dataclasses.asdict(stats) if dataclasses.is_dataclass(stats) else vars(stats),
    }
    title = (f"throughput: {len(requests)} requests, {args.dataset} dataset, {prompt_tokens / len(requests):.0f} in / "
             f"{output_tokens / len(requests):.0f} out on average, greedy")
    write_report(args.output_json, title, [row], meta, extra=extra)
    print("host pauses:", json.dumps(host_pauses))
    if steps is not None:
        print("step timeline:", json.dumps(steps, indent=1))
    return 0
