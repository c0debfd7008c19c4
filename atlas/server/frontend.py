"""One front end's shared state and what every endpoint checks: the engine and its limits, the served names,
the settings, the tokenizer, the thread pools (and preprocessing worker processes) that keep CPU work off the
event loop, auth, request sizes, admission, starting and collecting a request's streams, and the drain at
shutdown. The endpoints themselves live in completions.py, chat.py, responses.py, embeddings.py and
tokenization.py, each over one FrontEnd."""

from __future__ import annotations

import asyncio
import functools
import hmac
import logging
import threading
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from pydantic import BaseModel

from atlas.engine.async_engine import AsyncEngine, RequestStream
from atlas.engine.chat_template import TemplateLimits
from atlas.engine.cpu_threads import available_cpus
from atlas.engine.tokenizer import Tokenizer
from atlas.errors import InvalidRequestError, PromptTooLongError, ServerBusyError, busy_message
from atlas.outputs import RequestOutput
from atlas.processes import give_back_memory
from atlas.sampling_params import SamplingParams, StructuredOutputsParams
from atlas.server import protocol as P
from atlas.server.bodies import decode_body, read_body, wait_for_disconnect
from atlas.server.errors import APIError, ServerShutdownError
from atlas.server.logprobs import TokenText
from atlas.server.preprocess_workers import PreprocessWorkers, RemoteTokenizer
from atlas.server.settings import ServerSettings

logger = logging.getLogger(__name__)

# Request bodies up to this size are decoded, and single prompt texts up to this many characters tokenized, on the
# event loop: that takes less than the hop to the preprocessing pool and back (larger ones go to the pool).
INLINE_BODY_BYTES = 16 * 1024
INLINE_PROMPT_CHARS = 4096
# ... and a prompt of token ids up to this many (checking them takes about 45 us at 1,024: about the hop)
INLINE_PROMPT_IDS = 1024
# Work past these runs in the heavy pool (FrontEnd.heavy_pool), so that ordinary requests never queue
# behind it: a request body, a prompt or messages' text, a chat's messages, a request's tools.
HEAVY_BODY_BYTES = 1 << 20
HEAVY_CHARS = 256 * 1024
HEAVY_MESSAGES = 512
HEAVY_TOOLS = 128


@dataclass
class PromptInfo:
    text: str | None
    token_ids: list[int]
    params: SamplingParams


def usage(prompts: list[PromptInfo], finals: list[RequestOutput], echo_only: bool = False, details: bool = False
          ) -> P.UsageInfo:
    """details: with prompt_tokens_details (the prompt tokens the prefix cache served, each prompt counted once)."""
    prompt_tokens = sum(len(p.token_ids) for p in prompts)
    completion_tokens = 0 if echo_only else sum(len(c.token_ids) for out in finals for c in out.outputs)
    cached = P.PromptTokensDetails(cached_tokens=sum(out.num_cached_tokens for out in finals)) if details else None
    return P.UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                       total_tokens=prompt_tokens + completion_tokens, prompt_tokens_details=cached)


