"""Tensor and pipeline parallelism over torch.distributed: NCCL between GPUs, gloo on CPU and for the
host-side messages.

Layout. world = tp x pp ranks, rank = stage * tp + tp rank: the ranks of a stage are consecutive, so a
stage sits on one node when tp is at most the GPUs per node. Rank 0 (stage 0, tp rank 0) is the
driver: the scheduler, the tokenizer, the sampler, the API and any drafter live there. Every other rank is a worker
that builds the same engine (only its own shards and layers: layers/parallel.py) and runs the steps
the driver sends it; page ids are the driver's, so they agree everywhere, and the KV pool is the
smallest any rank's memory plan allows.

A step. The driver broadcasts the step's host-side description on a gloo group: the StepBatch numbers,
the token ids to compute, the page-table changes (appended pages; a table that changed otherwise is sent
whole) and the rows whose prompt logprobs are wanted. Every rank prepares the same input tensors and
runs its part of the forward; tensor-parallel ranks all-reduce twice a layer and all-gather the
vocabulary-sharded logits. Sampling happens once, on the driver. Under asynchronous scheduling the next
step's decodes read their input token on the device: the driver broadcasts its sampled ids to its
tensor-parallel peers (one small collective on the device stream, no host sync), who keep them exactly
as it does.

Pipeline stages. Stage s sends [x | residual] after its last layer to stage s + 1 (point to point, same
tp rank); the last stage sends the final-normed rows that need logits back to the first stage, which
holds the LM head (the embedding's own weight in tied models) and so samples next to the scheduler.
Each stage works through the steps in order; requests whose token is still in flight are not scheduled
(their next input is not known yet), so successive steps carry disjoint requests and up to pp of them
are in flight at once, one per stage.

Launch. On one node, the engine starts its workers itself (torch.multiprocessing: they fork from a
forkserver, a fresh interpreter that has imported the engine and never touches CUDA; a free port);
across nodes, each node runs the same command with --nnodes / --node-rank / --master-addr /
--master-port and starts its own ranks; under torchrun (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and
MASTER_PORT set) each process is one rank. The worker processes are started and run by `engine/workers.py` (`start` on the
driver; `run_node` in a process that is not the driver).

Failure: parallel_health.py (heartbeats, the driver's watchdog). Spawned workers ignore Ctrl-C and follow the
driver (which stops them) or exit when it is gone.

Files: this one is the glue the runner and the engine use (ParallelState: a step's numbering and sending, the
worker loop, the layers' view); parallel_protocol.py the messages, parallel_groups.py the placement, process
groups and transfers, parallel_health.py failure detection.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import logging
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from atlas.config import ALL_REDUCE_KINDS, EngineConfig
from atlas.errors import WorkerError
from atlas.layers.parallel import ModelParallel
from atlas.runtime.batch import StepBatch
from atlas.runtime.parallel_groups import Placement, ProcessGroups, SymmMemAllReduce, agrees_with_nccl
from atlas.runtime.parallel_health import FailureWatch
from atlas.runtime.parallel_protocol import (
    FINISH,
    HOST_REPORT,
    LORA_LOAD,
    STOP,
    StepInfo,
    decode_step,
    encode_step,
)

logger = logging.getLogger(__name__)

WORKER_STEPS_KEPT = 4096  # a worker keeps the host times of its last steps for a HOST_REPORT


class ParallelState:
    """This process's place in a parallel engine: its rank, the process groups (ProcessGroups), the steps
    between driver and workers, and failure detection (FailureWatch)."""

    def __init__(self, config: EngineConfig, place: Placement, children: list | None = None,
                 parent_pid: int | None = None):
        self.config = config
        self.tp, self.pp = config.tensor_parallel_size, config.pipeline_parallel_size
        self.rank, self.world_size = place.rank, place.world_size
        self.tp_rank, self.pp_rank = self.rank % self.tp, self.rank // self.tp
        self.local_rank, self.ranks_per_node = place.local_rank, place.ranks_per_node
        self.is_driver = self.rank == 0
        self.children: list = list(children or [])  # (rank, multiprocessing.Process) started here
        self.before_leaving: list[Callable[[], None]] = []  # run before the process groups are left
        self.current_step: StepInfo | None = None  # (a worker: the step being run)
        self._number = 0
        self._deferred: dict[int, Callable[[], object]] = {}
        self._closed = False
        self.groups = ProcessGroups(config, place, self.children)
        self.device_type = self.groups.device_type
        self.model_parallel: ModelParallel = self.groups.model_parallel
        self.store = self.groups.store
        self.watch = FailureWatch(self.rank, self.world_size, float(config.distributed_timeout), self.store,
                                  self.children, parent_pid)
        self.failure_listeners = self.watch.failure_listeners
        self.watch.start()

    # ------------------------------------------------------------------ what the layers see
    def layer_view(self, device: torch.device, dtype: torch.dtype) -> ModelParallel:
        """The view the model is built with. On CUDA, all-reduces of decode-sized tensors take the
        faster path the tp_all_reduce tuning knob names when every rank set it up and its sums agree with NCCL's:
        `peer` (the default: kernels/peer_all_reduce.py, one kernel writing this rank's rows into its peers'
        buffers over NVLink and summing theirs, fused with the following residual add + RMSNorm where the
        model defers its reduction), `symm_mem`
        (torch's one-shot symmetric-memory op, experimental) or `nccl` (NCCL for every tensor)."""
        view = self.model_parallel
        if self.tp == 1:
            return view
        choice = self.config.tuning.tp_all_reduce  # (checked with the config)
        if device.type != "cuda":
            return view
        # Every rank takes the same path: the fast one only if every rank asks for the same one.
        wanted = ALL_REDUCE_KINDS.index(choice)
        if wanted == 0 or self.agree_min(wanted, "all-reduce choice") != -self.agree_min(-wanted, "all-reduce choice"):
            return view
        fast = None
        try:
            if choice == "peer":
                from atlas.kernels.peer_all_reduce import PeerAllReduce

                fast = PeerAllReduce.over_group(self.groups.tp_group, device, dtype)
            else:
                fast = SymmMemAllReduce(self.groups.tp_group, device, dtype)
        except Exception as exc:  # noqa: BLE001 - an optimisation: NCCL does the job without it
            logger.warning("%s all-reduce unavailable (%s: %s); NCCL all-reduces", choice, type(exc).__name__, exc)
        ok = self.agree_min(int(fast is not None), f"{choice} all-reduce set-up")
        if ok:
            ok = self.agree_min(int(agrees_with_nccl(fast, self.groups.tp_group, device, dtype)), f"{choice} all-reduce check")
            if not ok:
                logger.warning("the %s all-reduce differs from NCCL's on some rank; NCCL all-reduces", choice)
        if not ok:
            return view
        logger.info("decode-sized all-reduces go through the %s all-reduce", choice)
        return dataclasses.replace(view, fast=fast)

    @property
    def is_first_stage(self) -> bool:
        return self.model_parallel.is_first_stage

    @property
    def is_last_stage(self) -> bool:
        return self.model_parallel.is_last_stage

    # ------------------------------------------------------------------ driver -> workers
    def begin_step(self, batch: StepBatch, prompt_rows: list[int], share_samples: bool) -> StepInfo:
        """The driver: number the step, send it to every worker, start its clock. A worker: the step
        being run."""
        if not self.is_driver:
            return self.current_step
        self.raise_if_failed()
        self._number += 1
        info = StepInfo(self._number, prompt_rows, share_samples)
        self.groups.broadcast(encode_step(batch, info))
        self.watch.step_launched(info.number)
        return info

    def load_lora(self, slot: int, name: str, folder: str) -> None:
        """The driver: every worker writes adapter `name` (its share, read from `folder`) into `slot` before the next
        step, as the driver has just queued its own (the control channel keeps the order)."""
        self.groups.broadcast((LORA_LOAD, slot, name, folder))

    def end_step(self, info: StepInfo) -> None:
        self.watch.step_ended(info.number)

    def announce_finish(self, info: StepInfo) -> None:
        """Pipeline parallelism: the first stage's tensor-parallel peers make the step's logits with the
        driver (an all-gather), so they hear when it finishes a step."""
        if self.tp > 1:
            self.groups.broadcast((FINISH, info.number))

    def defer(self, number: int, finish: Callable[[], object]) -> None:
        self._deferred[number] = finish

    def agree_min(self, value: int, what: str = "memory plan") -> int:
        """The smallest value any rank has (e.g. KV pages every rank can hold). A start-up meeting point:
        a rank that does not reach it within the timeout (stuck loading, say) is named."""
        with self.watch.meeting(what):
            return self.groups.agree_min(value)

    # ------------------------------------------------------------------ device tensors (ProcessGroups')
    def share_samples(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.groups.share_samples(tokens)

    def send_next(self, t: torch.Tensor) -> None:
        self.groups.send_next(t)

    def receive_previous(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return self.groups.receive_previous(shape, dtype, device)

    def send_to_first(self, t: torch.Tensor) -> None:
        self.groups.send_to_first(t)

    def receive_from_last(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return self.groups.receive_from_last(shape, dtype, device)

    def wait_event(self, event) -> None:
        """Wait for a CUDA event, giving up with the worker's error if one fails meanwhile."""
        while not event.query():
            self.raise_if_failed()
            time.sleep(20e-6)

    # ------------------------------------------------------------------ the worker loop
    def serve(self, runner) -> None:
        """Run the driver's steps until it stops the engine. Each step's host time is kept (the wait for
        its message, its launch) for a HOST_REPORT: whether a worker or the driver holds the devices back."""
        times: collections.deque[tuple[float, float]] = collections.deque(maxlen=WORKER_STEPS_KEPT)
        while True:
            t0 = time.perf_counter()
            try:
                msg = self.groups.receive()
            except RuntimeError as exc:  # the control channel broke: its other end is the driver
                raise DriverLost(f"lost the driver (rank 0) without a stop from it ({exc})") from None
            t1 = time.perf_counter()
            if msg[0] == STOP:
                return
            if msg[0] == FINISH:
                finish = self._deferred.pop(msg[1], None)
                if finish is not None:
                    finish()
                continue
            if msg[0] == HOST_REPORT:
                self._write_host_report(msg[1], msg[2], times)
                continue
            if msg[0] == LORA_LOAD:
                from atlas.models.lora import read_adapter

                _, slot, name, folder = msg
                runner.load_lora(slot, runner.prepare_lora(read_adapter(name, folder)))
                continue
            batch, info = decode_step(msg)
            self.current_step = info
            runner.launch(batch)
            self.watch.steps_done = info.number
            times.append((t1 - t0, time.perf_counter() - t1))

    def report_worker_host_times(self, prefix: str, steps: int) -> list[Path]:
        """The driver: ask every worker to write the host times of its last `steps` steps to
        PREFIX.rankN.json (written asynchronously; -> the paths to expect)."""
        self.groups.broadcast((HOST_REPORT, prefix, steps))
        return [Path(f"{prefix}.rank{r}.json") for r in range(1, self.world_size)]

    def _write_host_report(self, prefix: str, steps: int, times) -> None:
        recent = list(times)[-steps:] if steps > 0 else []
        waits, launches = [1e3 * w for w, _ in recent], [1e3 * x for _, x in recent]

        def median(v: list[float]) -> float | None:
            return statistics.median(v) if v else None

        report = {"rank": self.rank, "steps": len(recent),
                  "wait_for_message_ms": {"median": median(waits), "mean": statistics.fmean(waits) if waits else None},
                  "launch_ms": {"median": median(launches), "mean": statistics.fmean(launches) if launches else None}}
        path = Path(f"{prefix}.rank{self.rank}.json")
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(report, indent=1))
        tmp.replace(path)  # (whole or absent for a reader that polls for it)

    # ------------------------------------------------------------------ failures (FailureWatch's)
    @property
    def failure(self) -> WorkerError | None:
        return self.watch.failure

    def fail(self, rank: int, what: str) -> None:
        self.watch.fail(rank, what)

    def abort(self) -> None:
        self.watch.abort()

    def interrupted(self) -> None:
        self.watch.interrupted()

    def raise_if_failed(self) -> None:
        self.watch.raise_if_failed()

    def failure_from(self, exc: BaseException) -> WorkerError:
        return self.watch.failure_from(exc)

    # ------------------------------------------------------------------ shutdown
    def shutdown(self) -> None:
        """Stop the workers (the driver) and leave the process groups. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        self.watch.stop()
        if self.is_driver:
            if self.watch.failure is None:
                with contextlib.suppress(Exception):
                    self.groups.broadcast((STOP,))
                    self.groups.wait_sends()
            for _, proc in self.children:
                proc.join(10.0)
                if proc.exitcode is None:
                    proc.kill()
                    proc.join(5.0)
        self.groups.leave(self.before_leaving)


class DriverLost(RuntimeError):
    """A worker's control channel from the driver broke: the driver ended without stopping the engine."""
