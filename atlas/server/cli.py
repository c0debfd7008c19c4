"""`atlas serve`: the OpenAI-compatible server.

The web stack (fastapi, uvicorn, pydantic, prometheus-client) is imported inside the command only,
so `atlas --help` and the other commands work without the `server` extras.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket

from atlas.config import EngineConfig
from atlas.errors import AtlasError, ConfigError

logger = logging.getLogger("atlas.server")

SERVER_PACKAGES = ("fastapi", "uvicorn", "pydantic", "prometheus_client")


def check_server_extras() -> None:
    import importlib

    missing = []
    for name in SERVER_PACKAGES:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    if missing:
        raise AtlasError(f"atlas serve needs the server extras ({', '.join(missing)} missing): "
                         "install atlas[server], e.g. pip install -e '.[server]'")


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind and listen before the model loads: a taken port fails at once, and clients that connect
    during start-up wait in the backlog instead of being refused."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ConfigError(f"--host {host!r}: cannot resolve it ({exc})") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port} ({exc.strerror}): choose another --port or --host") \
            from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    if sock.family == socket.AF_INET6:
        host = f"[{host}]"
    return f"http://{host}:{port}"


def cmd_serve(args: argparse.Namespace) -> int:
    check_server_extras()
    import uvicorn

    from atlas.engine.async_engine import AsyncEngine
    from atlas.engine.core import EngineCore
    from atlas.server.app import build_app

    api_key = args.api_key or os.environ.get("ATLAS_API_KEY") or None
    config = EngineConfig.from_cli_args(args)
    sock = bind_socket(args.host, args.port)
    try:
        core = EngineCore(config)
        engine = AsyncEngine(core, start=False)
        names = args.served_model_name or [config.model or "atlas-default"]
        app = build_app(engine, names, api_key)
    except BaseException:
        sock.close()
        raise

    plan = core.plan
    logger.info("model: %s (%s), served as %s", core.model_path, core.model_config.architecture, ", ".join(names))
    logger.info("dtype: %s, device: %s", str(core.runner.dtype).replace("torch.", ""), core.device)
    logger.info("KV cache: %d pages x %d tokens = %d tokens", plan.num_pages, plan.block_size, plan.token_capacity)
    logger.info("max concurrent sequences: %d, max model len: %d, API key: %s", config.max_num_seqs,
                core.max_model_len, "required" if api_key else "none")
    url = url_of(sock)
    logger.info("listening on %s (OpenAI API at %s/v1)", url, url)

    uv_config = uvicorn.Config(app, log_config=None, log_level=args.log_level, access_log=args.access_log,
                               timeout_graceful_shutdown=args.shutdown_timeout)
    server = uvicorn.Server(uv_config)
    # uvicorn handles SIGINT / SIGTERM while it runs (stop accepting, let in-flight requests finish, shut
    # the engine down) and then re-raises the signal it caught; after a clean shutdown that is a no-op.
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.run(sockets=[sock])
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        sock.close()
        engine.shutdown()
    logger.info("server stopped")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "serve", help="Serve the OpenAI-compatible HTTP API (needs atlas[server]).",
        description="OpenAI-compatible server: /v1/completions, /v1/chat/completions, /v1/models, /health, "
                    "/metrics, /tokenize, /detokenize.")
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="Address to listen on (0.0.0.0 for every interface).")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="Model name(s) clients use; the first is reported. Default: the --model value, or "
                        "'atlas-default' for the built-in model.")
    g.add_argument("--api-key", default=None,
                   help="Require 'Authorization: Bearer KEY' on /v1/* and /tokenize (also read from ATLAS_API_KEY).")
    g.add_argument("--access-log", action=argparse.BooleanOptionalAction, default=True,
                   help="Log one line per HTTP request.")
    g.add_argument("--shutdown-timeout", type=float, default=10.0, metavar="SECONDS",
                   help="On SIGINT/SIGTERM, how long in-flight requests may finish before they are aborted.")
    EngineConfig.add_cli_args(p)
    p.set_defaults(func=cmd_serve)
