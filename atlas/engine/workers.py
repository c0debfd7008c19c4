"""Worker processes of a parallel engine: the driver starts its node's ranks, each rank builds its part of the
engine (an EngineCore on its ParallelState) and serves steps until the driver stops it; another node's
`atlas serve` / `atlas generate` (or a torchrun rank) runs `run_node`. The process groups and the
communication are `runtime/parallel_groups.py`'s, the step protocol `runtime/parallel_protocol.py`'s, failure
detection `runtime/parallel_health.py`'s and the glue `runtime/parallel.py`'s; this module is where they meet
the engine."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading

import torch

from atlas.config import EngineConfig
from atlas.errors import ConfigError
from atlas.runtime.parallel import DriverLost, ParallelState
from atlas.runtime.parallel_groups import Placement, device_type, placement
from atlas.runtime.parallel_health import STORE_KEY

logger = logging.getLogger(__name__)


def start(config: EngineConfig) -> ParallelState:
    """The driver's side: start this node's workers, then join the process groups as rank 0."""
    place = placement(config)
    if place.rank != 0:
        raise ConfigError(f"this process is rank {place.rank}, not the driver: run it through `atlas serve` (or "
                          "`atlas generate`) with the same flags as node 0, which then runs it as a worker")
    children = _spawn(config, place)
    try:
        return ParallelState(config, place, children)
    except BaseException:
        for _, proc in children:
            proc.kill()
        raise


def _spawn(config: EngineConfig, place: Placement) -> list:
    if device_type(config) == "cuda" and torch.cuda.device_count() < place.ranks_per_node:
        raise ConfigError(f"{place.ranks_per_node} ranks on this node (--tensor-parallel-size x "
                          f"--pipeline-parallel-size / --nnodes) need as many GPUs; {torch.cuda.device_count()} are "
                          "visible (CUDA_VISIBLE_DEVICES)")
    import torch.multiprocessing as mp

    ctx = mp.get_context("forkserver")
    # Workers fork from a server process that has torch and the engine imported already (a second engine
    # in this process starts its workers in a fraction of the time); the server never touches CUDA.
    ctx.set_forkserver_preload(["atlas.engine.core"])
    level = logging.getLogger("atlas").getEffectiveLevel()
    children = []
    for rank in place.spawn:
        local = rank - place.rank
        proc = ctx.Process(target=_spawned_worker, name=f"atlas-rank{rank}", daemon=True,
                           args=(config, Placement(rank, place.world_size, local, place.ranks_per_node,
                                                   place.master_addr, place.master_port), os.getpid(), level,
                                 dict(os.environ)))
        proc.start()
        children.append((rank, proc))
    return children


def _configure_worker_logging(rank: int, level: int) -> None:
    logging.basicConfig(level=level, format=f"%(asctime)s %(levelname)s rank{rank} %(name)s: %(message)s")
    logging.getLogger("atlas").setLevel(level)


def _spawned_worker(config: EngineConfig, place: Placement, parent_pid: int, level: int, env: dict[str, str]
                    ) -> None:
    """A worker that the engine started (on its node): the driver's environment as it is now (the forkserver
    has the one of its own start; NCCL, CUDA and Atlas read theirs later), quiet logs (one set per node), no
    Ctrl-C of its own (the driver stops it)."""
    os.environ.clear()
    os.environ.update(env)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _configure_worker_logging(place.rank, max(level, logging.WARNING))
    raise SystemExit(run_worker(config, place, parent_pid=parent_pid))


def run_worker(config: EngineConfig, place: Placement, children: list | None = None,
               parent_pid: int | None = None) -> int:
    """Join as a worker, build this rank's part of the engine, run steps until the driver stops it."""
    from atlas.engine.core import EngineCore
    from atlas.heap import freeze_startup_heap

    state = None
    try:
        state = ParallelState(config, place, children, parent_pid)
        core = EngineCore(config, parallel=state)
        freeze_startup_heap()  # (a worker keeps its engine for its life)
        state.serve(core.runner)
        return 0
    except BaseException as exc:
        if state is not None:
            with contextlib.suppress(Exception):
                state.store.set(f"{STORE_KEY}error/{state.rank}", f"{type(exc).__name__}: {exc}")
        if isinstance(exc, KeyboardInterrupt):
            return 130
        if isinstance(exc, DriverLost):  # (the driver's own log says why it went; no traceback here)
            logger.warning("rank %d: %s; exiting", place.rank, exc)
            return 1
        logger.exception("rank %d failed", place.rank)
        return 1
    finally:
        if state is not None:
            state.shutdown()


def run_node(config: EngineConfig) -> int:
    """A process that is not the driver (another node's `atlas serve`, or a torchrun rank other than 0):
    start this node's other ranks (unless torchrun did), then work as this node's first rank. Ctrl-C here
    stops this node's ranks (the driver then names the rank it lost)."""
    place = placement(config)
    if place.torchrun and place.local_rank != 0:  # (torchrun starts every rank: one speaks for the node)
        logging.getLogger("atlas").setLevel(logging.WARNING)
    children = _spawn(config, place)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})

    def on_signal() -> None:
        sig = signal.sigwait({signal.SIGINT, signal.SIGTERM})
        logger.warning("rank %d: %s, stopping this node's ranks", place.rank, signal.Signals(sig).name)
        for _, proc in children:
            proc.kill()
        os._exit(130)

    threading.Thread(target=on_signal, name="atlas-signals", daemon=True).start()
    logger.info("rank %d of %d (node %d): waiting for the driver at %s:%d", place.rank, place.world_size,
                config.node_rank, place.master_addr, place.master_port)
    code = run_worker(config, place, children)
    for _, proc in children:
        proc.join(10.0)
    return code
