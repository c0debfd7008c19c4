"""The link between a front end (EngineClient) and the engine process's loop (EngineServer), over a real ZeroMQ
socket with the engine's loop in a thread: what one turn of the front end's event loop sends goes out as one
message, the engine's replies to what it read at once come back as one, and each request still gets its own
answer (its tokens, or its own refusal)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from atlas import LLM, SamplingParams
from atlas.config import EngineConfig
from atlas.engine import wire
from atlas.engine.core import EngineCore
from atlas.engine.engine_client import EngineClient
from atlas.engine.engine_process import EngineServer
from atlas.engine.info import EngineInfo
from atlas.errors import InvalidRequestError

pytest.importorskip("zmq")
pytest.importorskip("msgspec")

MODEL = "atlas/assets/default-model"
FLAGS = dict(kv_cache_memory="64MiB", max_model_len=128, skip_tokenizer_init=True)
PROMPTS = [[5, 6, 7, 8], [100, 101], [42] * 9, [7, 300, 9]]


def test_a_burst_is_one_message_each_way_and_each_request_gets_its_own_answer(tmp_path):
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in LLM(MODEL, **FLAGS).generate(
        [{"prompt_token_ids": p} for p in PROMPTS], params)]

    core = EngineCore(EngineConfig.from_kwargs(model=MODEL, **FLAGS))
    server = EngineServer(core, f"ipc://{tmp_path}/engine", "m")
    received, sent = [], []
    handle, send = server._handle, server._send
    server._handle = lambda identity, message: (received.append(type(message)), handle(identity, message))
    server._send = lambda identity, message: (sent.append(type(message)), send(identity, message))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()

    async def burst():
        client = EngineClient(EngineInfo.of(core), f"ipc://{tmp_path}/engine")
        client.start()
        await asyncio.sleep(0.2)  # (the Hello on its own)
        received.clear()
        sent.clear()
        adds = [client.add_request(p, params) for p in PROMPTS]
        adds.insert(2, client.add_request([1] * 200, params))  # longer than the context: refused, alone
        results = await asyncio.gather(*adds, return_exceptions=True)
        outs = []
        for stream in results[:2] + results[3:]:
            async with stream:
                last = [out async for out in stream][-1]
            outs.append(last.outputs[0].token_ids)
        client.shutdown()
        return results[2], outs

    refused, outs = asyncio.run(burst())
    server.stop()
    thread.join(timeout=30)
    assert isinstance(refused, InvalidRequestError) and "128" in str(refused)
    assert outs == expected
    # the five adds went out as one Batch, and their five replies (four accepted, one refused), held while the
    # engine read them, went back as one Replies
    assert received[:2] == [wire.Batch, wire.Add] and received.count(wire.Add) == 5
    assert sent[:6] == [wire.Reply] * 5 + [wire.Replies]


def test_a_batch_of_every_kind_of_message_reaches_the_engine_whole():
    """Whatever a front end queues in one turn (its Hello included, when a request follows it at once) decodes as the
    engine's message it was."""
    messages = [wire.Hello(0, 1), wire.Add(1, "r", [1, 2], b"p", 0.5, 0), wire.Abort(["r"]), wire.Call(2, "metrics")]
    assert wire.engine_decoder.decode(wire.encoder.encode(wire.Batch(messages))) == wire.Batch(messages)
    replies = wire.Replies([wire.Reply(1, True), wire.Reply(2, False, error="no")])
    assert wire.front_end_decoder.decode(wire.encoder.encode(replies)) == replies
