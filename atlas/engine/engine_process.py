"""The engine core in a process of its own, for `atlas serve`.

The process runs EngineCore's step loop and nothing else: no HTTP, no chat templates, no per-token work for
a client. Front ends (atlas/engine/engine_client.py, one per --api-server-count) reach it through one ZeroMQ
ROUTER socket (atlas/engine/wire.py). Between two steps the loop takes what the front ends sent (requests,
aborts, questions); after each step it sends each front end one message with the new tokens and text of its
requests. Sending never waits for a front end (unbounded queues in ZeroMQ's I/O thread), so a slow front end
or client cannot slow the engine.

Faults: a step that raises fails the requests that were running and the loop goes on (as in AsyncEngine); a
front end whose process is gone has its requests aborted and their pages freed; if the loop itself breaks the
front ends get a Dead message and the process exits with status 1. SIGTERM stops the loop (the launcher
sends it once the front ends have drained); SIGINT is the launcher's to handle.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import signal
import time
from typing import Any

from atlas.engine import wire
from atlas.engine.async_engine import loop_failure, step_error
from atlas.engine.info import EngineInfo
from atlas.errors import InvalidRequestError, ServerBusyError, WorkerError, busy_message
from atlas.lora_request import LORA_CALLS
from atlas.processes import give_back_memory, process_alive

logger = logging.getLogger(__name__)

# How often the loop looks whether its front ends (and the launcher) are still there.
LIVENESS_INTERVAL_S = 0.25
TRIM_AFTER_IDLE_S = 1.0  # idle this long before the heap is trimmed
STATS_INTERVAL_S = 10.0


def error_reply(call_id: int, exc: BaseException) -> wire.Reply:
    return wire.Reply(call_id, ok=False, error_type=type(exc).__name__, error=str(exc),
                      param=getattr(exc, "param", None))


class _Sent:
    """How much of one request's outputs a front end has (tokens, text and logprobs per sequence)."""

    __slots__ = ("owner", "tokens", "text", "prompt_logprobs")

    def __init__(self, owner: bytes, n: int):
        self.owner = owner
        self.tokens = [0] * n
        self.text = [0] * n
        self.prompt_logprobs = 0


def _hand_over(entries: list, start: int) -> list:
    """entries[start:], to send (msgspec writes the Logprobs as they are), forgotten here: None in their places (the
    list keeps its length, which the output processor counts). The front end keeps a request's logprobs from the
    deltas it gets; kept here as well, a request of 2 prompts x n = 128 x 200 tokens with 20 logprobs held a
    million entries in the engine too, and left its heap a hundred MiB up after it."""
    sent = entries[start:]
    entries[start:] = [None] * len(sent)
    return sent


class StatsLog:
    """A line every STATS_INTERVAL_S while requests run (vLLM's periodic stats): throughput since the last line,
    running and waiting sequences, KV cache use, prefix-cache hits and speculative acceptance."""

    def __init__(self, core, name: str = "engine"):
        self.core = core
        self.name = name  # (the line's first word: "engine", or "engine R" for replica R under -dp)
        self.last = time.monotonic()
        self.prompt_tokens = self.generation_tokens = 0
        self.idle_logged = True
        self.holds, self.held_s = 0, 0.0  # (--tuning late_scheduling: the device clock's totals at the last line)

    def maybe_log(self) -> None:
        now = time.monotonic()
        if now - self.last < STATS_INTERVAL_S:
            return
        core, stats = self.core, self.core.stats
        prompt, generation = stats.num_prompt_tokens, stats.num_generation_tokens
        busy = core.has_unfinished() or prompt != self.prompt_tokens or generation != self.generation_tokens
        if busy or not self.idle_logged:
            sched, kv = core.scheduler, core.kv
            seconds = now - self.last
            line = (f"{self.name}: {(prompt - self.prompt_tokens) / seconds:,.1f} prompt tok/s, "
                    f"{(generation - self.generation_tokens) / seconds:,.1f} generation tok/s, running "
                    f"{len(sched.running)}, waiting {len(sched.waiting)}, KV cache {100 * kv.usage:.1f} %, prefix "
                    f"cache hits {100 * kv.stats.hit_rate:.1f} %")
            if stats.spec_num_draft_tokens:
                line += f", draft acceptance {100 * stats.spec_acceptance_rate:.1f} %"
            if core.proposer is not None:
                line += f", draft length {stats.spec_draft_length}"
            clock = core.device_clock
            if clock is not None:  # (how often, and how long, scheduling waited for arrivals)
                holds, held = clock.holds - self.holds, clock.held_s - self.held_s
                line += f", scheduling held {holds} times, {1000 * held / max(1, holds):.1f} ms each"
                self.holds, self.held_s = clock.holds, clock.held_s
            logger.info(line)
            self.idle_logged = not busy
        self.last, self.prompt_tokens, self.generation_tokens = now, prompt, generation


