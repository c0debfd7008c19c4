"""A front end's event-loop time per engine step for one request streaming many sequences with logprobs (issue
43's "2 prompts x n = 128 x 20 logprobs" row), on the CPU: an engine step's message (one token and 21 logprob
entries per sequence) decoded and applied by the EngineClient, then each sequence's chunk written as the
completions stream writes it (its logprobs through the pydantic models). The start-up heap is frozen first, as a
front end does (atlas/heap.py): without that the cyclic collector scans every imported module's objects and the
figures triple.

    python tools/logprob_stream_cost.py [--sequences 128] [--steps 40] --tokenizer atlas/assets/default-model
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time

from atlas.engine import wire
from atlas.engine.engine_client import ClientStream, EngineClient
from atlas.engine.tokenizer import Tokenizer
from atlas.heap import freeze_startup_heap
from atlas.sampling_params import SamplingParams
from atlas.server import protocol as P
from atlas.server.logprobs import TokenText
from atlas.server.streaming import next_delta


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sequences", type=int, default=128)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--logprobs", type=int, default=20)
    p.add_argument("--tokenizer", default="atlas/assets/default-model")
    args = p.parse_args()
    tokenizer = Tokenizer(args.tokenizer)
    token_text = TokenText(tokenizer)
    vocab = min(len(tokenizer.hf), 4096)
    rng = random.Random(0)
    loop = asyncio.new_event_loop()
    client = EngineClient(info=None, address="")
    stream = ClientStream(client, "r", loop, [5, 6, 7], SamplingParams(n=args.sequences, logprobs=args.logprobs,
                                                                         max_tokens=args.steps))
    client._streams["r"] = stream
    freeze_startup_heap()
    states: dict = {}
    warm = 4
    applied = written = 0.0
    for step in range(args.steps):
        seqs = []
        for i in range(args.sequences):
            entries = {rng.randrange(vocab): (-5 * rng.random(), r, None) for r in range(1, args.logprobs + 2)}
            seqs.append(wire.SeqDelta(i, step, [next(iter(entries))], step, "a", [entries], -1.0))
        message = wire.encoder.encode(wire.Step([wire.RequestDelta("r", seqs, False)]))
        t0 = time.perf_counter()
        client._on_step(wire.front_end_decoder.decode(message))
        t1 = time.perf_counter()
        out = stream._snapshot()
        for c in out.outputs:
            _, text, new = next_delta(states, c.index, c)
            logprobs, _ = token_text.completion_logprobs(c.token_ids[new], c.logprobs[new], 0)
            chunk = P.CompletionChunk(id="cmpl-x", created=0, model="m", choices=[
                P.CompletionChoice(index=c.index, text=text, logprobs=logprobs, finish_reason=None)])
            f"data: {chunk.model_dump_json()}\n\n"
        t2 = time.perf_counter()
        if step >= warm:
            applied += t1 - t0
            written += t2 - t1
    steps = args.steps - warm
    print(f"{args.sequences} sequences x {args.logprobs + 1} logprob entries a step: decode and apply "
          f"{applied / steps * 1e3:.2f} ms, chunks written {written / steps * 1e3:.2f} ms a step "
          f"({written / steps / args.sequences * 1e6:.0f} us a chunk)")


if __name__ == "__main__":
    main()
