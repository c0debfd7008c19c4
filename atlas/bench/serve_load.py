"""`atlas bench serve`: a bounded load test of the OpenAI-compatible server, on loopback only.

It starts `atlas serve` on 127.0.0.1 with the engine flags given (or targets a running server with
--url, which must be a loopback address), sends --num-requests streaming requests with at most
--concurrency in flight, stops by itself (every request has a timeout, the whole run a deadline), and
reports requests/s, time to first token, end-to-end latency and time per output token percentiles,
output tokens/s and the error count. The peer, measured in the same run after the server has stopped:
the offline engine (`LLM.generate`) on the same prompts with the same flags and the same concurrency
cap, so the ratio is what HTTP, streaming and the asyncio front cost.

Text goes to stdout; --output-json writes JSON and a .txt beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import ipaddress
import json
import logging
import os
import platform
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from atlas.config import EngineConfig
from atlas.errors import ConfigError

logger = logging.getLogger(__name__)

# Short code prefixes (the default model is trained on Python); cycled over the requests.
DEFAULT_PROMPTS = [
    "def fibonacci(n):",
    "import os\nimport sys\n\n\ndef main():",
    "class Stack:\n    def __init__(self):",
    "def read_lines(path):\n    with open(path) as f:",
    "# Sort a list of dictionaries by a key\n",
    "def is_prime(n):\n    if n < 2:",
    "for i, line in enumerate(lines):",
    "def parse_args(argv=None):\n    parser = argparse.ArgumentParser(",
]


@dataclass
class RequestResult:
    ok: bool
    ttft: float | None = None  # seconds to the first streamed token (its text or, where it has none yet, its id)
    e2e: float | None = None
    output_tokens: int = 0
    prompt_tokens: int = 0
    error: str | None = None


# ---------------------------------------------------------------------------------- the server
def check_loopback(url: str) -> str:
    parsed = urlparse(url)
    host = parsed.hostname or ""
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if parsed.scheme != "http" or not loopback:
        raise ConfigError(f"--url {url!r}: this load generator only targets http:// on a loopback address "
                          "(127.0.0.1, localhost, ::1)")
    return url.rstrip("/")


def engine_flags(args: argparse.Namespace) -> list[str]:
    """The engine flags of this command line that differ from the defaults, as `atlas serve` flags."""
    flags: list[str] = []
    for f in dataclasses.fields(EngineConfig):
        value = getattr(args, f.name)
        if value == f.default:
            continue
        flag = "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, (tuple, list)):  # (nargs="+" flags: --lora-modules a=/x b=/y)
            flags += [flag, *map(str, value)]
        elif isinstance(value, dict):  # (JSON flags: --hf-overrides, --override-generation-config)
            flags += [flag, json.dumps(value)]
        else:
            flags += [flag, str(value)]
    return flags


class ServerProcess:
    """`atlas serve` on 127.0.0.1 and a free port, in a child process; its log goes to a file."""

    def __init__(self, flags: list[str], log_path: Path, startup_timeout: float = 600.0):
        cmd = [sys.executable, "-m", "atlas.cli", "serve", "--host", "127.0.0.1", "--port", "0", "--no-access-log",
               *flags]
        logger.info("starting: %s", " ".join(cmd))
        self.log_path = log_path
        self.log = open(log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env={**os.environ, "ATLAS_API_KEY": ""})
        self.url = self._wait_for_url(startup_timeout)
        self.pump = threading.Thread(target=self._copy_log, daemon=True)
        self.pump.start()

    def _wait_for_url(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            self.log.write(line)
            m = re.search(r"listening on (http://\S+)", line)
            if m:
                self.log.flush()
                return m.group(1)
        self.stop()
        raise RuntimeError(f"atlas serve did not start; see {self.log_path}")

    def _copy_log(self) -> None:
        for line in self.proc.stdout:
            self.log.write(line)

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if getattr(self, "pump", None) is not None:
            self.pump.join(5)
        self.log.close()
        return self.proc.returncode


# ---------------------------------------------------------------------------------- the client
async def one_request(session, path: str, body: dict[str, Any], chat: bool) -> RequestResult:
    """One streamed request through an aiohttp session: its TTFT, end-to-end time and token counts."""
    start = time.perf_counter()
    result = RequestResult(ok=False)
    try:
        async with session.post(path, json=body) as resp:
            if resp.status != 200:
                result.error = f"HTTP {resp.status}: {(await resp.read()).decode(errors='replace')[:200]}"
                return result
            done = False
            async for raw in resp.content:  # (one SSE line at a time)
                if not raw.startswith(b"data: "):
                    continue
                data = raw[6:].strip()
                if data == b"[DONE]":
                    done = True
                    break
                event = json.loads(data)
                if "error" in event:
                    result.error = event["error"].get("message", "error event")
                    return result
                for choice in event.get("choices") or []:
                    piece = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
                    if result.ttft is None and (piece or choice.get("token_ids") or choice.get("finish_reason")):
                        result.ttft = time.perf_counter() - start
                usage = event.get("usage")
                if usage:
                    result.output_tokens = usage["completion_tokens"]
                    result.prompt_tokens = usage["prompt_tokens"]
            result.e2e = time.perf_counter() - start
            result.ok = done and result.error is None
            if not done:
                result.error = "the stream ended without [DONE]"
    except Exception as exc:  # noqa: BLE001 - counted as an error, the run goes on
        result.error = f"{type(exc).__name__}: {exc}"
    return result


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def endpoint_path(args: argparse.Namespace) -> str:
    return "/v1/chat/completions" if args.endpoint == "chat" else "/v1/completions"


def warm_up(url: str, prompt: str, args: argparse.Namespace, api_key: str | None) -> None:
    """One short request, answered before the timed load starts."""
    import httpx

    body = request_body(prompt, args, args.served_model_name) | {"stream": False, "max_tokens": 4}
    body.pop("stream_options")
    body.pop("max_completion_tokens", None)
    httpx.post(f"{url}{endpoint_path(args)}", json=body, headers=auth_headers(api_key),
               timeout=args.request_timeout).raise_for_status()


# The engine's request histograms whose means split the client's TTFT: from the front end's hand-over to the
# engine (arrival) to the first token, in the engine's queue (of which the hand-over: from arrival until the engine
# core took the request in), and from the first step to the first token.
ENGINE_PHASES = {"ttft": "atlas_time_to_first_token_seconds", "queue": "vllm:request_queue_time_seconds",
                 "handover": "atlas_request_handover_seconds", "prefill": "vllm:request_prefill_time_seconds"}


def engine_phase_totals(url: str, api_key: str | None) -> dict[str, tuple[float, float]] | None:
    """(sum, count) of each ENGINE_PHASES histogram from the server's /metrics; None where it has none."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    try:
        resp = httpx.get(f"{url}/metrics", headers=auth_headers(api_key), timeout=30)
        resp.raise_for_status()
    except httpx.HTTPError as exc:
        logger.warning("no engine-side figures: /metrics: %s", exc)
        return None
    samples = {s.name: s.value for family in text_string_to_metric_families(resp.text) for s in family.samples}
    totals = {}
    for phase, name in ENGINE_PHASES.items():
        if f"{name}_sum" in samples and f"{name}_count" in samples:
            totals[phase] = (samples[f"{name}_sum"], samples[f"{name}_count"])
    return totals


