"""Cases of the peer-memory all-reduce (atlas/kernels/peer_all_reduce.py), run by two processes at once.

    python tests/peer_all_reduce_cases.py cpu     (under TRITON_INTERPRET=1: the kernel in Triton's
        interpreter, the two ranks' buffers in shared CPU memory, each process mapping them)
    python tests/peer_all_reduce_cases.py cuda [--bench OUT.json]   (two GPUs: symmetric memory over
        NVLink, NCCL as the oracle, eager and inside a CUDA graph; --bench also times 100 all-reduces of
        one decode row in a graph against NCCL's)

Each rank checks its sums against the oracle (CPU: the two inputs, which every rank can regenerate from
their seeds; CUDA: NCCL's all-reduce of the same tensors) and the fused residual add + RMSNorm against
fused_ops.add_rms_norm of that sum; on CPU it then runs the engine's start-up check
(runtime/parallel_groups.agrees_with_nccl) with gloo as the oracle. The parent checks that both ranks got
bit-identical results. Prints one line per rank and exits non-zero on any failure.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import sys
import time
import traceback

import torch
import torch.multiprocessing as mp

from atlas.kernels.fused_ops import add_rms_norm, add_rms_norm_ref
from atlas.kernels.peer_all_reduce import PeerAllReduce

WORLD = 2
EPS = 1e-6


def _inputs(case: int, rank: int, rows: int, width: int, dtype: torch.dtype, device) -> tuple:
    g = torch.Generator().manual_seed(1000 * case + rank)
    x = torch.randn(rows, width, generator=g).to(dtype)
    g = torch.Generator().manual_seed(1000 * case + 99)  # residual and weight: the same on every rank
    residual = torch.randn(rows, width, generator=g).to(dtype)
    weight = (1 + 0.1 * torch.randn(width, generator=g)).to(dtype)
    return x.to(device), residual.to(device), weight.to(device)


def _cases(max_rows: int, widths: list[int], repeats: int) -> list[tuple[int, int, bool]]:
    """(rows, width, fused) in an order that changes rows and widths between calls, so slots and epoch
    parities are exercised across shapes."""
    out = []
    for i in range(repeats):
        for width in widths:
            for rows in (1, max_rows, 3 if max_rows >= 3 else 1):
                out.append((rows, width, (i + rows) % 2 == 0))
    return out


def _check_pushed(rank: int, ar: PeerAllReduce, device, dtype, rows_list: list[int], width: int
                  ) -> list[torch.Tensor]:
    """A "sum" GEMV that sends its rows to the peers itself (gemv_triton's push), then the all-reduce (every
    other call fused with the norm) that takes them without sending them again: against the sum of every
    rank's GEMV output (each rank recomputes the others' from their seeds)."""
    from atlas.kernels.gemv_triton import gemv_triton

    results = []
    for case, rows in enumerate(rows_list):
        k = 96

        def gemv_input(r, case=case, rows=rows, k=k):
            g = torch.Generator().manual_seed(7000 + 10 * case + r)
            return torch.randn(rows, k, generator=g).to(dtype).to(device)

        g = torch.Generator().manual_seed(7999 + case)
        w = (torch.randn(width, k, generator=g) / k ** 0.5).to(dtype).to(device)
        residual = torch.randn(rows, width, generator=g).to(dtype).to(device)
        norm_w = (1 + 0.1 * torch.randn(width, generator=g)).to(dtype).to(device)
        geometry = dict(block_n=16, block_k=64, num_warps=4, num_stages=2, kind="sum")  # (few interpreted programs)
        partials = [gemv_triton(gemv_input(r), w, None, **geometry) for r in range(WORLD)]
        total = sum(p.float() for p in partials).to(dtype)
        y = gemv_triton(gemv_input(rank), w, None, **geometry, push=ar)
        assert torch.equal(y, partials[rank]), f"pushed case {case}: the GEMV's own output changed"
        results += _reduce_and_check(ar, y, total, residual, norm_w, case % 2 == 1, f"pushed case {case}")
    return results


def _check_rank(rank: int, ar: PeerAllReduce, device, dtype, cases, oracle) -> list[torch.Tensor]:
    results = []
    for case, (rows, width, fused) in enumerate(cases):
        x, residual, weight = _inputs(case, rank, rows, width, dtype, device)
        total = oracle(case, x, rows, width)
        results += _reduce_and_check(ar, x, total, residual, weight, fused, f"case {case}")
    return results


def _reduce_and_check(ar: PeerAllReduce, x, total, residual, weight, fused: bool, label: str
                      ) -> list[torch.Tensor]:
    """ar(x) against `total` (the oracle's sum), or with `fused` the all-reduce + residual add + RMSNorm
    against the reference norm of that sum; -> the outputs."""
    rows, width = x.shape
    if fused:
        got = ar.add_rms_norm(x, residual, weight, EPS)
        assert got is not None, f"{label}: the fused kernel refused {rows}x{width}"
        want = (add_rms_norm if x.device.type == "cuda" else add_rms_norm_ref)(total, residual, weight, EPS)
        assert torch.equal(got[1], want[1]), f"{label}: residual stream differs"
        torch.testing.assert_close(got[0], want[0], rtol=1.6e-2, atol=1e-5)
        return list(got)
    got = ar(x)
    assert torch.equal(got, total), f"{label} ({rows}x{width}): sum differs by " \
                                    f"{(got.float() - total.float()).abs().max().item()}"
    return [got]


# --------------------------------------------------------------------------------------------------
# CPU: the interpreter, shared memory
# --------------------------------------------------------------------------------------------------

CPU_ROWS, CPU_SLOT = 4, 64


class _WholeElements:
    """Triton's interpreter with loads and stores that touch `buffers` (the ranks' shared slots) made element by
    element whole, as the GPU's are. The interpreter copies each element with a memcpy of run-time size, which
    glibc does in pieces for a 2-byte element: a poll racing the peer's store then reads an element that is
    neither EMPTY nor the row's value (a torn bfloat16) and sums it, a failure the GPU cannot have. numpy's
    fancy indexing copies each element with one typed move. Everything else goes to the interpreter's own."""

    def __init__(self, native, buffers) -> None:
        import numpy as np

        self._native = native
        self._spans = [(b.data_ptr(), b.data_ptr() + b.numel() * b.element_size(), b.element_size(),
                        b.view({2: torch.int16, 4: torch.int32}[b.element_size()]).numpy()) for b in buffers]
        self._np = np
        self.whole = 0  # loads and stores of shared slots made here (the harness checks the interpreter used it)

    def __getattr__(self, name: str):
        return getattr(self._native, name)

    def _span(self, ptrs, mask, itemsize: int):
        """(elements, indexes into them) when every address `mask` keeps lies in one shared buffer of this
        element size, else None."""
        kept = ptrs[mask]
        if kept.size == 0:
            return None
        low, high = int(kept.min()), int(kept.max())
        for start, end, size, elements in self._spans:
            if size == itemsize and start <= low and high + size <= end:
                return elements, (kept - start) // size
        return None

    def load(self, ptrs, mask, other, dtype):
        ptrs, mask = ptrs.reshape(-1), mask.reshape(-1).astype(bool)
        found = self._span(ptrs, mask, self._np.dtype(dtype).itemsize)
        if found is None:
            return self._native.load(ptrs.reshape(other.shape), mask.reshape(other.shape), other, dtype)
        elements, index = found
        self.whole += 1
        out = self._np.array(other, dtype=dtype).reshape(-1)
        out.view(elements.dtype)[mask] = elements[index]
        return out.reshape(other.shape)

    def store(self, ptrs, value, mask):
        flat_ptrs, flat_mask = ptrs.reshape(-1), mask.reshape(-1).astype(bool)
        found = self._span(flat_ptrs, flat_mask, value.dtype.itemsize)
        if found is None:
            return self._native.store(ptrs, value, mask)
        elements, index = found
        self.whole += 1
        elements[index] = value.reshape(-1).view(elements.dtype)[flat_mask]
        return None


