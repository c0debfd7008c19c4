"""A front end's handle on an engine in another process (atlas/engine/engine_process.py).

EngineClient offers what the HTTP app uses of AsyncEngine (add_request -> a stream of cumulative
RequestOutputs, abort, cut, health, the engine's info, constraint compiles, metrics) over one ZeroMQ DEALER
socket, all in the front end's event loop: one receive per engine step carries the new tokens of every
request of this front end, and each request's stream only marks itself updated. The cumulative output a
reader gets is built when it reads, so a client that reads slowly gets its pending tokens in one piece and a
client that stops reading costs nothing per step.

Output text: for a request without stop strings, the front end detokenizes the token ids itself when it was given
a tokenizer (the engine then makes no text for it), batched over the requests of each engine step; the engine's
host time per step is what every stream waits on, and several front ends share this work. A request with stop
strings gets its text from the engine, which must see the text to stop on it.

The engine process is watched (its pid, every 0.1 s): when it is gone, or sends Dead, every open stream fails
with EngineDeadError, `healthy` turns False and the `dead_listeners` are called (the front end then exits).
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import copy
import dataclasses
import itertools
import logging
import os
import pickle
import time
from array import array
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any

import msgspec

from atlas.engine import wire
from atlas.engine.async_engine import EngineDeadError, EngineStepError, RequestStream, compile_in_time
from atlas.engine.info import EngineInfo
from atlas.engine.tokenizer import IncrementalDetokenizer, Tokenizer, detokenize_runs
from atlas.errors import InvalidRequestError, ModelNotFoundError, PromptTooLongError, ServerBusyError
from atlas.lora_request import LORA_CALLS
from atlas.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from atlas.processes import process_alive
from atlas.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
# (a finished request's metrics travel as dataclasses.astuple: fields in this order, the inherited ones first)
_METRICS_FIELDS = tuple(f.name for f in dataclasses.fields(RequestMetrics))

WATCH_INTERVAL_S = 0.1

_ERRORS: dict[str, type[Exception]] = {
    "InvalidRequestError": InvalidRequestError, "GrammarCompileError": InvalidRequestError,
    "PromptTooLongError": PromptTooLongError, "ServerBusyError": ServerBusyError,
    "ModelNotFoundError": ModelNotFoundError,
}


def _error_of(reply: wire.Reply) -> Exception:
    cls = _ERRORS.get(reply.error_type)
    if cls is None:
        return EngineStepError(f"the engine could not take this request ({reply.error_type}: {reply.error})")
    if issubclass(cls, InvalidRequestError):
        return cls(reply.error, param=reply.param)
    return cls(reply.error)


_ENCODER = msgspec.msgpack.Encoder()
_ENTRIES = msgspec.msgpack.Decoder(list[dict[int, Logprob] | None])


def _run_length(raw: Any) -> int | None:
    """The entries of one delta's logprobs as msgpack (an array: its header says how many), None for nil."""
    with memoryview(raw) as head:
        kind = head[0]
        if 0x90 <= kind <= 0x9F:
            return kind & 0x0F
        if kind in (0xDC, 0xDD):
            return int.from_bytes(head[1:3 if kind == 0xDC else 5], "big")
    if kind == 0xC0:
        return None
    raise ValueError(f"logprobs: not a msgpack array (0x{kind:02x})")


