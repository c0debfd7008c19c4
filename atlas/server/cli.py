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

from atlas.config import EngineConfig, json_object, parse_memory_size
from atlas.engine.chat_content import CONTENT_FORMATS
from atlas.errors import AtlasError, ConfigError

logger = logging.getLogger("atlas.server")

SERVER_PACKAGES = ("fastapi", "uvicorn", "pydantic", "prometheus_client", "zmq", "msgspec")



# One front end streaming to 256 clients saturates its core (0.78 of the offline engine on the H200 against 1.12 with
# two, which also make the output text: BENCHMARKS.md section 4); hosts this large have cores to spare for a second.
LARGE_HOST_CPUS = 8
FRONT_ENDS_ON_LARGE_HOSTS = 2



def _template_kwargs(text: str) -> dict:
    """--default-chat-template-kwargs' JSON object (argparse names the flag and this message on a bad one)."""
    try:
        return json_object(text, "--default-chat-template-kwargs")
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None

def default_api_server_count() -> int:
    """--api-server-count when none is given: two front ends on hosts with LARGE_HOST_CPUS or more (usable) CPUs."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return FRONT_ENDS_ON_LARGE_HOSTS if cpus >= LARGE_HOST_CPUS else 1


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


def bind_socket(host: str, port: int, reuse_port: bool = False) -> socket.socket:
    """Bind and listen before the model loads: a taken port fails at once, and clients that connect
    during start-up wait in the backlog instead of being refused."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ConfigError(f"--host {host!r}: cannot resolve it ({exc})") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port} ({exc.strerror}): choose another --port or --host") \
            from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def bind_sockets(host: str, port: int, count: int) -> list[socket.socket]:
    """One listening socket per front end, all on one port (SO_REUSEPORT), so that the kernel spreads the
    connections over the front ends evenly. On one shared socket, whichever front end wakes first accepts a
    burst of connections: 64 connections made at once went 64 / 0 or 51 / 13 to two front ends, and the loaded
    one held back every stream on it. Where the option is missing, the front ends share one socket."""
    first = bind_socket(host, port)  # (without SO_REUSEPORT: also fails on a port another server shares this way)
    if count == 1 or not hasattr(socket, "SO_REUSEPORT"):
        return [first]
    port = first.getsockname()[1]
    first.close()
    socks: list[socket.socket] = []
    try:
        for _ in range(count):
            socks.append(bind_socket(host, port, reuse_port=True))
    except BaseException:
        for sock in socks:
            sock.close()
        raise
    return socks


def url_of(sock: socket.socket, tls: bool = False) -> str:
    host, port = sock.getsockname()[:2]
    if sock.family == socket.AF_INET6:
        host = f"[{host}]"
    return f"{'https' if tls else 'http'}://{host}:{port}"


def make_uvicorn_server(app, log_level: str = "info", access_log: bool = True, sigint: bool = True):
    """A uvicorn server for an Atlas app: on shutdown it starts the app's --shutdown-timeout clock (after
    which the app cuts what still runs, each with a proper answer); uvicorn's own, later, timeout is
    only a backstop. `sigint=False` (a front end of `atlas serve`): Ctrl-C is the launcher's, which sends
    SIGTERM; the terminal's SIGINT to the whole process group is ignored here."""
    import uvicorn

    server_state = app.state.server

    class Server(uvicorn.Server):
        async def shutdown(self, sockets=None) -> None:
            # uvicorn's shutdown closes the listener first: drain with it open, so that /health answers 503 (and
            # new requests a 503) while in-flight requests finish, instead of connections being refused.
            server_state.begin_shutdown()
            await server_state.drain(lambda: self.force_exit)
            await super().shutdown(sockets)

        def handle_exit(self, sig, frame) -> None:
            if sig == signal.SIGINT and not sigint:
                return
            self.signals = getattr(self, "signals", 0) + 1
            if self.signals == 2 and server_state.loop is not None:
                # A second signal during the drain: cut what still runs now, each with a proper answer (an
                # error event and [DONE], or a 503), instead of dropping connections mid-stream. A third one
                # stops at once.
                server_state.loop.call_soon_threadsafe(server_state.cut_in_flight, True)
                return
            super().handle_exit(sig, frame)

    from atlas.server.connections import ConnectionLimits, connection_cap, guarded_protocol

    settings = server_state.settings
    limits = ConnectionLimits(settings.header_timeout, connection_cap(settings.max_connections),
                              settings.max_connections_per_client)
    config = uvicorn.Config(app, log_config=None, log_level=log_level, access_log=access_log,
                            timeout_graceful_shutdown=settings.shutdown_timeout + 5, http=guarded_protocol(limits),
                            timeout_keep_alive=settings.timeout_keep_alive, ssl_keyfile=settings.ssl_keyfile,
                            ssl_certfile=settings.ssl_certfile, ssl_ca_certs=settings.ssl_ca_certs,
                            ssl_cert_reqs=settings.ssl_cert_reqs)
    return Server(config)


