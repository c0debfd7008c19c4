"""Byte-level BPE tokenizers trained with `tokenizers`, saved as a transformers PreTrainedTokenizerFast.

The vocabulary starts with four special tokens, always at ids 0-3:
`<|endoftext|>` (end of a document; the tokenizer's eos and pad), `<|im_start|>` and `<|im_end|>`
(ChatML turns; `<|im_end|>` ends a chat reply) and `<|mask|>` (never seen in pre-training; reserved
as the mask token of a DFlash drafter, which embeds it with the target's own embedding table).

Text is pre-split by a regular expression suited to source code (identifiers with underscores stay
whole, runs of indentation are one piece, at most three digits per piece), then mapped to bytes, so
any string round-trips exactly.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

EOS_TOKEN = "<|endoftext|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
MASK_TOKEN = "<|mask|>"
SPECIAL_TOKENS = (EOS_TOKEN, IM_START_TOKEN, IM_END_TOKEN, MASK_TOKEN)

# ChatML; `corpus.format_chatml` renders the same text in Python for the training data.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Pieces, in order of preference: English contractions; an identifier with at most one leading
# non-word character (usually a space); up to three digits; a run of punctuation with an optional
# leading space (and the newlines after it); newlines with the blanks before them; blanks that are
# not followed by a word (so the last blank of an indentation run joins the word after it); blanks.
PRETOKENIZE_PATTERN = (
    r"'(?i:[sdmt]|ll|ve|re)"
    r"|[^\r\n\p{L}\p{N}_]?[\p{L}_][\p{L}\p{N}_]*"
    r"|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}_]+[\r\n]*"
    r"|\s*[\r\n]+"
    r"|\s+(?!\S)"
    r"|\s+"
)


def _strip_specials(text: str) -> str:
    for tok in SPECIAL_TOKENS:
        text = text.replace(tok, "\n")
    return text


def train_bpe_tokenizer(texts: Sequence[str], vocab_size: int, min_frequency: int = 2,
                        show_progress: bool = False) -> Any:
    """A `tokenizers.Tokenizer` with `vocab_size` entries (special tokens and the 256 bytes included)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size {vocab_size} is below the {256 + len(SPECIAL_TOKENS)} bytes and special tokens")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                  special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=show_progress)
    # Special-token strings in the data are atomic when encoding; keep them out of the merges.
    tok.train_from_iterator((_strip_specials(t) for t in texts), trainer, length=len(texts))
    for i, special in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(special) == i, f"{special} is not id {i}"
    return tok


def encode_batch(tok: Any, texts: Sequence[str]) -> list[list[int]]:
    """Token ids of each text, encoded in parallel by the Rust tokenizer (no special tokens added)."""
    fast = getattr(tok, "encode_batch_fast", None) or tok.encode_batch
    return [e.ids for e in fast(list(texts), add_special_tokens=False)]


def tokenizer_config(model_max_length: int) -> dict:
    """tokenizer_config.json: a PreTrainedTokenizerFast with eos, pad, the chat template, the specials."""
    added = {str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                      "single_word": False, "special": True} for i, t in enumerate(SPECIAL_TOKENS)}
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "unk_token": None,
        "additional_special_tokens": list(SPECIAL_TOKENS[1:]),
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": CHATML_TEMPLATE,
    }


def save_tokenizer(tok: Any, out_dir: Path | str, model_max_length: int) -> list[Path]:
    """Write tokenizer.json and tokenizer_config.json (nothing else: the chat template is inline)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(model_max_length), indent=2) + "\n")
    return [out / "tokenizer.json", out / "tokenizer_config.json"]


def special_token_ids() -> dict[str, int]:
    return {t: i for i, t in enumerate(SPECIAL_TOKENS)}


def chars_per_token(texts: Iterable[str], ids: Iterable[list[int]]) -> float:
    n_chars = sum(len(t) for t in texts)
    n_tokens = sum(len(i) for i in ids)
    return n_chars / max(1, n_tokens)