class Logprobs(Sequence):
    """A sequence's logprob entries as the engine sent them: each delta's msgpack, one run after the other in one
    buffer, decoded into {token id: Logprob} dicts when read (an index, a slice, iteration).

    Kept as objects, a request of 2 prompts x n = 128 x 200 tokens with 20 logprobs made a million of them on the
    event loop while it ran (about 3.5 ms a step), and the front end's heap stayed hundreds of MiB up after it:
    the small-object allocator gives an arena back only once every object in it is gone, and what other requests
    kept meanwhile is spread over them all. Here they are a few hundred bytes a token in one buffer (C memory, which
    the heap trim gives back), and a reader makes the entries it reads as it goes (the large response: a choice at
    a time).

    Append-only: `view()`, a snapshot of the entries so far, stays as it is while runs are appended, and `cut()`
    (the engine took tokens back) makes a new one."""

    __slots__ = ("_buf", "_ends", "_tokens", "_n")

    def __init__(self) -> None:
        self._buf = bytearray()
        self._ends = array("q")  # where each run ends in _buf
        self._tokens = array("q")  # the entries up to the end of each run
        self._n = 0

    def append(self, raw: Any) -> None:
        """One delta's entries: their msgpack array (a msgspec.Raw), nil for none."""
        count = _run_length(raw)
        if not count:
            return
        self._buf += raw
        self._ends.append(len(self._buf))
        self._n += count
        self._tokens.append(self._n)

    def view(self) -> Logprobs:
        snapshot = Logprobs.__new__(Logprobs)
        snapshot._buf, snapshot._ends, snapshot._tokens, snapshot._n = self._buf, self._ends, self._tokens, self._n
        return snapshot

    def cut(self, n: int) -> Logprobs:
        """The first n entries, in a new Logprobs (views of this one stay as they are)."""
        if n >= self._n:
            return self
        out = Logprobs()
        for j in range(self._runs()):
            start = self._tokens[j - 1] if j else 0
            if start >= n:
                break
            if self._tokens[j] <= n:
                out.append(self._buf[self._ends[j - 1] if j else 0:self._ends[j]])
            else:
                out.append(_ENCODER.encode(self._run(j)[:n - start]))
        return out

    def _runs(self) -> int:
        return bisect.bisect_right(self._tokens, self._n)  # (a view ends where a run ends)

    def _run(self, j: int) -> list:
        # (a copy of the run's bytes: the buffer may grow meanwhile in the event loop, and a thread may be reading)
        return _ENTRIES.decode(self._buf[self._ends[j - 1] if j else 0:self._ends[j]])

    def __len__(self) -> int:
        return self._n

    def __iter__(self) -> Iterator[dict[int, Logprob] | None]:
        for j in range(self._runs()):
            yield from self._run(j)

    def __getitem__(self, index: int | slice) -> Any:
        if isinstance(index, slice):
            start, stop, step = index.indices(self._n)
            if step != 1:
                return list(self)[index]
            out: list = []
            j = bisect.bisect_right(self._tokens, start)
            while start < stop:
                first = self._tokens[j - 1] if j else 0
                out += self._run(j)[start - first:stop - first]
                start = self._tokens[j]
                j += 1
            return out
        if index < 0:
            index += self._n
        if not 0 <= index < self._n:
            raise IndexError("logprobs index out of range")
        j = bisect.bisect_right(self._tokens, index)
        return self._run(j)[index - (self._tokens[j - 1] if j else 0)]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (Logprobs, list)):
            return len(self) == len(other) and list(self) == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Logprobs({list(self)!r})"


class _Seq:
    __slots__ = ("index", "text", "token_ids", "logprobs", "cumulative_logprob", "finish_reason", "stop_reason",
                 "error")

    def __init__(self, index: int, logprobs: bool):
        self.index = index
        self.text = ""
        self.token_ids: list[int] = []
        self.logprobs: Logprobs | None = Logprobs() if logprobs else None
        self.cumulative_logprob: float | None = 0.0 if logprobs else None
        self.finish_reason = self.stop_reason = self.error = None


