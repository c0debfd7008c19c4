"""Issue 43's probe, on the CPU: a benign client's latency and /health's while hostile requests run against a
real `atlas serve` (the shipped model by default). Each row: baseline p50/p99 of a short chat completion, then the
same while the row's hostile requests run, the hostile answers' status and time. Writes JSON (--out) and a table.

    python tools/isolation_probe.py --out /tmp/probe.json [--rows big_prompts,many_messages,detokenize]

The resident memory of the server's whole process tree (front ends, engine, compile and preprocessing workers) is
read before each row and --settle-seconds after it (the issue's target: back within 10 % of before); the baseline
waits until the workers have started (the tree's size steady over 3 s).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time

import httpx

BENIGN = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}


def _rows() -> dict:
    big = "word " * 1_600_000  # 8 MB of text: over any context
    return {
        # 4 concurrent 8 MB prompts (over the context: a 400 each once tokenized)
        "big_prompts": [("POST", "/v1/completions", {"model": "m", "prompt": big, "max_tokens": 1})] * 4,
        # a chat of 100k short messages
        "many_messages": [("POST", "/v1/chat/completions", {
            "model": "m", "max_tokens": 1,
            "messages": [{"role": "user" if i % 2 == 0 else "assistant", "content": f"m{i}"}
                         for i in range(100_000)]})] * 2,
        # /detokenize of 4 M ids
        "detokenize": [("POST", "/detokenize", {"model": "m", "tokens": [5] * 4_000_000})],
        # a catastrophic regex constraint
        "regex": [("POST", "/v1/completions", {"model": "m", "prompt": "x", "max_tokens": 16,
                                                "structured_outputs": {"regex": "((.{0,100}){0,100}){0,100}"}})],
        # 10,000 tools with tool_choice required
        "tools_10k": [("POST", "/v1/chat/completions", {
            "model": "m", "max_tokens": 16, "tool_choice": "required", "messages": [{"role": "user", "content": "x"}],
            "tools": [{"type": "function", "function": {"name": f"f{i}", "parameters": {
                "type": "object", "properties": {"a": {"type": "integer"}}}}} for i in range(10_000)]})],
        # 2 prompts x n = 128 x 200 tokens with 20 logprobs
        "n128_logprobs": [("POST", "/v1/completions", {"model": "m", "prompt": ["a", "b"], "n": 128,
                                                       "max_tokens": 200, "logprobs": 20, "ignore_eos": True})],
        # 2,000,000 stop_token_ids + min_tokens
        "stop_ids": [("POST", "/v1/completions", {"model": "m", "prompt": "x", "max_tokens": 8, "min_tokens": 4,
                                                  "stop_token_ids": list(range(2_000_000))})],
        # a schema with 10,000 required properties
        "schema_10k": [("POST", "/v1/chat/completions", {
            "model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "x"}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {
                "type": "object", "required": [f"p{i}" for i in range(10_000)],
                "properties": {f"p{i}": {"type": "integer"} for i in range(10_000)}}}}})],
        # 8 concurrent exponential client chat templates (needs --trust-request-chat-template)
        "exp_templates": [("POST", "/v1/chat/completions", {
            "model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}],
            "chat_template": "{% for a in range(99) %}{% for b in range(99) %}{% for c in range(99) %}{% for d in "
                             "range(99) %}x{% endfor %}{% endfor %}{% endfor %}{% endfor %}"})] * 8,
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _latencies(client: httpx.Client, url: str, seconds: float, stop: threading.Event | None = None) -> tuple:
    """Benign chat completions and /health probes, one after the other, for `seconds` (or until stop)."""
    chat, health = [], []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end and not (stop is not None and stop.is_set()):
        t = time.perf_counter()
        client.post(url + "/v1/chat/completions", json=BENIGN, timeout=300).raise_for_status()
        chat.append(time.perf_counter() - t)
        t = time.perf_counter()
        client.get(url + "/health", timeout=300)
        health.append(time.perf_counter() - t)
    return chat, health


def _tree_rss(pid: int) -> int:
    """Resident bytes of the process and all its descendants (the front ends, the engine, the workers): Linux."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rpartition(")")[2].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        todo.extend(children.get(p, []))
        try:
            with open(f"/proc/{p}/status") as f:
                total += next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
        except (OSError, StopIteration):
            pass
    return total


def _settle(pid: int, timeout: float = 120.0) -> None:
    """Until the server's workers have started: its tree's resident size the same (within 1 %) over 3 s. /health
    answers before the preprocessing and compile workers are up, and on a loaded machine they take tens of seconds
    to start: a row's RSS read before them counted them as its growth."""
    end = time.monotonic() + timeout
    last = _tree_rss(pid)
    while time.monotonic() < end:
        time.sleep(3)
        now = _tree_rss(pid)
        if abs(now - last) <= 0.01 * last:
            return
        last = now