def settings_from_args(args: argparse.Namespace):
    """The server's own settings (ServerSettings) from `atlas serve`'s flags; a bad value is a ConfigError."""
    from atlas.server.settings import ServerSettings

    api_key = args.api_key or os.environ.get("ATLAS_API_KEY") or None
    if api_key is not None and api_key != api_key.strip() and api_key.strip():
        logger.warning("the API key has spaces or line breaks around it: they are ignored (clients send the "
                       "key without them)")
    try:
        return ServerSettings(
            api_key=api_key, public_metrics_and_docs=args.public_metrics_and_docs,
            max_request_body_bytes=parse_memory_size(args.max_request_body_bytes, "max_request_body_bytes"),
            max_sequences_per_request=args.max_sequences_per_request,
            max_request_list_items=args.max_request_list_items,
            max_prompt_chars_per_token=args.max_prompt_chars_per_token,
            max_waiting_requests=args.max_waiting_requests,
            header_timeout=args.header_timeout, body_timeout=args.body_timeout,
            timeout_keep_alive=args.timeout_keep_alive, max_connections=args.max_connections,
            max_connections_per_client=args.max_connections_per_client,
            trust_request_chat_template=args.trust_request_chat_template,
            exclude_tools_when_tool_choice_none=args.exclude_tools_when_tool_choice_none,
            default_chat_template_kwargs=args.default_chat_template_kwargs or {},
            log_requests=args.enable_log_requests and not args.disable_log_requests,
            log_outputs=args.enable_log_outputs, max_log_len=args.max_log_len,
            chat_template_timeout=args.chat_template_timeout, shutdown_timeout=args.shutdown_timeout,
            preprocess_workers=args.preprocess_workers, start_preprocess_workers=True,
            detokenize_in=args.detokenize_in,
            enable_prompt_tokens_details=args.enable_prompt_tokens_details,
            return_tokens_as_token_ids=args.return_tokens_as_token_ids,
            chat_template_content_format=args.chat_template_content_format,
            force_include_usage=args.enable_force_include_usage, response_role=args.response_role,
            docs=not args.disable_fastapi_docs, request_id_headers=args.enable_request_id_headers, server_load_tracking=args.enable_server_load_tracking,
            enable_auto_tool_choice=args.enable_auto_tool_choice, tool_call_parser=args.tool_call_parser,
            allow_runtime_lora_updating=args.allow_runtime_lora_updating,
            reasoning_parser=args.reasoning_parser, bind_host=args.host, allowed_hosts=args.allowed_hosts,
            allowed_origins=args.allowed_origins or (), allowed_methods=args.allowed_methods or ("*",),
            allowed_headers=args.allowed_headers or ("*",), allow_credentials=args.allow_credentials,
            ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile, ssl_ca_certs=args.ssl_ca_certs,
            ssl_cert_reqs=args.ssl_cert_reqs, root_path=args.root_path)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def cmd_serve(args: argparse.Namespace) -> int:
    from atlas.runtime.parallel_groups import is_driver

    if args.model_tag is not None:  # `atlas serve MODEL`, as `vllm serve MODEL`
        if args.model is not None and args.model != args.model_tag:
            raise ConfigError(f"two models given: {args.model_tag!r} and --model {args.model!r}; give one")
        args.model = args.model_tag
    config = EngineConfig.from_cli_args(args)
    if not is_driver(config):  # another node's ranks (or a torchrun rank): no HTTP here
        from atlas.engine.workers import run_node

        return run_node(config)
    check_server_extras()

    from atlas.server.launcher import Launcher

    if args.api_server_count is None:
        args.api_server_count = default_api_server_count()
    if args.api_server_count < 1:
        raise ConfigError(f"--api-server-count must be at least 1, got {args.api_server_count}")
    from atlas.engine.data_parallel import check_data_parallel

    check_data_parallel(config, args.data_parallel_size)
    settings = settings_from_args(args)
    api_key = settings.api_key
    from atlas.server.connections import raise_open_file_limit

    limit = raise_open_file_limit()
    if limit is not None and limit[1] > limit[0]:
        logger.debug("open-file limit raised from %d to %d", *limit)
    socks = bind_sockets(args.host, args.port, args.api_server_count)
    names = args.served_model_name or [config.model or "atlas-default"]
    launcher = Launcher(config, socks, names, settings, args.api_server_count, args.uvicorn_log_level or args.log_level,
                        args.access_log, log_stats=not args.disable_log_stats,
                        data_parallel_size=args.data_parallel_size)
    try:
        infos = launcher.start_engine()
    except BaseException:
        for sock in socks:
            sock.close()
        raise
    # The engine has logged the model, device, dtype and KV cache; what the server adds:
    logger.info("served as %s; API key: %s", ", ".join(names),
                "required" + ("" if settings.public_metrics_and_docs else " (also for /metrics and /docs)")
                if api_key else "none")
    logger.info("limits: request body %s bytes, %d sequences per request, chat templates from requests %s",
                f"{settings.max_request_body_bytes:,}", settings.max_sequences_per_request,
                "allowed" if settings.trust_request_chat_template else "refused")
    from atlas.server.browsers import default_allowed_hosts

    hosts = settings.allowed_hosts if settings.allowed_hosts is not None else default_allowed_hosts(args.host)
    logger.info("browsers: Host %s; CORS %s", "any" if "*" in hosts else "one of " + ", ".join(hosts),
                "for " + ", ".join(settings.allowed_origins) if settings.allowed_origins else "off")
    from atlas.server.connections import web_stack

    loop, http = web_stack()
    if (loop, http) != ("uvloop", "httptools"):
        # (each streamed token costs a front end about 1.5x the CPU with h11: BENCHMARKS.md section 4)
        logger.warning("the front ends run on %s's event loop and %s: `pip install uvloop httptools` (in atlas[server]) "
                       "makes streaming cheaper", loop, http)
    url = url_of(socks[0], settings.tls)
    engines = (f"engine in process {infos[0].pid}" if len(infos) == 1 else
               f"{len(infos)} engine replicas in processes {', '.join(str(i.pid) for i in infos)}")
    logger.info("%s, %d HTTP front end process%s; listening on %s (OpenAI API at %s/v1); Ctrl-C stops it", engines,
                args.api_server_count, "es" if args.api_server_count > 1 else "", url, url)
    try:
        status = launcher.run(infos)
    finally:
        for sock in socks:
            sock.close()
    logger.info("server stopped" + (" (status 1)" if status else ""))
    return status


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "serve", help="Serve the OpenAI-compatible HTTP API (needs atlas[server]). Runs until stopped.",
        description="OpenAI-compatible server: /v1/completions, /v1/chat/completions, /v1/models, /tokenize, "
                    "/detokenize, /tokenizer_info, /health, /metrics, /docs. It runs in the foreground until "
                    "Ctrl-C / SIGTERM: use another shell for clients.")
    add_server_arguments(p)
    p.set_defaults(func=cmd_serve)


