"""The server's own settings: the `atlas serve` flags beyond the engine's, checked once at start-up."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from atlas.engine.chat_template import RESERVED_KWARGS
from atlas.server.browsers import parse_list
from atlas.server.output_parsers import HARMONY_REASONING, REASONING_PARSERS, TOOL_PARSERS

DETOKENIZE_IN = ("auto", "engine", "front-end")


@dataclass(frozen=True)
class ServerSettings:
    """The server's own settings (the `atlas serve` flags beyond the engine's)."""

    api_key: str | None = None
    # With an API key: False also puts /metrics, /docs and /openapi.json behind it (/health stays open).
    public_metrics_and_docs: bool = True
    max_request_body_bytes: int = 8 * 2**20
    max_sequences_per_request: int = 256  # prompts x n
    # Most items in one of a request's lists (stop_token_ids, stop, tools, messages, prompts, token ids to
    # detokenize beyond the context): the work a request causes is bounded before any of it is done.
    max_request_list_items: int = 4096
    # Prompt text longer than this many characters per token of the context cannot fit; it is refused before
    # it is tokenized (a 15 MB prompt tokenized for nothing held the preprocessing pool for seconds).
    max_prompt_chars_per_token: int = 64
    # Admission control: requests (prompts) that may wait for a sequence slot beyond the --max-num-seqs running;
    # past it new requests get 429 with Retry-After. None: 8 x --max-num-seqs; 0: no bound.
    max_waiting_requests: int | None = None
    trust_request_chat_template: bool = False
    # --default-chat-template-kwargs (vLLM's): template variables every chat renders with, under the request's own
    # chat_template_kwargs (which win), e.g. {"enable_thinking": false} for Qwen3
    default_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    log_requests: bool = False  # a line per request as it starts (--enable-log-requests)
    log_outputs: bool = False  # a line per finished sequence with its text (--enable-log-outputs)
    max_log_len: int | None = None  # characters of output text in those lines (--max-log-len; None: all)
    chat_template_timeout: float = 5.0  # seconds one chat template may render
    shutdown_timeout: float = 10.0  # how long in-flight requests may finish once shutdown begins
    # Connections (atlas/server/connections.py): deadlines for a request's headers and between its body's chunks,
    # idle keep-alive, caps on open connections in all and per client address (0: no cap).
    header_timeout: float = 10.0
    body_timeout: float = 30.0
    timeout_keep_alive: float = 5.0
    max_connections: int = 4096
    max_connections_per_client: int = 0
    preprocess_threads: int | None = None  # default: CPUs available + 2
    # Worker processes for large preprocessing (a client's chat template, large chats, tokenizations): at most
    # this many at once (preprocess_workers.py); 0: in the front end's heavy thread.
    preprocess_workers: int = 1
    start_preprocess_workers: bool = False  # at start-up (atlas serve); else with the first large request
    # Where output text is made (--detokenize-in): "engine", "front-end" (each front end for its own requests
    # without stop strings, off the engine's step), or "auto": the front ends when there are two or more.
    detokenize_in: str = "auto"
    # Tool calling and reasoning output (vLLM's flags).
    enable_auto_tool_choice: bool = False  # tool_choice "auto": tool calls parsed from the reply's text
    # --exclude-tools-when-tool-choice-none (vLLM's): a request with tool_choice "none" renders its chat without the tools
    exclude_tools_when_tool_choice_none: bool = False
    # --allow-runtime-lora-updating (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING): /v1/load_lora_adapter and
    # /v1/unload_lora_adapter load and unload adapters (with --enable-lora)
    allow_runtime_lora_updating: bool = False
    # --enable-prompt-tokens-details (vLLM's): usage.prompt_tokens_details.cached_tokens, the prompt tokens whose KV
    # the prefix cache gave (the Responses API's input_tokens_details always has them)
    enable_prompt_tokens_details: bool = False
    # --return-tokens-as-token-ids (vLLM's): logprob entries name tokens "token_id:N" unless a request says false
    return_tokens_as_token_ids: bool = False
    # --chat-template-content-format (vLLM's): message content as a string, as text parts, or per template (auto)
    chat_template_content_format: str = "auto"
    force_include_usage: bool = False  # --enable-force-include-usage: every stream ends with a usage chunk
    response_role: str = "assistant"  # --response-role: a chat reply's role (with add_generation_prompt)
    docs: bool = True  # False (--disable-fastapi-docs): no /docs and no /openapi.json
    request_id_headers: bool = False  # --enable-request-id-headers: every response carries X-Request-Id
    server_load_tracking: bool = False  # --enable-server-load-tracking: GET /load
    tool_call_parser: str | None = None  # how the model writes tool calls (TOOL_PARSERS)
    reasoning_parser: str | None = None  # <think>...</think> into reasoning_content (REASONING_PARSERS)
    # Browsers (atlas/server/browsers.py). The address the server is bound to (--host) sets the default
    # allowed hosts; allowed_hosts None = that default, ("*",) = any Host.
    bind_host: str = "127.0.0.1"
    allowed_hosts: tuple[str, ...] | None = None
    # CORS (vLLM's flags): off while allowed_origins is empty; ("*",) = any origin.
    allowed_origins: tuple[str, ...] = ()
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    # TLS (vLLM's flags): HTTPS with this key and certificate (PEM files); with ssl_ca_certs and ssl_cert_reqs 2
    # (ssl.CERT_REQUIRED) every client must present a certificate that CA signed (1: optional).
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    ssl_ca_certs: str | None = None
    ssl_cert_reqs: int = 0
    # --root-path (vLLM's): the path prefix a proxy routes to this server ("" for none; see app.RootPath)
    root_path: str = ""

    def __post_init__(self) -> None:
        for name in ("header_timeout", "body_timeout", "timeout_keep_alive", "max_connections",
                     "max_connections_per_client", "preprocess_workers"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be 0 or more, got {getattr(self, name)}")
        if self.api_key is not None:
            # A key read from a file or a secret often ends in a newline, and clients' tokens are stripped:
            # strip it, so that it can match. A key of only spaces is a mistake, not "no key".
            object.__setattr__(self, "api_key", self.api_key.strip())
            if not self.api_key:
                raise ValueError("--api-key (or ATLAS_API_KEY) is empty or only spaces")
            # An HTTP header carries bytes that clients write as ASCII (the openai library cannot send anything
            # else), and a bearer token is ASCII by its RFC: a key beyond it could never be sent as written.
            if not all(" " <= ch <= "~" for ch in self.api_key):
                raise ValueError("--api-key (or ATLAS_API_KEY) has characters outside printable ASCII (accents, "
                                 "other scripts or control characters), which clients cannot send in an "
                                 "Authorization header: use letters, digits and punctuation, e.g. the output of "
                                 "'openssl rand -hex 32'")
        if not isinstance(self.default_chat_template_kwargs, dict):
            raise ValueError("--default-chat-template-kwargs must be a JSON object of template variables, e.g. "
                             "'{\"enable_thinking\": false}'")
        for name in (*RESERVED_KWARGS, "chat_template"):
            if name in self.default_chat_template_kwargs:
                raise ValueError(f"--default-chat-template-kwargs: {name!r} is set per request (the messages, "
                                 "their options, the template), not as a default template variable; leave it out")
        if self.detokenize_in not in DETOKENIZE_IN:
            raise ValueError(f"--detokenize-in: one of {', '.join(DETOKENIZE_IN)}, got {self.detokenize_in!r}")
        for name in ("allowed_hosts", "allowed_origins", "allowed_methods", "allowed_headers"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, parse_list(value, f"--{name.replace('_', '-')}"))
        if self.allowed_hosts is not None and not self.allowed_hosts:
            raise ValueError("--allowed-hosts is empty: name the hosts the server answers for, or '*' for any")
        if self.allow_credentials and "*" in self.allowed_origins:
            raise ValueError("--allow-credentials with --allowed-origins '*' would let every web page make "
                             "requests with its users' credentials: name the origins")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_PARSERS:
            raise ValueError(f"--tool-call-parser: one of {', '.join(TOOL_PARSERS)}, got {self.tool_call_parser!r}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (the format the model writes "
                             "tool calls in)")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"--reasoning-parser: one of {', '.join(REASONING_PARSERS)}, "
                             f"got {self.reasoning_parser!r}")
        if self.reasoning_parser == HARMONY_REASONING and self.tool_call_parser not in (None, "openai"):
            raise ValueError(f"--reasoning-parser {HARMONY_REASONING} reads gpt-oss's harmony format, whose tool "
                             f"calls --tool-call-parser openai reads, not {self.tool_call_parser}")
        for name in ("max_request_body_bytes", "max_sequences_per_request", "max_request_list_items",
                     "max_prompt_chars_per_token"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
        if self.max_waiting_requests is not None and self.max_waiting_requests < 0:
            raise ValueError("--max-waiting-requests must be >= 0 (0: no bound)")
        for name in ("chat_template_timeout", "shutdown_timeout"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0")

        self._check_tls()
        if self.root_path:
            root = "/" + self.root_path.strip("/")
            if root == "/" or any(ch in root for ch in "?#% "):
                raise ValueError(f"--root-path: a path prefix such as /api/atlas, got {self.root_path!r}")
            object.__setattr__(self, "root_path", root)

    def _check_tls(self) -> None:
        if (self.ssl_keyfile is None) != (self.ssl_certfile is None):
            raise ValueError("HTTPS needs both --ssl-keyfile and --ssl-certfile")
        if self.ssl_keyfile is None:
            if self.ssl_ca_certs is not None or self.ssl_cert_reqs:
                raise ValueError("--ssl-ca-certs and --ssl-cert-reqs need --ssl-keyfile and --ssl-certfile")
            return
        if self.ssl_cert_reqs not in (0, 1, 2):
            raise ValueError(f"--ssl-cert-reqs: 0 (no client certificate), 1 (optional) or 2 (required), got "
                             f"{self.ssl_cert_reqs!r}")
        if self.ssl_cert_reqs and self.ssl_ca_certs is None:
            raise ValueError("--ssl-cert-reqs 1 or 2 needs --ssl-ca-certs (the CA that signs client certificates)")
        import ssl

        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        try:  # (the files read now, so that a bad one stops start-up with its name, not a front end later)
            context.load_cert_chain(self.ssl_certfile, self.ssl_keyfile)
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(f"--ssl-certfile {self.ssl_certfile} / --ssl-keyfile {self.ssl_keyfile}: cannot load "
                             f"them as a PEM certificate and its private key ({exc})") from None
        if self.ssl_ca_certs is not None:
            try:
                context.load_verify_locations(self.ssl_ca_certs)
            except (OSError, ssl.SSLError) as exc:
                raise ValueError(f"--ssl-ca-certs {self.ssl_ca_certs}: cannot load it as PEM CA certificates "
                                 f"({exc})") from None

    @property
    def tls(self) -> bool:
        return self.ssl_certfile is not None

    def front_ends_detokenize(self, api_server_count: int) -> bool:
        """Whether the front ends make the output text (--detokenize-in) with this many of them."""
        return self.detokenize_in == "front-end" or (self.detokenize_in == "auto" and api_server_count >= 2)
