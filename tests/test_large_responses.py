"""Large non-streaming responses (atlas/server/large_responses.py) and the logprob entries they are made of: the
pieces are the single dump's bytes, they are sent with their length and the heap is given back after the last;
a Logprob is not an object the garbage collector walks."""

from __future__ import annotations

import asyncio
import gc
import pickle

from atlas.outputs import Logprob
from atlas.server import protocol as P
from atlas.server.large_responses import LargeJSONResponse, dump_in_pieces, json_pieces


def _completion(n: int) -> P.CompletionResponse:
    texts = ['"choices":[] in a text', "caf\u00e9 \u2014 \U0001f600", "", "line\nbreak \\ and \"quotes\""]
    choices = [P.CompletionChoice(index=i, text=texts[i % len(texts)], finish_reason="length",
                                  logprobs=P.CompletionLogprobs(tokens=["a", '"choices":[]'], text_offset=[0, 1],
                                                                token_logprobs=[-0.5, None],
                                                                top_logprobs=[{"a": -0.5, "\u00e9": -1.25}, None]))
               for i in range(n)]
    return P.CompletionResponse(id="cmpl-1", created=1, model='m "choices":[]', choices=choices,
                                usage=P.UsageInfo(prompt_tokens=1, completion_tokens=2 * n, total_tokens=1 + 2 * n))


def test_the_pieces_join_to_the_single_dump():
    for n in (0, 1, 2, 5):
        body = _completion(n)
        whole = body.model_dump_json()
        assert b"".join(json_pieces(body)) == whole.encode()
        assert dump_in_pieces(body) == whole
    chat = P.ChatCompletionResponse(id="c", created=1, model="m", choices=[
        P.ChatChoice(index=i, message=P.ChatResponseMessage(content=f'"choices":[] {i}'), finish_reason="stop")
        for i in range(3)])
    assert b"".join(json_pieces(chat)) == chat.model_dump_json().encode()


def test_a_large_response_sends_its_pieces_with_their_length_then_gives_the_memory_back():
    body = _completion(4)
    pieces = json_pieces(body)
    events: list = []

    async def given_back() -> None:
        events.append("given back")

    async def send(message: dict) -> None:
        events.append(message)

    response = LargeJSONResponse(list(pieces), given_back)
    asyncio.run(response({"type": "http"}, None, send))
    start, *bodies, last = events
    assert start["type"] == "http.response.start" and start["status"] == 200
    headers = dict(start["headers"])
    assert headers[b"content-type"] == b"application/json"
    assert headers[b"content-length"] == str(len(body.model_dump_json().encode())).encode()
    assert [m["body"] for m in bodies] == pieces  # one message a piece, the last one closing the body
    assert [m["more_body"] for m in bodies] == [True] * (len(pieces) - 1) + [False]
    assert last == "given back"  # after the whole body was sent
    assert response.pieces == []  # (the response holds none of them once sent)


def test_logprob_entries_are_not_walked_by_the_garbage_collector():
    """A request of 2 prompts x n = 128 x 200 tokens x 21 entries holds a million of them: tracked, every full
    collection walked them all (the front end's event loop and the engine's steps stalled meanwhile)."""
    lp = Logprob(-0.25, 1, "a")
    entry = {5: lp, 7: Logprob(logprob=-2.0, rank=3)}
    assert not gc.is_tracked(lp)
    assert not gc.is_tracked(entry)  # (a dict of untracked values is not tracked either)
    assert (lp.logprob, lp.rank, lp.decoded_token) == (-0.25, 1, "a")
    assert entry[7].decoded_token is None
    assert lp == Logprob(-0.25, 1, "a") and lp != Logprob(-0.25, 2, "a")
    assert pickle.loads(pickle.dumps(entry)) == entry
    assert repr(lp) == "Logprob(logprob=-0.25, rank=1, decoded_token='a')"


def test_the_engine_process_forgets_logprob_entries_once_handed_to_its_front_end():
    """The front end keeps a request's logprobs; the engine process sends each entry once and keeps none (a
    request of n = 128 x 2 x 200 tokens with 20 logprobs held a million there as well)."""
    from atlas.engine.engine_process import _hand_over

    entries = [None, {3: Logprob(-0.5, 1, "a"), 9: Logprob(-1.5, 2, "b")}, {4: Logprob(-0.25, 1, None)}]
    assert _hand_over(entries, 0) == [None, {3: (-0.5, 1, "a"), 9: (-1.5, 2, "b")}, {4: (-0.25, 1, None)}]
    assert entries == [None, None, None]  # (its length stays: the engine counts the entries)
    entries.append({7: Logprob(-3.0, 1, "c")})
    assert _hand_over(entries, 3) == [{7: (-3.0, 1, "c")}]
    assert entries == [None] * 4