def engine_phase_means(before: dict | None, after: dict | None) -> dict[str, float] | None:
    """Each phase's mean over the requests finished between two engine_phase_totals."""
    if not before or not after:
        return None
    means = {}
    for phase, (total, count) in after.items():
        total0, count0 = before.get(phase, (0.0, 0.0))
        if count > count0:
            means[phase] = (total - total0) / (count - count0)
    return means or None


def resolved_detokenize_in(args: argparse.Namespace) -> str:
    """Where the started server makes output text, as it resolves --detokenize-in for its front-end count."""
    from atlas.server.settings import ServerSettings

    front_ends = ServerSettings(detokenize_in=args.detokenize_in).front_ends_detokenize(args.api_server_count)
    return "front-end" if front_ends else "engine"


def request_body(prompt: str | list[int], args: argparse.Namespace, model: str | None) -> dict[str, Any]:
    # return_token_ids: a chunk for every token, text or not, so TTFT counts the first token as the offline peer
    # does (a token can have no text yet: part of a character, or, with random weights and a smaller tokenizer
    # than the model's vocabulary, an id the tokenizer does not know).
    body: dict[str, Any] = {"stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True,
                            "temperature": args.temperature, "ignore_eos": args.ignore_eos}
    if model:
        body["model"] = model
    if args.endpoint == "chat":
        body.update(messages=[{"role": "user", "content": prompt}], max_completion_tokens=args.max_tokens)
    else:
        body.update(prompt=prompt, max_tokens=args.max_tokens)
    return body