class EngineServer:
    """EngineCore's loop behind a ROUTER socket bound at `address`."""

    def __init__(self, core, address: str, model_name: str, log_stats: bool = False, replica: int | None = None):
        """replica: this engine's index under --data-parallel-size (None without)."""
        import zmq

        self.core = core
        self.zmq = zmq
        self.context = zmq.Context(io_threads=1)
        self.socket = self.context.socket(zmq.ROUTER)
        self.replies: dict[bytes, list[wire.Reply]] | None = None  # (while reading the socket: _receive)
        self.socket.setsockopt(zmq.SNDHWM, 0)  # never drop or block: a slow front end must not cost a step
        self.socket.setsockopt(zmq.RCVHWM, 0)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind(address)
        self.poller = zmq.Poller()
        self.poller.register(self.socket, zmq.POLLIN)
        self.front_ends: dict[bytes, int] = {}  # identity -> pid
        self.sent: dict[str, _Sent] = {}  # request id -> what its front end has
        # calls answered later (compiles, adapter reads): (front end, call id, future, what to do with its result on
        # this thread before answering, or None)
        self.calls: list[tuple[bytes, int, Any, Any]] = []
        self._reads = None  # the thread that reads LoRA adapters (made on first use)
        self.stopping = False
        self.dead_reason: str | None = None
        self.num_step_failures = 0
        self.parent_pid = os.getppid()
        self._next_check = 0.0
        self.stats_log = StatsLog(core, "engine" if replica is None else f"engine {replica}") if log_stats else None
        self.responses = None  # ResponseStore, on first use
        core.output_processor.emit = self._emit  # (deltas straight from the sequences' state)
        self.metrics = None
        try:
            from atlas.engine.metrics import EngineMetrics
        except ImportError:  # (prometheus-client is a server extra)
            pass
        else:
            self.metrics = EngineMetrics(core, model_name, lambda: self.num_step_failures, replica)

    # ------------------------------------------------------------------ the loop
    def run(self) -> int:
        core = self.core
        core.prepare_structured_outputs()
        idle_since: float | None = None  # (set when the last request finished; None once the heap is trimmed)
        try:
            while not self.stopping:
                core.check_alive()
                busy = core.has_unfinished()
                if busy:
                    idle_since = None
                elif idle_since is None:
                    idle_since = time.monotonic()
                elif idle_since and time.monotonic() - idle_since >= TRIM_AFTER_IDLE_S:
                    # What the finished requests freed goes back to the system, once the engine has stayed idle:
                    # the trim walks the whole heap (tens of ms in a GPU process), and a client that sends its next
                    # request at once must not wait for it.
                    give_back_memory()
                    idle_since = 0.0
                self._receive(0 if busy else (5 if self.calls else int(LIVENESS_INTERVAL_S * 1000)))
                self._answer_calls()
                self._check_liveness()
                if self.stats_log is not None:
                    self.stats_log.maybe_log()
                if self.stopping or not core.has_unfinished():
                    continue
                if core.device_clock is not None:
                    self._hold(core.device_clock.hold_until())
                try:
                    outputs = core.step()
                except WorkerError:
                    raise
                except Exception as exc:  # noqa: BLE001 - a failed step must not end the server
                    self._recover(exc)
                    continue
                if outputs:
                    self._send_outputs(outputs)
        except BaseException as exc:
            self.dead_reason = loop_failure(exc)
        finally:
            self._close()
        return 1 if self.dead_reason is not None else 0

    def stop(self, *_: Any) -> None:
        self.stopping = True

    def _close(self) -> None:
        try:
            for rid in list(self.core.parents):
                self.core.abort_request(rid)
        except Exception:  # noqa: BLE001 - best effort while going down
            logger.exception("could not abort every request")
        if self.dead_reason is not None:
            for identity in self.front_ends:
                self._send(identity, wire.Dead(self.dead_reason))
        if self._reads is not None:
            self._reads.shutdown(wait=False, cancel_futures=True)
        self.socket.close(linger=500 if self.dead_reason is not None else 0)
        self.context.term()
        shutdown = getattr(self.core, "shutdown", None)
        if shutdown is not None:
            shutdown()

    # ------------------------------------------------------------------ from the front ends
    def _hold(self, until: float | None) -> None:
        """--tuning late_scheduling: take requests from the front ends until `until` (time.monotonic), when the
        step in flight should be nearly done, so that they join the step scheduled next (engine/device_clock.py)."""
        start = time.monotonic()
        while until is not None and not self.stopping:
            ms = int((until - time.monotonic()) * 1000)
            if ms < 1:
                break
            self._receive(ms)
        held = time.monotonic() - start
        clock = self.core.device_clock
        if clock is not None and held >= 0.001:
            clock.holds += 1
            clock.held_s += held

    def _receive(self, timeout_ms: int) -> None:
        zmq = self.zmq
        if timeout_ms and not self.poller.poll(timeout_ms):
            return
        # (the replies to what is read here go out together, one message a front end, once the socket is empty)
        self.replies = {}
        try:
            while True:
                try:
                    identity, payload = self.socket.recv_multipart(zmq.NOBLOCK, copy=True)
                except zmq.Again:
                    return
                try:
                    message = wire.engine_decoder.decode(payload)
                except Exception:  # noqa: BLE001 - not one of ours: ignore it
                    logger.warning("ignored a malformed message from a front end")
                    continue
                self._handle(identity, message)
        finally:
            replies, self.replies = self.replies, None
            for identity, batch in replies.items():
                self._send(identity, batch[0] if len(batch) == 1 else wire.Replies(batch))

    def _handle(self, identity: bytes, message: Any) -> None:
        if isinstance(message, wire.Batch):
            for one in message.messages:
                self._handle(identity, one)
        elif isinstance(message, wire.Add):
            self._add(identity, message)
        elif isinstance(message, wire.Abort):
            for rid in message.request_ids:
                self.core.abort_request(rid)
                self.sent.pop(rid, None)
        elif isinstance(message, wire.Call):
            self._call(identity, message)
        elif isinstance(message, wire.Hello):
            self.front_ends[identity] = message.pid
            logger.debug("front end %d (pid %d) connected", message.index, message.pid)

    def _add(self, identity: bytes, msg: wire.Add) -> None:
        core = self.core
        try:
            if msg.max_waiting and len(core.parents) >= core.config.max_num_seqs + msg.max_waiting:
                raise ServerBusyError(busy_message(core.config.max_num_seqs, msg.max_waiting))
            params = pickle.loads(msg.params)
            core.add_request({"prompt_token_ids": msg.prompt_token_ids}, params, msg.request_id, msg.arrival_time,
                             msg.group or None, lora=msg.lora or None)
        except Exception as exc:  # noqa: BLE001 - the front end's answer to its client
            self._send(identity, error_reply(msg.call_id, exc))
            return
        self.sent[msg.request_id] = _Sent(identity, params.n)
        self._send(identity, wire.Reply(msg.call_id, ok=True))

    def _call(self, identity: bytes, msg: wire.Call) -> None:
        try:
            if msg.method == "metrics":
                body = self.metrics.render() if self.metrics is not None else b""
                self._send(identity, wire.Reply(msg.call_id, ok=True, result=body))
            elif msg.method in ("response_put", "response_get"):  # the Responses API's past conversations
                if self.responses is None:
                    from atlas.engine.response_store import ResponseStore

                    self.responses = ResponseStore()
                if msg.method == "response_put":
                    self.responses.put(*pickle.loads(msg.arg))
                    result = b""
                else:
                    result = pickle.dumps(self.responses.get(pickle.loads(msg.arg)))
                self._send(identity, wire.Reply(msg.call_id, ok=True, result=result))
            elif msg.method == "lora":  # LoRA adapters: load, unload, list (engine/lora.py)
                method, args = pickle.loads(msg.arg)
                if method not in LORA_CALLS:
                    raise InvalidRequestError(f"unknown LoRA call {method!r}")
                if method == "load_lora_adapter":  # read on a thread of its own (the loop goes on), added here
                    if self._reads is None:
                        import concurrent.futures

                        self._reads = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="atlas-lora-read")
                    future = self._reads.submit(self.core.read_lora_adapter, *args)
                    self.calls.append((identity, msg.call_id, future,
                                       lambda prepared, name=args[0]: self.core.add_lora_adapter(name, prepared)))
                    return
                result = pickle.dumps(getattr(self.core, method)(*args))
                self._send(identity, wire.Reply(msg.call_id, ok=True, result=result))
            elif msg.method == "compile":  # answered once compiled (the loop goes on meanwhile)
                future = self.core.structured.compile(pickle.loads(msg.arg))
                self.calls.append((identity, msg.call_id, future, None))
            else:
                raise InvalidRequestError(f"unknown call {msg.method!r}")
        except Exception as exc:  # noqa: BLE001
            self._send(identity, error_reply(msg.call_id, exc))

    def _answer_calls(self) -> None:
        if not self.calls:
            return
        still = []
        for identity, call_id, future, then in self.calls:
            if not future.done():
                still.append((identity, call_id, future, then))
            elif future.exception() is not None:
                self._send(identity, error_reply(call_id, future.exception()))
            elif then is None:
                self._send(identity, wire.Reply(call_id, ok=True))
            else:
                try:
                    result = pickle.dumps(then(future.result()))
                except Exception as exc:  # noqa: BLE001 - (e.g. an adapter of that name added meanwhile)
                    self._send(identity, error_reply(call_id, exc))
                else:
                    self._send(identity, wire.Reply(call_id, ok=True, result=result))
        self.calls = still

    def _check_liveness(self) -> None:
        now = time.monotonic()
        if now < self._next_check:
            return
        self._next_check = now + LIVENESS_INTERVAL_S
        if os.getppid() != self.parent_pid:  # the launcher is gone: nobody can reach this engine any more
            logger.error("the server's main process is gone; the engine stops")
            self.stopping = True
            return
        for identity, pid in list(self.front_ends.items()):
            if process_alive(pid):
                continue
            del self.front_ends[identity]
            mine = [rid for rid, s in self.sent.items() if s.owner == identity]
            for rid in mine:
                self.core.abort_request(rid)
                del self.sent[rid]
            if mine:
                logger.warning("front end pid %d is gone; %d of its request(s) aborted, their pages freed", pid,
                               len(mine))

    # ------------------------------------------------------------------ to the front ends
    def _send(self, identity: bytes, message: Any) -> None:
        if self.replies is not None and isinstance(message, wire.Reply):  # (while reading: sent once it is done)
            self.replies.setdefault(identity, []).append(message)
            return
        self.socket.send_multipart([identity, wire.encoder.encode(message)], copy=False)

    def _emit(self, parent, finished: bool) -> tuple[bytes, wire.RequestDelta] | None:
        """OutputProcessor's emit here: (owner, delta) for a parent a step touched (or whose constraint did not
        compile), made from its sequences' state without copying it."""
        if finished:  # (the full output once, for the metrics; it also forgets the parent)
            out = self.core.output_processor.make_output(parent, True)
            if self.metrics is not None:
                self.metrics.on_finished(out)
            sent = self.sent.pop(parent.request_id, None)
        else:
            sent = self.sent.get(parent.request_id)
        if sent is None:
            return None  # aborted meanwhile
        visible_length = self.core.output_processor.visible_length
        seqs = []
        for c in parent.children:
            i = c.index
            tokens, text = c.output_token_ids, c.output_text
            end = visible_length(c)
            t0, x0 = min(sent.tokens[i], len(tokens)), min(sent.text[i], end)
            seqs.append(wire.SeqDelta(
                i, t0, tokens[t0:], x0, text[x0:end],
                _hand_over(c.logprobs, t0) if c.logprobs is not None else None,
                c.cumulative_logprob, c.status.value if c.is_finished else None, c.stop_reason, c.error))
            sent.tokens[i], sent.text[i] = len(tokens), end
        first = parent.children[0]
        delta = wire.RequestDelta(parent.request_id, seqs, finished, first.num_cached_tokens)
        prompt_logprobs = first.prompt_logprobs
        if prompt_logprobs is not None and len(prompt_logprobs) > sent.prompt_logprobs:
            delta.prompt_logprobs_offset = sent.prompt_logprobs
            delta.prompt_logprobs = _hand_over(prompt_logprobs, sent.prompt_logprobs)
            sent.prompt_logprobs = len(prompt_logprobs)
        if finished:
            delta.metrics = dataclasses.astuple(first.metrics)
            delta.embedding = first.embedding
        return sent.owner, delta

    def _send_outputs(self, outputs: list[tuple[bytes, wire.RequestDelta]]) -> None:
        """A step's (owner, delta) pairs from _emit: one message per front end."""
        by_owner: dict[bytes, list[wire.RequestDelta]] = {}
        for identity, delta in outputs:
            by_owner.setdefault(identity, []).append(delta)
        for identity, deltas in by_owner.items():
            self._send(identity, wire.Step(deltas))

    def _recover(self, exc: Exception) -> None:
        """A step raised: fail the requests that were running (pages freed), keep the waiting ones."""
        self.num_step_failures += 1
        failed = self.core.fail_running()
        logger.error("engine step failed (%s: %s); failed %d running request(s)", type(exc).__name__, exc,
                     len(failed), exc_info=exc)
        by_owner: dict[bytes, list[str]] = {}
        for rid in failed:
            sent = self.sent.pop(rid, None)
            if sent is not None:
                by_owner.setdefault(sent.owner, []).append(rid)
        reason = str(step_error(exc))
        for identity, rids in by_owner.items():
            self._send(identity, wire.Step([], failed=rids, failure=reason))


