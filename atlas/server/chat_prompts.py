"""A chat's messages as prompt token ids (for /v1/chat/completions, /v1/responses and /tokenize): the request's
own chat template and template variables (refused unless the operator trusts them), reasoning_effort,
continue_final_message, and whether the rendering is large work for the heavy pool."""

from __future__ import annotations

import dataclasses
from typing import Any

from atlas.engine.chat_content import content_format
from atlas.engine.chat_template import RESERVED_KWARGS
from atlas.errors import InvalidRequestError, PromptTooLongError
from atlas.sampling_params import StructuredOutputsParams, resolve_max_tokens
from atlas.server import protocol as P
from atlas.server.errors import APIError
from atlas.server.frontend import HEAVY_CHARS, HEAVY_MESSAGES, HEAVY_TOOLS, FrontEnd, PromptInfo
from atlas.server.sampling import sampling_params
from atlas.server.settings import ServerSettings

# A chat template sent with a request (when trusted) may be at most this long.
MAX_REQUEST_TEMPLATE_CHARS = 128 * 1024


def heavy_chat(req: Any) -> bool:
    """Whether a chat's rendering is large work: a client's own template, or many or long messages or tools."""
    messages = req.messages or []
    return (getattr(req, "chat_template", None) is not None or len(messages) > HEAVY_MESSAGES
            or len(getattr(req, "tools", None) or []) > HEAVY_TOOLS
            or sum(len(m.text()) for m in messages) > HEAVY_CHARS)


def template_and_kwargs(settings: ServerSettings, chat_template: str | None, kwargs: dict[str, Any] | None,
                        set_by_fields: tuple[str, ...] = ()) -> tuple[str | None, dict[str, Any]]:
    """The request's own chat template (if any, and if allowed) and its template variables: the server's
    --default-chat-template-kwargs under the request's chat_template_kwargs (set_by_fields: variables a request
    field of their own sets, e.g. reasoning_effort, which the defaults then leave alone)."""
    kwargs = dict(kwargs or {})
    if "chat_template" in kwargs:
        inner = kwargs.pop("chat_template")
        if not isinstance(inner, str):
            raise APIError(400, "chat_template_kwargs.chat_template: must be a string", param="chat_template_kwargs")
        if chat_template is not None and inner != chat_template:
            raise APIError(400, "chat_template is given twice (as a field and in chat_template_kwargs)",
                           param="chat_template")
        chat_template = inner
    hints = {"messages": "the request's messages", "add_generation_prompt": "the request field add_generation_prompt",
             "tools": "the request's tools", "documents": "not supported",
             "continue_final_message": "the request field continue_final_message"}
    for name in RESERVED_KWARGS:
        if name in kwargs:
            raise APIError(400, f"chat_template_kwargs.{name}: the server sets this template variable itself "
                                f"(from {hints[name]}); leave it out of chat_template_kwargs",
                           param="chat_template_kwargs")
    defaults = {k: v for k, v in settings.default_chat_template_kwargs.items() if k not in set_by_fields}
    kwargs = {**defaults, **kwargs}
    if chat_template is not None:
        if not settings.trust_request_chat_template:
            raise APIError(400, "this server does not accept chat templates from requests; it renders the model's "
                                "own (the operator can allow them with --trust-request-chat-template)",
                           param="chat_template")
        if len(chat_template) > MAX_REQUEST_TEMPLATE_CHARS:
            raise APIError(400, f"chat_template: at most {MAX_REQUEST_TEMPLATE_CHARS:,} characters",
                           param="chat_template")
    return chat_template, kwargs


def check_continue_final_message(req: P.ChatCompletionRequest | P.TokenizeRequest) -> None:
    """vLLM's rules: continue_final_message continues the last message, which must be the assistant's, and
    excludes add_generation_prompt (true by default: the request sends false)."""
    if not req.continue_final_message:
        return
    if req.add_generation_prompt:
        raise APIError(400, "Cannot set both `continue_final_message` and `add_generation_prompt` to True "
                            "(send add_generation_prompt: false to continue the final message)",
                       param="continue_final_message")
    if req.messages and req.messages[-1].role != "assistant":
        raise APIError(400, "continue_final_message continues the final message, which must be the "
                            f"assistant's (it is a {req.messages[-1].role} message)",
                       param="continue_final_message")


def with_reasoning_effort(front: FrontEnd, effort: str, template: str | None, kwargs: dict[str, Any]) -> dict[str, Any]:
    """reasoning_effort as the chat template's variable of that name (as gpt-oss's template reads it), refused
    where the template never reads it: it would change nothing."""
    source = template if template is not None else front.need_tokenizer("messages").chat_template
    if source is None or "reasoning_effort" not in source:
        raise APIError(400, "reasoning_effort: this model's chat template does not read reasoning_effort, so it "
                            "would change nothing; send the request without it", param="reasoning_effort")
    if kwargs.get("reasoning_effort", effort) != effort:
        raise APIError(400, "reasoning_effort is given twice (as a field and in chat_template_kwargs)",
                       param="reasoning_effort")
    return {**kwargs, "reasoning_effort": effort}


def chat_prompt_ids(front: FrontEnd, messages: list[P.ChatMessage], add_generation_prompt: bool,
                    chat_template: str | None, template_kwargs: dict[str, Any],
                    tools: list[P.ToolDefinition] | None = None, continue_final_message: bool = False
                    ) -> list[int]:
    """Render the chat template and tokenize (runs in the preprocessing pool)."""
    tokenizer = front.need_tokenizer("messages")
    fmt = content_format(front.settings.chat_template_content_format, chat_template or tokenizer.chat_template)
    ids = tokenizer.chat_ids([m.for_template(fmt) for m in messages], add_generation_prompt,
                             chat_template=chat_template,
                             tools=[t.model_dump(exclude_none=True) for t in tools] if tools else None,
                             continue_final_message=continue_final_message, **template_kwargs)
    if not ids:
        raise InvalidRequestError("the chat template produced an empty prompt", param="messages")
    return ids


def chat_request_prompt(front: FrontEnd, req: P.ChatCompletionRequest, template: str | None,
                        template_kwargs: dict[str, Any], structured: StructuredOutputsParams | None = None
                        ) -> PromptInfo:
    tools = None if front.settings.exclude_tools_when_tool_choice_none and req.tool_choice == "none" else req.tools
    ids = front.truncated(chat_prompt_ids(front, req.messages, req.add_generation_prompt, template, template_kwargs,
                                          tools, req.continue_final_message), req)
    try:
        front.info.check_prompt_length(len(ids))
    except PromptTooLongError as exc:
        raise PromptTooLongError(str(exc).replace("the prompt has", "the messages make a prompt of"),
                                 param="messages") from None
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    max_tokens = resolve_max_tokens(requested, front.info.sampling_defaults.get("max_tokens"), len(ids),
                                    front.info.max_model_len, param)
    k = (req.top_logprobs or 0) if req.logprobs else None
    params = sampling_params(front.info, req, max_tokens, k, rename={"max_tokens": param, "logprobs": "top_logprobs"},
                             structured=structured)
    if req.prompt_logprobs is not None:
        params = dataclasses.replace(params, prompt_logprobs=req.prompt_logprobs)
    return PromptInfo(None, ids, params)
