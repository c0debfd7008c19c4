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
        made = iter(body.choices)  # (choices made as they are written: the same bytes)
        assert b"".join(json_pieces(body.model_copy(update={"choices": []}), made)) == whole.encode()
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

    first = [None, {3: Logprob(-0.5, 1, "a"), 9: Logprob(-1.5, 2, "b")}, {4: Logprob(-0.25, 1, None)}]
    entries = list(first)
    assert _hand_over(entries, 0) == first
    assert entries == [None, None, None]  # (its length stays: the engine counts the entries)
    entries.append({7: Logprob(-3.0, 1, "c")})
    assert _hand_over(entries, 3) == [{7: Logprob(-3.0, 1, "c")}]
    assert entries == [None] * 4


def _wire_runs(runs: list[list]) -> list:
    """Each run of entries as a front end gets it: the msgpack of a delta's logprobs, decoded as msgspec.Raw."""
    from atlas.engine import wire

    step = wire.Step([wire.RequestDelta("r", [wire.SeqDelta(0, 0, [], 0, "", run) for run in runs], False)])
    return [sd.logprobs for sd in wire.front_end_decoder.decode(wire.encoder.encode(step)).outputs[0].seqs]


def test_a_front_end_keeps_logprobs_as_the_engine_sent_them_and_reads_them_as_entries():
    import sys

    from atlas.engine.engine_client import Logprobs

    def entry(i: int) -> dict:
        return {i: Logprob(-i / 8, 1, f"t{i}"), i + 1000: Logprob(-i / 4, 2, None)}

    runs = [[entry(0)], [entry(1), None, entry(3)], [], None, [entry(4)] * 20 + [entry(5)]]
    expected = [e for run in runs if run for e in run]
    lp = Logprobs()
    views = []
    for raw in _wire_runs(runs):
        lp.append(raw)
        views.append(lp.view())
    assert len(lp) == len(expected) == 25
    assert list(lp) == expected and lp == expected
    for i in (0, 1, 2, 3, 4, 24, -1, -25):
        assert lp[i] == expected[i]
    for s in (slice(0, 25), slice(1, 3), slice(2, 7), slice(3, 4), slice(5, 5), slice(-3, None), slice(None, None, 2)):
        assert lp[s] == expected[s], s
    assert [len(v) for v in views] == [1, 4, 4, 4, 25]  # (a view stays as it was when taken)
    assert list(views[1]) == expected[:4]
    cut = lp.cut(6)  # (inside the last run)
    assert list(cut) == expected[:6] and list(lp) == expected
    assert list(lp.cut(4)) == expected[:4] and lp.cut(30) is lp

    raws = _wire_runs([[entry(i) for i in range(21)]] * 2000)  # 42,000 entries
    blocks = sys.getallocatedblocks()
    kept = Logprobs()
    for raw in raws:
        kept.append(raw)
    assert len(kept) == 42_000
    assert sys.getallocatedblocks() - blocks < 100  # (no Python object per entry, nor per run)
