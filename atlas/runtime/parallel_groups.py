"""Where this process stands in a parallel engine (its rank, placement and the model's split) and its process
groups with the transfers over them: the control channel's broadcasts, start-up agreements, the samples shared
between tensor-parallel peers, point-to-point sends between pipeline stages, and the fast all-reduces for decode.

Layout: world = tp x pp ranks, rank = stage * tp + tp rank (the ranks of a stage are consecutive, so a stage
sits on one node when tp is at most the GPUs per node). The groups: `ctrl` (gloo, the driver's messages and
start-up agreements), one data group per stage (tensor parallelism: NCCL on CUDA), and under pipeline
parallelism one group per direction (a step's return never waits behind the next step's send).
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import pickle
import signal
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from atlas.config import EngineConfig, ModelConfig
from atlas.errors import ConfigError, WorkerError
from atlas.layers.parallel import ModelParallel
from atlas.models.registry import model_class
from atlas.runtime.parallel_protocol import CHUNK, frame, unframe

logger = logging.getLogger(__name__)

# Set when leaving the process groups timed out: a thread is then stuck in the collectives library, and
# the interpreter's normal exit can abort on it; the CLI then ends its process with os._exit.
GROUPS_LEFT_HANGING = False
_IDLE = datetime.timedelta(days=365)  # workers wait for the next step as long as the driver is idle


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
    for what, count in model_class(model).tensor_parallel_divisors(model).items():
        if count % tp:
            raise ConfigError(f"--tensor-parallel-size {tp} does not divide the model's {count} {what}: {fix}")
    if model.num_hidden_layers < pp:
        raise ConfigError(f"--pipeline-parallel-size {pp} is more than the model's {model.num_hidden_layers} "
                          "layers")


def device_type(config: EngineConfig) -> str:
    if config.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return config.device


class ProcessGroups:
    """This rank's process groups (joined at construction) and every transfer over them."""

    def __init__(self, config: EngineConfig, place: Placement, children: list):
        import torch.distributed as dist

        self.tp, self.pp = config.tensor_parallel_size, config.pipeline_parallel_size
        self.rank, self.world_size = place.rank, place.world_size
        self.tp_rank, self.pp_rank = self.rank % self.tp, self.rank // self.tp
        self.children = children  # (rank, multiprocessing.Process) started here: watched while joining
        self._pending: list = []  # (work, tensors) of asynchronous sends not known to be done
        timeout = float(config.distributed_timeout)
        self.device_type = device_type(config)
        if self.device_type == "cuda":
            torch.cuda.set_device(place.local_rank)
        backend = "nccl" if self.device_type == "cuda" else "gloo"
        # Data collectives get twice the watchdog's timeout: the watchdog, which names the rank, goes first.
        data_timeout = datetime.timedelta(seconds=2 * timeout)
        init = "env://" if place.torchrun else f"tcp://{place.master_addr}:{place.master_port}"
        self._join(lambda: dist.init_process_group(
            backend, init_method=init, rank=self.rank, world_size=self.world_size,
            timeout=datetime.timedelta(seconds=max(600.0, 2 * timeout))))
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
                    raise WorkerError(f"rank {rank} (pid {proc.pid}) {exit_words(proc.exitcode)} before it joined "
                                      "the other ranks (its log says why); the engine stopped", rank=rank)
        if errors:
            raise errors[0]

    # ------------------------------------------------------------------ the control channel
    def broadcast(self, obj: tuple) -> None:
        """The driver: a message to every worker (asynchronous; kept until sent)."""
        import torch.distributed as dist

        head, rest = frame(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
        sent = [torch.frombuffer(head, dtype=torch.uint8)]
        works = [dist.broadcast(sent[0], 0, group=self.ctrl, async_op=True)]
        if rest:
            sent.append(torch.frombuffer(bytearray(rest), dtype=torch.uint8))
            works.append(dist.broadcast(sent[1], 0, group=self.ctrl, async_op=True))
        self._keep(works, sent)

    def receive(self) -> tuple:
        """A worker: the driver's next message."""
        import torch.distributed as dist

        head = torch.empty(CHUNK, dtype=torch.uint8)
        dist.broadcast(head, 0, group=self.ctrl)
        data, more = unframe(head.numpy())
        if more:
            rest = torch.empty(more, dtype=torch.uint8)
            dist.broadcast(rest, 0, group=self.ctrl)
            data += rest.numpy().tobytes()
        return pickle.loads(data)

    def _keep(self, works: list, tensors: list) -> None:
        """Hold asynchronous sends (and their tensors) until they are done."""
        self._pending = [(w, t) for w, t in self._pending if not w.is_completed()]
        self._pending.append((works[-1] if len(works) == 1 else _AllWorks(works), tensors))

    def wait_sends(self) -> None:
        for work, _ in self._pending:
            work.wait()

    def agree_min(self, value: int) -> int:
        """The smallest value any rank has."""
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.ctrl)
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

    # ------------------------------------------------------------------ leaving
    def leave(self, before_leaving: list[Callable[[], None]]) -> None:
        """Leave the process groups (after `before_leaving`), bounded in time."""
        import torch.distributed as dist

        self._pending = []
        if not dist.is_initialized():
            return
        for prepare in before_leaving:  # (e.g. the runner drops graphs holding captured collectives)
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


def exit_words(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by signal {signal.Signals(-code).name}"
        return f"was killed by signal {-code}"
    return f"exited with code {code}"
