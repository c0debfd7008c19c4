"""Large non-streaming responses, built off the event loop in pieces and sent as those pieces.

A request with many sequences and logprobs (2 prompts x n = 128 x 200 tokens x 20 logprobs: a million entries,
29 MB of JSON) took seconds of Python to turn into its response; on the event loop that stalled every other client
for as long. Such a response is built in a preprocessing thread, and its JSON written one choice at a time: each
serializer call then holds the interpreter lock for a few milliseconds (pydantic's serializer never lets go of it
within one call), so the event loop gets its turn between them. The bytes are the same as a single
`model_dump_json()` of the whole response.

The pieces are sent as they are (LargeJSONResponse, its Content-Length their sum): joining them, and encoding the
joined text, made two more copies of the whole body, each as large as the pieces together, and a body that size
comes from the heap, where what it leaves free stays resident. Once the last piece is sent they are dropped and the
heap's free pages go back to the system (glibc's malloc_trim): the million entries the response was made of, and the
thread's building of it, left the front end hundreds of MiB up otherwise.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable

from pydantic import BaseModel
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from atlas.outputs import RequestOutput

# A response with more logprob entries than this (tokens x (1 + top logprobs), over its choices) is built in a
# preprocessing thread (about 1 ms of Python per 1,000 entries); smaller ones are built on the event loop.
LARGE_RESPONSE_ENTRIES = 16_384

_CHOICES = '"choices":['


def logprob_entries(finals: list[RequestOutput], top: int | None) -> int:
    """The logprob entries a response of these outputs carries (0 without logprobs)."""
    if top is None:
        return 0
    return sum(len(c.token_ids) for out in finals for c in out.outputs) * (1 + top)


def chat_entries(body: BaseModel) -> int:
    """The logprob entries of a chat completion response."""
    return sum(len(c.logprobs.content) + sum(len(t.top_logprobs) for t in c.logprobs.content)
               for c in body.choices if c.logprobs is not None and c.logprobs.content)  # type: ignore[attr-defined]


def _head(body: BaseModel) -> tuple[str, str]:
    """body's JSON without its choices, split where they go: (up to and with '"choices":[', from the ']' on)."""
    head = body.model_copy(update={"choices": []}).model_dump_json()
    # (the first '"choices":[]' is the key: a string value holding those characters has its quotes escaped)
    at = head.index(_CHOICES + "]") + len(_CHOICES)
    return head[:at], head[at:]


def dump_in_pieces(body: BaseModel) -> str:
    """body.model_dump_json(), with its `choices` serialized one at a time (the interpreter lock is let go in
    between)."""
    choices = body.choices  # type: ignore[attr-defined]
    if len(choices) <= 1:
        return body.model_dump_json()
    before, after = _head(body)
    return before + ",".join(c.model_dump_json() for c in choices) + after


def json_pieces(body: BaseModel, choices: Iterable[BaseModel] | None = None) -> list[bytes]:
    """body.model_dump_json() as UTF-8, in pieces: the response without its choices around them, and each choice
    (after a comma but the first) serialized on its own. b"".join of them is the single dump's bytes. `choices`:
    the body's choices made as they are written (each one let go before the next is made; body's own are then
    not written)."""
    if choices is None:
        choices = body.choices  # type: ignore[attr-defined]
    before, after = _head(body)
    pieces = [before.encode()]
    for i, c in enumerate(choices):
        pieces.append((("," if i else "") + c.model_dump_json()).encode())
    pieces.append(after.encode())
    return pieces


class LargeJSONResponse(Response):
    """A JSON body sent as the pieces it was written in (json_pieces), its Content-Length their sum; once the last
    is sent the pieces are dropped and `after_sent` is awaited (the front end's heap trim)."""

    media_type = "application/json"

    def __init__(self, pieces: list[bytes], after_sent: Callable[[], Awaitable[None]] | None = None):
        self.pieces = pieces
        self.after_sent = after_sent
        super().__init__(headers={"content-length": str(sum(len(p) for p in pieces))})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        pieces, self.pieces = self.pieces, []
        for i, piece in enumerate(pieces, 1):
            await send({"type": "http.response.body", "body": piece, "more_body": i < len(pieces)})
        del pieces
        if self.after_sent is not None:
            await self.after_sent()
