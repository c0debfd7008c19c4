"""POST /v1/chat/completions: messages through the chat template, the reply parsed into content, reasoning and
tool calls (output_parsers.py), as one JSON response or as server-sent events. The Responses API
(responses.py) comes in through Chat.answer."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel, ValidationError

from atlas.engine.async_engine import RequestStream
from atlas.outputs import RequestOutput
from atlas.server import protocol as P
from atlas.server.beam_search import beam_search, check_beam_search
from atlas.server.bodies import json_response
from atlas.server.chat_prompts import (
    chat_request_prompt,
    check_continue_final_message,
    heavy_chat,
    template_and_kwargs,
    with_reasoning_effort,
)
from atlas.server.errors import APIError, error_event, raise_if_failed, validation_error
from atlas.server.frontend import FrontEnd, PromptInfo, usage
from atlas.server.large_responses import (
    LARGE_RESPONSE_ENTRIES,
    LargeJSONResponse,
    chat_entries,
    json_pieces,
    logprob_entries,
)
from atlas.server.logprobs import prompt_logprobs_of
from atlas.server.output_parsers import (
    HARMONY_REASONING,
    TOOL_PARSERS,
    ChoiceParser,
    HarmonyToolParser,
    ReasoningParser,
    reasoning_for_request,
)
from atlas.server.sampling import check_stream_options, continuous_usage, structured_spec
from atlas.server.streaming import ChoiceState, ChunkWriter, merge_streams, next_delta, running_usage, sse
from atlas.server.tool_choice import finish_reason, tool_plan


def chat_reply(req: P.ChatCompletionRequest, response_role: str = "assistant") -> tuple[str, str]:
    """(the reply's role, the text `echo` puts before it), as vLLM has them: the role is `response_role`
    (--response-role) with add_generation_prompt, else the last message's (the reply continues that message); echo
    repeats the last message's content when it has the reply's role."""
    last = req.messages[-1]
    role = response_role if req.add_generation_prompt else last.role
    return role, last.text() if req.echo and last.role == role else ""


class Chat:
    """The /v1/chat/completions endpoint over a FrontEnd."""

    def __init__(self, front: FrontEnd):
        self.front = front

    async def create(self, request: Request) -> Response:
        arrival = time.time()
        self.front.check_generation()
        req: P.ChatCompletionRequest = await self.front.parse_body(request, P.ChatCompletionRequest)
        result = await self.answer(request, req, arrival)
        if isinstance(result, BaseModel):
            if chat_entries(result) > LARGE_RESPONSE_ENTRIES:
                pieces = await self.front.run_blocking(json_pieces, result)
                return LargeJSONResponse(pieces, self.front.give_back_memory)
            return json_response(result)
        if isinstance(result, Response):
            return result
        return sse(result)

    async def answer_body(self, request: Request, body: dict[str, Any], arrival: float
                          ) -> P.ChatCompletionResponse | AsyncIterator[str] | Response:
        """A chat request translated from another API (the Responses API, Anthropic's Messages API), checked as a
        chat request and answered as `answer` does, its usage with prompt_tokens_details."""
        try:
            req = P.ChatCompletionRequest.model_validate(body)
        except ValidationError as exc:
            raise validation_error(exc) from None
        return await self.answer(request, req, arrival, details=True)

    async def answer(self, request: Request, req: P.ChatCompletionRequest, arrival: float, details: bool = False
                     ) -> P.ChatCompletionResponse | AsyncIterator[str] | Response:
        """A chat request, validated: its response, its stream's SSE lines, or a 499 when the client left
        (also the Responses API's way in). details: usage with prompt_tokens_details whatever the setting."""
        details = details or self.front.settings.enable_prompt_tokens_details
        model = self.front.check_model(req.model)
        if req.use_beam_search:
            check_beam_search(req, self.front.info.max_logprobs, self.front.info.logprobs_mode)
        include_usage = check_stream_options(req, self.front.settings.force_include_usage)
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        self.front.check_sizes(req)
        self.front.check_sequences(1, req.n)
        check_continue_final_message(req)
        template, template_kwargs = template_and_kwargs(
            self.front.settings, req.chat_template, req.chat_template_kwargs,
            set_by_fields=("reasoning_effort",) if req.reasoning_effort is not None else ())
        if req.reasoning_effort is not None:
            template_kwargs = with_reasoning_effort(self.front, req.reasoning_effort, template, template_kwargs)
        constraint = structured_spec(req)
        tool_parser, tool_spec, tool_mode = await tool_plan(self.front, req)
        if tool_spec is not None and constraint is not None:
            raise APIError(400, f"{constraint[1]}: tool_choice {tool_mode!r} already constrains the output; give "
                                "one of them", param=constraint[1])
        if constraint is not None:
            await self.front.compile_constraint(*constraint)
        structured = tool_spec if tool_spec is not None else (constraint[0] if constraint else None)
        reasoning = reasoning_for_request(self.front.settings.reasoning_parser, template_kwargs)
        # gpt-oss (harmony): one parser reads reasoning, answer and calls, unless the grammar forces the reply.
        harmony = tool_mode in ("none", "auto") and (reasoning == HARMONY_REASONING
                                                     or self.front.settings.tool_call_parser == "openai")
        if harmony or (tool_parser is not None and tool_mode == "auto"
                       and TOOL_PARSERS[self.front.settings.tool_call_parser].needs_special_tokens) or (
                reasoning is not None and ReasoningParser.needs_special_tokens_for(reasoning)):
            # The format's markers are special tokens: keep them in the text the parser reads (as vLLM does).
            req = req.model_copy(update={"skip_special_tokens": False})
        prompts = [await self.front.run_blocking(chat_request_prompt, self.front, req, template, template_kwargs,
                                                 structured, heavy=heavy_chat(req))]
        k = prompts[0].params.logprobs
        if reasoning == HARMONY_REASONING:
            reasoning = None

        def choice_parser() -> ChoiceParser:
            tools = tool_parser() if tool_parser is not None else None
            if harmony and not isinstance(tools, HarmonyToolParser):
                tools = HarmonyToolParser(calls=False)
            return ChoiceParser(ReasoningParser(reasoning) if reasoning and not harmony else None, tools,
                                max_calls=1 if req.parallel_tool_calls is False else None)

        request_id = self.front.request_id(request, "chatcmpl")
        if req.use_beam_search:  # (n beams in place of n samples: server/beam_search.py)
            created = int(time.time())
            finals = await beam_search(self.front, request, req, request_id, prompts, arrival,
                                       self.front.adapter(model))
        else:
            streams = await self.front.start(request_id, prompts, arrival, lora=self.front.adapter(model))
            created = int(time.time())
            if req.stream:
                return self.chat_events(req, model, request_id, created, prompts, streams, include_usage,
                                        choice_parser, tool_mode, details)
            finals = await self.front.collect(request, streams)
        if finals is None:
            return Response(status_code=499)
        args = (req, model, request_id, created, prompts, finals, choice_parser, tool_mode, k, details)
        if logprob_entries(finals, k) > LARGE_RESPONSE_ENTRIES:  # (seconds of Python: off the loop)
            return await self.front.run_blocking(self.chat_response, *args)
        return self.chat_response(*args)

    def chat_response(self, req: P.ChatCompletionRequest, model: str, request_id: str, created: int,
                      prompts: list[PromptInfo], finals: list[RequestOutput], choice_parser: Callable[[], ChoiceParser],
                      tool_mode: str, k: int | None, details: bool = False) -> P.ChatCompletionResponse:
        role, echoed = chat_reply(req, self.front.settings.response_role)
        names = self.front.token_texts(req)
        choices = []
        for c in finals[0].outputs:
            raise_if_failed(c)
            parser = choice_parser()
            parsed = parser.parse(c.text, final=True)
            calls = [call for call in parsed.calls if call.name is not None]
            tool_calls = [P.ToolCall(id=call_id, function=P.FunctionCall(name=call.name, arguments=call.arguments))
                          for call_id, call in zip(parser.call_ids(calls), calls, strict=True)]
            content = echoed + (parsed.content or "") if echoed else parsed.content
            choices.append(P.ChatChoice(
                index=c.index,
                message=P.ChatResponseMessage(role=role, content=content, reasoning_content=parsed.reasoning,
                                              tool_calls=tool_calls),
                logprobs=(names.chat_logprobs(c.token_ids, c.logprobs, k)
                          if k is not None and c.logprobs is not None else None),
                finish_reason=finish_reason(c.finish_reason, bool(tool_calls), tool_mode), stop_reason=c.stop_reason,
                token_ids=list(c.token_ids) if req.return_token_ids else None))
        return P.ChatCompletionResponse(id=request_id, created=created, model=model, choices=choices,
                                        usage=usage(prompts, finals, details=details),
                                        prompt_token_ids=prompts[0].token_ids if req.return_token_ids else None,
                                        prompt_logprobs=(prompt_logprobs_of(finals[0])
                                                         if req.prompt_logprobs is not None else None))

    async def chat_events(self, req: P.ChatCompletionRequest, model: str, request_id: str, created: int,
                          prompts: list[PromptInfo], streams: list[RequestStream], include_usage: bool,
                          choice_parser: Callable[[], ChoiceParser] = lambda: ChoiceParser(None, None),
                          tool_mode: str = "none", details: bool = False) -> AsyncIterator[str]:
        k = (req.top_logprobs or 0) if req.logprobs else None

        def chunk(choices: list[P.ChatStreamChoice], usage: P.UsageInfo | None = None,
                  prompt_token_ids: list[int] | None = None) -> str:
            body = P.ChatCompletionChunk(id=request_id, created=created, model=model, choices=choices, usage=usage,
                                         prompt_token_ids=prompt_token_ids)
            return f"data: {body.model_dump_json()}\n\n"

        writer = ChunkWriter("chat.completion.chunk", request_id, created, model)
        states: dict[int, ChoiceState] = {}
        names = self.front.token_texts(req)
        running = running_usage(len(prompts[0].token_ids), states, continuous_usage(req))

        parsers: dict[int, ChoiceParser] = {}
        called: set[int] = set()  # choices that streamed tool calls
        final: RequestOutput | None = None
        role, echoed = chat_reply(req, self.front.settings.response_role)
        try:
            yield chunk([P.ChatStreamChoice(index=j, delta=P.DeltaMessage(role=role, content=""),
                                            token_ids=[] if req.return_token_ids else None) for j in range(req.n)],
                        running(), prompt_token_ids=prompts[0].token_ids if req.return_token_ids else None)
            if echoed:  # (the echoed message: each choice's first content delta, as vLLM streams it)
                yield "".join(chunk([P.ChatStreamChoice(index=j, delta=P.DeltaMessage(content=echoed))], running())
                              for j in range(req.n))
            async for _, out in merge_streams(streams):
                if out.finished:
                    final = out
                    self.front.log_output(out)
                events = []  # one write per engine output
                for c in out.outputs:
                    raise_if_failed(c)
                    delta = next_delta(states, c.index, c)
                    if delta is None:
                        continue
                    state, _, tokens = delta
                    parser = parsers.get(c.index) or parsers.setdefault(c.index, choice_parser())
                    reasoning, text, calls = parser.delta(c.text, final=state.done)
                    if calls:
                        called.add(c.index)
                    new_tokens = tokens.stop > tokens.start
                    if (not (text or reasoning or calls) and not ((k is not None or req.return_token_ids) and new_tokens)
                            and not state.done):
                        continue
                    logprobs = None
                    if k is not None and c.logprobs is not None:
                        logprobs = names.chat_logprobs(c.token_ids[tokens], c.logprobs[tokens], k)
                    finish = finish_reason(c.finish_reason, c.index in called, tool_mode)
                    if logprobs is None and not reasoning and not calls:
                        events.append(writer.text(c.index, text, finish, c.stop_reason,
                                                  list(c.token_ids[tokens]) if req.return_token_ids else None,
                                                  usage=running()))
                        continue
                    message = P.DeltaMessage(content=text, reasoning_content=reasoning,
                                             tool_calls=[P.DeltaToolCall(**d) for d in calls] or None)
                    events.append(chunk([P.ChatStreamChoice(
                        index=c.index, delta=message, logprobs=logprobs, finish_reason=finish, stop_reason=c.stop_reason,
                        token_ids=list(c.token_ids[tokens]) if req.return_token_ids else None)], running()))
                if events:
                    yield "".join(events)
            if include_usage and final is not None:
                yield chunk([], usage(prompts, [final], details=details))
        except Exception as exc:  # noqa: BLE001 - the status line is gone: report in the stream
            yield error_event(exc)
        finally:
            for s in streams:
                s.close()
        yield "data: [DONE]\n\n"
