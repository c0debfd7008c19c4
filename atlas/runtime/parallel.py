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

Failure. Workers publish a heartbeat (and the last step they finished) to the rendezvous store; a
watchdog thread on the driver checks the local workers' processes, the heartbeats, and how long the
oldest step has been in flight. A worker that dies, stops responding, or does not finish a step within
--distributed-timeout ends the engine with a WorkerError that names its rank: the watchdog kills the
local workers and tells the remote ones to exit, which breaks any collective the driver waits in.
Spawned workers ignore Ctrl-C and follow the driver (which stops them) or exit when it is gone.
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import json
import logging
import os
import pickle
import signal
import socket
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from atlas.config import ALL_REDUCE_KINDS, EngineConfig, ModelConfig
from atlas.errors import ConfigError, WorkerError
from atlas.layers.parallel import ModelParallel
from atlas.processes import process_alive
from atlas.runtime.batch import StepBatch
from atlas.runtime.step_inputs import scheduled_tokens

logger = logging.getLogger(__name__)

STEP, FINISH, STOP, HOST_REPORT = 0, 1, 2, 3
WORKER_STEPS_KEPT = 4096  # a worker keeps the host times of its last steps for a HOST_REPORT
# Set when leaving the process groups timed out: a thread is then stuck in the collectives library, and
# the interpreter's normal exit can abort on it; the CLI then ends its process with os._exit.
GROUPS_LEFT_HANGING = False
_CHUNK = 16 << 10  # bytes of a message that travel in its first broadcast (the rest, if any, in a second)
_IDLE = datetime.timedelta(days=365)  # workers wait for the next step as long as the driver is idle
_HEARTBEAT_S = 0.5
STORE_KEY = "atlas/"


def world_size(config: EngineConfig) -> int:
    return config.tensor_parallel_size * config.pipeline_parallel_size


# ---------------------------------------------------------------------------------- placement
@dataclass(frozen=True)
class Placement:
    """How this process takes part: its global rank, and where all ranks meet."""

    rank: int
    world_size: int
    local_rank: int
    ranks_per_node: int
    master_addr: str
    master_port: int
    spawn: tuple[int, ...] = ()  # global ranks this process starts (none under torchrun)
    torchrun: bool = False


