"""The memory plan: count every buffer first, then give what is left to KV pages.

On CUDA: budget = total memory x --gpu-memory-utilization; from it come the weights, the activation
peak of the largest step (measured by a profiling forward), memory outside PyTorch's allocator, and
any extra buffers (e.g. a drafter's); the rest becomes KV pages. --kv-cache-memory gives the KV size instead
(on CPU its default is 1 GiB). Either way, a plan that cannot hold one full-length sequence is an error that
names the fix.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from atlas.errors import OutOfMemoryPlanError

logger = logging.getLogger(__name__)

GiB = 1 << 30


def fmt_bytes(n: float) -> str:
    if n >= GiB / 10:
        return f"{n / GiB:.2f} GiB"
    return f"{n / (1 << 20):.1f} MiB" if n >= 1 << 20 else f"{n / 1024:.1f} KiB"


@dataclass
class MemoryPlan:
    device: str
    page_bytes: int  # all layers, K and V, one page
    block_size: int
    num_pages: int
    source: str  # how the KV size was chosen, in words
    breakdown: dict[str, int] = field(default_factory=dict)  # named byte counts that went into it
    # KV cache groups (engine/kv_groups.py): the windowed layers' own pool (page_bytes and num_pages are then the
    # global layers' pool's); 0 without.
    window_pages: int = 0
    window_page_bytes: int = 0

    @property
    def kv_bytes(self) -> int:
        return self.page_bytes * self.num_pages + self.window_page_bytes * self.window_pages

    @property
    def token_capacity(self) -> int:
        return self.num_pages * self.block_size

    def describe(self) -> str:
        parts = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in self.breakdown.items())
        window = ""
        if self.window_pages:
            window = (f"; the windowed layers' own pool {self.window_pages:,} pages "
                      f"({fmt_bytes(self.window_page_bytes * self.window_pages)}, {fmt_bytes(self.window_page_bytes)} "
                      "per page)")
        return (f"KV cache: {self.token_capacity:,} tokens in {self.num_pages:,} pages of {self.block_size} "
                f"({fmt_bytes(self.kv_bytes)}, {fmt_bytes(self.page_bytes)} per page{window}) on {self.device}, "
                f"{self.source}" + (f" [{parts}]" if parts else ""))


@dataclass(frozen=True)
class WindowPoolShape:
    """How a window group's pool grows with the sequences it serves: each running sequence holds at most
    per_seq_pages of it (its window and a step's rows past it), and the steps' tokens beyond that at most
    step_pages. The memory plan sizes the pool from it (runtime/memory.split_kv_groups)."""

    window: int
    per_seq_pages: int
    step_pages: int

    def pages(self, num_seqs: int) -> int:
        return num_seqs * self.per_seq_pages + self.step_pages


def window_pool_shape(window: int, block_size: int, step_tokens: int, lookahead: int = 0,
                      steps_in_flight: int = 1) -> WindowPoolShape:
    """A sequence scheduled for n tokens at position c holds its window-group pages from the one of position
    c - W + 1 to the one of c + n - 1 (KVCacheManager.release_out_of_window): at most ceil((W - 1) / block) + 2
    pages and those of its n tokens, with `lookahead` more positions for a drafter. The n of the steps scheduled and
    not yet read back (steps_in_flight, and the one being scheduled) sum to step_tokens each (the token budget, or
    --max-model-len where that is less: one sequence's step then always fits)."""
    per_seq = -(-(window - 1) // block_size) + 2 + -(-lookahead // block_size)
    return WindowPoolShape(window, per_seq, (steps_in_flight + 1) * -(-step_tokens // block_size))


def split_kv_groups(kv_bytes: int, page_bytes: int, window_page_bytes: int, shape: WindowPoolShape,
                    seq_pages: int, max_num_seqs: int) -> tuple[int, int]:
    """(full-group pages, window-group pages) out of kv_bytes of KV (KV cache groups: engine/kv_groups.py). The
    window pool holds the windows of as many sequences of seq_pages full-group pages (a --max-model-len sequence)
    as the bytes hold side by side, at most max_num_seqs, and the steps' tokens; the full pool takes the rest.
    Shorter sequences may then run short of window pages before the full pool runs out (the scheduler waits or
    preempts as for the full pool); never of full pages before --max-model-len sequences would."""
    per_seq = seq_pages * page_bytes + shape.per_seq_pages * window_page_bytes
    seqs = min(max_num_seqs, max(1, (kv_bytes - shape.step_pages * window_page_bytes) // per_seq))
    window_pages = shape.pages(seqs)
    return max(0, (kv_bytes - window_pages * window_page_bytes) // page_bytes), window_pages


def check_fits(plan: MemoryPlan, max_model_len: int, on_cuda: bool) -> None:
    if plan.num_pages < 1 or plan.token_capacity < max_model_len:
        more = "raise --gpu-memory-utilization" if on_cuda else "raise --kv-cache-memory"
        raise OutOfMemoryPlanError(
            f"the KV cache holds {plan.token_capacity} tokens, fewer than one sequence of --max-model-len "
            f"{max_model_len}: lower --max-model-len, or {more}. ({plan.describe()})")


def plan_fixed(device: str, page_bytes: int, block_size: int, num_pages: int) -> MemoryPlan:
    return MemoryPlan(device, page_bytes, block_size, num_pages, source="--num-gpu-blocks-override")


def plan_cpu(page_bytes: int, block_size: int, kv_bytes: int | None, useful_pages: int,
             default_bytes: int, state_bytes: int = 0, snapshot_bytes: int = 0) -> MemoryPlan:
    """`useful_pages` = pages that max-num-seqs full-length sequences could ever use; more is waste.
    `state_bytes`: the recurrent-state slots of a hybrid model's max-num-seqs sequences, and `snapshot_bytes` its
    state snapshots for prefix caching, taken from the same budget first (check_state_fits)."""
    budget = default_bytes if kv_bytes is None else kv_bytes
    flag = "the CPU default KV budget" if kv_bytes is None else "--kv-cache-memory"
    check_state_fits(state_bytes, budget, flag, "raise --kv-cache-memory", snapshot_bytes)
    state_bytes += snapshot_bytes
    if not page_bytes:  # (a pipeline stage of linear-attention layers only: its pages cost nothing here)
        pages = useful_pages
        source = f"{flag} {fmt_bytes(budget)}, no paged layers on this rank"
    elif kv_bytes is None:
        pages = min((default_bytes - state_bytes) // page_bytes, useful_pages)
        source = f"the CPU default of {fmt_bytes(default_bytes)}"
        if pages == useful_pages:
            source += ", cut to what --max-num-seqs full-length sequences can use"
        source += " (--kv-cache-memory sets it)"
    else:
        pages = (kv_bytes - state_bytes) // page_bytes
        source = f"--kv-cache-memory {fmt_bytes(kv_bytes)}"
    breakdown = {"recurrent state": state_bytes - snapshot_bytes} if state_bytes else {}
    if snapshot_bytes:
        breakdown["recurrent-state snapshots"] = snapshot_bytes
    return MemoryPlan("cpu", page_bytes, block_size, pages, source=source, breakdown=breakdown)


def check_state_fits(state_bytes: int, budget: int, what: str, more: str, snapshot_bytes: int = 0) -> None:
    """The recurrent state of --max-num-seqs sequences (a hybrid model's), and its snapshots for prefix caching, are
    counted before any KV page: a clear error when they alone do not fit the budget."""
    if state_bytes and state_bytes + snapshot_bytes >= budget:
        if snapshot_bytes:
            raise OutOfMemoryPlanError(
                f"the recurrent state of --max-num-seqs sequences (linear-attention layers, "
                f"{fmt_bytes(state_bytes)}) and its {fmt_bytes(snapshot_bytes)} of snapshots for prefix caching "
                f"(--state-snapshots) leave nothing of {what} ({fmt_bytes(budget)}) for KV pages: lower "
                f"--state-snapshots (0: no prefix caching for this model) or --max-num-seqs, or {more}")
        raise OutOfMemoryPlanError(
            f"the recurrent state of --max-num-seqs sequences (linear-attention layers) takes "
            f"{fmt_bytes(state_bytes)}, leaving nothing of {what} ({fmt_bytes(budget)}) for KV pages: lower "
            f"--max-num-seqs, or {more}")


def _torch_said(exc: BaseException) -> str:
    """torch's out-of-memory message cut to its first two sentences: what it tried to allocate (the rest, its
    breakdown of the device and its allocator's advice, is about torch, not the flags that fix the start)."""
    return ". ".join(str(exc).split(". ")[:2])


def profiling_ran_out(exc: BaseException, num_tokens: int, max_num_seqs: int, weights: int,
                      free_at_start: int) -> OutOfMemoryPlanError:
    """The error for a device that ran out of memory in the profiling forward (the largest step, before any KV page
    is planned): what the step was, what the weights took of what was free, and the flags that make it smaller."""
    return OutOfMemoryPlanError(
        f"the GPU ran out of memory profiling the largest step ({num_tokens:,} tokens, {max_num_seqs} sequences) "
        f"after the weights took {fmt_bytes(weights)} of the {fmt_bytes(free_at_start)} free at start "
        f"({_torch_said(exc)}): lower --max-num-batched-tokens or --max-num-seqs, use a smaller model, or free the "
        "GPU (another process or engine may hold it)")


def weights_ran_out(exc: BaseException, device: str, free_at_start: int, total: int,
                    quantizing: bool = False) -> OutOfMemoryPlanError:
    """The error for a device that ran out of memory building or loading the model's weights (before any plan): what
    was free, and the ways to a smaller share of weights on this device. `quantizing` (--quantization fp8): the
    plain weights load whole before they are quantized, so that flag is no way out."""
    fp8 = ("serve an FP8 checkpoint (--quantization fp8 loads the plain weights whole first)" if quantizing else
           "serve an FP8 checkpoint or pass --quantization fp8 (half the bytes of bf16)")
    return OutOfMemoryPlanError(
        f"the model's weights do not fit {device}: it ran out of memory loading them with {fmt_bytes(free_at_start)} "
        f"of {fmt_bytes(total)} free at start ({_torch_said(exc)}). Spread the model over more GPUs "
        f"(--tensor-parallel-size or --pipeline-parallel-size), {fp8}, use a smaller model, or free the GPU (another "
        "process or engine may hold it)")


def plan_cuda(page_bytes: int, block_size: int, total: int, free_at_start: int, utilization: float,
              weights: int, activation_peak: int, non_torch: int, extra: dict[str, int] | None = None,
              useful_pages: int = 0) -> MemoryPlan:
    """`useful_pages`: the pages of a rank whose layers keep no paged cache (page_bytes 0; a pipeline stage of
    linear-attention layers only), which the other ranks' plans then bound."""
    budget = int(total * utilization)
    if free_at_start < budget:
        raise OutOfMemoryPlanError(
            f"only {fmt_bytes(free_at_start)} of the GPU's {fmt_bytes(total)} were free at start, less than "
            f"--gpu-memory-utilization {utilization} asks for ({fmt_bytes(budget)}): lower "
            "--gpu-memory-utilization or free the GPU")
    breakdown = {"budget": budget, "weights": weights, "activation peak": activation_peak,
                 "outside torch": non_torch, **(extra or {})}
    state = (extra or {}).get("recurrent state", 0)
    check_state_fits(state, budget - weights - activation_peak - non_torch, "the budget after weights and "
                     "activations", "raise --gpu-memory-utilization", (extra or {}).get("recurrent-state snapshots", 0))
    kv = budget - weights - activation_peak - non_torch - sum((extra or {}).values())
    if kv <= 0:
        raise OutOfMemoryPlanError(
            f"no memory is left for the KV cache: weights {fmt_bytes(weights)} + activations "
            f"{fmt_bytes(activation_peak)} + {fmt_bytes(non_torch)} outside PyTorch (CUDA context, libraries; "
            f"other processes' growth since start) + {fmt_bytes(sum((extra or {}).values()))} of other buffers "
            f"already use the budget of {fmt_bytes(budget)}. Raise "
            "--gpu-memory-utilization, lower --max-num-batched-tokens / --max-num-seqs, or use a smaller model")
    return MemoryPlan("cuda", page_bytes, block_size, kv // page_bytes if page_bytes else useful_pages,
                      source=f"--gpu-memory-utilization {utilization} of {fmt_bytes(total)}", breakdown=breakdown)


def plan_cuda_kv_bytes(page_bytes: int, block_size: int, kv_bytes: int, free_at_start: int, weights: int,
                       activation_peak: int, non_torch: int, extra: dict[str, int] | None = None,
                       useful_pages: int = 0) -> MemoryPlan:
    """--kv-cache-memory on a GPU: the KV cache (with a hybrid model's recurrent state and its snapshots) is that
    size, whatever --gpu-memory-utilization says (vLLM's --kv-cache-memory-bytes); the start refuses when the
    weights, the activation peak, memory outside PyTorch, the other buffers and it do not fit what was free."""
    extra = dict(extra or {})
    state, snapshots = extra.pop("recurrent state", 0), extra.pop("recurrent-state snapshots", 0)
    check_state_fits(state, kv_bytes, "--kv-cache-memory", "raise --kv-cache-memory", snapshots)
    need = weights + activation_peak + non_torch + sum(extra.values()) + kv_bytes
    breakdown = {"budget": need, "weights": weights, "activation peak": activation_peak, "outside torch": non_torch,
                 **extra}
    if state:
        breakdown["recurrent state"] = state
    if snapshots:
        breakdown["recurrent-state snapshots"] = snapshots
    if need > free_at_start:
        raise OutOfMemoryPlanError(
            f"--kv-cache-memory {fmt_bytes(kv_bytes)} does not fit: with weights {fmt_bytes(weights)}, activations "
            f"{fmt_bytes(activation_peak)}, {fmt_bytes(non_torch)} outside PyTorch and "
            f"{fmt_bytes(sum(extra.values()))} of other buffers it needs {fmt_bytes(need)}, and "
            f"{fmt_bytes(free_at_start)} were free at start: lower --kv-cache-memory or free the GPU")
    pages = (kv_bytes - state - snapshots) // page_bytes if page_bytes else useful_pages
    return MemoryPlan("cuda", page_bytes, block_size, pages, source=f"--kv-cache-memory {fmt_bytes(kv_bytes)}",
                      breakdown=breakdown)
