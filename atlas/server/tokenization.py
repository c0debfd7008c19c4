"""POST /tokenize, POST /detokenize and GET /tokenizer_info (vLLM's): a prompt's or a chat's token ids through the
same template and limits as generation, the text of token ids, and the tokenizer's settings."""

from __future__ import annotations

from typing import Any

from fastapi import Request

from atlas.server import protocol as P
from atlas.server.chat_prompts import (
    chat_prompt_ids,
    check_continue_final_message,
    heavy_chat,
    template_and_kwargs,
)
from atlas.server.errors import APIError
from atlas.server.frontend import HEAVY_CHARS, FrontEnd


class Tokenization:
    """The tokenizer's endpoints over a FrontEnd."""

    def __init__(self, front: FrontEnd):
        self.front = front

    def tokenize_ids(self, req: P.TokenizeRequest, template: str | None, template_kwargs: dict[str, Any]) -> list[int]:
        if req.messages is not None:
            return chat_prompt_ids(self.front, req.messages, req.add_generation_prompt, template, template_kwargs,
                                   req.tools, req.continue_final_message)
        return self.front.need_tokenizer("prompt").encode(req.prompt, add_special_tokens=req.add_special_tokens)

    async def tokenize(self, request: Request) -> P.TokenizeResponse:
        req: P.TokenizeRequest = await self.front.parse_body(request, P.TokenizeRequest)
        await self.front.check_served(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of prompt and messages", param="prompt")
        self.front.check_sizes(req, must_fit=False)
        check_continue_final_message(req)
        template, template_kwargs = template_and_kwargs(self.front.settings, req.chat_template,
                                                        req.chat_template_kwargs)
        heavy = (heavy_chat(req) if req.messages is not None else len(req.prompt) > HEAVY_CHARS)
        ids = await self.front.run_blocking(self.tokenize_ids, req, template, template_kwargs, heavy=heavy)
        return P.TokenizeResponse(count=len(ids), max_model_len=self.front.info.max_model_len, tokens=ids)

    async def detokenize(self, request: Request) -> P.DetokenizeResponse:
        req: P.DetokenizeRequest = await self.front.parse_body(request, P.DetokenizeRequest)
        await self.front.check_served(req.model)
        self.front.need_tokenizer("tokens")
        cap = max(self.front.settings.max_request_list_items, 4 * self.front.info.max_model_len)
        if len(req.tokens) > cap:
            raise APIError(400, f"tokens: {len(req.tokens):,} ids; this server detokenizes at most {cap:,} at once "
                                "(4 x --max-model-len, or --max-request-list-items)", param="tokens")
        vocab = self.front.info.vocab_size
        if any(not 0 <= t < vocab for t in req.tokens):
            raise APIError(400, f"token ids must be in [0, {vocab})", param="tokens")
        heavy = len(req.tokens) > HEAVY_CHARS // 4
        # (need_tokenizer inside: in the heavy thread it is the preprocessing workers' stand-in)
        text = await self.front.run_blocking(
            lambda: self.front.need_tokenizer("tokens").decode(req.tokens, skip_special_tokens=False), heavy=heavy)
        return P.DetokenizeResponse(prompt=text)

    def tokenizer_info(self) -> P.TokenizerInfoResponse:
        tokenizer = self.front.tokenizer
        if tokenizer is None:
            raise APIError(404, "this server runs without a tokenizer (--skip-tokenizer-init)", code="no_tokenizer")
        return P.TokenizerInfoResponse(**tokenizer.info())