async def run_load(url: str, prompts: list[str], args: argparse.Namespace, api_key: str | None,
                   start_at: float | None = None, first_index: int = 0) -> tuple[list[RequestResult], float, float]:
    """-> (results, start, end): wall-clock times of the run after the warm-up (which waits until `start_at`
    when given, so that several client processes start together)."""
    import aiohttp

    chat = args.endpoint == "chat"
    path = endpoint_path(args)
    connector = aiohttp.TCPConnector(limit=args.concurrency)
    timeout = aiohttp.ClientTimeout(total=args.request_timeout)
    # (aiohttp rather than httpx: a fifth of the client's time per streamed chunk, 11 against 49 us on the CPU,
    #  so that a client process streaming 64 requests at 100 tokens/s does not add its own queueing to the TTFT)
    async with aiohttp.ClientSession(base_url=url, headers=auth_headers(api_key), connector=connector,
                                     timeout=timeout) as client:
        model = args.served_model_name
        warm = await one_request(client, path, request_body(prompts[0], args, model), chat)  # not counted
        if not warm.ok:
            raise RuntimeError(f"the warm-up request failed: {warm.error}")
        results: list[RequestResult | None] = [None] * args.num_requests
        next_index = iter(range(args.num_requests))

        async def worker() -> None:
            for i in next_index:
                body = request_body(prompts[(first_index + i) % len(prompts)], args, model)
                results[i] = await one_request(client, path, body, chat)

        if start_at is not None:
            await asyncio.sleep(max(0.0, start_at - time.time()))
        start = time.time()
        t0 = time.perf_counter()
        workers = [asyncio.ensure_future(worker()) for _ in range(args.concurrency)]
        try:
            await asyncio.wait_for(asyncio.gather(*workers), timeout=args.max_duration)
        except asyncio.TimeoutError:
            logger.warning("the run reached --max-duration %.0fs; unfinished requests count as errors",
                           args.max_duration)
        wall = time.perf_counter() - t0
    done = [r if r is not None else RequestResult(ok=False, error="not finished by --max-duration") for r in results]
    return done, start, start + wall


def _client_process(url: str, prompts: list[str], args: argparse.Namespace, api_key: str | None, start_at: float,
                    first_index: int, conn) -> None:
    """One of --client-processes: its share of the load, results sent back through `conn`."""
    logging.getLogger("httpx").setLevel(logging.WARNING)
    conn.send(asyncio.run(run_load(url, prompts, args, api_key, start_at, first_index)))
    conn.close()


