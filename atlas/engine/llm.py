"""The offline API users know from vLLM: LLM(model=...).generate(prompts, SamplingParams(...))."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from atlas.config import EngineConfig
from atlas.engine.beam_search import BeamSearch, advance_all, step_params, step_work
from atlas.engine.chat_content import check_content, content_for_template, content_format
from atlas.engine.chat_template import RESERVED_KWARGS
from atlas.engine.core import EngineCore, PromptInput
from atlas.errors import InvalidRequestError
from atlas.heap import frozen_heap
from atlas.lora_request import LoRARequest
from atlas.outputs import (
    BeamSearchOutput,
    ClassificationOutput,
    ClassificationRequestOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from atlas.sampling_params import BeamSearchParams, SamplingParams, check_beam_logprobs
from atlas.scoring import (
    activate,
    check_cross_encoder,
    cosine,
    cross_encoder_activation,
    cross_encoder_prompt,
    pair_texts,
)
from atlas.vllm_config import engine_kwargs


class LLM:
    """Loads a model once and generates for batches of prompts with continuous batching.

    Keyword arguments are the engine flags (see `EngineConfig`), e.g. LLM(model=PATH,
    max_model_len=4096, enable_prefix_caching=False, dtype="bfloat16"); vLLM's speculative_config,
    structured_outputs_config, optimization_level and disable_log_stats mean the same here (atlas/vllm_config.py).
    """

    def __init__(self, model: str | None = None, **kwargs: Any):
        self.config = EngineConfig.from_kwargs(model=model, **engine_kwargs(kwargs))
        self.engine = EngineCore(self.config)

    def get_tokenizer(self):
        return self.engine.tokenizer

    def shutdown(self) -> None:
        """Stop the worker processes of a tensor- or pipeline-parallel engine now (they also stop when the
        LLM is garbage-collected or the program ends). Nothing to do on one device."""
        self.engine.shutdown()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prompt prefix, so that the next prompts are computed whole (vLLM's; a benchmark's cold
        start). False, nothing forgotten, while a request holds pages (never between calls of this LLM)."""
        return self.engine.kv.reset_prefix_cache()

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's generation_config.json defaults (--generation-config), as vLLM's."""
        return SamplingParams(**self.engine.sampling_defaults)

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order. A prompt is a string, {"prompt_token_ids": [...]}
        or a list of token ids. lora_request (an LLM made with enable_lora=True): the adapter of every prompt, or
        one per prompt (None: the base model)."""
        if self.engine.pooling:
            raise InvalidRequestError("this LLM was made with runner='pooling' (embeddings only): use LLM.embed, or "
                                      "make it without runner='pooling' to generate", param="runner")
        prompts = _prompt_list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params_list = (
            [sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams) else list(sampling_params)
        )
        if len(params_list) != len(prompts):
            raise InvalidRequestError(
                f"got {len(params_list)} SamplingParams for {len(prompts)} prompts; give one, or one per prompt",
                param="sampling_params")
        loras = ([lora_request] * len(prompts) if lora_request is None or isinstance(lora_request, LoRARequest)
                 else list(lora_request))
        if len(loras) != len(prompts):
            raise InvalidRequestError(f"got {len(loras)} LoRA requests for {len(prompts)} prompts; give one, or one "
                                      "per prompt", param="lora_request")
        return self._run(prompts, params_list, use_tqdm, loras)

    def beam_search(self, prompts: PromptInput | Sequence[PromptInput], params: BeamSearchParams,
                    use_tqdm: bool = False, lora_request: LoRARequest | None = None) -> list[BeamSearchOutput]:
        """vLLM's beam search: per prompt, its params.beam_width best beams, best first (engine/beam_search.py).
        Each step scores every live beam of every prompt in one batch of one-token requests."""
        if self.engine.pooling:
            raise InvalidRequestError("this LLM computes embeddings (runner='pooling'): it searches nothing",
                                      param="runner")
        if not isinstance(params, BeamSearchParams):
            raise InvalidRequestError("beam_search takes a BeamSearchParams", param="params")
        engine = self.engine
        check_beam_logprobs(params.beam_width, engine.max_logprobs, logprobs_mode=engine.config.logprobs_mode)
        searches = []
        for prompt in _prompt_list(prompts):
            search = BeamSearch(engine.tokenize_prompt(prompt)[1], params, engine.eos_token_ids)
            engine.check_prompt_length(search.last_prompt_length)
            searches.append(search)
        step = step_params(params)
        bar = tqdm(total=params.max_tokens, desc="beam search", unit="step", disable=not use_tqdm)
        try:
            while work := step_work(searches):
                outs = self._run([{"prompt_token_ids": beam} for _, beam in work], [step] * len(work), False,
                                 [lora_request] * len(work))
                advance_all(searches, work, outs)
                bar.update(1)
        finally:
            bar.close()
        decode = engine.tokenizer.decode if engine.tokenizer is not None else None
        return [search.output(decode) for search in searches]

    def embed(self, prompts: PromptInput | Sequence[PromptInput], use_tqdm: bool = False
              ) -> list[EmbeddingRequestOutput]:
        """vLLM's LLM.embed (an LLM made with runner="pooling"): one EmbeddingRequestOutput per prompt, in order,
        its vector in `.outputs.embedding`. A prompt is a string, {"prompt_token_ids": [...]} or a list of ids."""
        if not self.engine.pooling:
            raise InvalidRequestError("LLM.embed needs an embedding engine: LLM(model, runner='pooling') (vLLM's "
                                      "argument)", param="runner")
        if self.engine.class_labels is not None:
            raise InvalidRequestError("this model is a sequence classifier: its outputs are class logits, not "
                                      "embeddings; use LLM.classify", param="runner")
        prompts = _prompt_list(prompts)
        outs = self._run(prompts, [SamplingParams(max_tokens=1)] * len(prompts), use_tqdm)
        return [EmbeddingRequestOutput(o.request_id, EmbeddingOutput(o.embedding), o.prompt_token_ids, o.finished)
                for o in outs]

    def classify(self, prompts: PromptInput | Sequence[PromptInput], use_tqdm: bool = False
                 ) -> list[ClassificationRequestOutput]:
        """vLLM's LLM.classify (a *ForSequenceClassification checkpoint, runner="pooling"): one
        ClassificationRequestOutput per prompt, in order, its class probabilities in `.outputs.probs` (in the
        order of the checkpoint's id2label)."""
        if not self.engine.pooling or self.engine.class_labels is None:
            raise InvalidRequestError("LLM.classify needs a sequence-classification checkpoint "
                                      "(*ForSequenceClassification) made with LLM(model, runner='pooling')",
                                      param="runner")
        prompts = _prompt_list(prompts)
        outs = self._run(prompts, [SamplingParams(max_tokens=1)] * len(prompts), use_tqdm)
        return [ClassificationRequestOutput(o.request_id, ClassificationOutput.from_logits(o.embedding),
                                            o.prompt_token_ids, o.finished) for o in outs]

    def score(self, data_1: str | Sequence[str], data_2: str | Sequence[str], use_tqdm: bool = False
              ) -> list[ScoringRequestOutput]:
        """vLLM's LLM.score (runner="pooling"): one ScoringRequestOutput per pair, its score in `.outputs.score`.
        One text against a list scores it against each; two lists of one length pair by index (atlas/scoring.py).
        An embedding model scores by cosine similarity; a one-label sequence classifier (a cross-encoder) reads each
        pair as one prompt."""
        engine = self.engine
        if not engine.pooling:
            raise InvalidRequestError("LLM.score needs LLM(model, runner='pooling') (vLLM's argument) on an embedding "
                                      "checkpoint or a one-label sequence classifier (a cross-encoder)",
                                      param="runner")
        pairs = pair_texts(data_1, data_2)
        if engine.class_labels is not None:
            activation = cross_encoder_activation(engine.model_config.raw)
            check_cross_encoder(engine.class_labels, activation)
            prompts = [cross_encoder_prompt(q, d) for q, d in pairs]
            outs = self._run(prompts, [SamplingParams(max_tokens=1)] * len(prompts), use_tqdm)
            return [ScoringRequestOutput(o.request_id, ScoringOutput(activate(o.embedding[0], activation)),
                                         o.prompt_token_ids, o.finished) for o in outs]
        distinct = list(dict.fromkeys(t for pair in pairs for t in pair))  # (a text given twice is embedded once)
        outs = dict(zip(distinct, self._run(distinct, [SamplingParams(max_tokens=1)] * len(distinct), use_tqdm),
                        strict=True))
        return [ScoringRequestOutput(f"{outs[a].request_id}_{outs[b].request_id}",
                                     ScoringOutput(cosine(outs[a].embedding, outs[b].embedding)),
                                     outs[a].prompt_token_ids + outs[b].prompt_token_ids) for a, b in pairs]

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        lora_request: LoRARequest | None = None,
        chat_template: str | None = None,
        chat_template_content_format: str = "auto",
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        mm_processor_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, through the chat template (vLLM's parameters, in
        its order): `chat_template` in place of the tokenizer's, the tool definitions as the template's `tools`,
        `chat_template_kwargs` as further template variables (not the ones the parameters set); with
        `continue_final_message` and add_generation_prompt False the last message is left open, continued.
        chat_template_content_format: how a message's content reaches the template (engine/chat_content.py).
        sampling_params: one for every conversation, or one each."""
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise InvalidRequestError("chat needs a tokenizer; this engine runs without one", param="messages")
        if mm_processor_kwargs:
            raise InvalidRequestError("mm_processor_kwargs: multimodal inputs are not supported",
                                      param="mm_processor_kwargs")
        template_kwargs = dict(chat_template_kwargs or {})
        for name in (*RESERVED_KWARGS, "chat_template"):
            if name in template_kwargs:
                raise InvalidRequestError(f"chat_template_kwargs.{name}: set by chat()'s own parameter (or not "
                                          "supported); leave it out of chat_template_kwargs",
                                          param="chat_template_kwargs")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        try:
            fmt = content_format(chat_template_content_format, chat_template or tokenizer.chat_template)
        except ValueError as exc:
            raise InvalidRequestError(str(exc), param="chat_template_content_format") from None
        conversations = [[_with_content(m, fmt) for m in conv] for conv in conversations]
        prompts = [
            {"prompt_token_ids": tokenizer.chat_ids(conv, add_generation_prompt, chat_template=chat_template,
                                                    tools=tools, continue_final_message=continue_final_message,
                                                    **template_kwargs)}
            for conv in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    def _run(self, prompts: list[PromptInput], params_list: list[SamplingParams], use_tqdm: bool,
             loras: list[LoRARequest | None] | None = None) -> list[RequestOutput]:
        engine = self.engine
        for params in params_list:  # a constraint that does not compile fails the call before anything runs
            params.check_token_ids(engine.model_config.vocab_size)
            if params.structured_outputs is not None:
                engine.structured.compile_sync(params.structured_outputs)
        ids: list[str] = []
        try:
            for prompt, params, lora in zip(prompts, params_list, loras or [None] * len(prompts), strict=True):
                ids.append(engine.add_request(prompt, params, lora=lora))
        except Exception:
            for rid in ids:  # a bad prompt fails the call without leaving work queued
                engine.abort_request(rid)
            raise
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="generating", unit="req", disable=not use_tqdm)
        try:
            with frozen_heap():  # (the collector's full passes skip the engine and everything else alive now)
                while len(finished) < len(ids):
                    for out in engine.step(final_only=True):
                        if out.finished:
                            finished[out.request_id] = out
                            bar.update(1)
        except BaseException:
            for rid in ids:
                if rid not in finished:
                    engine.abort_request(rid)
            raise
        finally:
            bar.close()
        return [finished[rid] for rid in ids]


def _prompt_list(prompts) -> list:
    """One prompt (a string, {"prompt_token_ids": [...]} or a list of ids) or a sequence of them -> a list."""
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        return [prompts]
    return list(prompts)


def _with_content(message: dict[str, Any], fmt: str) -> dict[str, Any]:
    """A chat message with its content as a template of content format `fmt` reads it (text parts only)."""
    content = message.get("content")
    try:
        check_content(content)
    except ValueError as exc:
        raise InvalidRequestError(f"a message's content: {exc}", param="messages") from None
    if "content" not in message:
        return message
    return {**message, "content": content_for_template(content, fmt)}