class FrontEnd:
    """The state the endpoints share (app.state.server) and the checks and steps they have in common."""

    def __init__(self, engine: AsyncEngine, served_model_names: list[str], settings: ServerSettings,
                 tokenizer: Tokenizer | None = None):
        self.engine = engine
        self.info = engine.info
        self.names = list(served_model_names)
        self.model_name = self.names[0]
        self.settings = settings
        self.api_key = settings.api_key
        # The server's own tokenizer instance: the engine thread uses the engine's concurrently.
        self.tokenizer = tokenizer
        if tokenizer is not None:
            tokenizer.set_template_limits(TemplateLimits(timeout_s=settings.chat_template_timeout))
        self.token_text = TokenText(tokenizer)
        engine.enable_metrics(self.model_name)  # (kept where the engine runs)
        cap = settings.max_waiting_requests
        engine.max_waiting = 8 * self.info.max_num_seqs if cap is None else cap
        # CPU work of a request (JSON decoding, tokenization, chat templates) runs here, off the event loop.
        threads = settings.preprocess_threads or available_cpus() + 2
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="atlas-preprocess")
        # Large work (a client's own chat template, huge bodies, prompts, chats, tool lists) has one thread of its
        # own: such requests wait for each other, not ordinary requests for them (8 client templates queued every
        # chat behind them for 10 s). One thread: templates and JSON are Python, which a second thread would not
        # run any faster (the interpreter lock), only take from the event loop and the ordinary requests.
        # With --preprocess-workers (default 1), that thread hands the tokenizer's work (templates, tokenization)
        # to worker processes (preprocess_workers.py) and only waits for the answer.
        self._thread = threading.local()
        self.heavy_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="atlas-heavy",
                                             initializer=lambda: setattr(self._thread, "heavy", True))
        self.workers = (PreprocessWorkers(tokenizer.source, settings.chat_template_timeout,
                                          settings.preprocess_workers)
                        if tokenizer is not None and settings.preprocess_workers else None)
        self.shutting_down = False
        self.in_flight = 0  # HTTP requests being answered, /health aside (DrainGuard)
        self.num_cut = 0  # requests cut at the shutdown timeout
        self._cut_timer: asyncio.TimerHandle | None = None
        self.loop: asyncio.AbstractEventLoop | None = None  # the server's event loop, once it runs

    async def run_blocking(self, fn: Callable[..., Any], *args: Any, heavy: bool = False) -> Any:
        """fn(*args) in the preprocessing pool (the heavy pool for large work); the event loop keeps serving
        meanwhile."""
        if not heavy:
            return await asyncio.get_running_loop().run_in_executor(self.pool, functools.partial(fn, *args))

        def run() -> Any:
            try:
                return fn(*args)
            finally:
                give_back_memory()  # (what the large work freed goes back to the system, not into the heap)

        return await asyncio.get_running_loop().run_in_executor(self.heavy_pool, run)

    async def give_back_memory(self) -> None:
        """The heap's free pages back to the system, in the preprocessing pool (the trim walks the whole heap:
        milliseconds to tens of them; ctypes lets go of the interpreter lock meanwhile): after a large response is
        sent, what its building freed."""
        await asyncio.get_running_loop().run_in_executor(self.pool, give_back_memory)

    async def parse_body(self, request: Request, model: type[BaseModel]) -> Any:
        raw = await read_body(request, self.settings.max_request_body_bytes, self.settings.body_timeout)
        if len(raw) <= INLINE_BODY_BYTES:  # (tens of microseconds: less than the hop to the pool and back)
            return decode_body(raw, model)
        return await self.run_blocking(decode_body, raw, model, heavy=len(raw) > HEAVY_BODY_BYTES)

    # ------------------------------------------------------------------ shutdown
    def begin_shutdown(self) -> None:
        """Shutdown has begun (no new connections): requests still running after --shutdown-timeout are
        cut then: streams get an error event and [DONE], the others a 503."""
        if self.shutting_down:
            return
        self.shutting_down = True
        self._cut_timer = asyncio.get_running_loop().call_later(self.settings.shutdown_timeout, self.cut_in_flight)

    async def drain(self, stop: Callable[[], bool]) -> None:
        """The drain before the listener closes: until no request is in flight (the cut at --shutdown-timeout ends
        those still running), `stop()` (a third signal) or the timeout plus a second. Meanwhile the server still
        accepts connections, /health answers 503 and new requests get a 503 (DrainGuard), so that a load balancer
        sees the drain instead of refused connections."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.shutdown_timeout + 1.0
        while self.in_flight and not stop() and loop.time() < deadline:
            await asyncio.sleep(0.02)

    def cut_in_flight(self, forced: bool = False) -> int:
        """Cut what still runs: streams get an error event and [DONE], the others a 503. `forced`: a second
        signal came during the drain (no waiting for the timeout)."""
        timeout = self.settings.shutdown_timeout
        error = ServerShutdownError(
            "the server was stopped at once (a second signal during its shutdown) while this request was running"
            if forced else f"the server is shutting down and this request was still running after its shutdown "
                           f"timeout ({timeout:g} s)")
        if self._cut_timer is not None:
            self._cut_timer.cancel()
        cut = self.engine.cut(error)
        if cut:
            self.num_cut += cut
            logger.warning("shutdown: %d request(s) still running after --shutdown-timeout %g s were cut "
                           "(streams get an error event, others a 503)", cut, timeout)
        return cut

    def close(self) -> None:
        if self._cut_timer is not None:
            self._cut_timer.cancel()
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.heavy_pool.shutdown(wait=False, cancel_futures=True)
        if self.workers is not None:
            self.workers.close()

    # ------------------------------------------------------------------ shared checks
    def check_auth(self, request: Request) -> None:
        if self.api_key is None:
            return
        headers = request.headers.getlist("authorization")
        if not headers and request.headers.get("x-api-key") is not None:  # (Anthropic's clients send the key so)
            headers = ["Bearer " + request.headers["x-api-key"]]
        if len(headers) > 1:
            raise APIError(401, "the request has several Authorization headers: send one, "
                                "'Authorization: Bearer <key>'", param=None, code="invalid_api_key")
        header = headers[0] if headers else ""
        scheme, _, token = header.partition(" ")
        # The header's own bytes (Starlette reads them as latin-1, which gives them back unchanged) against the
        # key's (printable ASCII: ServerSettings); only spaces and tabs around the token are dropped.
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip(" \t").encode("latin-1"),
                                                                 self.api_key.encode("ascii")):
            raise APIError(401, "missing or incorrect API key: send the header 'Authorization: Bearer <key>'",
                           param=None, code="invalid_api_key")

    @staticmethod
    def request_id(request: Request, prefix: str) -> str:
        """A request's id, `prefix`-<its X-Request-Id header> where the client sends one (vLLM's: the response's
        id, the engine's and the log's, so that a client's own id follows the request; two requests in flight
        under one id are refused), else `prefix`-<a new uuid>."""
        given = request.headers.get("x-request-id")
        if given is None:
            return f"{prefix}-{uuid.uuid4().hex}"
        if not given or len(given) > 256 or not all(" " <= ch <= "~" for ch in given):
            raise APIError(400, "the X-Request-Id header must be 1 to 256 printable ASCII characters", param=None)
        return f"{prefix}-{given}"

    def check_model(self, name: str | None) -> str:
        if name is None or name in self.names:
            return self.model_name if name is None else name
        if self.info.lora:  # (a LoRA adapter's name: the engine knows which are loaded, and refuses the others)
            return name
        raise APIError(404, f"the model {name!r} does not exist; this server serves {', '.join(self.names)}",
                       param="model", code="model_not_found")

    def check_sequences(self, num_prompts: int, n: int) -> None:
        """Cap the sequences one request creates (prompts x n)."""
        cap = self.settings.max_sequences_per_request
        if num_prompts * n > cap:
            what = f"{num_prompts} prompt(s) x n={n}" if num_prompts > 1 else f"n={n}"
            raise APIError(400, f"this request asks for {num_prompts * n} sequences ({what}); this server allows at "
                                f"most {cap} per request", param="n" if n > 1 else "prompt")

    def token_texts(self, req: BaseModel) -> TokenText:
        """How the request's logprob entries name tokens: by text, or by id (vLLM's return_tokens_as_token_ids)."""
        by_id = getattr(req, "return_tokens_as_token_ids", None)
        if by_id is None:  # (a request's own true or false wins over the server's flag)
            by_id = self.settings.return_tokens_as_token_ids
        return self.token_text.with_ids() if by_id else self.token_text

    def truncated(self, ids: list[int], req: BaseModel) -> list[int]:
        """vLLM's truncate_prompt_tokens: the prompt's last k tokens (-1: as many as the context holds)."""
        k = getattr(req, "truncate_prompt_tokens", None)
        if k is None:
            return ids
        k = self.info.max_model_len if k == -1 else k
        return ids[-k:] if len(ids) > k else ids

    def check_sizes(self, req: BaseModel, must_fit: bool = True) -> None:
        """Each list and prompt of the request within its limit, before any work is done for it (400s naming the
        field and the flag that raises the limit). must_fit: the prompt is for generation, so one that could not
        fit in the context is refused untokenized (/tokenize counts any text the body limit lets through)."""
        cap = self.settings.max_request_list_items
        stop = getattr(req, "stop", None)
        lists = {"stop_token_ids": getattr(req, "stop_token_ids", None), "tools": getattr(req, "tools", None),
                 "messages": getattr(req, "messages", None), "stop": stop if isinstance(stop, list) else None,
                 "logit_bias": getattr(req, "logit_bias", None),
                 "allowed_token_ids": getattr(req, "allowed_token_ids", None),
                 "bad_words": getattr(req, "bad_words", None)}
        prompt = getattr(req, "prompt", None)
        texts: list[str] = [prompt] if isinstance(prompt, str) else []
        id_lists: list[list] = []
        if isinstance(prompt, list) and prompt:
            if isinstance(prompt[0], int):  # (a validated prompt list is of one kind: ids, texts or id lists)
                id_lists = [prompt]
            else:  # several prompts
                lists["prompt"] = prompt
                texts = [p for p in prompt if isinstance(p, str)]
                id_lists = [p for p in prompt if isinstance(p, list)]
        for field, items in lists.items():
            if items is not None and len(items) > cap:
                raise APIError(400, f"{field}: {len(items):,} items; this server takes at most {cap:,} "
                                    "(--max-request-list-items)", param=field)
        context = self.info.max_model_len
        if not must_fit or getattr(req, "truncate_prompt_tokens", None) is not None:
            return  # (a prompt to be truncated is measured once it is: its tokens' last k)
        for ids in id_lists:
            if len(ids) > context:
                raise PromptTooLongError(f"the prompt has {len(ids):,} tokens; the context holds {context:,} "
                                         "(--max-model-len)", param="prompt")
        messages = lists["messages"] or []
        texts.append("".join(m.content for m in messages if isinstance(getattr(m, "content", None), str)))
        chars = context * self.settings.max_prompt_chars_per_token
        for text in texts:
            if len(text) > chars:
                raise PromptTooLongError(
                    f"the {'messages have' if messages else 'prompt has'} {len(text):,} characters, more than "
                    f"{self.settings.max_prompt_chars_per_token} per token of the context ({context:,} tokens, "
                    "--max-model-len) could hold; shorten it (or raise --max-prompt-chars-per-token)",
                    param="messages" if messages else "prompt")

    def need_tokenizer(self, param: str) -> Tokenizer | RemoteTokenizer:
        """The tokenizer; in the heavy thread, the stand-in whose work runs in a preprocessing worker process."""
        if self.tokenizer is None:
            raise APIError(400, "this server runs without a tokenizer (--skip-tokenizer-init): send token ids",
                           param=param)
        if self.workers is not None and getattr(self._thread, "heavy", False):
            return self.workers.tokenizer
        return self.tokenizer

    async def compile_constraint(self, spec: StructuredOutputsParams, param: str) -> None:
        """Compile (or find in the cache) off the event loop and the engine thread: a constraint that does not
        compile is this request's 400, and nothing else waits for it."""
        try:
            await self.engine.compile_constraint(spec)
        except InvalidRequestError as exc:
            raise APIError(400, f"{param}: {exc}", param=param) from None

    # ------------------------------------------------------------------ running requests
    def check_admission(self, num_prompts: int) -> None:
        """429 with Retry-After when more requests already wait for a sequence slot than --max-waiting-requests:
        a loaded server says so at once instead of queueing work it cannot start in time. (Checked here
        against this front end's requests, and by an engine in a process of its own against all of them.)"""
        running = self.info.max_num_seqs
        cap = self.engine.max_waiting
        if cap and self.engine.num_streams + num_prompts > running + cap:
            raise ServerBusyError(busy_message(running, cap))

    async def lora_update(self, method: str, *args: str) -> None:
        """/v1/load_lora_adapter and /v1/unload_lora_adapter: refused unless the server was started for them."""
        if not self.info.lora:
            raise APIError(400, "this server was started without --enable-lora: it serves no LoRA adapters")
        if not self.settings.allow_runtime_lora_updating:
            raise APIError(400, "loading and unloading LoRA adapters at run time is off: start the server with "
                                "--allow-runtime-lora-updating (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING)")
        await self.engine.lora_call(method, *args)

    async def check_served(self, name: str | None) -> str:
        """check_model, and for an adapter's name that it is loaded (routes that send no request to the engine,
        which would refuse an unknown one: /tokenize, /detokenize)."""
        model = self.check_model(name)
        if self.adapter(model) is not None:
            await self.model(model)  # (its card, or the 404 /v1/models/{id} gives)
        return model

    def adapter(self, model: str) -> str | None:
        """The LoRA adapter a request's (checked) model names; None: the served model."""
        return None if model in self.names else model

    async def start(self, request_id: str, prompts: list[PromptInfo], arrival: float, lora: str | None = None
                    ) -> list[RequestStream]:
        """Queue every prompt (with its LoRA adapter, if lora names one); all or nothing."""
        self.check_admission(len(prompts))
        if self.settings.log_requests:
            for i, p in enumerate(prompts):
                logger.info("request %s: %d prompt tokens, %s", request_id if len(prompts) == 1 else f"{request_id}-{i}",
                            len(p.token_ids), p.params.summary())
        if len(prompts) == 1:
            # Sent to the engine before this handler first yields: a gather would wrap it in a task that runs only
            # after every other ready handler, so a burst of arrivals would reach the engine all at the end of it.
            p = prompts[0]
            return [await self.engine.add_request({"prompt_token_ids": p.token_ids}, p.params, request_id, arrival,
                                                  group=request_id, lora=lora)]
        results = await asyncio.gather(
            *(self.engine.add_request({"prompt_token_ids": p.token_ids}, p.params, f"{request_id}-{i}", arrival,
                                      group=request_id, lora=lora)
              for i, p in enumerate(prompts)),
            return_exceptions=True)
        streams = [r for r in results if not isinstance(r, BaseException)]
        for r in results:
            if isinstance(r, BaseException):
                for s in streams:
                    s.close()
                raise r
        return streams

    def log_output(self, out: RequestOutput) -> None:
        """With --enable-log-outputs, a line per finished sequence: its request, why it ended, its tokens and text
        (cut at --max-log-len characters)."""
        if not (self.settings.log_outputs and out.finished):
            return
        cap = self.settings.max_log_len
        for c in out.outputs:
            text = c.text if cap is None or len(c.text) <= cap else c.text[:cap] + "..."
            logger.info("request %s output %d: finished (%s), %d tokens: %r", out.request_id, c.index,
                        c.finish_reason, len(c.token_ids), text)

    async def collect(self, request: Request, streams: list[RequestStream]) -> list[RequestOutput] | None:
        """Final outputs, or None if the client went away first (its requests are then aborted)."""
        async def last(stream: RequestStream) -> RequestOutput:
            out = None
            async for out in stream:  # noqa: B007 - only the last one matters
                pass
            if out is not None:
                self.log_output(out)
            return out

        work = asyncio.gather(*(last(s) for s in streams))
        gone = asyncio.ensure_future(wait_for_disconnect(request))
        try:
            done, _ = await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
            if work in done:
                return work.result()
            logger.info("client disconnected; aborting %s", ", ".join(s.request_id for s in streams))
            return None
        finally:
            gone.cancel()
            if not work.done():
                work.cancel()
                work.add_done_callback(lambda f: f.cancelled() or f.exception())  # nothing left to report
            for s in streams:
                s.close()

    def check_generation(self) -> None:
        """A generation endpoint on an embedding server: 400 naming the fix."""
        if self.info.runner == "pooling":
            raise APIError(400, "this server runs an embedding model (--runner pooling): it serves POST /v1/embeddings "
                                "only; start it without --runner pooling to generate text")

    # ------------------------------------------------------------------ served models
    async def model_cards(self) -> list[P.ModelCard]:
        # root is the primary served name: the checkpoint's path on this machine is nobody's business (nor an
        # adapter's: its card's root is its own name, its parent the base model's, as vLLM's cards have them).
        cards = [P.ModelCard(id=name, root=self.model_name, max_model_len=self.info.max_model_len)
                 for name in self.names]
        if self.info.lora:
            cards += [P.ModelCard(id=name, root=name, parent=self.model_name, max_model_len=self.info.max_model_len)
                      for name, _ in await self.engine.lora_call("lora_adapters")]
        return cards

    async def models(self) -> P.ModelList:
        return P.ModelList(data=await self.model_cards())

    async def model(self, model_id: str) -> P.ModelCard:
        for card in await self.model_cards():
            if card.id == model_id:
                return card
        raise APIError(404, f"the model {model_id!r} does not exist; this server serves {', '.join(self.names)}",
                       param="model", code="model_not_found")