def run_load_processes(url: str, prompts: list[str], args: argparse.Namespace, api_key: str | None
                       ) -> tuple[list[RequestResult], float]:
    """The load from --client-processes processes (each with its share of the requests and the concurrency),
    started together: one Python client parsing every stream's events can be what limits a fast server."""
    import multiprocessing

    k = args.client_processes
    if k == 1:
        results, start, end = asyncio.run(run_load(url, prompts, args, api_key))
        return results, end - start
    context = multiprocessing.get_context("spawn")
    start_at = time.time() + 10.0  # (time to import and warm up)
    procs, pipes, first = [], [], 0
    for i in range(k):
        share = argparse.Namespace(**vars(args))
        share.concurrency = args.concurrency // k + (i < args.concurrency % k)
        share.num_requests = args.num_requests // k + (i < args.num_requests % k)
        receive, send = context.Pipe(duplex=False)
        proc = context.Process(target=_client_process, args=(url, prompts, share, api_key, start_at, first, send))
        proc.start()
        send.close()
        procs.append(proc)
        pipes.append(receive)
        first += share.num_requests
    parts = []
    for proc, pipe in zip(procs, pipes, strict=True):
        try:
            parts.append(pipe.recv())
        except EOFError:
            raise RuntimeError("a client process failed; see the log above") from None
        proc.join()
    results = [r for part in parts for r in part[0]]
    return results, max(p[2] for p in parts) - min(p[1] for p in parts)


# ---------------------------------------------------------------------------------- the peer
def offline_peer(args: argparse.Namespace, prompts: list[str]) -> dict[str, Any]:
    """The same requests through LLM.generate / LLM.chat, at most --concurrency sequences at once."""
    from atlas import LLM, SamplingParams
    from atlas.bench.offline import run_pass

    kwargs = {name: getattr(args, name) for name in EngineConfig.field_names()}
    kwargs["max_num_seqs"] = min(args.max_num_seqs, args.concurrency)
    llm = LLM(**kwargs)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, ignore_eos=args.ignore_eos)
    batch = [prompts[i % len(prompts)] for i in range(args.num_requests)]
    tokenizer = llm.engine.tokenizer
    if args.endpoint == "chat":
        batch = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
                 for p in batch]
    ids = [p if isinstance(p, list) else tokenizer.encode(p, add_special_tokens=args.endpoint != "chat")
           for p in batch]

    def timed() -> None:
        run_pass(llm, ids[:1], 1, params)  # warm-up
        t0 = time.perf_counter()
        # A new request as soon as one ends, --concurrency in flight: what the server's clients do.
        box["outs"] = run_pass(llm, ids, args.concurrency, params, schedule="continuous")
        box["seconds"] = time.perf_counter() - t0

    # In a worker thread, as the server runs its engine: on a busy CPU, torch's 2-thread OpenMP ops are
    # many times slower from the main thread than from another one, which would flatter the server.
    box: dict[str, Any] = {}
    worker = threading.Thread(target=timed, name="offline-peer")
    worker.start()
    worker.join()
    if "outs" not in box:
        raise RuntimeError("the offline peer failed; see the log above")
    outs, seconds = box["outs"], box["seconds"]
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    # Per request, from the engine's own clock: from its arrival (sent when another ended, as by the server's
    # clients) to its first token, and the time per token after it.
    metrics = [o.metrics for o in outs if o.metrics is not None and o.metrics.first_token_time is not None]
    ttft = [m.first_token_time - m.arrival_time for m in metrics]
    tpot = [(o.metrics.finished_time - o.metrics.first_token_time) / (len(o.outputs[0].token_ids) - 1)
            for o in outs if o.metrics is not None and o.metrics.finished_time is not None
            and o.metrics.first_token_time is not None and len(o.outputs[0].token_ids) > 1]
    # The same split of the TTFT as the server's engine reports in /metrics (means): in the queue, then from the
    # first step that took the request to its first token.
    split = [m for m in metrics if m.first_scheduled_time is not None]
    phases = {"ttft": ttft, "queue": [m.first_scheduled_time - m.arrival_time for m in split],
              "handover": [m.received_time - m.arrival_time for m in split if m.received_time is not None],
              "prefill": [m.first_token_time - m.first_scheduled_time for m in split]}
    return {"name": "offline LLM (peer)", "requests": len(outs), "errors": 0, "seconds": seconds,
            "requests_per_s": len(outs) / seconds, "output_tokens": tokens, "output_tokens_per_s": tokens / seconds,
            "ttft_s": percentiles(ttft), "tpot_s": percentiles(tpot),
            "engine_side_means_s": {k: sum(v) / len(v) for k, v in phases.items() if v}}