class ClientStream(RequestStream):
    """A request's outputs as they come from the engine process (deltas applied to its own state)."""

    def __init__(self, client: EngineClient, request_id: str, loop: asyncio.AbstractEventLoop,
                 prompt_token_ids: list[int], params: SamplingParams, tokenizer: Tokenizer | None = None):
        """tokenizer: make the output text here with it (not for stop strings, which the engine must see)."""
        super().__init__(client, request_id, loop)
        self.prompt_token_ids = prompt_token_ids
        self.seqs = [_Seq(i, params.logprobs is not None) for i in range(params.n)]
        self.prompt_logprobs: list | None = [] if params.prompt_logprobs is not None else None
        self.num_cached_tokens = 0
        self.metrics: RequestMetrics | None = None
        self.engine_done = False  # the engine sent the final output
        self.embedding: list[float] | None = None  # --runner pooling
        # Each sequence's detokenizer where this front end makes the text (None once the sequence has ended)
        self.detokenizers: list[IncrementalDetokenizer | None] | None = None
        if tokenizer is not None and params.detokenize and not params.stop_strings:
            self.detokenizers = [IncrementalDetokenizer(tokenizer, prompt_token_ids, params.skip_special_tokens)
                                 for _ in range(params.n)]
        self._dirty = False

    def apply(self, d: wire.RequestDelta) -> None:
        for sd in d.seqs:
            s = self.seqs[sd.index]
            if sd.token_offset != len(s.token_ids):
                del s.token_ids[sd.token_offset:]
            s.token_ids += sd.token_ids
            s.text = s.text + sd.text if sd.text_offset == len(s.text) else s.text[:sd.text_offset] + sd.text
            if sd.logprobs is not None and s.logprobs is not None and _run_length(sd.logprobs) is not None:
                if sd.token_offset != len(s.logprobs):
                    s.logprobs = s.logprobs.cut(sd.token_offset)
                s.logprobs.append(sd.logprobs)
            s.cumulative_logprob = sd.cumulative_logprob
            s.finish_reason, s.stop_reason, s.error = sd.finish_reason, sd.stop_reason, sd.error
        if d.prompt_logprobs is not None and self.prompt_logprobs is not None:
            del self.prompt_logprobs[d.prompt_logprobs_offset:]
            self.prompt_logprobs += d.prompt_logprobs
        self.num_cached_tokens = d.num_cached_tokens
        if d.metrics is not None:
            self.metrics = RequestMetrics(**dict(zip(_METRICS_FIELDS, d.metrics, strict=True)))
        if d.embedding is not None:
            self.embedding = d.embedding
        if d.finished:
            self.engine_done = True
        self._dirty = True
        self._ready.set()

    def restart_text(self, index: int, num_tokens: int) -> None:
        """The engine took back tokens of sequence `index` (it has num_tokens now): its text made again."""
        s = self.seqs[index]
        del s.token_ids[num_tokens:]
        old = self.detokenizers[index]
        detokenizer = IncrementalDetokenizer(old.tokenizer, self.prompt_token_ids, old.skip_special_tokens)
        s.text = "".join(detokenizer.add(t) for t in s.token_ids)
        self.detokenizers[index] = detokenizer

    def _snapshot(self) -> RequestOutput:
        outputs = [CompletionOutput(s.index, s.text, list(s.token_ids), s.cumulative_logprob,
                                    s.logprobs.view() if s.logprobs is not None else None, s.finish_reason,
                                    s.stop_reason, s.error) for s in self.seqs]
        return RequestOutput(self.request_id, None, self.prompt_token_ids, outputs, self.engine_done,
                             self.num_cached_tokens, self.metrics,
                             list(self.prompt_logprobs) if self.prompt_logprobs is not None else None,
                             self.embedding)

    async def __anext__(self) -> RequestOutput:
        if self.finished or self.closed:
            raise StopAsyncIteration
        while not self._dirty and self._error is None:
            self._ready.clear()
            await self._ready.wait()
        if self._error is not None and not self.engine_done:
            self.close()
            raise self._error
        self._dirty = False
        out = self._snapshot()
        if out.finished:
            self.finished = True
            self.engine._forget(self)
        return out


