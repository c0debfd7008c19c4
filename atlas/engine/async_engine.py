"""AsyncEngine: the asyncio front of EngineCore, for the server.

The EngineCore step loop runs in a thread of its own, so a slow step never blocks the event loop
that accepts connections and streams tokens. The two sides meet in three places only:

- requests and aborts are queued as operations (a deque + an Event) that the engine thread applies
  between steps; an add is acknowledged through a concurrent Future, so the caller gets the
  engine's validation error (InvalidRequestError, PromptTooLongError) as its own exception;
- each step's outputs are handed to the per-request asyncio queues with one
  `loop.call_soon_threadsafe` per event loop;
- a stream that is closed before its request finished (client gone, task cancelled) queues an abort,
  which frees the request's KV pages at the next step boundary.

An exception inside a step fails the requests that were running (their streams raise
EngineStepError), frees their pages and lets the waiting requests go on. If the loop itself breaks,
or a parallel engine loses a rank (WorkerError, even while idle), every stream fails with
EngineDeadError, `healthy` turns False and the `dead_listeners` are called (the server exits).

This module needs nothing beyond the standard library and the engine: no web framework.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from atlas.config import EngineConfig
from atlas.engine.core import EngineCore, PromptInput
from atlas.engine.info import EngineInfo
from atlas.errors import InvalidRequestError, WorkerError
from atlas.lora_request import LORA_CALLS
from atlas.outputs import RequestOutput
from atlas.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineStepError(RuntimeError):
    """The engine failed while it was running this request (a server fault, not the client's)."""


class EngineDeadError(RuntimeError):
    """The engine loop is not running (it broke, or the server is shutting down)."""


async def compile_in_time(compiled: Awaitable, info: EngineInfo) -> None:
    """Wait for a compile for at most the compile timeout (shielded: the compile goes on after a timeout, and
    its result is cached for the next request)."""
    try:
        await asyncio.wait_for(asyncio.shield(compiled), info.compile_timeout)
    except asyncio.TimeoutError:
        raise InvalidRequestError(info.compile_timeout_message(), param="structured_outputs") from None


def loop_failure(exc: BaseException) -> str:
    """Log why an engine loop stopped; -> the reason its streams are given. (A WorkerError's message says that
    the engine stopped, and why.)"""
    if isinstance(exc, WorkerError):
        logger.error("%s", exc)
        return str(exc)
    logger.error("the engine loop stopped", exc_info=exc)
    return f"the engine stopped after an internal error ({type(exc).__name__}: {exc})"


def step_error(exc: BaseException) -> EngineStepError:
    return EngineStepError(f"the engine failed while running this request ({type(exc).__name__}: {exc})")


class RequestStream:
    """The outputs of one request, as an async iterator of cumulative RequestOutputs. A reader that falls
    behind gets the newest output, not every intermediate one: the stream holds one output at most, so a
    client that stops reading costs nothing per step.

    Iteration ends after the output with `finished=True`. `close()` (or leaving `async with`) before
    that aborts the request and frees its pages.
    """

    def __init__(self, engine: Any, request_id: str, loop: asyncio.AbstractEventLoop):
        self.engine = engine
        self.request_id = request_id
        self.loop = loop
        self._latest: RequestOutput | None = None  # the newest output not read yet
        self._error: BaseException | None = None
        self._ready = asyncio.Event()
        self.finished = False
        self.closed = False

    def put(self, item: RequestOutput | BaseException) -> None:
        """(in the stream's event loop) A newer output, or the error that ends the request."""
        if isinstance(item, BaseException):
            self._error = item
        else:
            self._latest = item
        self._ready.set()

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished or self.closed:
            raise StopAsyncIteration
        while self._latest is None and self._error is None:
            self._ready.clear()
            await self._ready.wait()
        item, self._latest = self._latest, None
        if self._error is not None and (item is None or not item.finished):
            self.close()
            raise self._error
        if item.finished:
            self.finished = True
            self.engine._forget(self)
        return item

    def close(self) -> None:
        """Stop listening; abort the request if it has not finished."""
        if self.closed:
            return
        self.closed = True
        self.engine._forget(self)
        if not self.finished:
            self.engine.abort(self.request_id)

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self.close()


def _put_all(items: list[tuple[RequestStream, Any]]) -> None:
    for stream, item in items:
        stream.put(item)


class AsyncEngine:
    """Runs EngineCore.step() in a background thread and streams outputs to asyncio tasks."""

    def __init__(self, engine: EngineCore, start: bool = True):
        self.engine = engine
        self._ops: deque[tuple] = deque()
        self._wakeup = threading.Event()
        self._lock = threading.Lock()  # guards _streams
        self._streams: dict[str, RequestStream] = {}
        self._stopping = False
        self._cut_error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self.dead_reason: str | None = None
        self.num_step_failures = 0
        self._info: EngineInfo | None = None
        self.metrics = None  # EngineMetrics, after enable_metrics
        self.max_waiting = 0  # (admission is the front end's here: it sees every request)
        self.response_store = None  # the Responses API's past conversations, made on first use
        # Called in the engine thread with each finished RequestOutput (e.g. to record metrics).
        self.finish_listeners: list[Callable[[RequestOutput], None]] = []
        # Called once if the engine dies (with dead_reason set), e.g. to stop the server.
        self.dead_listeners: list[Callable[[], None]] = []
        if getattr(engine, "parallel", None) is not None:  # a lost rank wakes the loop, which then ends
            engine.parallel.failure_listeners.append(self._wakeup.set)
        if start:
            self.start()

    @classmethod
    def from_config(cls, config: EngineConfig, start: bool = True) -> AsyncEngine:
        return cls(EngineCore(config), start=start)

    # ------------------------------------------------------------------ life cycle
    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="atlas-engine", daemon=True)
        self._thread.start()
        self.engine.prepare_structured_outputs()

    @property
    def healthy(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the loop: unfinished requests are aborted (pages freed) and their streams fail."""
        self._stopping = True
        self._wakeup.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
            if self._thread.is_alive():
                logger.warning("the engine thread did not stop within %.0fs", timeout)
        shutdown = getattr(self.engine, "shutdown", None)
        if shutdown is not None and not (self._thread is not None and self._thread.is_alive()):
            shutdown()  # (a parallel engine's workers)

    # ------------------------------------------------------------------ what a front end asks
    @property
    def info(self) -> EngineInfo:
        if self._info is None:
            self._info = EngineInfo.of(self.engine)
        return self._info

    async def compile_constraint(self, spec: Any) -> None:
        """Compile a constraint (or find it in the cache) off the event loop and the engine thread. Raises
        InvalidRequestError when it does not compile, or not within --structured-outputs-compile-timeout."""
        await compile_in_time(asyncio.wrap_future(self.engine.structured.compile(spec)), self.info)

    def enable_metrics(self, model_name: str) -> None:
        """Keep the Prometheus metrics of this engine (atlas/engine/metrics.py; needs prometheus-client)."""
        from atlas.engine.metrics import EngineMetrics

        if self.metrics is None:
            self.metrics = EngineMetrics(self.engine, model_name, lambda: self.num_step_failures)
            self.finish_listeners.append(self.metrics.on_finished)

    async def render_metrics(self) -> bytes:
        return self.metrics.render() if self.metrics is not None else b""

    async def store_response(self, response_id: str, messages: list) -> None:
        """Keep a Responses API conversation for previous_response_id (atlas/server/responses.py)."""
        self._responses().put(response_id, messages)

    async def load_response(self, response_id: str) -> list | None:
        return self._responses().get(response_id)

    def _responses(self):
        if self.response_store is None:
            from atlas.engine.response_store import ResponseStore

            self.response_store = ResponseStore()
        return self.response_store

    # ------------------------------------------------------------------ requests (event-loop side)
    async def add_request(self, prompt: PromptInput, params: SamplingParams, request_id: str | None = None,
                          arrival_time: float | None = None, group: str | None = None,
                          lora: str | None = None) -> RequestStream:
        """Queue a request and wait until the engine accepted it. Raises the engine's
        InvalidRequestError for bad input, EngineDeadError if the engine is not running. lora: the name of its
        LoRA adapter (None: the base model)."""
        if self._cut_error is not None:
            raise type(self._cut_error)(str(self._cut_error))
        if not self.healthy:
            raise EngineDeadError(self.dead_reason or "the engine is not running")
        request_id = request_id or self.engine.new_request_id()
        stream = RequestStream(self, request_id, asyncio.get_running_loop())
        with self._lock:
            if request_id in self._streams:
                raise InvalidRequestError(f"request id {request_id!r} is already in use", param="request_id")
            self._streams[request_id] = stream
        accepted: concurrent.futures.Future = concurrent.futures.Future()
        self._submit(("add", prompt, params, request_id, arrival_time or time.time(), accepted, group, lora))
        if self._stopping:  # the loop may have drained its queue already: nobody would answer
            self._drain_ops(EngineDeadError(self.dead_reason or "the server is shutting down"))
        try:
            await asyncio.wrap_future(accepted)
        except BaseException:
            stream.close()  # (rejected, or the caller went away meanwhile: nothing stays queued)
            raise
        return stream

    async def lora_call(self, method: str, *args: Any) -> Any:
        """LoRA adapters (--enable-lora): "load_lora_adapter"(name, path), "unload_lora_adapter"(name) or
        "lora_adapters"(), run on the engine's thread."""
        if method not in LORA_CALLS:
            raise InvalidRequestError(f"unknown LoRA call {method!r}")
        if not self.healthy:
            raise EngineDeadError(self.dead_reason or "the engine is not running")
        if method == "load_lora_adapter":  # the files read off the engine's thread (steps go on), then added on it
            prepared = await asyncio.get_running_loop().run_in_executor(None, self.engine.read_lora_adapter, *args)
            method, args = "add_lora_adapter", (args[0], prepared)
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._submit(("call", method, args, done))
        return await asyncio.wrap_future(done)

    async def generate(self, prompt: PromptInput, params: SamplingParams, request_id: str | None = None,
                       arrival_time: float | None = None) -> AsyncIterator[RequestOutput]:
        """Cumulative outputs of one request until it finishes. Closing the iterator early (or
        cancelling the task that iterates it) aborts the request."""
        stream = await self.add_request(prompt, params, request_id, arrival_time)
        async with stream:
            async for out in stream:
                yield out

    def cut(self, error: BaseException) -> int:
        """Fail every open stream with `error` now and abort its request (pages are freed before the next
        step); requests added later fail with it too. For a server whose shutdown timeout has passed.
        Returns the number of requests cut."""
        self._cut_error = error
        with self._lock:
            streams = list(self._streams.values())
            self._streams.clear()
        self._post([(stream, error) for stream in streams])
        for stream in streams:
            self.abort(stream.request_id)
        return len(streams)

    def abort(self, request_id: str) -> None:
        """Abort a request (thread-safe, returns at once; the pages are freed before the next step)."""
        self._submit(("abort", request_id))

    def _submit(self, op: tuple) -> None:
        self._ops.append(op)
        self._wakeup.set()

    def _forget(self, stream: RequestStream) -> None:
        with self._lock:
            if self._streams.get(stream.request_id) is stream:
                del self._streams[stream.request_id]

    @property
    def num_streams(self) -> int:
        return len(self._streams)

    # ------------------------------------------------------------------ the engine thread
    def _run(self) -> None:
        engine = self.engine
        try:
            check_alive = getattr(engine, "check_alive", lambda: None)
            while not self._stopping:
                self._wakeup.clear()  # before draining, so that an op queued after the drain wakes us
                check_alive()
                self._apply_ops()
                if not engine.has_unfinished():
                    self._wakeup.wait()
                    continue
                try:
                    outputs = engine.step()
                except WorkerError:
                    raise  # a parallel engine that lost a rank cannot go on
                except Exception as exc:  # noqa: BLE001 - a failed step must not end the server
                    self._recover(exc)
                    continue
                self._deliver(outputs)
        except BaseException as exc:
            self.dead_reason = loop_failure(exc)
        finally:
            self._stopping = True
            reason = self.dead_reason or "the server is shutting down"
            self._fail_all(EngineDeadError(reason))
            if self.dead_reason is not None:
                for listener in self.dead_listeners:
                    try:
                        listener()
                    except Exception:  # noqa: BLE001 - best effort while going down
                        logger.exception("dead listener failed")

    def _apply_ops(self) -> None:
        engine = self.engine
        while True:
            try:
                op = self._ops.popleft()
            except IndexError:
                return
            if op[0] == "add":
                _, prompt, params, request_id, arrival_time, accepted, group, lora = op
                if not accepted.set_running_or_notify_cancel():
                    continue  # the caller gave up before the engine saw it
                try:
                    engine.add_request(prompt, params, request_id, arrival_time, group, lora=lora)
                except Exception as exc:  # noqa: BLE001 - handed to the caller
                    accepted.set_exception(exc)
                else:
                    accepted.set_result(request_id)
            elif op[0] == "call":
                _, method, args, done = op
                if not done.set_running_or_notify_cancel():
                    continue
                try:
                    done.set_result(getattr(engine, method)(*args))
                except Exception as exc:  # noqa: BLE001 - handed to the caller
                    done.set_exception(exc)
            else:
                engine.abort_request(op[1])

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        with self._lock:
            pairs = [(self._streams.get(out.request_id), out) for out in outputs]
        self._post(pairs)
        for out in outputs:
            if out.finished:
                for listener in self.finish_listeners:
                    try:
                        listener(out)
                    except Exception:  # noqa: BLE001 - metrics must never break serving
                        logger.exception("finish listener failed")

    def _fail(self, request_ids: list[str], error: BaseException) -> None:
        with self._lock:
            pairs = [(self._streams.pop(rid, None), error) for rid in request_ids]
        self._post(pairs)

    @staticmethod
    def _post(pairs: list[tuple[RequestStream | None, Any]]) -> None:
        """Hand items to their streams' queues: one call_soon_threadsafe per event loop."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for stream, item in pairs:
            if stream is not None:
                by_loop.setdefault(stream.loop, []).append((stream, item))
        for loop, items in by_loop.items():
            with contextlib.suppress(RuntimeError):  # that loop is closed: nobody is listening any more
                loop.call_soon_threadsafe(_put_all, items)

    def _drain_ops(self, error: BaseException) -> None:
        """Fail the adds that never reached the engine (it is stopping); aborts are moot then."""
        while True:
            try:
                op = self._ops.popleft()
            except IndexError:
                return
            if op[0] == "add" and op[5].set_running_or_notify_cancel():
                op[5].set_exception(error)

    def _recover(self, exc: Exception) -> None:
        """A step raised: fail and abort the requests that were running, keep the waiting ones."""
        self.num_step_failures += 1
        running = self.engine.fail_running()
        logger.error("engine step failed (%s: %s); failed %d running request(s)", type(exc).__name__, exc,
                     len(running), exc_info=exc)
        self._fail(running, step_error(exc))

    def _fail_all(self, error: BaseException) -> None:
        engine = self.engine
        try:
            for rid in list(engine.parents):
                engine.abort_request(rid)
        except Exception:  # noqa: BLE001 - best effort while going down
            logger.exception("could not abort every request")
        self._drain_ops(error)
        with self._lock:
            ids = list(self._streams)
        self._fail(ids, error)
