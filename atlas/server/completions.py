"""POST /v1/completions: prompts (text or token ids, one or several) completed, as one JSON response or as
server-sent events; echo, prompt scoring (max_tokens 0 with echo), legacy logprobs and vLLM's extra fields."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator, Iterator

from fastapi import Request
from fastapi.responses import Response

from atlas.engine.async_engine import RequestStream
from atlas.errors import InvalidRequestError
from atlas.outputs import CompletionOutput, RequestOutput
from atlas.sampling_params import StructuredOutputsParams, resolve_max_tokens
from atlas.server import protocol as P
from atlas.server.beam_search import beam_search, check_beam_search
from atlas.server.errors import APIError, error_event, raise_if_failed
from atlas.server.frontend import (
    HEAVY_CHARS,
    INLINE_PROMPT_CHARS,
    INLINE_PROMPT_IDS,
    FrontEnd,
    PromptInfo,
    usage,
)
from atlas.server.large_responses import (
    LARGE_RESPONSE_ENTRIES,
    LargeJSONResponse,
    dump_in_pieces,
    json_pieces,
    logprob_entries,
)
from atlas.server.logprobs import prompt_logprobs_of
from atlas.server.sampling import check_stream_options, continuous_usage, sampling_params, structured_spec
from atlas.server.streaming import ChoiceState, ChunkWriter, merge_streams, next_delta, running_usage, sse

# OpenAI's default max_tokens for /v1/completions; chat defaults to what the context leaves.
COMPLETION_DEFAULT_MAX_TOKENS = 16


def _echo_only(c: CompletionOutput) -> CompletionOutput:
    """A completion of `max_tokens: 0` with `echo`: the token generated for it is dropped."""
    return dataclasses.replace(c, text="", token_ids=[], logprobs=[] if c.logprobs is not None else None,
                               finish_reason="length" if c.finish_reason is not None else None, stop_reason=None)


class Completions:
    """The /v1/completions endpoint over a FrontEnd."""

    def __init__(self, front: FrontEnd):
        self.front = front
        self.details = front.settings.enable_prompt_tokens_details  # (usage.prompt_tokens_details)

    def prompt_ids(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            ids = self.front.need_tokenizer("prompt").encode(prompt)
            if not ids:
                raise InvalidRequestError("the prompt is empty", param="prompt")
            return prompt, ids
        return None, self.front.info.check_prompt_ids(list(prompt))

    def completion_prompts(self, req: P.CompletionRequest, structured: StructuredOutputsParams | None = None
                           ) -> list[PromptInfo]:
        """Tokenize and check every prompt (runs in the preprocessing pool)."""
        echo_only = bool(req.echo) and req.max_tokens == 0
        prompts = []
        for prompt in req.prompts():
            text, ids = self.prompt_ids(prompt)
            kept = self.front.truncated(ids, req)
            if len(kept) < len(ids):  # (an echo shows the prompt the model saw)
                text, ids = None, kept
            self.front.info.check_prompt_length(len(ids))
            if echo_only:  # prompt scoring: one token is generated and dropped, as vLLM does
                max_tokens = 1
            else:
                default = self.front.info.sampling_defaults.get("max_tokens", COMPLETION_DEFAULT_MAX_TOKENS)
                max_tokens = resolve_max_tokens(req.max_tokens, default, len(ids), self.front.info.max_model_len,
                                                "max_tokens")
            params = sampling_params(self.front.info, req, max_tokens, req.logprobs, structured=structured)
            if req.echo and req.logprobs is not None:  # the echoed prompt gets its logprobs too
                params = dataclasses.replace(params, prompt_logprobs=req.logprobs)
            elif req.prompt_logprobs is not None:
                params = dataclasses.replace(params, prompt_logprobs=req.prompt_logprobs)
            if req.echo and text is None:
                text = self.front.need_tokenizer("prompt").decode(ids) if self.front.tokenizer else ""
            prompts.append(PromptInfo(text, ids, params))
        return prompts

    async def create(self, request: Request) -> Response:
        arrival = time.time()
        self.front.check_generation()
        req: P.CompletionRequest = await self.front.parse_body(request, P.CompletionRequest)
        model = self.front.check_model(req.model)
        if req.use_beam_search:
            check_beam_search(req, self.front.info.max_logprobs, self.front.info.logprobs_mode)
        include_usage = check_stream_options(req, self.front.settings.force_include_usage)
        if req.max_tokens == 0 and not req.echo:
            raise APIError(400, "max_tokens: must be an integer >= 1 (0 only with echo, to score the prompt)",
                           param="max_tokens")
        self.front.check_sizes(req)
        self.front.check_sequences(len(req.prompts()), req.n)
        constraint = structured_spec(req)
        if constraint is not None:
            await self.front.compile_constraint(*constraint)
        spec = constraint[0] if constraint else None
        # (one short text, or one list of token ids, which the validator made homogeneous: checked on the loop)
        small = (len(req.prompt) <= INLINE_PROMPT_CHARS if isinstance(req.prompt, str)
                 else len(req.prompt) <= INLINE_PROMPT_IDS and isinstance(req.prompt[0], int))
        heavy = not small and sum(len(p) for p in ([req.prompt] if isinstance(req.prompt, str) else req.prompt)
                                  if isinstance(p, str)) > HEAVY_CHARS
        prompts = (self.completion_prompts(req, spec) if small
                   else await self.front.run_blocking(self.completion_prompts, req, spec, heavy=heavy))
        echo_only = bool(req.echo) and req.max_tokens == 0
        request_id = self.front.request_id(request, "cmpl")
        if req.use_beam_search:  # (n beams in place of n samples: server/beam_search.py)
            created = int(time.time())
            finals = await beam_search(self.front, request, req, request_id, prompts, arrival,
                                       self.front.adapter(model))
        else:
            streams = await self.front.start(request_id, prompts, arrival, lora=self.front.adapter(model))
            created = int(time.time())
            if req.stream:
                return sse(self.completion_events(req, model, request_id, created, prompts, streams,
                                                  include_usage, echo_only, continuous_usage(req)))
            finals = await self.front.collect(request, streams)
        if finals is None:
            return Response(status_code=499)
        args = (req, model, request_id, created, prompts, finals, echo_only)
        if logprob_entries(finals, req.logprobs) > LARGE_RESPONSE_ENTRIES:  # (seconds of Python: off the loop)
            return LargeJSONResponse(await self.front.run_blocking(self.completion_pieces, *args),
                                     self.front.give_back_memory)
        return Response(dump_in_pieces(self.completion_body(*args)), media_type="application/json")

    def completion_pieces(self, req: P.CompletionRequest, model: str, request_id: str, created: int,
                          prompts: list[PromptInfo], finals: list[RequestOutput], echo_only: bool) -> list[bytes]:
        """completion_body's JSON in pieces (json_pieces) for a large response, in the preprocessing pool: each
        choice made, written and let go before the next (the entries of one choice are alive at a time)."""
        head = P.CompletionResponse(id=request_id, created=created, model=model, choices=[],
                                    usage=usage(prompts, finals, echo_only, self.details))
        return json_pieces(head, self.completion_choices(req, prompts, finals, echo_only))

    def completion_body(self, req: P.CompletionRequest, model: str, request_id: str, created: int,
                        prompts: list[PromptInfo], finals: list[RequestOutput], echo_only: bool
                        ) -> P.CompletionResponse:
        return P.CompletionResponse(id=request_id, created=created, model=model,
                                    choices=list(self.completion_choices(req, prompts, finals, echo_only)),
                                    usage=usage(prompts, finals, echo_only, self.details))

    def completion_choices(self, req: P.CompletionRequest, prompts: list[PromptInfo], finals: list[RequestOutput],
                           echo_only: bool) -> Iterator[P.CompletionChoice]:
        names = self.front.token_texts(req)
        for i, out in enumerate(finals):
            prefix = prompts[i].text if req.echo else ""
            for c in out.outputs:
                raise_if_failed(c)
                c = _echo_only(c) if echo_only else c
                logprobs = None
                if req.logprobs is not None and c.logprobs is not None:
                    echoed = names.echo_logprobs(prompts[i].token_ids, out) if req.echo else None
                    logprobs, _ = names.completion_logprobs(c.token_ids, c.logprobs, len(prefix), echoed)
                ids = req.return_token_ids
                yield P.CompletionChoice(index=i * req.n + c.index, text=prefix + c.text, logprobs=logprobs,
                                         finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                                         prompt_token_ids=prompts[i].token_ids if ids else None,
                                         token_ids=list(c.token_ids) if ids else None,
                                         prompt_logprobs=(prompt_logprobs_of(out)
                                                          if req.prompt_logprobs is not None else None))

    async def completion_events(self, req: P.CompletionRequest, model: str, request_id: str, created: int,
                                prompts: list[PromptInfo], streams: list[RequestStream], include_usage: bool,
                                echo_only: bool = False, continuous: bool = False) -> AsyncIterator[str]:
        states: dict[int, ChoiceState] = {}
        finals: dict[int, RequestOutput] = {}
        want_logprobs = req.logprobs is not None
        writer = ChunkWriter("text_completion", request_id, created, model)
        names = self.front.token_texts(req)
        running = running_usage(sum(len(p.token_ids) for p in prompts), states, continuous)

        try:
            async for i, out in merge_streams(streams):
                if out.finished:
                    finals[i] = out
                    self.front.log_output(out)
                events = []  # one write per engine output
                for c in out.outputs:
                    raise_if_failed(c)
                    c = _echo_only(c) if echo_only else c
                    index = i * req.n + c.index
                    first = index not in states
                    delta = next_delta(states, index, c)
                    if delta is None:
                        continue
                    state, text, tokens = delta
                    echoed = None
                    if first and req.echo:
                        text = (prompts[i].text or "") + text
                        state.text_offset = len(prompts[i].text or "")
                        if want_logprobs:
                            echoed = names.echo_logprobs(prompts[i].token_ids, out)
                    new_tokens = tokens.stop > tokens.start
                    if not text and not ((want_logprobs or req.return_token_ids) and new_tokens) and not state.done:
                        continue
                    logprobs = None
                    if want_logprobs and c.logprobs is not None:
                        logprobs, state.text_offset = names.completion_logprobs(
                            c.token_ids[tokens], c.logprobs[tokens], state.text_offset, echoed)
                    prompt_ids = token_ids = None
                    if req.return_token_ids:
                        token_ids = list(c.token_ids[tokens])
                        if not state.prompt_ids_sent:
                            prompt_ids, state.prompt_ids_sent = prompts[i].token_ids, True
                    if logprobs is None:
                        events.append(writer.text(index, text, c.finish_reason, c.stop_reason, token_ids, prompt_ids,
                                                  running()))
                        continue
                    chunk = P.CompletionChunk(id=request_id, created=created, model=model, choices=[
                        P.CompletionChoice(index=index, text=text, logprobs=logprobs, finish_reason=c.finish_reason,
                                           stop_reason=c.stop_reason, prompt_token_ids=prompt_ids,
                                           token_ids=token_ids)], usage=running())
                    events.append(f"data: {chunk.model_dump_json()}\n\n")
                if events:
                    yield "".join(events)
            if include_usage:
                chunk = P.CompletionChunk(id=request_id, created=created, model=model, choices=[],
                                          usage=usage(prompts, [finals[i] for i in sorted(finals)], echo_only,
                                                        self.details))
                yield f"data: {chunk.model_dump_json()}\n\n"
        except Exception as exc:  # noqa: BLE001 - the status line is gone: report in the stream
            yield error_event(exc)
        finally:
            for s in streams:
                s.close()
        yield "data: [DONE]\n\n"