def add_server_arguments(p: argparse.ArgumentParser) -> None:
    """`atlas serve`'s arguments (the model, the server's settings, the engine's, vLLM's names), on `p` (also
    `atlas run-batch`'s)."""
    from atlas.server.output_parsers import REASONING_PARSERS, TOOL_PARSERS  # (standard library only)

    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="Checkpoint folder or hub id to serve (the same as --model).")
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="Address to listen on (0.0.0.0 for every interface).")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--api-server-count", type=int, default=None, metavar="N",
                   help="HTTP front-end processes on the one port, sharing the engine process (tokenization, chat "
                        "templates and streaming spread over N cores). Metrics and limits are the same in each. "
                        f"Default: {FRONT_ENDS_ON_LARGE_HOSTS} on a host with {LARGE_HOST_CPUS} or more CPUs (one "
                        "front end streaming 256 requests keeps a core busy and holds the engine back), else 1.")
    g.add_argument("--data-parallel-size", "-dp", type=int, default=1, metavar="D",
                   help="Engine replicas, each a whole copy of the model on --tensor-parallel-size x "
                        "--pipeline-parallel-size GPUs of its own (D x that many GPUs in all, on this node); every "
                        "request goes to the replica with the fewest of its front end's requests in flight. vLLM's "
                        "flag; not with --enable-expert-parallel (each replica holds every expert).")
    g.add_argument("--detokenize-in", choices=("auto", "engine", "front-end"),  # (ServerSettings.DETOKENIZE_IN)
                   default="auto",
                   help="Where output text is made: 'engine' (in the engine process, on its step), 'front-end' "
                        "(each front end for its requests without stop strings, batched per engine step; a request "
                        "with stop strings gets its text from the engine, which stops on it), or 'auto' (the "
                        "front ends when there are two or more). Outputs are the same either way.")
    g.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="Model name(s) clients use; the first is reported. Default: the --model value, or "
                        "'atlas-default' for the built-in model.")
    g.add_argument("--api-key", default=None,
                   help="Require 'Authorization: Bearer KEY' on /v1/*, /tokenize, /detokenize and /tokenizer_info "
                        "(also read from ATLAS_API_KEY). /health is always open; /metrics, /docs and "
                        "/openapi.json are open unless --no-public-metrics-and-docs.")
    g.add_argument("--public-metrics-and-docs", action=argparse.BooleanOptionalAction, default=True,
                   help="With --api-key, leave /metrics, /docs and /openapi.json open (the default); "
                        "--no-public-metrics-and-docs puts them behind the key too.")
    g.add_argument("--max-request-body-bytes", default="8MiB", metavar="SIZE",
                   help="Largest request body accepted (e.g. 8MiB, 1000000); larger ones get 413.")
    g.add_argument("--max-sequences-per-request", type=int, default=256, metavar="N",
                   help="Most sequences one request may create (prompts x n); more is a 400.")
    g.add_argument("--max-request-list-items", type=int, default=4096, metavar="N",
                   help="Most items in one list of a request (stop_token_ids, stop, tools, messages, prompts, "
                        "logit_bias entries); "
                        "more is a 400 before any work is done.")
    g.add_argument("--max-prompt-chars-per-token", type=int, default=64, metavar="N",
                   help="A prompt text longer than N characters per token of --max-model-len is refused before "
                        "it is tokenized (it could not fit).")
    g.add_argument("--max-waiting-requests", type=int, default=None, metavar="N",
                   help="Requests that may wait for a sequence slot beyond the --max-num-seqs running; past it new "
                        "requests get 429 with Retry-After. Default 8 x --max-num-seqs; 0: no bound.")
    g.add_argument("--header-timeout", type=float, default=10.0, metavar="SECONDS",
                   help="A connection whose request headers are not complete this long after it opened (or after its "
                        "last response) is closed: slow-header clients cannot hold connections.")
    g.add_argument("--body-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="A request body whose next part does not arrive within this many seconds gets 408.")
    g.add_argument("--timeout-keep-alive", type=float, default=5.0, metavar="SECONDS",
                   help="Idle keep-alive connections are closed after this long (uvicorn's flag).")
    g.add_argument("--max-connections", type=int, default=4096, metavar="N",
                   help="Open connections per front end; past it the oldest idle connection is closed to make room "
                        "(else the new one). Lowered to what the open-file limit leaves, which is raised to the "
                        "system's maximum at start-up; 0: that limit alone.")
    g.add_argument("--max-connections-per-client", type=int, default=0, metavar="N",
                   help="Open connections from one client address beyond this are closed at once (0: no cap; behind "
                        "a reverse proxy every client has the proxy's address).")
    g.add_argument("--trust-request-chat-template", action="store_true",
                   help="Accept a chat template sent with a request (chat_template, or chat_template_kwargs."
                        "chat_template). Off: such requests get 400. Templates always render in a sandbox with "
                        "limits.")
    g.add_argument("--chat-template-timeout", type=float, default=5.0, metavar="SECONDS",
                   help="Longest one chat template may take to render; past it the request gets 400.")
    g.add_argument("--preprocess-workers", type=int, default=1, metavar="N",
                   help="Worker processes for large preprocessing (a request's own chat template; chats over 512 "
                        "messages, 256 KiB or 128 tools; prompts over 256 KiB; large detokenizations), per front end, "
                        "so that it never holds the front end's interpreter; recycled when their memory grows. 0: "
                        "in a thread of the front end.")
    g.add_argument("--allow-runtime-lora-updating", action="store_true",
                   help="With --enable-lora: POST /v1/load_lora_adapter {lora_name, lora_path} and "
                        "/v1/unload_lora_adapter {lora_name} load and unload adapters while the server runs (vLLM's "
                        "VLLM_ALLOW_RUNTIME_LORA_UPDATING). A client with the API key may then read any adapter "
                        "folder this server can read, or fetch one from the hub.")
    g.add_argument("--exclude-tools-when-tool-choice-none", action="store_true",
                   help="A chat request with tool_choice \"none\" renders its template without its tools (vLLM's "
                        "flag; by default the tools are rendered and no tool call is parsed).")
    g.add_argument("--default-chat-template-kwargs", type=_template_kwargs, default=None, metavar="JSON",
                   help="Template variables every chat renders with, under the request's own chat_template_kwargs "
                        "(which win), as vLLM's flag: e.g. '{\"enable_thinking\": false}' turns Qwen3's thinking off "
                        "by default.")
    g.add_argument("--enable-prompt-tokens-details", action="store_true",
                   help="usage.prompt_tokens_details.cached_tokens in completions and chat responses: the prompt "
                        "tokens the prefix cache served (vLLM's flag).")
    g.add_argument("--chat-template-content-format", default="auto", choices=CONTENT_FORMATS,
                   help="How a message's content reaches the chat template: string (a list's text parts joined by "
                        "newlines), openai (a list of text parts; a string as one part), auto (openai where the "
                        "template loops over or indexes a message's content, else string), as vLLM's flag.")
    g.add_argument("--enable-log-outputs", action="store_true",
                   help="Log a line per finished sequence: its request id, finish reason, token count and text "
                        "(vLLM's flag; the text cut at --max-log-len).")
    g.add_argument("--max-log-len", type=_non_negative_int, default=None, metavar="N",
                   help="Characters of output text in --enable-log-outputs' lines (default: all).")
    g.add_argument("--enable-force-include-usage", action="store_true",
                   help="Every streamed completion and chat reply ends with a usage chunk, as if the request set "
                        "stream_options.include_usage (vLLM's flag).")
    g.add_argument("--response-role", default="assistant", metavar="ROLE",
                   help="The role of chat replies (with add_generation_prompt; vLLM's flag).")
    g.add_argument("--enable-server-load-tracking", action="store_true",
                   help="GET /load answers {\"server_load\": N}, the requests this front end is answering (vLLM's "
                        "flag; with several --api-server-count front ends, each its own).")
    g.add_argument("--enable-request-id-headers", action="store_true",
                   help="Every response carries an X-Request-Id header: the request's own (which also names the "
                        "request: its response id, the engine's and the log's), else a new one (vLLM's flag).")
    g.add_argument("--disable-fastapi-docs", action="store_true",
                   help="Serve no /docs page and no /openapi.json (vLLM's flag).")
    g.add_argument("--return-tokens-as-token-ids", action="store_true",
                   help="Logprob entries name their tokens 'token_id:N' (for tokens that are not whole text), unless "
                        "a request's return_tokens_as_token_ids is false (vLLM's flag).")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='Allow tool_choice "auto" (the default when a request has tools): the reply\'s text is '
                        "parsed for tool calls with --tool-call-parser. Without it such requests get 400; "
                        '"required" and named functions are enforced by the grammar engine either way.')
    g.add_argument("--tool-call-parser", default=None, choices=list(TOOL_PARSERS),
                   help="The format the model writes tool calls in (vLLM's names): hermes (= qwen) "
                        '<tool_call>{...}</tool_call>; llama3_json (= llama) {"name": ..., "parameters": ...} '
                        'separated by ";"; qwen3_coder <tool_call><function=NAME><parameter=P>...; glm45 '
                        "<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>...; mistral [TOOL_CALLS]; "
                        "pythonic (= llama4_pythonic) [f(a=1), g(b='x')]; openai: gpt-oss's harmony format "
                        "(reasoning, answer and calls).")
    g.add_argument("--reasoning-parser", default=None, choices=list(REASONING_PARSERS),
                   help="Split <think>...</think> from chat replies into reasoning_content (streams too). "
                        "qwen3, glm45: reasoning when the reply opens <think>; deepseek_r1: the reply starts inside "
                        "the reasoning (the template opens <think>); gemma4: Gemma 4's <|channel>thought ... "
                        "<channel|>; openai_gptoss: gpt-oss's analysis channel.")
    g.add_argument("--allowed-hosts", action="append", default=None, metavar="HOSTS",
                   help="Host names (the request's Host header, without the port) the server answers for; other "
                        "requests get 421, which stops DNS rebinding. Comma-separated or a JSON list, repeatable; "
                        "'*' = any. Default: the --host address, localhost, 127.0.0.1 and ::1; any host when "
                        "--host is 0.0.0.0 or ::.")
    g.add_argument("--allowed-origins", action="append", default=None, metavar="ORIGINS",
                   help="Turn CORS on for these web origins (e.g. https://app.example; '*' = any), as a JSON list "
                        "(vLLM's form) or comma-separated, repeatable. Default: CORS off. A request whose Origin "
                        "header is neither allowed nor the server's own gets 403.")
    g.add_argument("--allowed-methods", action="append", default=None, metavar="METHODS",
                   help="With --allowed-origins: the methods CORS allows (default '*').")
    g.add_argument("--allowed-headers", action="append", default=None, metavar="HEADERS",
                   help="With --allowed-origins: the request headers CORS allows (default '*').")
    g.add_argument("--allow-credentials", action="store_true",
                   help="With --allowed-origins: let browsers send cookies and HTTP authentication (not with '*').")
    g.add_argument("--root-path", default="", metavar="PREFIX",
                   help="The path prefix a proxy routes to this server (e.g. /api/atlas), as vLLM's flag: requests "
                        "with or without it reach the routes, and /docs and /openapi.json name the prefixed URLs.")
    g.add_argument("--ssl-keyfile", default=None, metavar="PATH",
                   help="Serve HTTPS with this private key (PEM; with --ssl-certfile).")
    g.add_argument("--ssl-certfile", default=None, metavar="PATH",
                   help="Serve HTTPS with this certificate (PEM, its chain after it; with --ssl-keyfile).")
    g.add_argument("--ssl-ca-certs", default=None, metavar="PATH",
                   help="CA certificates (PEM) that client certificates must be signed by (with --ssl-cert-reqs).")
    g.add_argument("--ssl-cert-reqs", type=int, default=0, choices=(0, 1, 2), metavar="0|1|2",
                   help="Client certificates: 0 not asked for, 1 checked when given, 2 required (mutual TLS; "
                        "Python's ssl.CERT_* values, as vLLM's flag).")
    g.add_argument("--access-log", action=argparse.BooleanOptionalAction, default=True,
                   help="Log one line per HTTP request.")
    g.add_argument("--enable-log-requests", action="store_true",
                   help="Log each request as it starts: its id, prompt length and sampling settings (vLLM's flag; "
                        "off by default, as in vLLM).")
    g.add_argument("--disable-log-requests", action="store_true",
                   help="Do not log each request (the default; vLLM's older flag).")
    g.add_argument("--disable-log-stats", action="store_true",
                   help="No periodic line of throughput, running / waiting requests, KV cache use and prefix-cache "
                        "hits (logged every 10 s while requests run).")
    g.add_argument("--uvicorn-log-level", default=None, choices=["critical", "error", "warning", "info", "debug",
                                                                 "trace"],
                   help="Log level of the HTTP server (uvicorn); default: --log-level.")
    g.add_argument("--shutdown-timeout", type=float, default=10.0, metavar="SECONDS",
                   help="On SIGINT/SIGTERM, how long in-flight requests may finish; then they are cut (streams "
                        "get an error event and [DONE], others a 503) and the exit status is 1.")
    EngineConfig.add_cli_args(p)
    from atlas.server.vllm_compat import add_vllm_flags

    add_vllm_flags(p)


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a whole number of characters, not {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value