def _free_port(addr: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


def placement(config: EngineConfig) -> Placement:
    world = world_size(config)
    env = os.environ
    if all(k in env for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")):
        if int(env["WORLD_SIZE"]) != world:
            raise ConfigError(f"torchrun started {env['WORLD_SIZE']} processes but --tensor-parallel-size "
                              f"{config.tensor_parallel_size} x --pipeline-parallel-size "
                              f"{config.pipeline_parallel_size} needs {world}")
        per_node = int(env.get("LOCAL_WORLD_SIZE", world))
        return Placement(int(env["RANK"]), world, int(env["LOCAL_RANK"]), per_node, env["MASTER_ADDR"],
                         int(env["MASTER_PORT"]), torchrun=True)
    nodes, node = config.nnodes, config.node_rank
    per_node = world // nodes
    addr = config.master_addr or env.get("MASTER_ADDR") or "127.0.0.1"
    port = config.master_port or int(env.get("MASTER_PORT") or 0)
    if not port:
        if nodes > 1:
            raise ConfigError("--nnodes > 1 needs --master-port (the same on every node), or MASTER_PORT")
        port = _free_port(addr)
    first = node * per_node
    return Placement(first, world, 0, per_node, addr, port, spawn=tuple(range(first + 1, first + per_node)))


def is_driver(config: EngineConfig) -> bool:
    """Whether this process is rank 0 (always, without parallelism)."""
    return world_size(config) == 1 or placement(config).rank == 0


def check_model(config: EngineConfig, model: ModelConfig) -> None:
    """Refuse a layout the model cannot be split into, naming the flag to change."""
    tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
    raw = model.raw
    heads, kv = model.num_attention_heads, model.num_key_value_heads
    fix = "choose another --tensor-parallel-size"
    if heads % tp:
        raise ConfigError(f"--tensor-parallel-size {tp} does not divide the model's {heads} attention heads: {fix}")
    if "kv_lora_rank" not in raw and kv % tp and tp % kv:
        raise ConfigError(f"--tensor-parallel-size {tp} is neither a divisor nor a multiple of the model's {kv} "
                          f"key/value heads: {fix}")
    if config.enable_expert_parallel:
        experts = raw.get("n_routed_experts") or raw.get("num_experts") or raw.get("num_local_experts")
        if not isinstance(experts, int):
            raise ConfigError(f"--enable-expert-parallel: {model.architecture} has no routed experts; leave the flag out")
        if experts % tp:
            raise ConfigError(f"--enable-expert-parallel: --tensor-parallel-size {tp} does not divide the model's "
                              f"{experts} routed experts: {fix}")
    for key in ("intermediate_size", "moe_intermediate_size"):
        size = raw.get(key)
        if key == "moe_intermediate_size" and config.enable_expert_parallel:
            continue  # (whole experts)
        if isinstance(size, int) and size % tp:
            raise ConfigError(f"--tensor-parallel-size {tp} does not divide the model's {key} {size}: {fix}")
    if model.num_hidden_layers < pp:
        raise ConfigError(f"--pipeline-parallel-size {pp} is more than the model's {model.num_hidden_layers} "
                          "layers")


# ---------------------------------------------------------------------------------- step messages
@dataclass
class StepInfo:
    """What every rank knows about a step beyond its StepBatch."""

    number: int
    prompt_rows: list[int] = field(default_factory=list)  # flat rows whose prompt logprobs the driver wants
    share_samples: bool = False  # the driver broadcasts the sampled ids to its tensor-parallel peers


class RemoteSeq:
    """A worker's view of a scheduled sequence: its id, its page table, and the tokens it computes this
    step (`window`: the known tokens, then drafts, from the first row that is not a pending input)."""

    __slots__ = ("request_id", "block_ids", "window")

    def __init__(self, request_id: str, block_ids: list[int], window: list[int]):
        self.request_id = request_id
        self.block_ids = block_ids
        self.window = window


class StepEncoder:
    """Driver side: a step as a compact tuple, with only the page-table changes workers have not seen.

    It keeps a copy of every table it sent: a table that still starts with that copy sends only its new
    pages; any other change (pages trimmed or replaced, a new request under an old id) sends it whole."""

    _PRUNE_EVERY = 16

    def __init__(self) -> None:
        self.sent: dict[str, tuple[object, list[int]]] = {}  # request id -> (sequence, its table as sent)

    def encode(self, batch: StepBatch, info: StepInfo) -> tuple:
        ids, tokens, pages = [], [], []
        sent = self.sent
        for i, seq in enumerate(batch.seqs):
            rid, blocks = seq.request_id, seq.block_ids
            s, k = batch.start[i], batch.num_scheduled[i]
            if batch.pending_input[i]:
                s, k = s + 1, k - 1
            ids.append(rid)
            tokens.append(scheduled_tokens(seq, s, k))
            known = sent.get(rid)
            n = len(known[1]) if known is not None else 0
            if known is not None and known[0] is seq and len(blocks) >= n and blocks[:n] == known[1]:
                pages.append((n, blocks[n:]) if len(blocks) > n else None)
            else:
                pages.append((0, list(blocks)))
            sent[rid] = (seq, list(blocks))
        forget = []
        if info.number % self._PRUNE_EVERY == 0:
            forget = [rid for rid, (seq, _) in sent.items() if getattr(seq, "is_finished", False)]
            for rid in forget:
                del sent[rid]
        return (STEP, info.number, ids, tokens, pages, forget, batch.num_scheduled, batch.start,
                batch.num_sample_rows, batch.num_drafts, batch.pending_input, batch.num_output_tokens,
                batch.num_draft_rows, info.prompt_rows, info.share_samples)


class StepDecoder:
    """Worker side: the page tables of the running requests, and each step message as a StepBatch."""

    def __init__(self) -> None:
        self.tables: dict[str, list[int]] = {}

    def decode(self, msg: tuple) -> tuple[StepBatch, StepInfo]:
        (_, number, ids, tokens, pages, forget, num_scheduled, start, num_sample_rows, num_drafts, pending,
         num_outputs, num_draft_rows, prompt_rows, share_samples) = msg
        tables = self.tables
        for rid, change in zip(ids, pages, strict=True):
            if change is None:
                continue
            first, new = change
            if first == 0:
                tables[rid] = list(new)
            else:
                table = tables[rid]
                del table[first:]
                table.extend(new)
        seqs = [RemoteSeq(rid, tables[rid], window) for rid, window in zip(ids, tokens, strict=True)]
        for rid in forget:
            tables.pop(rid, None)
        batch = StepBatch(seqs, num_scheduled, start=start, num_sample_rows=num_sample_rows, num_drafts=num_drafts,
                          pending_input=pending, num_output_tokens=num_outputs, num_draft_rows=num_draft_rows)
        return batch, StepInfo(number, prompt_rows, share_samples)


# ---------------------------------------------------------------------------------- process groups
def device_type(config: EngineConfig) -> str:
    if config.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return config.device


class ParallelState:
    """This process's place in a parallel engine: its rank, the process groups, the messages between
    driver and workers, the point-to-point transfers between pipeline stages, and failure detection."""

    def __init__(self, config: EngineConfig, place: Placement, children: list | None = None,
                 parent_pid: int | None = None):
        import torch.distributed as dist

        self.config = config
        self.tp, self.pp = config.tensor_parallel_size, config.pipeline_parallel_size
        self.rank, self.world_size = place.rank, place.world_size
        self.tp_rank, self.pp_rank = self.rank % self.tp, self.rank // self.tp
        self.local_rank, self.ranks_per_node = place.local_rank, place.ranks_per_node
        self.is_driver = self.rank == 0
        self.timeout = float(config.distributed_timeout)
        self.children: list = list(children or [])  # (rank, multiprocessing.Process) started here
        self.parent_pid = parent_pid
        self.failure: WorkerError | None = None
        self.failure_listeners: list[Callable[[], None]] = []
        self.before_leaving: list[Callable[[], None]] = []  # run before the process groups are left
        self.steps_done = 0  # (a worker: the last step it ran)
        self.meetings = 0  # start-up meeting points reached (agree_min)
        self._meeting: tuple[int, str, float] | None = None  # (the driver: the one it waits at, since when)
        self.current_step: StepInfo | None = None  # (a worker: the step being run)
        self._inflight: dict[int, float] = {}  # (the driver: step number -> when it was launched)
        self._number = 0
        self._encoder = StepEncoder()
        self._pending: list = []  # (work, tensors) of asynchronous sends not known to be done
        self._deferred: dict[int, Callable[[], object]] = {}
        self._stop = threading.Event()
        self._closed = False

        self.device_type = device_type(config)
        if self.device_type == "cuda":
            torch.cuda.set_device(self.local_rank)
        backend = "nccl" if self.device_type == "cuda" else "gloo"
        # Data collectives get twice the watchdog's timeout: the watchdog, which names the rank, goes first.
        data_timeout = datetime.timedelta(seconds=2 * self.timeout)
        init = "env://" if place.torchrun else f"tcp://{place.master_addr}:{place.master_port}"
        self._join(lambda: dist.init_process_group(
            backend, init_method=init, rank=self.rank, world_size=self.world_size,
            timeout=datetime.timedelta(seconds=max(600.0, 2 * self.timeout))))
        self.ctrl = dist.new_group(backend="gloo", timeout=_IDLE)
        stages = [dist.new_group(list(range(s * self.tp, (s + 1) * self.tp)), backend=backend, timeout=data_timeout)
                  for s in range(self.pp)]
        self.tp_group = stages[self.pp_rank]
        self.model_parallel = ModelParallel(self.tp_rank, self.tp, self.pp_rank, self.pp, self.tp_group,
                                            expert_parallel=config.enable_expert_parallel)
        self.fwd = self.ret = None
        if self.pp > 1:  # one group per direction: a step's return never waits behind the next step's send
            self.fwd = dist.new_group(backend=backend, timeout=data_timeout)
            self.ret = dist.new_group(backend=backend, timeout=data_timeout)
        self.store = dist.TCPStore(place.master_addr, place.master_port, is_master=False,
                                   timeout=datetime.timedelta(seconds=60))
        thread = threading.Thread(target=self._watch if self.is_driver else self._heartbeat,
                                  name=f"atlas-{'watchdog' if self.is_driver else 'heartbeat'}", daemon=True)
        thread.start()

    def _join(self, init: Callable[[], None]) -> None:
        """Meet the other ranks; the workers started here are watched meanwhile, so that one that dies
        before it joins ends the wait with its rank (instead of the rendezvous timeout)."""
        if not self.children:
            init()
            return
        done, errors = threading.Event(), []

        def run() -> None:
            try:
                init()
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
                errors.append(exc)
            finally:
                done.set()

        threading.Thread(target=run, name="atlas-rendezvous", daemon=True).start()
        while not done.wait(0.2):
            for rank, proc in self.children:
                if proc.exitcode is not None:
                    raise WorkerError(f"rank {rank} (pid {proc.pid}) {_exit_words(proc.exitcode)} before it joined "
                                      "the other ranks (its log says why); the engine stopped", rank=rank)
        if errors:
            raise errors[0]

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
        import dataclasses

        fast = None
        try:
            if choice == "peer":
                from atlas.kernels.peer_all_reduce import PeerAllReduce

                fast = PeerAllReduce.over_group(self.tp_group, device, dtype)
            else:
                fast = SymmMemAllReduce(self.tp_group, device, dtype)
        except Exception as exc:  # noqa: BLE001 - an optimisation: NCCL does the job without it
            logger.warning("%s all-reduce unavailable (%s: %s); NCCL all-reduces", choice, type(exc).__name__, exc)
        ok = self.agree_min(int(fast is not None), f"{choice} all-reduce set-up")
        if ok:
            ok = self.agree_min(int(agrees_with_nccl(fast, self.tp_group, device, dtype)), f"{choice} all-reduce check")
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
    def _send(self, obj: tuple) -> None:
        import torch.distributed as dist

        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        first = min(len(data), _CHUNK - 8)
        # (framed in a bytearray, then wrapped: a tenth of the host time of filling a tensor piece by piece)
        frame = bytearray(_CHUNK)
        frame[:8] = len(data).to_bytes(8, "little")
        frame[8: 8 + first] = data[:first]
        head = torch.frombuffer(frame, dtype=torch.uint8)
        sent = [head]
        works = [dist.broadcast(head, 0, group=self.ctrl, async_op=True)]
        if len(data) > first:
            rest = torch.frombuffer(bytearray(data[first:]), dtype=torch.uint8)
            sent.append(rest)
            works.append(dist.broadcast(rest, 0, group=self.ctrl, async_op=True))
        self._keep(works, sent)

    def _receive(self) -> tuple:
        import torch.distributed as dist

        head = torch.empty(_CHUNK, dtype=torch.uint8)
        dist.broadcast(head, 0, group=self.ctrl)
        frame = head.numpy()
        size = int.from_bytes(frame[:8].tobytes(), "little")
        first = min(size, _CHUNK - 8)
        data = frame[8: 8 + first].tobytes()
        if size > first:
            rest = torch.empty(size - first, dtype=torch.uint8)
            dist.broadcast(rest, 0, group=self.ctrl)
            data += rest.numpy().tobytes()
        return pickle.loads(data)

    def _keep(self, works: list, tensors: list) -> None:
        """Hold asynchronous sends (and their tensors) until they are done."""
        self._pending = [(w, t) for w, t in self._pending if not w.is_completed()]
        self._pending.append((works[-1] if len(works) == 1 else _AllWorks(works), tensors))

    def begin_step(self, batch: StepBatch, prompt_rows: list[int], share_samples: bool) -> StepInfo:
        """The driver: number the step, send it to every worker, start its clock. A worker: the step
        being run."""
        if not self.is_driver:
            return self.current_step
        self.raise_if_failed()
        self._number += 1
        info = StepInfo(self._number, prompt_rows, share_samples)
        self._send(self._encoder.encode(batch, info))
        self._inflight[info.number] = time.monotonic()
        return info

    def end_step(self, info: StepInfo) -> None:
        self._inflight.pop(info.number, None)

    def announce_finish(self, info: StepInfo) -> None:
        """Pipeline parallelism: the first stage's tensor-parallel peers make the step's logits with the
        driver (an all-gather), so they hear when it finishes a step."""
        if self.tp > 1:
            self._send((FINISH, info.number))

    def defer(self, number: int, finish: Callable[[], object]) -> None:
        self._deferred[number] = finish

    def agree_min(self, value: int, what: str = "memory plan") -> int:
        """The smallest value any rank has (e.g. KV pages every rank can hold). A start-up meeting point:
        a rank that does not reach it within the timeout (stuck loading, say) is named."""
        import torch.distributed as dist

        self.meetings += 1
        self._meeting = (self.meetings, what, time.monotonic())
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.ctrl)
        self._meeting = None
        return int(t[0])

    # ------------------------------------------------------------------ device tensors
    def share_samples(self, tokens: torch.Tensor) -> torch.Tensor:
        """The driver's sampled ids on every rank of the first stage (workers pass an empty tensor)."""
        import torch.distributed as dist

        if self.tp > 1:
            dist.broadcast(tokens, 0, group=self.tp_group)
        return tokens

    def send_next(self, t: torch.Tensor) -> None:
        """To the next pipeline stage (same tp rank)."""
        import torch.distributed as dist

        t = t.contiguous()
        self._keep([dist.isend(t, self.rank + self.tp, group=self.fwd)], [t])

    def receive_previous(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        import torch.distributed as dist

        buf = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(buf, self.rank - self.tp, group=self.fwd)
        return buf

    def send_to_first(self, t: torch.Tensor) -> None:
        """From the last stage to the first (same tp rank): the rows that need logits."""
        import torch.distributed as dist

        t = t.contiguous()
        self._keep([dist.isend(t, self.tp_rank, group=self.ret)], [t])

    def receive_from_last(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        import torch.distributed as dist

        buf = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(buf, (self.pp - 1) * self.tp + self.tp_rank, group=self.ret)
        return buf

    def wait_event(self, event) -> None:
        """Wait for a CUDA event, giving up with the worker's error if one fails meanwhile."""
        while not event.query():
            self.raise_if_failed()
            time.sleep(20e-6)

    # ------------------------------------------------------------------ the worker loop
    def serve(self, runner) -> None:
        """Run the driver's steps until it stops the engine. Each step's host time is kept (the wait for
        its message, its launch) for a HOST_REPORT: whether a worker or the driver holds the devices back."""
        decoder = StepDecoder()
        times: collections.deque[tuple[float, float]] = collections.deque(maxlen=WORKER_STEPS_KEPT)
        while True:
            t0 = time.perf_counter()
            try:
                msg = self._receive()
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
            batch, info = decoder.decode(msg)
            self.current_step = info
            runner.launch(batch)
            self.steps_done = info.number
            times.append((t1 - t0, time.perf_counter() - t1))

    def report_worker_host_times(self, prefix: str, steps: int) -> list[Path]:
        """The driver: ask every worker to write the host times of its last `steps` steps to
        PREFIX.rankN.json (written asynchronously; -> the paths to expect)."""
        self._send((HOST_REPORT, prefix, steps))
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

    # ------------------------------------------------------------------ failure detection
    def _heartbeat(self) -> None:
        beat = 0
        while not self._stop.wait(_HEARTBEAT_S):
            if self.parent_pid is not None and not process_alive(self.parent_pid):
                os._exit(1)  # the process that started this worker is gone
            beat += 1
            try:
                self.store.set(f"{STORE_KEY}hb/{self.rank}", f"{beat} {self.steps_done} {self.meetings}")
                if self.store.check([f"{STORE_KEY}abort"]):
                    logger.error("rank %d: the driver ended the engine; exiting", self.rank)
                    os._exit(1)
            except Exception as exc:  # noqa: BLE001 - the store is gone: so is the driver
                if not self._stop.is_set():
                    logger.warning("rank %d: lost the driver's store (%s: %s); exiting", self.rank,
                                   type(exc).__name__, exc)
                    logging.shutdown()
                    os._exit(1)
                return

    def _watch(self) -> None:
        seen: dict[int, tuple[str, float]] = {}
        while not self._stop.wait(_HEARTBEAT_S):
            try:
                problem = self._find_problem(seen)
            except Exception as exc:  # noqa: BLE001 - the store went away: only shutdown does that
                if not self._stop.is_set():
                    logger.debug("watchdog: %s", exc)
                continue
            if problem is not None:
                self.fail(*problem)
                return

    def _find_problem(self, seen: dict[int, tuple[str, float]], stale_after: float | None = None
                      ) -> tuple[int, str] | None:
        """The first failed rank and what happened to it, or None. `seen`: each rank's last heartbeat and
        when it changed (kept between calls); stale_after: seconds without a new one that count as dead."""
        stale_after = self.timeout if stale_after is None else stale_after
        for rank, proc in self.children:
            if proc.exitcode is not None:
                return rank, f"rank {rank} (pid {proc.pid}) {_exit_words(proc.exitcode)}"
        now = time.monotonic()
        progress: dict[int, int] = {}
        met: dict[int, int] = {}
        for rank in range(1, self.world_size):
            if self.store.check([f"{STORE_KEY}error/{rank}"]):
                return rank, f"rank {rank} failed"
            key = f"{STORE_KEY}hb/{rank}"
            if not self.store.check([key]):
                continue  # still starting
            value = self.store.get(key).decode()
            if seen.get(rank, ("",))[0] != value:
                seen[rank] = (value, now)
            _, steps, meetings = value.split()
            progress[rank], met[rank] = int(steps), int(meetings)
            if now - seen[rank][1] > stale_after:
                return rank, f"rank {rank} stopped responding (no heartbeat for {now - seen[rank][1]:.0f} s)"
        meeting = self._meeting
        if meeting is not None and now - meeting[2] > self.timeout:
            behind = [r for r in range(1, self.world_size) if met.get(r, 0) < meeting[0]]
            if behind:
                return behind[0], (f"rank {behind[0]} did not reach the {meeting[1]} within --distributed-timeout "
                                   f"{self.timeout:g} s (still starting or loading?)")
        for number, started in sorted(self._inflight.items()):  # (a step left unread is no hang: ranks went on)
            if now - started <= self.timeout:
                break
            behind = [r for r in range(1, self.world_size) if progress.get(r, 0) < number]
            if behind:
                ranks = ", ".join(map(str, behind))
                return behind[0], (f"rank{'s' if len(behind) > 1 else ''} {ranks} did not finish step {number} "
                                   f"within --distributed-timeout {self.timeout:g} s")
        return None

    def _published_error(self, rank: int) -> str:
        with contextlib.suppress(Exception):
            key = f"{STORE_KEY}error/{rank}"
            if self.store.check([key]):
                return self.store.get(key).decode()
        return ""

    def fail(self, rank: int, what: str) -> None:
        """A worker failed: record it, and stop every worker so that nothing waits for it."""
        if self.failure is not None:
            return
        detail = self._published_error(rank)
        self.failure = WorkerError(f"{what}{f': {detail}' if detail else ''}; the engine stopped", rank=rank)
        logger.error("%s", self.failure)
        self.abort()
        for listener in self.failure_listeners:
            with contextlib.suppress(Exception):
                listener()

    def abort(self) -> None:
        """Kill the local workers and tell remote ones to exit (which also ends any collective in flight)."""
        with contextlib.suppress(Exception):
            self.store.set(f"{STORE_KEY}abort", "1")
        for _, proc in self.children:
            if proc.exitcode is None:
                proc.kill()

    def interrupted(self) -> None:
        """The driver was interrupted inside a step: the engine ends (its workers are stopped)."""
        if self.failure is None:
            self.failure = WorkerError("the engine was interrupted in the middle of a step and stopped", rank=0)
            self.abort()

    def raise_if_failed(self) -> None:
        if self.failure is not None:
            raise self.failure

    def failure_from(self, exc: BaseException) -> WorkerError:
        """The error to end the engine with after `exc` broke a parallel step: the failed worker's, once the
        watchdog has named it (a collective fails as soon as a peer's connection drops), else exc's."""
        if isinstance(exc, WorkerError):
            return exc
        # A collective fails as soon as a peer's connection drops; the peer is then named by its exit (a
        # local worker), its published error, or its heartbeat stopping (4 beats missed: a remote one).
        deadline = time.monotonic() + 5.0
        seen: dict[int, tuple[str, float]] = {}
        while self.failure is None and time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                problem = self._find_problem(seen, stale_after=4 * _HEARTBEAT_S)
                if problem is not None:
                    self.fail(*problem)
                    break
            time.sleep(0.05)
        if self.failure is None:
            self.failure = WorkerError(f"rank {self.rank} failed in a parallel step ({type(exc).__name__}: {exc}); "
                                       "the engine stopped", rank=self.rank)
            self.abort()
        return self.failure

    # ------------------------------------------------------------------ shutdown
    def shutdown(self) -> None:
        """Stop the workers (the driver) and leave the process groups. Safe to call twice."""
        import torch.distributed as dist

        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self.is_driver:
            if self.failure is None:
                with contextlib.suppress(Exception):
                    self._send((STOP,))
                    for work, _ in self._pending:
                        work.wait()
            for _, proc in self.children:
                proc.join(10.0)
                if proc.exitcode is None:
                    proc.kill()
                    proc.join(5.0)
        self._pending = []
        if not dist.is_initialized():
            return
        for prepare in self.before_leaving:  # (e.g. the runner drops graphs holding captured collectives)
            with contextlib.suppress(Exception):
                prepare()
        leave = dist.destroy_process_group
        if self.device_type == "cuda":
            # Destroying NCCL communicators whose collectives were captured in CUDA graphs can hang
            # (pytorch/pytorch#115388); aborting them cannot, and clears the groups just the same.
            from torch.distributed import distributed_c10d

            leave = getattr(distributed_c10d, "_abort_process_group", leave)

        def run() -> None:
            with contextlib.suppress(Exception):
                leave()

        thread = threading.Thread(target=run, name="atlas-leave-groups", daemon=True)
        thread.start()
        thread.join(30.0)
        if thread.is_alive():
            global GROUPS_LEFT_HANGING
            GROUPS_LEFT_HANGING = True
            logger.warning("rank %d: leaving the process groups did not finish within 30 s", self.rank)


class DriverLost(RuntimeError):
    """A worker's control channel from the driver broke: the driver ended without stopping the engine."""


class SymmMemAllReduce:
    """Experimental: a one-shot all-reduce through torch symmetric memory, for the small tensors of decode
    steps, where NCCL's latency dominates. Each rank copies its tensor into its symmetric buffer and reads
    every peer's over NVLink (no multicast: it stays off on our machines); it can be captured in CUDA
    graphs. Tensors larger than the buffer, or of another dtype, go to NCCL."""

    def __init__(self, group, device: torch.device, dtype: torch.dtype, max_bytes: int = 8 << 20):
        import torch.distributed._symmetric_memory as symm_mem

        self.group_name = group.group_name
        self.dtype = dtype
        self.max_numel = max_bytes // torch.empty((), dtype=dtype).element_size()
        self.buffer = symm_mem.empty(self.max_numel, dtype=dtype, device=device)
        symm_mem.rendezvous(self.buffer, self.group_name)

    def takes(self, x: torch.Tensor) -> bool:
        # (the kernel reads whole 16-byte vectors: sizes that are not a multiple of them go to NCCL)
        return (x.is_cuda and x.dtype == self.dtype and x.numel() <= self.max_numel
                and x.numel() * x.element_size() % 16 == 0)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        staged = self.buffer[: x.numel()]
        staged.copy_(x.reshape(-1))
        return torch.ops.symm_mem.one_shot_all_reduce(staged, "sum", self.group_name).view(x.shape)


def agrees_with_nccl(fast, group, device: torch.device, dtype: torch.dtype) -> bool:
    """Start-up check of a fast all-reduce: the same sums as NCCL's for a few shapes it takes, and where it
    fuses the residual add + RMSNorm, the same as NCCL's sum through fused_ops.add_rms_norm (seeded per rank;
    every rank runs the same calls)."""
    import torch.distributed as dist

    from atlas.kernels.fused_ops import add_rms_norm

    g = torch.Generator(device=device).manual_seed(1234 + dist.get_rank())
    tol = 2e-2 if dtype != torch.float32 else 1e-5

    def close(a: torch.Tensor, b: torch.Tensor) -> bool:
        return torch.allclose(a.float(), b.float(), rtol=tol, atol=tol)

    fused = getattr(fast, "add_rms_norm", None)
    ok = True  # (no early return on a mismatch: every rank must make the same calls)
    shapes = [(1, 8), (1, 4096), (3, 4096), (64, 4096), (2, 5000)]
    if hasattr(fast, "max_numel"):  # (a flat buffer: its largest tensor too)
        shapes.append((1, fast.max_numel))
    for shape in shapes:
        x = torch.randn(shape, generator=g, device=device).to(dtype)
        want = x.clone()
        dist.all_reduce(want, group=group)
        if not fast.takes(x):
            continue
        try:
            ok &= close(fast(x), want)
            if fused is None:
                continue
            residual = torch.randn(shape, generator=g, device=device).to(dtype)
            weight = (1 + 0.1 * torch.randn(shape[-1], generator=g, device=device)).to(dtype)
            got = fused(x, residual, weight, 1e-6)
            if got is not None:
                want_norm, want_residual = add_rms_norm(want, residual, weight, 1e-6)
                ok &= close(got[0], want_norm) and close(got[1], want_residual)
        except RuntimeError as exc:  # a size or layout the kernel refuses: NCCL does the job
            logger.warning("fast all-reduce of %s failed: %s", tuple(shape), exc)
            return False
    return ok


class _AllWorks:
    """Several asynchronous works seen as one."""

    def __init__(self, works: list):
        self.works = works

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)

    def wait(self) -> None:
        for w in self.works:
            w.wait()


def _exit_words(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by signal {signal.Signals(-code).name}"
        return f"was killed by signal {-code}"
    return f"exited with code {code}"