def _summary(values: list[float]) -> dict:
    values = sorted(values)
    if not values:
        return {}
    return {"n": len(values), "p50": statistics.median(values), "p99": values[min(len(values) - 1,
                                                                                  int(0.99 * len(values)))],
            "max": values[-1]}


def _run_row(client: httpx.Client, url: str, requests: list) -> dict:
    """The row's hostile requests at once; benign probes until they are all answered."""
    answers: list = []

    def hostile(method: str, path: str, body: dict) -> None:
        t = time.perf_counter()
        try:
            r = httpx.request(method, url + path, json=body, timeout=600)
            answers.append((r.status_code, round(time.perf_counter() - t, 3)))
        except httpx.HTTPError as exc:
            answers.append((type(exc).__name__, round(time.perf_counter() - t, 3)))

    threads = [threading.Thread(target=hostile, args=req) for req in requests]
    for th in threads:
        th.start()
    time.sleep(0.2)  # (the hostile bodies are on their way)
    done = threading.Event()

    def wait() -> None:
        for th in threads:
            th.join()
        done.set()

    waiter = threading.Thread(target=wait)
    waiter.start()
    chat, health = _latencies(client, url, 600, stop=done)
    waiter.join()
    return {"chat": _summary(chat), "health": _summary(health), "hostile": answers}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=None, help="default: the shipped model")
    p.add_argument("--out", required=True)
    p.add_argument("--rows", default=None, help="comma-separated (default: all)")
    p.add_argument("--baseline-seconds", type=float, default=5.0)
    p.add_argument("--serve-args", default="", help="more `atlas serve` flags")
    p.add_argument("--settle-seconds", type=float, default=10.0,
                   help="wait after each row before reading the server's resident memory")
    args = p.parse_args()
    rows = _rows()
    names = args.rows.split(",") if args.rows else list(rows)
    port = _free_port()
    cmd = [sys.executable, "-m", "atlas.cli", "serve", "--port", str(port), "--served-model-name", "m",
           *(["--model", args.model] if args.model else []), *args.serve_args.split()]
    with open(args.out + ".server.log", "w") as log:
        server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ))
    url = f"http://127.0.0.1:{port}"
    results: dict = {"command": " ".join(cmd), "rows": {}}
    try:
        with httpx.Client() as client:
            for _ in range(600):
                try:
                    if client.get(url + "/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.5)
            else:
                raise RuntimeError("the server did not start; see " + args.out + ".server.log")
            _settle(server.pid)
            chat, health = _latencies(client, url, args.baseline_seconds)
            results["baseline"] = {"chat": _summary(chat), "health": _summary(health)}
            results["baseline"]["rss"] = _tree_rss(server.pid)
            for name in names:
                rss_before = _tree_rss(server.pid)
                results["rows"][name] = _run_row(client, url, rows[name])
                row = results["rows"][name]
                time.sleep(args.settle_seconds)  # (a recycled worker's replacement starts; freed pages go back)
                row["rss_before"], row["rss_after"] = rss_before, _tree_rss(server.pid)
                print(f"{name}: benign p99 {row['chat'].get('p99', 0):.3f} s, /health max "
                      f"{row['health'].get('max', 0):.3f} s, hostile {row['hostile']}, RSS "
                      f"{rss_before / 2**20:,.0f} -> {row['rss_after'] / 2**20:,.0f} MiB", flush=True)
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=60)
    print(f"baseline: benign p50 {results['baseline']['chat']['p50']:.3f} s, p99 {results['baseline']['chat']['p99']:.3f}"
          f" s; /health p99 {results['baseline']['health']['p99']:.3f} s")
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    print(_table(results))
    return 0


def _table(results: dict) -> str:
    """The results as BENCHMARKS.md's table (markdown)."""
    base = results["baseline"]
    lines = ["| row | hostile answers (status, s) | benign p50 / p99 (s) | /health max (s) | RSS before -> after (MiB) |",
             "|---|---|---:|---:|---:|",
             f"| baseline | | {base['chat']['p50']:.2f} / {base['chat']['p99']:.2f} | "
             f"{base['health']['max']:.3f} | {base['rss'] / 2**20:,.0f} |"]
    for name, row in results["rows"].items():
        answers = ", ".join(f"{status} {seconds:.1f}" for status, seconds in row["hostile"])
        chat = row["chat"]
        lines.append(f"| {name} | {answers} | {chat.get('p50', 0):.2f} / {chat.get('p99', 0):.2f} | "
                     f"{row['health'].get('max', 0):.3f} | {row['rss_before'] / 2**20:,.0f} -> "
                     f"{row['rss_after'] / 2**20:,.0f} ({100 * (row['rss_after'] / row['rss_before'] - 1):+.0f} %) |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