class EngineClient:
    """The engine in another process, as the HTTP app sees it. `start()` runs in the front end's event loop."""

    def __init__(self, info: EngineInfo, address: str, index: int = 0, parent_pid: int | None = None,
                 tokenizer: Tokenizer | None = None):
        """tokenizer: the one to detokenize outputs with in this front end (None: the engine makes the text)."""
        self.info = info
        self.tokenizer = tokenizer
        self.address = address
        self.index = index
        self.parent_pid = parent_pid  # the launcher: without it nobody could stop this front end cleanly
        self.dead_reason: str | None = None
        self.dead_listeners: list[Callable[[], None]] = []
        self.max_waiting = 0
        self._streams: dict[str, ClientStream] = {}
        self._calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self._ids = itertools.count()
        self._cut_error: BaseException | None = None
        self._socket = None
        self._context = None
        self._tasks: list[asyncio.Task] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._outbox: list[Any] = []  # (messages for the engine, sent at the end of this turn of the loop: _send)
        self._stopping = False

    # ------------------------------------------------------------------ life cycle
    def start(self) -> None:
        if self._socket is not None:
            return
        import zmq
        import zmq.asyncio

        self._loop = asyncio.get_running_loop()
        self._context = zmq.asyncio.Context(io_threads=1)
        sock = self._context.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, f"{self.index}-{os.getpid()}".encode())
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.address)
        self._socket = sock
        self._send(wire.Hello(self.index, os.getpid()))
        self._tasks = [asyncio.ensure_future(self._read()), asyncio.ensure_future(self._watch())]

    @property
    def healthy(self) -> bool:
        return self._socket is not None and self.dead_reason is None and not self._stopping

    def shutdown(self, timeout: float = 0.0) -> None:
        """Stop talking to the engine (which the launcher stops); safe from any thread."""
        self._stopping = True
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(self._close)

    def _close(self) -> None:
        for task in self._tasks:
            task.cancel()
        if self._socket is not None:
            self._socket.close(linger=0)
        if self._context is not None:
            self._context.term()

    # ------------------------------------------------------------------ requests
    async def add_request(self, prompt: Any, params: SamplingParams, request_id: str | None = None,
                          arrival_time: float | None = None, group: str | None = None,
                          lora: str | None = None) -> ClientStream:
        if self._cut_error is not None:
            raise type(self._cut_error)(str(self._cut_error))
        if not self.healthy:
            raise EngineDeadError(self.dead_reason or "the engine is not running")
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            ids = list(prompt["prompt_token_ids"])
        elif isinstance(prompt, (list, tuple)):
            ids = list(prompt)
        else:
            raise InvalidRequestError("the engine process takes prompt token ids (tokenize in the front end)",
                                      param="prompt")
        params.validate()
        request_id = request_id or f"req-{self.index}-{next(self._ids)}"
        if request_id in self._streams:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", param="request_id")
        stream = ClientStream(self, request_id, asyncio.get_running_loop(), ids, params, self.tokenizer)
        sent = params
        if stream.detokenizers is not None:
            sent = copy.copy(params)
            sent.detokenize = False  # (the text is made here)
        self._streams[request_id] = stream
        call_id, reply = self._new_call()
        self._send(wire.Add(call_id, request_id, ids, pickle.dumps(sent), arrival_time or time.time(),
                            self.max_waiting, group or "", lora or ""))
        try:
            await reply
        except BaseException:
            stream.close()  # (refused, or the caller went away: nothing stays queued)
            raise
        return stream

    async def generate(self, prompt: Any, params: SamplingParams, request_id: str | None = None,
                       arrival_time: float | None = None) -> AsyncIterator[RequestOutput]:
        stream = await self.add_request(prompt, params, request_id, arrival_time)
        async with stream:
            async for out in stream:
                yield out

    def has_request(self, request_id: str) -> bool:
        """Whether a request of that id is open here (its stream not yet closed)."""
        return request_id in self._streams

    def abort(self, request_id: str) -> None:
        if self._socket is not None and self.dead_reason is None:
            self._send(wire.Abort([request_id]))

    def cut(self, error: BaseException) -> int:
        """Fail every open stream with `error` now and abort its request; later requests fail with it too."""
        self._cut_error = error
        streams = list(self._streams.values())
        self._streams.clear()
        for stream in streams:
            stream.put(error)
        if streams and self.dead_reason is None:
            self._send(wire.Abort([s.request_id for s in streams]))
        return len(streams)

    def _forget(self, stream: RequestStream) -> None:
        if self._streams.get(stream.request_id) is stream:
            del self._streams[stream.request_id]

    @property
    def num_streams(self) -> int:
        return len(self._streams)

    # ------------------------------------------------------------------ questions
    async def compile_constraint(self, spec: Any) -> None:
        call_id, reply = self._new_call()
        self._send(wire.Call(call_id, "compile", pickle.dumps(spec)))
        await compile_in_time(reply, self.info)

    def enable_metrics(self, model_name: str) -> None:
        """(The engine process keeps the metrics, for every front end.)"""

    async def lora_call(self, method: str, *args: Any) -> Any:
        """(AsyncEngine.lora_call, in the engine process)"""
        if method not in LORA_CALLS:
            raise InvalidRequestError(f"unknown LoRA call {method!r}")
        call_id, reply = self._new_call()
        self._send(wire.Call(call_id, "lora", pickle.dumps((method, args))))
        return pickle.loads(await reply)

    async def render_metrics(self) -> bytes:
        call_id, reply = self._new_call()
        self._send(wire.Call(call_id, "metrics"))
        return await reply  # (the exposition text, as the engine rendered it)

    async def store_response(self, response_id: str, messages: list) -> None:
        """(kept in the engine process, so that every front end finds it)"""
        call_id, reply = self._new_call()
        self._send(wire.Call(call_id, "response_put", pickle.dumps((response_id, messages))))
        await reply

    async def load_response(self, response_id: str) -> list | None:
        call_id, reply = self._new_call()
        self._send(wire.Call(call_id, "response_get", pickle.dumps(response_id)))
        return pickle.loads(await reply)

    def _new_call(self) -> tuple[int, asyncio.Future]:
        if not self.healthy:
            raise EngineDeadError(self.dead_reason or "the engine is not running")
        call_id = next(self._call_ids)
        future = asyncio.get_running_loop().create_future()
        self._calls[call_id] = future
        return call_id, future

    def _send(self, message: Any) -> None:
        """Queue a message for the engine, sent with the others of this turn of the event loop (one send for a
        burst of requests); at once from outside the loop."""
        outbox = self._outbox
        outbox.append(message)
        if len(outbox) > 1:
            return  # (the flush is scheduled)
        try:
            running = asyncio.get_running_loop() is self._loop
        except RuntimeError:
            running = False
        if running:
            self._loop.call_soon(self._flush)
        else:
            self._flush()

    def _flush(self) -> None:
        outbox, self._outbox = self._outbox, []
        if not outbox or self._socket is None or self._socket.closed:
            return
        message = outbox[0] if len(outbox) == 1 else wire.Batch(outbox)
        self._socket.send(wire.encoder.encode(message))

    # ------------------------------------------------------------------ from the engine
    async def _read(self) -> None:
        decode = wire.front_end_decoder.decode
        try:
            while True:
                message = decode(await self._socket.recv(copy=False))
                if isinstance(message, wire.Step):
                    self._on_step(message)
                elif isinstance(message, wire.Reply):
                    self._on_reply(message)
                elif isinstance(message, wire.Replies):
                    for reply in message.replies:
                        self._on_reply(reply)
                elif isinstance(message, wire.Dead):
                    self._die(message.reason)
                    return
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - without this reader nothing reaches the clients
            if not self._stopping:
                logger.exception("the front end's link to the engine broke")
                self._die(f"the link to the engine broke ({type(exc).__name__}: {exc})")

    def _on_step(self, step: wire.Step) -> None:
        streams = self._streams
        touched = []
        local = False
        for delta in step.outputs:
            stream = streams.get(delta.request_id)
            if stream is not None:
                touched.append((stream, delta))
                local |= stream.detokenizers is not None
        if local:
            self._detokenize(touched)
        for stream, delta in touched:
            stream.apply(delta)
        if step.failed:
            error = EngineStepError(step.failure)
            for rid in step.failed:
                stream = streams.pop(rid, None)
                if stream is not None:
                    stream.put(error)

    def _detokenize(self, touched: list[tuple[ClientStream, wire.RequestDelta]]) -> None:
        """The text of this step's new tokens for the streams whose text is made here, in one batched decode, put
        into their deltas as the engine would have sent it: a stop token has no text, and a sequence that stopped
        or reached its length gets the text still held back for a partial character."""
        detokenizers, runs, targets = [], [], []
        for stream, delta in touched:
            if stream.detokenizers is None:
                continue
            for sd in delta.seqs:
                detokenizer = stream.detokenizers[sd.index]
                seq = stream.seqs[sd.index]
                if detokenizer is None:  # (ended: its text is complete; the engine's offset is that of no text)
                    sd.text_offset, sd.text = len(seq.text), ""
                    continue
                if sd.token_offset != len(seq.token_ids):
                    stream.restart_text(sd.index, sd.token_offset)
                    detokenizer = stream.detokenizers[sd.index]
                tokens = sd.token_ids
                if sd.finish_reason == "stop" and tokens and not isinstance(sd.stop_reason, str):
                    tokens = tokens[:-1]
                detokenizers.append(detokenizer)
                runs.append(tokens)
                targets.append((stream, seq, sd))
        if not targets:
            return
        texts = detokenize_runs(self.tokenizer, detokenizers, runs)
        for (stream, seq, sd), detokenizer, run_texts in zip(targets, detokenizers, texts, strict=True):
            text = "".join(run_texts)
            if sd.finish_reason is not None:
                if sd.finish_reason in ("stop", "length"):
                    text += detokenizer.flush()
                stream.detokenizers[sd.index] = None
            sd.text_offset, sd.text = len(seq.text), text

    def _on_reply(self, reply: wire.Reply) -> None:
        future = self._calls.pop(reply.call_id, None)
        if future is None or future.done():
            return
        if reply.ok:
            future.set_result(reply.result)
        else:
            future.set_exception(_error_of(reply))

    async def _watch(self) -> None:
        pid = self.info.pid
        while self.dead_reason is None:
            await asyncio.sleep(WATCH_INTERVAL_S)
            if not process_alive(pid):
                self._die(f"the engine process (pid {pid}) exited")
            elif self.parent_pid is not None and os.getppid() != self.parent_pid:
                self._die("the server's main process is gone")

    def _die(self, reason: str) -> None:
        if self.dead_reason is not None:
            return
        self.dead_reason = reason
        if not self._stopping:
            logger.error("engine unavailable: %s", reason)
        error = EngineDeadError(reason)
        streams = list(self._streams.values())
        self._streams.clear()
        for stream in streams:
            stream.put(error)
        calls = list(self._calls.values())
        self._calls.clear()
        for future in calls:
            if not future.done():
                future.set_exception(EngineDeadError(reason))
        for listener in self.dead_listeners:
            try:
                listener()
            except Exception:  # noqa: BLE001 - best effort while going down
                logger.exception("dead listener failed")
