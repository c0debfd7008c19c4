"""Where a streamed request's time to first token goes, on a running `atlas serve` started with
--enable-log-requests: per request, the client's send, the front end's hand-over to the engine (its log line),
the response headers and the first token's chunk, all on the wall clock (one machine). Prints the split's
percentiles and writes every request's times (--out).

    python tools/ttft_timeline.py --url http://127.0.0.1:8321 --server-log serve.log --concurrency 256 \\
        --num-requests 1024 --processes 4 --out timeline.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import re
import time
from datetime import datetime

import numpy as np

PROMPTS = ["def fibonacci(n):", "import numpy as np\n", "class Stack:\n    def __init__(self):",
           "for i in range(10):", "SELECT name FROM users WHERE", "#include <stdio.h>\nint main() {"]


async def one(session, i: int, max_tokens: int) -> dict:
    body = {"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
            "temperature": 0, "return_token_ids": True}
    rec = {"send": time.time()}
    async with session.post("/v1/completions", json=body) as resp:
        rec["headers"] = time.time()
        async for raw in resp.content:  # (one SSE line at a time; aiohttp, as atlas bench serve's client)
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            event = json.loads(line[6:])
            rec.setdefault("id", event.get("id"))
            if "first" not in rec and any(c.get("token_ids") for c in event.get("choices") or []):
                rec["first"] = time.time()
        rec["end"] = time.time()
    return rec


async def load(url: str, concurrency: int, num: int, first: int, max_tokens: int, start_at: float) -> list[dict]:
    import aiohttp

    async with aiohttp.ClientSession(base_url=url, connector=aiohttp.TCPConnector(limit=concurrency),
                                     timeout=aiohttp.ClientTimeout(total=600)) as client:
        await one(client, 0, 4)  # warm-up, not counted
        await asyncio.sleep(max(0.0, start_at - time.time()))
        todo = iter(range(first, first + num))
        out: list[dict] = []

        async def worker():
            for i in todo:
                out.append(await one(client, i, max_tokens))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return out


def _proc(args, share_c, share_n, first, start_at, conn):
    conn.send(asyncio.run(load(args.url, share_c, share_n, first, args.max_tokens, start_at)))


def log_times(path: str) -> dict[str, float]:
    """Request id -> the wall time of its front end's 'request ...' log line."""
    pat = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) INFO \S+: request (\S+): ")
    times = {}
    with open(path, errors="replace") as f:
        for line in f:
            m = pat.match(line)
            if m:
                times[m.group(2)] = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", required=True)
    p.add_argument("--server-log", required=True)
    p.add_argument("--concurrency", type=int, default=256)
    p.add_argument("--num-requests", type=int, default=1024)
    p.add_argument("--processes", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    ctx = multiprocessing.get_context("spawn")
    start_at = time.time() + 8
    k, procs, pipes, first = args.processes, [], [], 0
    for i in range(k):
        c = args.concurrency // k + (i < args.concurrency % k)
        n = args.num_requests // k + (i < args.num_requests % k)
        r, s = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_proc, args=(args, c, n, first, start_at, s))
        proc.start()
        procs.append(proc)
        pipes.append(r)
        first += n
    recs = [rec for r in pipes for rec in r.recv()]
    for proc in procs:
        proc.join()
    time.sleep(1)
    logged = log_times(args.server_log)
    for rec in recs:
        rec["front_end"] = logged.get(rec.get("id"))
    spans = {"send -> front end hands to engine": ("send", "front_end"),
             "front end -> headers": ("front_end", "headers"), "headers -> first token": ("headers", "first"),
             "send -> first token (TTFT)": ("send", "first")}
    summary = {}
    for name, (a, b) in spans.items():
        vals = [r[b] - r[a] for r in recs if r.get(a) is not None and r.get(b) is not None]
        if vals:
            summary[name] = {f"p{q}": round(float(np.percentile(vals, q)) * 1000, 1) for q in (10, 50, 90, 99)} | {
                "mean": round(float(np.mean(vals)) * 1000, 1), "n": len(vals)}
    for name, s in summary.items():
        print(f"{name:40s} {s}")
    with open(args.out, "w") as f:
        json.dump({"summary": summary, "requests": recs}, f)


if __name__ == "__main__":
    main()
