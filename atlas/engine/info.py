"""What a front end needs to know of the engine it serves (the same whether the engine runs in its thread or
in a process of its own), and the prompt checks that need nothing else."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from atlas.errors import InvalidRequestError, PromptTooLongError
from atlas.sampling_params import DEFAULT_MAX_LOGPROBS
from atlas.scoring import cross_encoder_activation


def check_token_ids(ids: list, vocab_size: int) -> list[int]:
    """Prompt token ids: exact ints (not bools) in [0, vocab_size)."""
    ids = list(ids)
    # (by type, which is twice as fast as a check per element for long prompts)
    if not set(map(type, ids)) <= {int} or min(ids, default=0) < 0 or max(ids, default=0) >= vocab_size:
        raise InvalidRequestError(f"prompt token ids must be integers in [0, {vocab_size})", param="prompt")
    return ids


def check_prompt_length(num_prompt_tokens: int, max_model_len: int) -> None:
    if num_prompt_tokens >= max_model_len:
        raise PromptTooLongError(
            f"the prompt has {num_prompt_tokens} tokens but the context is {max_model_len} tokens "
            f"(prompt + at least one generated token): shorten the prompt or raise --max-model-len",
            param="prompt")


def check_pooled_length(num_prompt_tokens: int, max_model_len: int) -> None:
    """--runner pooling: nothing is generated, so the input may fill the context."""
    if num_prompt_tokens > max_model_len:
        raise PromptTooLongError(
            f"the input has {num_prompt_tokens} tokens but the context is {max_model_len} tokens: shorten it "
            f"(or raise --max-model-len)", param="input")


@dataclass(frozen=True)
class EngineInfo:
    model: str | None  # --model as given (None: the built-in model)
    tokenizer_path: str | None  # None: the engine runs without a tokenizer
    max_model_len: int
    max_num_seqs: int
    vocab_size: int
    compile_timeout: float  # --structured-outputs-compile-timeout
    pid: int  # the process the engine runs in
    # SamplingParams defaults for fields a request leaves out (--generation-config)
    sampling_defaults: dict = dataclasses.field(default_factory=dict)
    chat_template: str | None = None  # --chat-template's text, when given
    chat_encoding: str | None = None  # a chat format written in code (engine/chat_encodings.py), when chats use one
    tokenizer_code: bool = False  # --trust-remote-code: the tokenizer runs the checkpoint's own tokenizer code
    runner: str = "generate"  # --runner
    embedding_size: int = 0  # --runner pooling: the pooled vector's length (the hidden size)
    normalized: bool = False  # --runner pooling: the vectors are L2-normalized
    matryoshka: bool = False  # ... and may be shortened (the request's `dimensions`)
    matryoshka_dimensions: tuple[int, ...] | None = None  # the lengths allowed, if the checkpoint lists them
    # --runner pooling on a sequence classifier: its class labels (the pooled vector is their logits); None otherwise
    class_labels: tuple[str, ...] | None = None
    # ... and the activation that makes its one logit a pair's score (atlas/scoring.py; a cross-encoder's)
    score_activation: str | None = None
    priority_scheduling: bool = False  # --scheduling-policy priority (else a request's priority must be 0)
    lora: bool = False  # --enable-lora: a request's model may name a LoRA adapter
    eos_token_ids: tuple[int, ...] = ()  # (the end-of-sequence tokens: they end a beam of a beam search)
    max_logprobs: int = DEFAULT_MAX_LOGPROBS  # --max-logprobs (-1 resolved to the vocabulary size)
    logprobs_mode: str = "raw_logprobs"  # --logprobs-mode

    @classmethod
    def of(cls, core) -> EngineInfo:
        tok = core.tokenizer
        return cls(model=core.config.model, tokenizer_path=tok.hf.name_or_path if tok is not None else None,
                   max_model_len=core.max_model_len, max_num_seqs=core.config.max_num_seqs,
                   vocab_size=core.model_config.vocab_size,
                   compile_timeout=core.config.structured_outputs_compile_timeout, pid=os.getpid(),
                   sampling_defaults=dict(core.sampling_defaults),
                   chat_template=tok.template_override if tok is not None else None,
                   chat_encoding=tok.chat_encoding if tok is not None else None,
                   tokenizer_code=tok.trust_remote_code if tok is not None else False,
                   priority_scheduling=core.config.scheduling_policy == "priority", lora=core.config.enable_lora,
                   eos_token_ids=tuple(core.eos_token_ids), max_logprobs=core.max_logprobs,
                   logprobs_mode=core.config.logprobs_mode,
                   **cls._pooling_fields(core))

    @staticmethod
    def _pooling_fields(core) -> dict:
        pooler = core.runner.pooler
        if pooler is None:
            return {}
        cfg = pooler.config
        labels = core.class_labels
        return dict(runner="pooling", embedding_size=len(labels) if labels else core.model_config.hidden_size,
                    normalized=cfg.normalize, matryoshka=cfg.matryoshka, matryoshka_dimensions=cfg.matryoshka_dimensions,
                    class_labels=labels,
                    score_activation=cross_encoder_activation(core.model_config.raw) if labels else None)

    def load_tokenizer(self):
        """The engine's tokenizer, loaded again in a front end (None where the engine runs without one)."""
        if self.tokenizer_path is None:
            return None
        from atlas.engine.tokenizer import Tokenizer

        return Tokenizer(self.tokenizer_path, chat_template=self.chat_template, chat_encoding=self.chat_encoding,
                         trust_remote_code=self.tokenizer_code)

    def check_prompt_ids(self, ids: list) -> list[int]:
        if not ids:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        return check_token_ids(ids, self.vocab_size)

    def check_prompt_length(self, num_prompt_tokens: int) -> None:
        check_prompt_length(num_prompt_tokens, self.max_model_len)

    def compile_timeout_message(self) -> str:
        return (f"the constraint did not compile within {self.compile_timeout:g} s "
                "(--structured-outputs-compile-timeout); simplify it")