def _cpu_rank(rank: int, buffers, port: int, queue) -> None:
    try:
        from fused_ops_cases import interpreter_rounds_bf16
        from triton.runtime import interpreter

        assert interpreter_rounds_bf16(), "cannot make the interpreter round bf16 like the GPU"
        whole = interpreter._interpreter = _WholeElements(interpreter._interpreter, buffers)
        dtype = torch.bfloat16
        ar = PeerAllReduce(rank, WORLD, [b.data_ptr() for b in buffers], buffers[rank], dtype, torch.device("cpu"),
                           keep=buffers, max_rows=CPU_ROWS, row_slot=CPU_SLOT)

        def oracle(case, x, rows, width):
            xs = [_inputs(case, r, rows, width, dtype, "cpu")[0] for r in range(WORLD)]
            return sum(v.float() for v in xs).to(dtype)

        cases = _cases(CPU_ROWS, [CPU_SLOT, 40], repeats=2)
        results = _check_rank(rank, ar, torch.device("cpu"), dtype, cases, oracle)
        # Zeros of either sign are summed, never taken for the EMPTY mark (-0.0's bits).
        zeros = torch.zeros(2, CPU_SLOT, dtype=dtype)
        zeros[:, ::2] = -0.0
        zeros[1, -1] = 3.0 if rank == 0 else -1.0
        want = torch.zeros(2, CPU_SLOT, dtype=dtype)
        want[1, -1] = 2.0
        got = ar(zeros)
        assert torch.equal(got, want), "a sum of signed zeros differs"
        results.append(got)
        results += _check_pushed(rank, ar, torch.device("cpu"), dtype, [1, CPU_ROWS, 2, 1], CPU_SLOT)
        # The engine's start-up check (runtime/parallel_groups.agrees_with_nccl), gloo standing in for NCCL.
        import torch.distributed as dist

        from atlas.runtime.parallel_groups import agrees_with_nccl

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
        assert agrees_with_nccl(ar, dist.group.WORLD, torch.device("cpu"), dtype), "start-up check failed"
        dist.destroy_process_group()
        assert whole.whole > 0, "the interpreter never went through _WholeElements: its internals changed"
        queue.put((rank, "ok", _digest(results), int(ar.counters.sum())))
    except BaseException:  # noqa: BLE001 - reported to the parent
        queue.put((rank, traceback.format_exc(), None, None))


