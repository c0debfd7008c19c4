"""Server-sent events: the engine's outputs of several prompts merged as they come, each choice's new text and
tokens since its last event, and the plain chunks that make up almost every stream written without pydantic."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from atlas.engine.async_engine import RequestStream
from atlas.outputs import CompletionOutput, RequestOutput
from atlas.server import protocol as P


class EventStream(StreamingResponse):
    """A streamed response whose client's disconnect is watched by one plain task, which cancels the stream (its
    events' generator then lets go of its requests, as under starlette's StreamingResponse). Starlette sets this up
    with an anyio task group, which cost more of a front end's CPU than the rest of a short request's stream: a wave
    of arrivals is handed to the engine at that pace (issue 36)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        stream = asyncio.current_task()
        gone = False

        async def watch() -> None:
            nonlocal gone
            while (await receive())["type"] != "http.disconnect":
                pass
            gone = True
            stream.cancel()

        watcher = asyncio.get_running_loop().create_task(watch())
        try:
            await self.stream_response(send)
        except asyncio.CancelledError:
            if not gone:
                raise
            stream.uncancel()  # (the client left: nothing more to send, and the server goes on)
        finally:
            watcher.cancel()
        if self.background is not None:
            await self.background()


def sse(events: AsyncIterator[str]) -> StreamingResponse:
    """A response of server-sent events, which neither caches nor a proxy's buffering may hold back."""
    return EventStream(events, media_type="text/event-stream",
                       headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def merge_streams(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) from several request streams, as they come."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                queue.put_nowait((i, out))
        except Exception as exc:  # noqa: BLE001 - re-raised by the consumer
            queue.put_nowait((i, exc))
        queue.put_nowait((i, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()


@dataclass
class ChoiceState:
    """What one streamed choice has sent so far."""

    text_sent: int = 0
    tokens_sent: int = 0
    text_offset: int = 0
    done: bool = False
    prompt_ids_sent: bool = False  # (return_token_ids: the prompt's ids go with the first chunk sent)


def next_delta(states: dict[int, ChoiceState], index: int, c: CompletionOutput
               ) -> tuple[ChoiceState, str, slice] | None:
    """(the choice's state, its text not sent yet, the slice of its token ids not sent yet), now counted as sent;
    None once the choice has finished."""
    state = states.setdefault(index, ChoiceState())
    if state.done:
        return None
    text = c.text[state.text_sent:]
    tokens = slice(state.tokens_sent, len(c.token_ids))
    state.text_sent = len(c.text)
    state.tokens_sent = len(c.token_ids)
    state.done = c.finish_reason is not None
    return state, text, tokens


def running_usage(prompt_tokens: int, states: dict[int, ChoiceState], continuous: bool
                  ) -> Callable[[], P.UsageInfo | None]:
    """A stream's usage so far, for every chunk (vLLM's stream_options.continuous_usage_stats): the prompt's tokens
    and the tokens its choices have sent (`states`, as next_delta keeps them). Without continuous, None."""
    def usage() -> P.UsageInfo | None:
        if not continuous:
            return None
        sent = sum(s.tokens_sent for s in states.values())
        return P.UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=sent, total_tokens=prompt_tokens + sent)

    return usage


_JSON = json.JSONEncoder(ensure_ascii=False, allow_nan=False).encode


def _ids(ids: list[int]) -> str:
    return "[" + ",".join(map(str, ids)) + "]"


class ChunkWriter:
    """Server-sent events of a stream's plain chunks (text, and token ids where return_token_ids asks for them; no
    logprobs, tool calls or reasoning), written without building pydantic models: the same JSON as the models give
    (a test compares them), at a fraction of the cost, for the events that make up almost every stream."""

    def __init__(self, kind: str, request_id: str, created: int, model: str):
        self.chat = kind == "chat.completion.chunk"
        self.head = (f'data: {{"id":{_JSON(request_id)},"object":"{kind}","created":{created},"model":{_JSON(model)},'
                     '"choices":[{"index":')

    def text(self, index: int, text: str | None, finish_reason: str | None, stop_reason: int | str | None,
             token_ids: list[int] | None = None, prompt_token_ids: list[int] | None = None,
             usage: P.UsageInfo | None = None) -> str:
        """One choice's chunk; token_ids (this chunk's) and, for completions, prompt_token_ids (the first chunk's)
        where return_token_ids asks for them (a chat stream sends the prompt's ids in its role chunk)."""
        if self.chat:
            assert prompt_token_ids is None, "a chat stream's prompt ids go in its first (role) chunk"
            body = f'"delta":{{"content":{_JSON(text)}}}' if text is not None else '"delta":{}'
        else:
            body = f'"text":{_JSON(text)}'
        ids = ""
        if prompt_token_ids is not None:
            ids += f',"prompt_token_ids":{_ids(prompt_token_ids)}'
        if token_ids is not None:
            ids += f',"token_ids":{_ids(token_ids)}'
        running = usage.model_dump_json() if usage is not None else "null"  # (continuous_usage_stats)
        return (f'{self.head}{index},{body},"logprobs":null,"finish_reason":{_JSON(finish_reason)},'
                f'"stop_reason":{_JSON(stop_reason)}{ids}}}],"usage":{running}}}\n\n')


async def chat_chunks(lines: AsyncIterator[str]) -> AsyncIterator[dict]:
    """The JSON objects of a chat completion stream's server-sent events, in order ([DONE] left out; an object with
    "error" is the stream's failure): what the APIs translated from a chat (Responses, Anthropic's) read."""
    async for line in lines:
        for piece in line.split("\n\n"):
            if piece.startswith("data: ") and piece != "data: [DONE]":
                yield json.loads(piece[6:])