# ---------------------------------------------------------------------------------- report
def percentiles(values: list[float], points: tuple[int, ...] = (50, 90, 99)) -> dict[str, float | None]:
    import numpy as np

    if not values:
        return {f"p{p}": None for p in points} | {"mean": None}
    arr = np.asarray(values)
    return {f"p{p}": float(np.percentile(arr, p)) for p in points} | {"mean": float(arr.mean())}


def summarize(results: list[RequestResult], wall: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    tokens = sum(r.output_tokens for r in ok)
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok
            if r.ttft is not None and r.e2e is not None and r.output_tokens > 1]
    errors = [r.error for r in results if not r.ok]
    return {
        "name": "atlas serve",
        "requests": len(ok),
        "errors": len(errors),
        "seconds": wall,
        "requests_per_s": len(ok) / wall,
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / wall,
        "prompt_tokens": sum(r.prompt_tokens for r in ok),
        "ttft_s": percentiles([r.ttft for r in ok if r.ttft is not None]),
        "e2e_s": percentiles([r.e2e for r in ok if r.e2e is not None]),
        "tpot_s": percentiles(tpot),
        "first_errors": sorted(set(errors))[:5],
    }


def _ms(stats: dict[str, float | None]) -> str:
    return "  ".join(f"{k} {v * 1000:.1f}" if v is not None else f"{k} -" for k, v in stats.items())


def front_end_stack() -> str:
    """The event loop and HTTP protocol the started server's front ends run on (the same environment as this)."""
    from atlas.server.connections import web_stack

    return "/".join(web_stack())


def render(server: dict[str, Any], peer: dict[str, Any] | None, meta: dict[str, Any]) -> str:
    w = meta["workload"]
    lines = [
        f"atlas bench serve: {w['num_requests']} requests, concurrency {w['concurrency']}, "
        f"{w['endpoint']}, max_tokens {w['max_tokens']}, temperature {w['temperature']}, "
        f"ignore_eos {w['ignore_eos']}, streaming"
        + (f", {meta['api_server_count']} front end(s)" if meta.get("api_server_count") else "")
        + (f", text made in: {meta['detokenize_in']}" if meta.get("detokenize_in") else "")
        + (f", front ends on {meta['front_end_stack']}" if meta.get("front_end_stack") else "")
        + (f", {meta['client_processes']} client processes" if meta.get("client_processes", 1) > 1 else ""),
        f"  machine: {meta['machine']['cpu_count']} CPU cores, {meta['machine']['platform']}"
        + (f", {meta['machine']['gpu']}" if meta["machine"].get("gpu") else ""),
        f"  requests ok {server['requests']}, errors {server['errors']}, wall {server['seconds']:.2f} s",
        f"  requests/s {server['requests_per_s']:.2f}, output tokens/s {server['output_tokens_per_s']:.1f}",
        f"  TTFT ms      {_ms(server['ttft_s'])}",
        f"  end-to-end ms {_ms(server['e2e_s'])}",
        f"  TPOT ms      {_ms(server['tpot_s'])}",
    ]
    if server.get("engine_side_means_s"):
        lines.append("  the server's engine, from /metrics (means, ms; each client process's warm-up request included): "
                     + "  ".join(f"{k} {v * 1000:.1f}" for k, v in server["engine_side_means_s"].items()))
    if server["first_errors"]:
        lines.append(f"  errors: {server['first_errors']}")
    if peer is not None:
        lines.append(f"  peer, {peer['name']}: requests/s {peer['requests_per_s']:.2f}, output tokens/s "
                     f"{peer['output_tokens_per_s']:.1f}; server / offline = "
                     f"{server['output_tokens_per_s'] / peer['output_tokens_per_s']:.2f}")
        if peer.get("ttft_s"):
            lines.append(f"  peer TTFT ms (from arrival) {_ms(peer['ttft_s'])}")
            lines.append(f"  peer TPOT ms {_ms(peer['tpot_s'])}")
        if peer.get("engine_side_means_s"):
            lines.append("  peer's engine (means, ms): "
                         + "  ".join(f"{k} {v * 1000:.1f}" for k, v in peer["engine_side_means_s"].items()))
    return "\n".join(lines)


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {"platform": platform.platform(), "python": platform.python_version(),
                            "cpu_count": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                            else os.cpu_count()}
    try:
        import torch

        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name()
    except ImportError:
        pass
    return info


