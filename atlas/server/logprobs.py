"""Logprobs as the OpenAI API shows them: each token's text and exact bytes, in the legacy completions layout
(tokens, text offsets, top logprobs by text) and the chat layout (content entries with bytes)."""

from __future__ import annotations

import copy
import math
import re

from atlas.engine.tokenizer import Tokenizer, byte_level_alphabet
from atlas.outputs import Logprob, RequestOutput
from atlas.server import protocol as P


class TokenText:
    """One token as logprobs show it: its text, and its exact bytes (a token may hold part of a
    UTF-8 character; its text is then written as OpenAI does, e.g. 'bytes:\\xe2\\x80')."""

    def __init__(self, tokenizer: Tokenizer | None):
        self.tokenizer = tokenizer
        self.cache: dict[int, tuple[str, list[int]]] = {}
        self.alphabet: dict[str, int] | None = None
        self.special: set[int] = set()
        self.as_ids = False  # (with_ids)
        if tokenizer is not None:
            decoder = getattr(getattr(tokenizer.hf, "backend_tokenizer", None), "decoder", None)
            if type(decoder).__name__ == "ByteLevel":
                self.alphabet = byte_level_alphabet()
            self.special = set(tokenizer.hf.all_special_ids)

    def _raw(self, token: int) -> bytes:
        hf = self.tokenizer.hf
        piece = hf.convert_ids_to_tokens(token)
        if isinstance(piece, str) and token not in self.special:
            if self.alphabet is not None and piece and all(c in self.alphabet for c in piece):
                return bytes(self.alphabet[c] for c in piece)
            m = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece)  # sentencepiece byte fallback
            if m:
                return bytes([int(m.group(1), 16)])
        return self.tokenizer.decode([token], skip_special_tokens=False).encode()

    def _lookup(self, token: int) -> tuple[str, list[int]]:
        hit = self.cache.get(token)
        if hit is None:
            if self.tokenizer is None:
                hit = (f"token_id:{token}", [])
            else:
                raw = self._raw(token)
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError:
                    text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
                hit = (text, list(raw))
            self.cache[token] = hit
        return hit

    def text(self, token: int) -> str:
        return self._lookup(token)[0]

    def bytes(self, token: int) -> list[int]:
        return self._lookup(token)[1]

    def shown(self, token: int) -> str:
        """The token as a logprob entry names it: its text, or with_ids(), 'token_id:123'."""
        return f"token_id:{token}" if self.as_ids else self.text(token)

    def shown_bytes(self, token: int) -> list[int]:
        return list(self.shown(token).encode()) if self.as_ids else self.bytes(token)

    def with_ids(self) -> TokenText:
        """This table (its cache shared) for a request with vLLM's return_tokens_as_token_ids: each logprob entry
        names its token by id (every token identifiable whatever its text), its bytes those of that name; text
        offsets still count the tokens' texts."""
        named = copy.copy(self)
        named.as_ids = True
        return named

    def completion_logprobs(self, token_ids: list[int], logprobs: list[dict[int, Logprob] | None], start: int,
                            out: P.CompletionLogprobs | None = None) -> tuple[P.CompletionLogprobs, int]:
        """Legacy completions logprobs of token_ids, text offsets counted from `start`, appended to
        `out` if given. An entry of None (the first prompt token, which nothing predicts) gives nulls."""
        out = out or P.CompletionLogprobs()
        offset = start
        for token, entries in zip(token_ids, logprobs, strict=False):
            out.tokens.append(self.shown(token))
            out.text_offset.append(offset)
            offset += len(self.text(token))  # (offsets into the text, whatever names the token)
            if entries is None:
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
                continue
            out.token_logprobs.append(_finite(entries[token].logprob))
            top: dict[str, float] = {}
            for t, e in entries.items():  # two tokens may print alike: keep the likelier
                key = self.shown(t)
                top[key] = _finite(max(e.logprob, top.get(key, e.logprob)))
            out.top_logprobs.append(top)
        return out, offset

    def echo_logprobs(self, prompt_ids: list[int], out: RequestOutput) -> P.CompletionLogprobs | None:
        """The echoed prompt's logprobs (offsets from 0), to which the completion's are appended."""
        if out.prompt_logprobs is None:
            return None
        return self.completion_logprobs(prompt_ids, out.prompt_logprobs, 0)[0]

    def chat_logprobs(self, token_ids: list[int], logprobs: list[dict[int, Logprob]], k: int
                      ) -> P.ChatChoiceLogprobs:
        text, raw = self.shown, self.shown_bytes
        content = []
        for token, entries in zip(token_ids, logprobs, strict=False):
            top = sorted((e.rank, t, e.logprob) for t, e in entries.items() if e.rank <= k)
            content.append(P.ChatTokenLogprob(
                token=text(token), logprob=_finite(entries[token].logprob), bytes=raw(token),
                top_logprobs=[P.TopLogprob(token=text(t), logprob=_finite(lp), bytes=raw(t)) for _, t, lp in top]))
        return P.ChatChoiceLogprobs(content=content)


def _finite(logprob: float) -> float:
    """A logprob as JSON can carry it: a token the distribution excludes (-inf: a filtered or masked token under
    --logprobs-mode processed_*) as -9999.0, as vLLM writes it."""
    return logprob if math.isfinite(logprob) else -9999.0


def prompt_logprobs_of(out: RequestOutput) -> list[dict[int, P.PromptLogprob] | None]:
    """vLLM's prompt_logprobs field: each prompt token's entry (None for the first, which nothing predicts)."""
    return [None if entry is None else {t: P.PromptLogprob(logprob=lp.logprob if math.isfinite(lp.logprob) else -9999.0,
                                                           rank=lp.rank, decoded_token=lp.decoded_token)
                                        for t, lp in entry.items()}
            for entry in out.prompt_logprobs or []]