def run_engine_process(config, address: str, model_name: str, ready, log_stats: bool = True,
                       replica: int | None = None, replicas: int = 1) -> None:
    """The engine process's entry: build the engine, say so on `ready` (a Connection: ("ready", EngineInfo) or
    ("error", exception type name, message)), then run the loop until SIGTERM or the launcher is gone. replica:
    its index of `replicas` under --data-parallel-size (it then takes its share of the GPUs first)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the launcher decides
    stop_early = []
    signal.signal(signal.SIGTERM, lambda *_: stop_early.append(True))
    from atlas.engine.core import EngineCore
    from atlas.heap import freeze_startup_heap

    try:
        if replica is not None:
            from atlas.engine.data_parallel import place_replica

            place_replica(config, replica, replicas)
        core = EngineCore(config)
        server = EngineServer(core, address, model_name, log_stats, replica)
    except BaseException as exc:  # noqa: BLE001 - the launcher reports it as the command's error
        from atlas.errors import AtlasError

        if not isinstance(exc, AtlasError):  # (a fault, not the user's mistake: its traceback, here where it is)
            logger.exception("the engine could not start")
        ready.send(("error", type(exc).__name__, str(exc)))
        ready.close()
        os._exit(1)
    signal.signal(signal.SIGTERM, server.stop)
    if stop_early:
        server.stop()
    ready.send(("ready", EngineInfo.of(core)))
    ready.close()
    freeze_startup_heap()
    code = server.run()
    logging.shutdown()
    os._exit(code)