def run_cpu() -> int:
    ctx = mp.get_context("spawn")
    buffers = [torch.empty(PeerAllReduce.size(WORLD, CPU_ROWS, CPU_SLOT), dtype=torch.bfloat16).share_memory_()
               for _ in range(WORLD)]
    for b in buffers:
        PeerAllReduce.mark_empty(b)
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_cpu_rank, args=(r, buffers, port, queue)) for r in range(WORLD)]
    for p in procs:
        p.start()
    return _collect(procs, queue, timeout=240)


# --------------------------------------------------------------------------------------------------
# CUDA: two GPUs, NCCL as the oracle
# --------------------------------------------------------------------------------------------------

def _cuda_rank(rank: int, port: int, bench: str | None, queue) -> None:
    import torch.distributed as dist

    try:
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                                device_id=device)
        group = dist.group.WORLD
        results = []
        for dtype in (torch.bfloat16, torch.float32):
            ar = PeerAllReduce.over_group(group, device, dtype)

            def oracle(case, x, rows, width):
                return _nccl_sum(x, group)

            cases = _cases(64, [4096, 5120, 1000], repeats=2)
            results += _check_rank(rank, ar, device, dtype, cases, oracle)
            results += _check_pushed(rank, ar, device, dtype, [1, 16, 3, 1], 4096)
            # Inside a CUDA graph: three all-reduces (one fused) replayed with new inputs.
            x = torch.zeros(2, 4096, dtype=dtype, device=device)
            residual = torch.zeros_like(x)
            weight = torch.ones(4096, dtype=dtype, device=device)
            stream = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                ar(x)  # warm-up (compiles), on both ranks alike
                ar.add_rms_norm(x, residual, weight, EPS)
                ar(x)
            torch.cuda.current_stream(device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                a = ar(x)
                b, c = ar.add_rms_norm(a, residual, weight, EPS)
                d = ar(b)
            for step in range(5):
                xi, ri, wi = _inputs(500 + step, rank, 2, 4096, dtype, device)
                x.copy_(xi)
                residual.copy_(ri)
                weight.copy_(wi)
                graph.replay()
                # (each op sums over the ranks again: b and c from the sum of a, d from the sum of b)
                want_a = _nccl_sum(xi, group)
                want_b, want_c = add_rms_norm(_nccl_sum(want_a, group), ri, wi, EPS)
                want_d = _nccl_sum(want_b, group)
                assert torch.equal(a, want_a) and torch.equal(c, want_c), f"graph replay {step} differs"
                torch.testing.assert_close(b, want_b, rtol=1.6e-2, atol=1e-5)
                torch.testing.assert_close(d, want_d, rtol=3.2e-2, atol=1e-4)
                results += [a.clone(), b.clone(), c.clone(), d.clone()]
        timing = _bench(group, device) if bench else None
        if bench and rank == 0:
            with open(bench, "w") as f:
                json.dump(timing, f, indent=2)
        queue.put((rank, "ok", _digest(results), timing))
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the parent
        queue.put((rank, traceback.format_exc(), None, None))


def _nccl_sum(x: torch.Tensor, group) -> torch.Tensor:
    import torch.distributed as dist

    out = x.clone()
    dist.all_reduce(out, group=group)
    return out


def _bench(group, device) -> dict:
    """Microseconds per all-reduce of [rows, 4096] bf16, 100 in one CUDA graph, peer kernel vs NCCL, and the
    fused norm against NCCL + the separate add_rms_norm kernel."""
    import torch.distributed as dist

    ar = PeerAllReduce.over_group(group, device, torch.bfloat16)
    out = {}
    for rows in (1, 8, 32, 64):
        x = torch.randn(rows, 4096, dtype=torch.bfloat16, device=device)
        residual = torch.randn_like(x)
        weight = torch.ones(4096, dtype=torch.bfloat16, device=device)

        def nccl(v):
            dist.all_reduce(v, group=group)
            return v

        variants = {
            "nccl": lambda x=x: nccl(x.clone()),
            "peer": lambda x=x: ar(x),
            "nccl+add_rms_norm": lambda x=x, r=residual, w=weight: add_rms_norm(nccl(x.clone()), r, w, EPS),
            "peer_fused_norm": lambda x=x, r=residual, w=weight: ar.add_rms_norm(x, r, w, EPS),
        }
        for name, fn in variants.items():
            stream = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                for _ in range(3):
                    fn()
            torch.cuda.current_stream(device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(100):
                    fn()
            graph.replay()
            torch.cuda.synchronize(device)
            dist.barrier(group)
            times = []
            for _ in range(5):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                graph.replay()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) * 1000 / 100)
                dist.barrier(group)
            out[f"{name}_rows{rows}_us"] = round(sorted(times)[len(times) // 2], 2)
    return out


def _digest(results: list[torch.Tensor]) -> tuple[int, str]:
    """(count, hash of the bytes) of a rank's results: tensors themselves cannot outlive the rank's process."""
    h = hashlib.sha256()
    for r in results:
        h.update(r.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return len(results), h.hexdigest()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_cuda(bench: str | None) -> int:
    if torch.cuda.device_count() < WORLD:
        print(f"needs {WORLD} GPUs, found {torch.cuda.device_count()}")
        return 2
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_cuda_rank, args=(r, port, bench, queue)) for r in range(WORLD)]
    for p in procs:
        p.start()
    return _collect(procs, queue, timeout=240)


def _collect(procs, queue, timeout: float) -> int:
    got = {}
    deadline = time.monotonic() + timeout
    while len(got) < len(procs) and time.monotonic() < deadline:
        try:
            rank, status, results, extra = queue.get(timeout=1)
        except Exception:  # noqa: BLE001 - queue.Empty: keep waiting while the ranks run
            if any(p.exitcode not in (None, 0) for p in procs):
                break
            continue
        got[rank] = (status, results, extra)
        if status != "ok":  # the other ranks would wait for it forever
            break
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
    failed = False
    for rank in range(len(procs)):
        status, results, extra = got.get(rank, ("no report (hung or died)", None, None))
        print(f"rank {rank}: {status if status != 'ok' else 'ok'}" + (f" {extra}" if extra is not None else ""))
        failed |= status != "ok"
    if not failed:
        same = got[0][1] == got[1][1]
        print(f"ranks agree bit for bit: {same} ({got[0][1][0]} tensors)")
        failed |= not same
    return 1 if failed else 0


if __name__ == "__main__":
    mode = sys.argv[1] if len(sys.argv) > 1 else "cpu"
    bench_out = sys.argv[sys.argv.index("--bench") + 1] if "--bench" in sys.argv else None
    sys.exit(run_cpu() if mode == "cpu" else run_cuda(bench_out))
