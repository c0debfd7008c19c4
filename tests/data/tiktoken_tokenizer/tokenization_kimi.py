"""A tiktoken tokenizer shipped as checkpoint code, as Kimi K2's is (tiktoken.model: base64 token, rank)."""

import base64

import tiktoken
from transformers import PreTrainedTokenizer
from transformers.convert_slow_tokenizer import bytes_to_unicode

PATTERN = r"""[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""


class TikTokenTokenizer(PreTrainedTokenizer):
    vocab_files_names = {"vocab_file": "tiktoken.model"}
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, vocab_file, bos_token="[BOS]", eos_token="[EOS]", **kwargs):
        ranks = {}
        with open(vocab_file) as f:
            for line in f:
                token, rank = line.split()
                ranks[base64.b64decode(token)] = int(rank)
        self.encoding = tiktoken.Encoding(name="fixture", pat_str=PATTERN, mergeable_ranks=ranks, special_tokens={})
        self.byte_text = bytes_to_unicode()
        self.text_byte = {c: b for b, c in self.byte_text.items()}
        self.token_ids = {self._text(t): r for t, r in ranks.items()}
        self.id_tokens = {r: t for t, r in self.token_ids.items()}
        super().__init__(bos_token=bos_token, eos_token=eos_token, **kwargs)

    def _text(self, raw: bytes) -> str:
        return "".join(self.byte_text[b] for b in raw)

    @property
    def vocab_size(self):
        return len(self.token_ids)

    def get_vocab(self):
        return {**self.token_ids, **self.added_tokens_encoder}

    def _tokenize(self, text, **kwargs):
        return [self._text(self.encoding.decode_single_token_bytes(i)) for i in self.encoding.encode_ordinary(text)]

    def _convert_token_to_id(self, token):
        return self.token_ids[token]

    def _convert_id_to_token(self, index):
        return self.id_tokens[index]

    def convert_tokens_to_string(self, tokens):
        return bytes(self.text_byte[c] for c in "".join(tokens)).decode("utf-8", errors="replace")

    def save_vocabulary(self, save_directory, filename_prefix=None):
        return ()

    def apply_chat_template(self, conversation, tools=None, tokenize=True, add_generation_prompt=False, **kwargs):
        # (a tokenizer class's own rendering: here the tools' keys sorted before the template writes them)
        return super().apply_chat_template(conversation, tools=_sorted(tools), tokenize=tokenize,
                                           add_generation_prompt=add_generation_prompt, **kwargs)


def _sorted(value):
    if isinstance(value, dict):
        return {k: _sorted(v) for k, v in sorted(value.items())}
    if isinstance(value, list):
        return [_sorted(v) for v in value]
    return value