def load_prompts(source: str | None) -> list[str]:
    if source is None:
        return list(DEFAULT_PROMPTS)
    lines = [ln for ln in Path(source).read_text().splitlines() if ln.strip()]
    prompts = [json.loads(ln)["prompt"] if ln.lstrip().startswith("{") else ln for ln in lines]
    if not prompts:
        raise ConfigError(f"--prompts {source}: no prompts in it")
    return prompts

def random_id_prompts(args: argparse.Namespace) -> list[list[int]]:
    """--input-len: one prompt of exactly that many token ids per request (vLLM's random dataset, as ids so that
    the length is exact), drawn with a fixed seed from the tokenizer's ordinary (not special) tokens; each request
    its own, so no prefix-cache hit shortens a prompt."""
    import random

    from atlas.engine.core import default_model_path
    from atlas.engine.tokenizer import Tokenizer

    if args.endpoint == "chat":
        raise ConfigError("--input-len sends token-id prompts, which /v1/chat/completions does not take: use "
                          "--endpoint completions, or --prompts FILE")
    if args.prompts:
        raise ConfigError("give --input-len or --prompts, not both")
    if args.input_len < 1:
        raise ConfigError(f"--input-len must be >= 1, got {args.input_len}")
    source = args.tokenizer or args.model
    if args.url and source is None:
        raise ConfigError("--input-len with --url needs --tokenizer (or --model) naming the served model's "
                          "tokenizer, to draw ids from its vocabulary")
    tokenizer = Tokenizer(source or default_model_path(), trust_remote_code=getattr(args, "trust_remote_code", False))
    special = set(tokenizer.hf.all_special_ids)
    ordinary = [i for i in range(len(tokenizer.hf)) if i not in special]
    rng = random.Random(0)
    return [[rng.choice(ordinary) for _ in range(args.input_len)] for _ in range(args.num_requests)]


def cmd_serve_load(args: argparse.Namespace) -> int:
    if args.num_requests < 1 or args.concurrency < 1:
        raise ConfigError("--num-requests and --concurrency must be >= 1")
    if not 1 <= args.client_processes <= args.concurrency:
        raise ConfigError("--client-processes must be between 1 and --concurrency")
    for module in ("aiohttp", "httpx"):  # (the load's client; the warm-up and /metrics reads)
        try:
            __import__(module)
        except ImportError as exc:
            raise ConfigError(f"atlas bench serve needs {module}: pip install -e '.[test]' (or pip install "
                              f"{module})") from exc
    prompts = random_id_prompts(args) if args.input_len is not None else load_prompts(args.prompts)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # no line per request
    api_key = args.api_key or None
    server = None
    if args.url:
        url = check_loopback(args.url)
    else:
        log_path = Path(args.server_log)
        if args.api_server_count is None:  # (the server's default, resolved here to be recorded)
            from atlas.server.cli import default_api_server_count

            args.api_server_count = default_api_server_count()
        server = ServerProcess([*engine_flags(args), "--api-server-count", str(args.api_server_count),
                                "--detokenize-in", args.detokenize_in], log_path)
        url = server.url
        api_key = None
    try:
        warm_up(url, prompts[0], args, api_key)  # (so that the engine-side figures leave out a cold first request)
        before = engine_phase_totals(url, api_key)
        results, wall = run_load_processes(url, prompts, args, api_key)
        engine_side = engine_phase_means(before, engine_phase_totals(url, api_key))
    finally:
        if server is not None:
            code = server.stop()
            logger.info("atlas serve stopped (exit code %s); its log is in %s", code, server.log_path)
    summary = summarize(results, wall)
    summary["engine_side_means_s"] = engine_side
    peer = offline_peer(args, prompts) if args.offline_peer and not args.url else None
    if peer is not None:
        summary["server_over_offline_output_tokens_per_s"] = summary["output_tokens_per_s"] / peer["output_tokens_per_s"]
    meta = {
        "argv": sys.argv[1:],
        "url": url, "machine": machine(), "engine_flags": engine_flags(args),
        "api_server_count": None if args.url else args.api_server_count,
        "detokenize_in": None if args.url else resolved_detokenize_in(args),
        "front_end_stack": None if args.url else front_end_stack(),
        "client_processes": args.client_processes,
        "workload": {"num_requests": args.num_requests, "concurrency": args.concurrency, "endpoint": args.endpoint,
                     "max_tokens": args.max_tokens, "temperature": args.temperature, "ignore_eos": args.ignore_eos,
                     "prompts": (f"{args.input_len} random token ids" if args.input_len is not None
                                 else args.prompts or "built-in code prefixes")},
    }
    text = render(summary, peer, meta)
    print(text)
    if args.output_json:
        path = Path(args.output_json)
        path.write_text(json.dumps({"meta": meta, "server": summary, "peer": peer}, indent=2))
        path.with_suffix(".txt").write_text(text + "\n")
    return 0 if summary["errors"] == 0 else 1


