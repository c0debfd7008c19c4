"""The messages between the engine process and the HTTP front ends (msgspec structs over ZeroMQ).

One socket joins them: the engine binds a ROUTER, each front end connects a DEALER. Front end -> engine:
Hello (who it is), Add (a request), Abort, Call (a question the engine answers with a Reply: the metrics,
a constraint's compile), several of these as one Batch. Engine -> front end: one Step per engine step with the new
tokens, text and logprobs of every request of that front end, Reply (several as Replies), and Dead when the engine
loop stops for good.

A Step carries deltas with offsets (`token_offset`, `text_offset`): the front end rebuilds each request's
cumulative output from them, and an offset that does not meet what it has is applied as a cut, so the
front end's text never drifts from the engine's. Sampling parameters travel pickled inside Add (once per
request, between processes of one server): everything per step is plain msgpack.
"""

from __future__ import annotations

from typing import Any

import msgspec

from atlas.outputs import Logprob


class Hello(msgspec.Struct, tag=True, array_like=True):
    index: int  # --api-server-count index of this front end
    pid: int  # the engine frees this front end's requests when the process is gone


class Add(msgspec.Struct, tag=True, array_like=True):
    call_id: int  # answered with a Reply once the engine accepted (or refused) it
    request_id: str
    prompt_token_ids: list[int]
    params: bytes  # a pickled SamplingParams
    arrival_time: float
    max_waiting: int  # admission: refuse when more requests than max_num_seqs + this are unfinished (0: no bound)
    group: str = ""  # the user request it is one prompt of (fair slots); "": its own
    lora: str = ""  # the name of its LoRA adapter; "": the base model


class Abort(msgspec.Struct, tag=True, array_like=True):
    request_ids: list[str]


class Call(msgspec.Struct, tag=True, array_like=True):
    call_id: int
    method: str  # "metrics" | "compile" | "response_put" | "response_get"
    arg: bytes = b""  # pickled argument


# One token's logprobs: token id -> Logprob, [logprob, rank, decoded text] on the wire.
LogprobEntry = dict[int, Logprob]
NIL = msgspec.Raw(b"\xc0")  # (msgpack's nil)


class SeqDelta(msgspec.Struct, array_like=True):
    index: int
    token_offset: int
    token_ids: list[int]
    text_offset: int
    text: str
    # From token_offset, when the request asked for them: the engine sends a list of entries (or None); a front
    # end gets their msgpack as it came (msgspec.Raw) and keeps it so (atlas/engine/engine_client.py, Logprobs):
    # no Python object per entry until they are read.
    logprobs: msgspec.Raw = NIL
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: Any = None  # a stop token id or a stop string
    error: str | None = None


class RequestDelta(msgspec.Struct, array_like=True):
    request_id: str
    seqs: list[SeqDelta]
    finished: bool
    num_cached_tokens: int = 0
    prompt_logprobs_offset: int = 0
    prompt_logprobs: list[LogprobEntry | None] | None = None
    metrics: tuple | None = None  # RequestMetrics fields, when finished
    embedding: list[float] | None = None  # --runner pooling: the pooled vector, when finished


class Step(msgspec.Struct, tag=True, array_like=True):
    outputs: list[RequestDelta]
    failed: list[str] = []  # requests the step failed (the engine stopped them)
    failure: str = ""  # why


class Reply(msgspec.Struct, tag=True, array_like=True):
    call_id: int
    ok: bool
    result: bytes = b""  # pickled
    error_type: str = ""  # an atlas.errors class name when not ok
    error: str = ""
    param: str | None = None


class Dead(msgspec.Struct, tag=True, array_like=True):
    reason: str


class Batch(msgspec.Struct, tag=True, array_like=True):
    """A front end's messages of one turn of its event loop, in order: a burst of new requests is one send (each
    send wakes the socket's I/O thread)."""
    messages: list[Hello | Add | Abort | Call]


class Replies(msgspec.Struct, tag=True, array_like=True):
    """The engine's replies to one front end from one read of its socket, in order."""
    replies: list[Reply]


ToEngine = Hello | Add | Abort | Call | Batch
ToFrontEnd = Step | Reply | Replies | Dead

encoder = msgspec.msgpack.Encoder()
engine_decoder = msgspec.msgpack.Decoder(ToEngine)
front_end_decoder = msgspec.msgpack.Decoder(ToFrontEnd)
