"""`atlas serve`'s process layout: a supervisor, the engine process and N HTTP front ends.

    atlas serve (this process: binds the port, starts and watches the others, owns the exit status)
      ├── engine process   EngineCore's loop behind a ZeroMQ socket (atlas/engine/engine_process.py)
      │                    (x D with --data-parallel-size D: a whole model each, on GPUs of its own;
      │                    atlas/engine/data_parallel.py)
      └── front end x N    uvicorn + the OpenAI app over an EngineClient (a DataParallelClient over D of them),
                           each on its own listening socket of the one port (cli.bind_sockets)
                           (--api-server-count; the kernel spreads connections over them)

The children are forked from this process while it runs one thread; each makes its own ZeroMQ context after the
fork. The engine is forked first, bare; then this process imports what a front end runs (torch through the
client, transformers, the web app: several seconds) once, so that every front end, a restarted one too, starts
from those imports in a fraction of a second (a restarted one's share of the port is not left unanswered while
it imports). Faults and shutdown:

- SIGINT / SIGTERM (the first): the front ends start no new request (a 503; /health answers 503), let in-flight
  requests finish for up to --shutdown-timeout, then cut the rest (streams get an error event and [DONE], others a 503); the engine
  is stopped after them. A second signal cuts at once (with the same answers); a third kills the front ends.
  The exit status is 1 when requests were cut, 0 otherwise.
- The engine process (any of them with -dp) dies: each front end fails its open streams (an error event, then [DONE]), /health
  answers 503 and the front ends exit; `atlas serve` exits with status 1 so that a supervisor restarts it.
- A front end dies: the engine frees its requests' pages, and a new front end takes its place (at most
  MAX_RESTARTS within RESTART_WINDOW_S, after which the server stops with status 1).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from dataclasses import dataclass, field

from atlas.config import EngineConfig
from atlas.errors import (
    AtlasError,
    ConfigError,
    ModelLoadError,
    OutOfMemoryPlanError,
    UnsupportedModelError,
    WorkerError,
)

logger = logging.getLogger("atlas.server")

MAX_RESTARTS = 5
RESTART_WINDOW_S = 60.0
ENGINE_STOP_TIMEOUT_S = 30.0

_START_ERRORS = {cls.__name__: cls for cls in (AtlasError, ConfigError, ModelLoadError, OutOfMemoryPlanError,
                                                 UnsupportedModelError, WorkerError)}


@dataclass
class FrontEndSpec:
    """What every front end process is started with."""

    sock: socket.socket
    addresses: list[str]  # (one engine process's, or each replica's with -dp)
    infos: list  # EngineInfo of each
    names: list[str]
    settings: object  # ServerSettings
    log_level: str
    access_log: bool
    detokenize: bool = False  # this front end makes its requests' output text (--detokenize-in)
    launcher_pid: int = field(default_factory=os.getpid)


def preload_front_end_imports() -> None:
    """The front ends' imports, made here before they are forked (module docstring). numpy's OpenBLAS would start
    a thread pool at import: one BLAS thread keeps this process single-threaded at every fork (a front end
    does no BLAS work worth threads)."""
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    import transformers.tokenization_utils_fast  # noqa: F401  (the tokenizer's: about 2 s of the imports)
    from transformers import AutoTokenizer  # noqa: F401

    import atlas.engine.engine_client  # noqa: F401
    import atlas.heap  # noqa: F401
    import atlas.server.app  # noqa: F401
    import atlas.server.cli  # noqa: F401


def run_front_end(index: int, spec: FrontEndSpec) -> None:
    """A front end process: the OpenAI app over an EngineClient, served by uvicorn on its socket."""
    from atlas.engine.data_parallel import DataParallelClient
    from atlas.engine.engine_client import EngineClient
    from atlas.heap import freeze_startup_heap
    from atlas.server.app import build_app
    from atlas.server.cli import make_uvicorn_server

    info = spec.infos[0]
    # (one tokenizer for the app and, where this front end makes the output text, for the client)
    tokenizer = info.load_tokenizer()
    if tokenizer is not None and spec.detokenize:
        tokenizer.prepare_detokenizer()
    clients = [EngineClient(replica_info, address, index, parent_pid=spec.launcher_pid,
                            tokenizer=tokenizer if spec.detokenize else None)
               for replica_info, address in zip(spec.infos, spec.addresses, strict=True)]
    client = clients[0] if len(clients) == 1 else DataParallelClient(clients)
    app = build_app(client, spec.names, tokenizer=tokenizer, settings=spec.settings)
    server = make_uvicorn_server(app, spec.log_level, spec.access_log, sigint=False)
    client.dead_listeners.append(lambda: setattr(server, "should_exit", True))
    # (not the launcher's handlers, inherited through the fork: uvicorn re-raises the signal it stopped on)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: None)
    freeze_startup_heap()
    server.run(sockets=[spec.sock])
    sys.exit(1 if client.dead_reason is not None or app.state.server.num_cut else 0)


class Launcher:
    def __init__(self, config: EngineConfig, socks: list[socket.socket], names: list[str], settings,
                 api_server_count: int, log_level: str, access_log: bool, log_stats: bool = True,
                 data_parallel_size: int = 1):
        self.config = config
        self.socks = socks  # (one per front end, or one they share; a restarted front end takes its index's)
        self.names = names
        self.settings = settings
        self.count = api_server_count
        self.log_level = log_level
        self.access_log = access_log
        self.log_stats = log_stats
        self.context = multiprocessing.get_context("fork")
        self.tmpdir = tempfile.mkdtemp(prefix="atlas-serve-")
        self.replicas = data_parallel_size
        self.addresses = ([f"ipc://{self.tmpdir}/engine"] if data_parallel_size == 1 else
                          [f"ipc://{self.tmpdir}/engine-{r}" for r in range(data_parallel_size)])
        self.engines: list[multiprocessing.process.BaseProcess] = []
        self.front_ends: dict[int, multiprocessing.process.BaseProcess] = {}
        self.restarts: list[float] = []
        self.signals = 0
        self.status = 0

    # ------------------------------------------------------------------ start-up
    def start_engine(self) -> list:
        """Start the engine process (with -dp, each replica's, loading at once) and wait until all are ready.
        -> their EngineInfo; raises the first start-up error (after stopping the others)."""
        from atlas.engine.engine_process import run_engine_process

        waits = []
        for r, address in enumerate(self.addresses):
            receive, send = self.context.Pipe(duplex=False)
            replica = None if self.replicas == 1 else r
            engine = self.context.Process(
                target=run_engine_process, name="atlas-engine" if replica is None else f"atlas-engine-{r}",
                args=(self.config, address, self.names[0], send, self.log_stats, replica, self.replicas))
            engine.start()
            send.close()
            self.engines.append(engine)
            waits.append(receive)
        try:
            return [self._wait_ready(engine, receive) for engine, receive in zip(self.engines, waits, strict=True)]
        except BaseException:  # (one failed, or Ctrl-C while the model loads)
            self.stop_engine()
            raise
        finally:
            for receive in waits:
                receive.close()

    @staticmethod
    def _wait_ready(engine, receive):
        def exited() -> AtlasError:
            return AtlasError(f"the engine process{'' if engine.name == 'atlas-engine' else ' ' + engine.name} exited "
                              f"during start-up (status {engine.exitcode}); see the log above")

        try:
            while not receive.poll(0.2):
                if not engine.is_alive():
                    raise exited()
            message = receive.recv()
        except EOFError:
            engine.join(5)
            raise exited() from None
        if message[0] == "error":
            engine.join(10)
            _, kind, text = message
            cls = _START_ERRORS.get(kind)
            if cls is not None:
                raise cls(text)
            raise RuntimeError(f"the engine could not start: {kind}: {text}")
        return message[1]

    def start_front_end(self, index: int, infos: list) -> None:
        spec = FrontEndSpec(self.socks[index % len(self.socks)], self.addresses, infos, self.names, self.settings,
                            self.log_level, self.access_log, self.settings.front_ends_detokenize(self.count))
        proc = self.context.Process(target=run_front_end, name=f"atlas-api-{index}", args=(index, spec))
        proc.start()
        self.front_ends[index] = proc

    # ------------------------------------------------------------------ running
    def run(self, infos: list) -> int:
        """Start the front ends (after start_engine, with its infos) and supervise until shutdown. -> the exit
        status."""
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            preload_front_end_imports()
            for index in range(self.count):
                self.start_front_end(index, infos)
            self._supervise(infos)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self._stop_all()
            shutil.rmtree(self.tmpdir, ignore_errors=True)
        return self.status

    def _on_signal(self, sig, frame) -> None:
        self.signals += 1
        if self.signals == 1:
            logger.info("shutting down: in-flight requests may finish for up to %g s (again to stop at once)",
                        self.settings.shutdown_timeout)
            for proc in self.front_ends.values():
                _signal(proc, signal.SIGTERM)
        elif self.signals == 2:
            logger.warning("second signal: requests still running are cut now (again to kill at once)")
            for proc in self.front_ends.values():
                _signal(proc, signal.SIGTERM)  # (a front end's second signal: cut with answers, then exit)
            self.status = 1
        else:
            for proc in self.front_ends.values():
                _signal(proc, signal.SIGKILL)
            self.status = 1

    def _supervise(self, infos: list) -> None:
        while True:
            procs = [*self.engines, *self.front_ends.values()]
            multiprocessing.connection.wait([p.sentinel for p in procs], timeout=0.5)
            gone = next((engine for engine in self.engines if not engine.is_alive()), None)
            if gone is not None:
                if self.signals == 0:
                    logger.error("the engine process%s exited (status %s): every open request failed; the server "
                                 "stops", "" if self.replicas == 1 else f" {gone.name}", gone.exitcode)
                self.status = 1
                self._wait_front_ends(5.0)
                return
            for index, proc in list(self.front_ends.items()):
                if proc.is_alive():
                    continue
                del self.front_ends[index]
                if self.signals:
                    if proc.exitcode:
                        self.status = 1  # (requests were cut)
                    continue
                logger.error("front end %d (pid %d) exited (status %s); its requests were aborted", index, proc.pid,
                             proc.exitcode)
                now = time.monotonic()
                self.restarts = [t for t in self.restarts if now - t < RESTART_WINDOW_S] + [now]
                if len(self.restarts) > MAX_RESTARTS:
                    logger.error("front ends exited %d times within %g s: the server stops", len(self.restarts),
                                 RESTART_WINDOW_S)
                    self.status = 1
                    self._on_signal(signal.SIGTERM, None)
                    continue
                self.start_front_end(index, infos)
            if self.signals and not self.front_ends:
                return

    def _wait_front_ends(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for proc in self.front_ends.values():
            proc.join(max(0.0, deadline - time.monotonic()))

    def stop_engine(self) -> None:
        """Stop the engine process(es): SIGTERM, then SIGKILL for one that has not stopped in time."""
        running = [engine for engine in self.engines if engine.exitcode is None]
        for engine in running:
            _signal(engine, signal.SIGTERM)
        deadline = time.monotonic() + ENGINE_STOP_TIMEOUT_S
        for engine in running:
            engine.join(max(0.0, deadline - time.monotonic()))
            if engine.is_alive():
                logger.warning("the engine process %s did not stop within %g s: killed", engine.name,
                               ENGINE_STOP_TIMEOUT_S)
                _signal(engine, signal.SIGKILL)
                engine.join(5)

    def _stop_all(self) -> None:
        for proc in self.front_ends.values():
            _signal(proc, signal.SIGTERM)
        self._wait_front_ends(self.settings.shutdown_timeout + 10)
        for proc in self.front_ends.values():
            if proc.is_alive():
                _signal(proc, signal.SIGKILL)
                proc.join(5)
        self.stop_engine()
        if self.signals and any(engine.exitcode not in (0, None, -signal.SIGTERM) for engine in self.engines):
            self.status = 1


def _signal(proc, sig) -> None:
    if proc.pid is not None and proc.exitcode is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, sig)
