"""`atlas run-batch` (vLLM's `vllm run-batch`): the requests of an OpenAI batch file, answered by the server's own
routes, into an output file in OpenAI's batch output format.

Each input line is {"custom_id", "method": "POST", "url", "body"} for one of the server's POST routes
(/v1/chat/completions, /v1/completions, /v1/embeddings, /v1/responses, /v1/messages, /v1/score, /v1/rerank,
/classify, /pooling, with or without /v1). The app `atlas serve` would run answers them in this process, without a
socket, so a line gets exactly the answer the server would give: its output line is {"id", "custom_id",
"response": {"status_code", "request_id", "body"}, "error": null}, in the order of the input, a request the server
refuses carrying its status and error body. A line that is not such a request (not JSON, no custom_id, another
method or route, `stream: true`) gets {"response": null, "error": {"code", "message"}} and the others go on. The
requests run concurrently (the engine batches them), at most --max-concurrency at a time. Input and output are
local files ("-": standard input / output) or, for the input, an http(s) URL.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import uuid
from pathlib import Path
from typing import Any

from atlas.config import EngineConfig
from atlas.errors import ConfigError

logger = logging.getLogger(__name__)

ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses", "/v1/messages", "/v1/score",
          "/v1/rerank", "/score", "/rerank", "/classify", "/pooling")


def register(subparsers: argparse._SubParsersAction) -> None:
    from atlas.server.cli import add_server_arguments

    p = subparsers.add_parser(
        "run-batch", help="Answer an OpenAI batch file (JSONL) through the server's routes (needs atlas[server]).",
        description="Each input line {custom_id, method: POST, url, body} is answered by the route of `atlas serve` "
                    "it names; the output lines are OpenAI's batch output format, in the input's order (vLLM's "
                    "run-batch). Takes atlas serve's model, engine and server flags.")
    g = p.add_argument_group("batch")
    g.add_argument("-i", "--input-file", required=True, metavar="PATH|URL",
                   help="The batch file: a local JSONL file, '-' for standard input, or an http(s) URL.")
    g.add_argument("-o", "--output-file", required=True, metavar="PATH",
                   help="Where the output lines go: a local file, or '-' for standard output.")
    g.add_argument("--max-concurrency", type=int, default=None, metavar="N",
                   help="Requests in flight at once (default: 4 x --max-num-seqs).")
    add_server_arguments(p)
    p.set_defaults(func=cmd_run_batch)


def read_lines(source: str) -> list[str]:
    if source == "-":
        text = sys.stdin.read()
    elif source.startswith(("http://", "https://")):
        import httpx

        reply = httpx.get(source, timeout=60, follow_redirects=True)
        if reply.status_code != 200:
            raise ConfigError(f"--input-file {source}: HTTP {reply.status_code}")
        text = reply.text
    else:
        path = Path(source)
        if not path.is_file():
            raise ConfigError(f"--input-file {source}: no such file")
        text = path.read_text(encoding="utf-8")
    return [line for line in text.splitlines() if line.strip()]


def _failed(custom_id: Any, code: str, message: str) -> dict[str, Any]:
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id, "response": None,
            "error": {"code": code, "message": message}}


def _request_of(line: str) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """-> (the request, None) or (None, its failed output line)."""
    try:
        item = json.loads(line)
    except ValueError as exc:
        return None, _failed(None, "invalid_json", f"the line is not JSON ({exc})")
    if not isinstance(item, dict):
        return None, _failed(None, "invalid_request", "a line must be a JSON object")
    custom_id = item.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return None, _failed(custom_id, "invalid_request", "custom_id: a non-empty string is required")
    if item.get("method", "POST") != "POST":
        return None, _failed(custom_id, "invalid_request", f"method {item.get('method')!r}: only POST")
    if item.get("url") not in ROUTES:
        return None, _failed(custom_id, "invalid_request", f"url {item.get('url')!r}: one of {', '.join(ROUTES)}")
    body = item.get("body")
    if not isinstance(body, dict):
        return None, _failed(custom_id, "invalid_request", "body: a JSON object is required")
    if body.get("stream"):
        return None, _failed(custom_id, "invalid_request", "body.stream: a batch answers each request whole; "
                                                           "leave stream out")
    return item, None


async def answer_all(app: Any, lines: list[str], max_concurrency: int, headers: dict[str, str]) -> list[dict]:
    """Every line's output line, in order."""
    import httpx
    from tqdm.auto import tqdm

    gate = asyncio.Semaphore(max_concurrency)
    bar = tqdm(total=len(lines), desc="run-batch", unit="req", disable=None)

    async def one(client: httpx.AsyncClient, line: str) -> dict[str, Any]:
        item, failed = _request_of(line)
        if failed is not None:
            bar.update(1)
            return failed
        async with gate:
            reply = await client.post(item["url"], json=item["body"], headers=headers)
        bar.update(1)
        try:
            body = reply.json()
        except ValueError:
            body = {"text": reply.text}
        request_id = body.get("id") if isinstance(body, dict) and isinstance(body.get("id"), str) else None
        return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": item["custom_id"],
                "response": {"status_code": reply.status_code, "request_id": request_id or uuid.uuid4().hex,
                             "body": body},
                "error": None}

    logging.getLogger("httpx").setLevel(logging.WARNING)  # (a line per request otherwise)
    transport = httpx.ASGITransport(app=app)
    try:
        async with app.router.lifespan_context(app), \
                httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1", timeout=None) as client:
            return list(await asyncio.gather(*(one(client, line) for line in lines)))
    finally:
        bar.close()


def cmd_run_batch(args: argparse.Namespace) -> int:
    import dataclasses

    from atlas.engine.async_engine import AsyncEngine
    from atlas.engine.core import EngineCore
    from atlas.server.app import build_app
    from atlas.server.cli import check_server_extras, settings_from_args

    check_server_extras()
    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            raise ConfigError(f"two models given: {args.model_tag!r} and --model {args.model!r}; give one")
        args.model = args.model_tag
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ConfigError(f"--max-concurrency must be at least 1, got {args.max_concurrency}")
    lines = read_lines(args.input_file)
    config = EngineConfig.from_cli_args(args)
    if getattr(args, "data_parallel_size", 1) > 1:
        raise ConfigError("atlas run-batch runs one engine (tensor and pipeline parallel as it may be); engine "
                          "replicas (--data-parallel-size) are atlas serve's")
    # (every request is queued at once: the batch's own bound replaces the server's waiting-room cap)
    settings = dataclasses.replace(settings_from_args(args), max_waiting_requests=0, max_sequences_per_request=max(
        256, args.max_sequences_per_request))
    engine = AsyncEngine(EngineCore(config), start=False)
    names = args.served_model_name or [config.model or "atlas-default"]
    app = build_app(engine, names, settings=settings)
    headers = {"Authorization": f"Bearer {settings.api_key}"} if settings.api_key else {}
    limit = args.max_concurrency or 4 * config.max_num_seqs
    outputs = asyncio.run(answer_all(app, lines, limit, headers))
    text = "".join(json.dumps(o, ensure_ascii=False) + "\n" for o in outputs)
    if args.output_file == "-":
        sys.stdout.write(text)
    else:
        Path(args.output_file).write_text(text, encoding="utf-8")
    ok = sum(1 for o in outputs if o["response"] is not None and o["response"]["status_code"] == 200)
    logger.info("run-batch: %d requests, %d answered 200, %d refused or malformed; output in %s", len(outputs), ok,
                len(outputs) - ok, args.output_file)
    return 0