def add_serve_benchmark(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="Bounded load test of `atlas serve` on loopback (requests/s, TTFT, latency).",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("load")
    g.add_argument("--url", default=None,
                   help="A running server (loopback only). Default: start `atlas serve` with the engine flags.")
    g.add_argument("--api-key", default=None, help="Bearer key for --url.")
    g.add_argument("--served-model-name", default=None, help="The model field to send (default: none).")
    g.add_argument("--num-requests", "--num-prompts", type=int, default=200,
                   help="Requests in all (--num-prompts: vLLM's bench name).")
    g.add_argument("--api-server-count", type=int, default=None, metavar="N",
                   help="HTTP front-end processes of the started server (atlas serve --api-server-count; default: "
                        "its default for this host).")
    g.add_argument("--detokenize-in", choices=("auto", "engine", "front-end"), default="auto",
                   help="Where the started server makes output text (atlas serve --detokenize-in).")
    g.add_argument("--concurrency", "--max-concurrency", type=int, default=16,
                   help="Requests in flight at once (--max-concurrency: vLLM's bench name).")
    g.add_argument("--client-processes", type=int, default=1, metavar="K",
                   help="Send the load from K processes (the requests and the concurrency split between them): "
                        "one client process can be what limits a fast server.")
    g.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    g.add_argument("--max-tokens", "--random-output-len", type=int, default=64,
                   help="Tokens each request generates (--random-output-len: vLLM's bench name).")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="Generate exactly --max-tokens per request (a fixed load).")
    g.add_argument("--prompts", default=None, help="File of prompts, one per line or JSONL with 'prompt'.")
    g.add_argument("--input-len", "--random-input-len", type=int, default=None, metavar="N",
                   help="Prompts of exactly N random token ids instead (one per request, ordinary tokens of the "
                        "tokenizer, seeded; completions only): vLLM's random dataset, sent as ids "
                        "(--random-input-len: vLLM's bench name).")
    g.add_argument("--request-timeout", type=float, default=300.0, metavar="SECONDS")
    g.add_argument("--max-duration", type=float, default=1800.0, metavar="SECONDS",
                   help="Deadline of the whole run; unfinished requests then count as errors.")
    g.add_argument("--offline-peer", action=argparse.BooleanOptionalAction, default=True,
                   help="Also time the offline engine on the same requests (only when the server is started here).")
    g.add_argument("--server-log", default="atlas-serve-bench.log", help="Where the started server's log goes.")
    g.add_argument("--output-json", default=None, help="Write the results here (and a .txt beside it).")
    EngineConfig.add_cli_args(p)
    p.set_defaults(func=cmd_serve_load)
