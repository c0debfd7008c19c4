"""Large non-streaming responses, built off the event loop in pieces.

A request with many sequences and logprobs (2 prompts x n = 128 x 200 tokens x 20 logprobs: a million entries,
29 MB of JSON) took seconds of Python to turn into its response; on the event loop that stalled every other client
for as long. Such a response is built in a preprocessing thread, and its JSON written one choice at a time: each
serializer call then holds the interpreter lock for a few milliseconds (pydantic's serializer never lets go of it
within one call), so the event loop gets its turn between them. The bytes are the same as a single
`model_dump_json()` of the whole response.
"""

from __future__ import annotations

from pydantic import BaseModel

from atlas.outputs import RequestOutput

# A response with more logprob entries than this (tokens x (1 + top logprobs), over its choices) is built in a
# preprocessing thread (about 1 ms of Python per 1,000 entries); smaller ones are built on the event loop.
LARGE_RESPONSE_ENTRIES = 16_384


def logprob_entries(finals: list[RequestOutput], top: int | None) -> int:
    """The logprob entries a response of these outputs carries (0 without logprobs)."""
    if top is None:
        return 0
    return sum(len(c.token_ids) for out in finals for c in out.outputs) * (1 + top)


def chat_entries(body: BaseModel) -> int:
    """The logprob entries of a chat completion response."""
    return sum(len(c.logprobs.content) + sum(len(t.top_logprobs) for t in c.logprobs.content)
               for c in body.choices if c.logprobs is not None and c.logprobs.content)  # type: ignore[attr-defined]


def dump_in_pieces(body: BaseModel) -> str:
    """body.model_dump_json(), with its `choices` serialized one at a time (the interpreter lock is let go in
    between)."""
    choices = body.choices  # type: ignore[attr-defined]
    if len(choices) <= 1:
        return body.model_dump_json()
    head = body.model_copy(update={"choices": []}).model_dump_json()
    # (the first '"choices":[]' is the key: a string value holding those characters has its quotes escaped)
    return head.replace('"choices":[]', '"choices":[' + ",".join(c.model_dump_json() for c in choices) + "]", 1)
