"""Tokenizer access: encoding, the chat template, and incremental detokenization with stop strings."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from atlas.errors import InvalidRequestError, ModelLoadError

logger = logging.getLogger(__name__)

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json", "spiece.model",
                    "vocab.txt")


class Tokenizer:
    """A thin wrapper over a Hugging Face tokenizer (tokenizer.json / tokenizer_config.json)."""

    def __init__(self, path: Path | str, revision: str | None = None):
        from transformers import AutoTokenizer

        folder = Path(path)
        if folder.is_dir() and not any((folder / name).is_file() for name in _TOKENIZER_FILES):
            raise ModelLoadError(
                f"{folder} has no tokenizer files ({', '.join(_TOKENIZER_FILES[:3])}, ...). Give --tokenizer PATH, "
                "or --skip-tokenizer-init to serve token-id prompts only")
        try:
            self.hf = AutoTokenizer.from_pretrained(str(path), revision=revision)
        except Exception as exc:  # missing or malformed tokenizer files
            raise ModelLoadError(
                f"cannot load a tokenizer from {path} ({type(exc).__name__}: {exc}). Give --tokenizer PATH, or "
                "--skip-tokenizer-init to serve token-id prompts only") from exc
        # Atlas checks prompt lengths against --max-model-len itself; the tokenizer's own limit only
        # produces a misleading warning for long texts.
        self.hf.model_max_length = 1 << 62
        self.eos_token_id = self.hf.eos_token_id
        self.vocab_size = len(self.hf)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.hf.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def decode_batch(self, sequences: list[list[int]], skip_special_tokens: bool = True) -> list[str]:
        """decode() of many sequences in one call into the Rust tokenizer (where there is one)."""
        backend = getattr(self.hf, "backend_tokenizer", None)
        if backend is None or len(sequences) < 2:
            return [self.decode(s, skip_special_tokens) for s in sequences]
        texts = backend.decode_batch(sequences, skip_special_tokens=skip_special_tokens)
        if getattr(self.hf, "clean_up_tokenization_spaces", False):
            texts = [self.hf.clean_up_tokenization(t) for t in texts]
        return texts

    def token_strings(self, token_ids: list[int]) -> list[str]:
        return [self.hf.decode([t]) for t in token_ids]

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            **template_kwargs: Any) -> str:
        if not self.has_chat_template:
            raise InvalidRequestError(
                "this model's tokenizer has no chat template; use a completion prompt instead", param="messages")
        try:
            return self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                               **template_kwargs)
        except Exception as exc:  # template errors come from user-supplied messages
            raise InvalidRequestError(f"the chat template rejected these messages: {exc}", param="messages") from exc


class IncrementalDetokenizer:
    """Decodes a growing token sequence a little at a time.

    Decoding token by token is wrong for byte-level and sentencepiece vocabularies (a character can
    span tokens; leading spaces depend on the previous token), so each step decodes a small window of
    recent tokens and emits only text that has become final (no trailing U+FFFD).
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.tokens = list(prompt_token_ids)
        self.read_offset = len(self.tokens)
        self.prefix_offset = max(self.read_offset - 6, 0)

    def add(self, token_id: int) -> str:
        decode = self.tokenizer.decode
        prefix, full = self.windows(token_id)
        return self.advance(decode(prefix, self.skip_special_tokens), decode(full, self.skip_special_tokens))

    def windows(self, token_id: int) -> tuple[list[int], list[int]]:
        """Append token_id; -> the two token windows whose texts `advance` needs (so that many
        detokenizers can decode theirs in one batched call)."""
        self.tokens.append(token_id)
        return self.tokens[self.prefix_offset: self.read_offset], self.tokens[self.prefix_offset:]

    def advance(self, prefix: str, full: str) -> str:
        """-> the text that became final with the token given to `windows`."""
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            delta = full[len(prefix):]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.tokens)
            return delta
        return ""

    def flush(self) -> str:
        """At the end of a sequence: the text still held back (an incomplete character decodes
        to U+FFFD, as a full decode would)."""
        decode = self.tokenizer.decode
        prefix = decode(self.tokens[self.prefix_offset: self.read_offset], self.skip_special_tokens)
        full = decode(self.tokens[self.prefix_offset:], self.skip_special_tokens)
        self.prefix_offset = self.read_offset = len(self.tokens)
        return full[len(prefix):]


def detokenize_batch(tokenizer: Tokenizer, detokenizers: list[IncrementalDetokenizer], token_ids: list[int]
                     ) -> list[str]:
    """IncrementalDetokenizer.add for many sequences (one token each), decoded in batched calls."""
    windows = [d.windows(t) for d, t in zip(detokenizers, token_ids, strict=True)]
    texts: list[str] = [""] * len(detokenizers)
    for skip in (True, False):
        idx = [i for i, d in enumerate(detokenizers) if d.skip_special_tokens is skip]
        if not idx:
            continue
        decoded = tokenizer.decode_batch([w for i in idx for w in windows[i]], skip)
        for j, i in enumerate(idx):
            texts[i] = detokenizers[i].advance(decoded[2 * j], decoded[2 * j + 1])
    return texts


def find_stop_string(text: str, new_chars: int, stop_strings: list[str]) -> tuple[int, str] | None:
    """Earliest stop string that ends inside the last `new_chars` characters of text -> (index, string)."""
    if not stop_strings:
        return None
    best: tuple[int, str] | None = None
    for stop in stop_strings:
        begin = max(0, len(text) - new_chars - len(stop) + 1)
        idx = text.find(stop, begin)
        if idx != -1 and (best is None or idx < best[0]):
            best = (idx, stop)
    return best
