"""EngineCore: the step loop that ties scheduler, KV pages, model runner and outputs together.

Everything here is host-side bookkeeping; the one device call per step is ModelRunner.execute().
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from atlas.config import EngineConfig, ModelConfig
from atlas.engine.cpu_threads import configure_cpu_threads
from atlas.engine.kv_cache import KVCacheManager
from atlas.engine.request import Request, RequestStatus
from atlas.engine.scheduler import Scheduler, SchedulerConfig
from atlas.engine.tokenizer import IncrementalDetokenizer, Tokenizer, find_stop_string
from atlas.errors import ConfigError, InvalidRequestError, PromptTooLongError
from atlas.models.loader import resolve_model_path
from atlas.outputs import Logprob, RequestOutput, mean_acceptance_length
from atlas.runtime.capture import HiddenCapture
from atlas.runtime.cuda_graphs import scratch_pages_needed
from atlas.runtime.model_runner import ModelRunner, resolve_device
from atlas.sampling_params import SamplingParams
from atlas.speculative import CommittedTokens, build_proposer

logger = logging.getLogger(__name__)

PromptInput = str | dict | list[int]


def default_model_path() -> Path:
    """The small model shipped inside the package, used when --model is not given."""
    return Path(__file__).resolve().parent.parent / "assets" / "default-model"


@dataclass
class ParentRequest:
    """A user request; n > 1 fans out into n sibling sequences."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[Request]
    emitted: bool = False


@dataclass
class EngineStats:
    num_prompt_tokens: int = 0  # prompt tokens computed (prefix-cache hits excluded)
    num_generation_tokens: int = 0
    num_steps: int = 0
    num_finished: int = 0
    finished_reasons: dict[str, int] = field(default_factory=dict)
    # Speculative decoding.
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_num_verify_steps: int = 0

    @property
    def spec_mean_acceptance_length(self) -> float | None:
        return mean_acceptance_length(self.spec_num_accepted_tokens, self.spec_num_verify_steps)


class EngineCore:
    def __init__(self, config: EngineConfig):
        self.config = config
        model_ref = config.model or str(default_model_path())
        self.model_path = resolve_model_path(model_ref, config.revision)
        self.model_config = ModelConfig.from_path(self.model_path)
        self.max_model_len = self._resolve_max_model_len()

        self.tokenizer: Tokenizer | None = None
        if not config.skip_tokenizer_init:
            tok_path = resolve_model_path(config.tokenizer, config.revision) if config.tokenizer else self.model_path
            self.tokenizer = Tokenizer(tok_path)
        self.eos_token_ids = list(self.model_config.eos_token_ids)
        tokenizer_eos = self.tokenizer.eos_token_id if self.tokenizer is not None else None
        if tokenizer_eos is not None and tokenizer_eos not in self.eos_token_ids:
            self.eos_token_ids.append(tokenizer_eos)
        self._load_generation_config()

        torch.manual_seed(config.seed)
        if resolve_device(config.device).type == "cpu":  # before loading: torch's default may oversubscribe
            configure_cpu_threads(config.num_cpu_threads)
        t0 = time.perf_counter()
        self.runner = ModelRunner(config, self.model_config, self.max_model_len)
        self.device = self.runner.device
        default_budget = 8192 if self.device.type == "cuda" else 2048
        self.max_num_batched_tokens = config.max_num_batched_tokens or default_budget
        self.proposer = build_proposer(config, self.runner) if config.speculative else None
        self.plan = self._plan_and_allocate()
        self.kv = KVCacheManager(self.plan.num_pages, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, self.max_num_batched_tokens, self.max_model_len), self.kv)
        self.parents: dict[str, ParentRequest] = {}
        self.stats = EngineStats()
        self._ids = itertools.count()
        logger.info("model %s (%s) on %s in %s, loaded in %.1fs", model_ref, self.model_config.architecture,
                    self.device, str(self.runner.dtype).replace("torch.", ""), time.perf_counter() - t0)
        logger.info(self.plan.describe())
        logger.info("max model len %d, max num seqs %d, token budget per step %d, prefix caching %s",
                    self.max_model_len, config.max_num_seqs, self.max_num_batched_tokens,
                    "on" if config.enable_prefix_caching else "off")

    # ------------------------------------------------------------------ set-up helpers
    def _plan_and_allocate(self):
        """Count every buffer, size the KV pages, allocate them; then install the proposer."""
        runner, proposer = self.runner, self.proposer
        extra: dict[str, int] = {}
        extra_page_bytes = 0
        layers: tuple[int, ...] = ()
        if proposer is not None:
            layers = proposer.capture_layers()
            extra_page_bytes = proposer.kv_bytes_per_token() * self.config.block_size
            if layers:
                # Planned for a full step of captured rows, before the proposer says what it needs.
                runner.capture_layers = layers
                extra["hidden capture"] = HiddenCapture.bytes_for(
                    len(layers), self.model_config.hidden_size, self.max_num_batched_tokens, runner.dtype)
        # Uniform steps worth a CUDA graph: decodes, and verifies of a full set of drafts.
        q_lens = [1] + ([proposer.num_draft_tokens + 1] if proposer is not None else [])
        graphs = runner.graph_memory_estimate(self.config.max_num_seqs, max(q_lens))
        if graphs:
            extra["cuda graphs"] = graphs
        plan = runner.plan_memory(self.config.max_num_seqs, self.max_num_batched_tokens,
                                  extra_page_bytes=extra_page_bytes, extra=extra)
        num_scratch = scratch_pages_needed(max(q_lens), self.config.block_size)
        runner.allocate_kv_cache(plan.num_pages, num_scratch)
        if proposer is not None:
            # The drafter's cache has the same page ids as the target's, scratch pages included.
            proposer.allocate_kv_cache(plan.num_pages + num_scratch, self.config.block_size)
            if layers:
                min_rows = self.config.max_num_seqs * (proposer.num_draft_tokens + 1)
                runner.install_capture(layers, self.max_num_batched_tokens, min_rows)
                runner.capture.rightsize(proposer.prefill_hidden_rows(self.max_num_batched_tokens))
            proposer.bind(runner)
        runner.capture_step_graphs(self.config.max_num_seqs, q_lens)
        return plan

    def _resolve_max_model_len(self) -> int:
        limit = self.model_config.max_position_embeddings
        wanted = self.config.max_model_len
        if wanted is None:
            return limit
        if wanted > limit:
            raise ConfigError(f"--max-model-len {wanted} exceeds the model's max_position_embeddings {limit}; "
                              f"use --max-model-len {limit} or less")
        return wanted

    def _load_generation_config(self) -> None:
        """generation_config.json may list extra EOS ids (e.g. chat end-of-turn tokens)."""
        import json

        path = self.model_path / "generation_config.json"
        if not path.is_file():
            return
        try:
            eos = json.loads(path.read_text()).get("eos_token_id")
        except (json.JSONDecodeError, AttributeError):
            logger.warning("ignoring malformed %s", path)
            return
        for token in [eos] if isinstance(eos, int) else (eos or []):
            if isinstance(token, int) and token not in self.eos_token_ids:
                self.eos_token_ids.append(token)

    # ------------------------------------------------------------------ requests
    def new_request_id(self) -> str:
        return f"req-{next(self._ids)}"

    def tokenize_prompt(self, prompt: PromptInput) -> tuple[str | None, list[int]]:
        """A prompt is text, {"prompt_token_ids": [...]} (or {"prompt": text}), or a list of token ids."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                prompt = list(prompt["prompt_token_ids"])
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise InvalidRequestError("a prompt dict needs 'prompt' or 'prompt_token_ids'", param="prompt")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError(
                    "this engine runs without a tokenizer (skip_tokenizer_init): send prompt token ids",
                    param="prompt")
            ids = self.tokenizer.encode(prompt)
            text = prompt
        elif isinstance(prompt, (list, tuple)):
            ids, text = list(prompt), None
            vocab = self.model_config.vocab_size
            if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab for t in ids):
                raise InvalidRequestError(f"prompt token ids must be integers in [0, {vocab})", param="prompt")
        else:
            raise InvalidRequestError(f"unsupported prompt type {type(prompt).__name__}", param="prompt")
        if not ids:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        return text, ids

    def check_prompt_length(self, num_prompt_tokens: int) -> None:
        if num_prompt_tokens >= self.max_model_len:
            raise PromptTooLongError(
                f"the prompt has {num_prompt_tokens} tokens but the context is {self.max_model_len} tokens "
                f"(prompt + at least one generated token): shorten the prompt or raise --max-model-len",
                param="prompt")

    def add_request(self, prompt: PromptInput, params: SamplingParams, request_id: str | None = None,
                    arrival_time: float | None = None) -> str:
        """Validate and queue a request; raises InvalidRequestError (nothing is queued) on bad input."""
        params.validate()
        text, ids = self.tokenize_prompt(prompt)
        self.check_prompt_length(len(ids))
        request_id = request_id or self.new_request_id()
        if request_id in self.parents:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", param="request_id")
        children = []
        for index in range(params.n):
            generator = None
            if params.seed is not None:
                generator = torch.Generator(device=self.device).manual_seed(params.seed + index)
            child = Request(f"{request_id}#{index}" if params.n > 1 else request_id, request_id, index, text, ids,
                            params, self.eos_token_ids, generator, arrival_time)
            if self.tokenizer is not None:
                child.detokenizer = IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens)
            if index > 0:
                child.share_from = children[0]
            children.append(child)
        self.parents[request_id] = ParentRequest(request_id, text, ids, children)
        for child in children:
            self.scheduler.add(child)
            if self.proposer is not None:
                self.proposer.on_request_start(child)
        return request_id

    def abort_request(self, request_id: str) -> bool:
        """Stop a request now and free its pages. Returns False if it is unknown or already done."""
        parent = self.parents.pop(request_id, None)
        if parent is None:
            return False
        for child in parent.children:
            if not child.is_finished:
                self.scheduler.finish(child, RequestStatus.FINISHED_ABORTED)
                if self.proposer is not None:
                    self.proposer.on_request_finish(child)
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ------------------------------------------------------------------ the step
    def step(self) -> list[RequestOutput]:
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return []
        batch = sched.batch
        result = self.runner.execute(batch)
        self.stats.num_steps += 1
        now = time.time()
        commits: list[CommittedTokens] = []
        for i, req in enumerate(batch.seqs):
            n = batch.num_scheduled[i]
            sampled = result.sampled_token_ids[i]
            num_drafts = max(0, batch.num_sample_rows(i) - 1)
            # KV of rejected draft positions is not valid: only the accepted part counts as computed.
            num_valid = n - (num_drafts - (len(sampled) - 1)) if num_drafts else n
            start = req.num_computed_tokens
            self.stats.num_prompt_tokens += max(0, min(start + num_valid, req.num_prompt_tokens) - start)
            req.num_computed_tokens = start + num_valid
            req.spec_token_ids = []
            req.spec_draft_probs = None
            if result.prompt_logprobs and result.prompt_logprobs[i]:
                for position, logprob, rank, top in result.prompt_logprobs[i]:
                    if position + 1 == len(req.prompt_logprobs):  # (a recompute after preemption repeats some)
                        req.prompt_logprobs.append(self._logprob_entry(req.prompt_token_ids[position + 1],
                                                                       (logprob, rank, top)))
            hidden = result.hidden[i]
            if hidden is not None and num_drafts:
                hidden = hidden[:num_valid]
            commits.append(CommittedTokens(req, start, num_valid, hidden))
            if sampled:
                if req.metrics.first_token_time is None:
                    req.metrics.first_token_time = now
                if num_drafts:
                    self._record_verify(req, num_drafts, len(sampled) - 1)
                self._commit_tokens(req, sampled, result.logprobs[i])
                if num_drafts and not req.is_finished:
                    self.kv.trim(req, req.num_tokens)  # pages of rejected positions go back

        if self.proposer is not None:
            self.proposer.on_commit(commits)
        touched: dict[str, ParentRequest] = {}
        for i, req in enumerate(batch.seqs):
            self.kv.cache_computed_pages(req)
            if req.is_finished:
                req.metrics.finished_time = now
                self.scheduler.finish(req, req.status)
                if self.proposer is not None:
                    self.proposer.on_request_finish(req)
                self.stats.num_finished += 1
                self.stats.finished_reasons[req.status.value] = self.stats.finished_reasons.get(req.status.value, 0) + 1
            if result.sampled_token_ids[i] or req.is_finished:
                parent = self.parents.get(req.parent_id)
                if parent is not None:
                    touched[parent.request_id] = parent
        if self.proposer is not None:
            self._propose()
        return [self._make_output(p) for p in touched.values()]

    def _record_verify(self, req: Request, num_drafts: int, num_accepted: int) -> None:
        for counters in (req.metrics, self.stats):
            counters.spec_num_draft_tokens += num_drafts
            counters.spec_num_accepted_tokens += num_accepted
            counters.spec_num_verify_steps += 1

    def _propose(self) -> None:
        """Drafts for every running request whose next step is a decode."""
        proposer = self.proposer
        candidates = []
        for req in self.scheduler.running:
            if req.is_finished or req.num_computed_tokens != req.num_tokens - 1:
                continue
            if proposer.lookahead_slots and not self.kv.allocate(req, proposer.lookahead_slots):
                continue  # no pages for the drafter's scratch rows: decode plainly this time
            candidates.append(req)
        if not candidates:
            return
        for req, draft in zip(candidates, proposer.propose(candidates), strict=True):
            # Never draft past max_tokens or the context: those tokens could not be kept.
            room = self.max_model_len - req.num_tokens
            if req.params.max_tokens is not None:
                room = min(room, req.params.max_tokens - req.num_output_tokens)
            k = max(0, min(len(draft.token_ids), room - 1))
            req.spec_token_ids = list(draft.token_ids[:k])
            req.spec_draft_probs = draft.probs[:k] if draft.probs is not None and k else None

    def _commit_tokens(self, req: Request, tokens: list[int], logprobs: list | None) -> None:
        """Append tokens one by one, stopping exactly where plain decoding would."""
        for k, token in enumerate(tokens):
            req.append_token(token)
            self.stats.num_generation_tokens += 1
            if logprobs is not None:
                self._append_logprobs(req, token, logprobs[k])
            if self._check_stop(req, token):
                if req.detokenizer is not None and not isinstance(req.stop_reason, str):
                    req.output_text += req.detokenizer.flush()  # text held back for a partial character
                return

    def _check_stop(self, req: Request, token: int) -> bool:
        """Detokenize token and decide whether req ends with it (status and stop_reason are set)."""
        params = req.params
        may_stop = req.num_output_tokens >= params.min_tokens
        if may_stop and token in req.stop_token_ids:
            # The stop token itself adds no text, so it never reaches the detokenizer.
            req.status = RequestStatus.FINISHED_STOPPED
            req.stop_reason = None if token in req.eos_token_ids else token
            return True
        new_text = req.detokenizer.add(token) if req.detokenizer is not None else ""
        req.output_text += new_text
        if may_stop and new_text:
            hit = find_stop_string(req.output_text, len(new_text), params.stop_strings)
            if hit is not None:
                idx, stop = hit
                req.output_text = req.output_text[: idx + len(stop) if params.include_stop_str_in_output else idx]
                req.status = RequestStatus.FINISHED_STOPPED
                req.stop_reason = stop
                return True
        if (params.max_tokens is not None and req.num_output_tokens >= params.max_tokens) or (
                req.num_tokens >= self.max_model_len):
            req.status = RequestStatus.FINISHED_LENGTH
            return True
        return False

    def _logprob_entry(self, token: int, entry: tuple) -> dict[int, Logprob]:
        """{token: Logprob} for a chosen token, then the top ones in rank order."""
        logprob, rank, top = entry
        decode = (lambda t: self.tokenizer.decode([t], skip_special_tokens=False)) if self.tokenizer else (lambda t: None)
        entries = {token: Logprob(logprob, rank, decode(token))}
        for r, (tok, lp) in enumerate(top, start=1):
            if tok not in entries:
                entries[tok] = Logprob(lp, r, decode(tok))
        return entries

    def _append_logprobs(self, req: Request, token: int, entry: tuple) -> None:
        req.logprobs.append(self._logprob_entry(token, entry))
        req.cumulative_logprob += entry[0]

    def _visible_text(self, req: Request) -> str:
        """While running, hold back the characters that could still be the start of a stop string."""
        hold = req.params.max_stop_string_len - 1
        if req.is_finished or hold <= 0:
            return req.output_text
        return req.output_text[: max(0, len(req.output_text) - hold)]

    def _make_output(self, parent: ParentRequest) -> RequestOutput:
        finished = all(c.is_finished for c in parent.children)
        if finished:
            self.parents.pop(parent.request_id, None)
        first = parent.children[0]
        return RequestOutput(
            request_id=parent.request_id,
            prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            outputs=[c.completion_output(self._visible_text(c)) for c in parent.children],
            finished=finished,
            num_cached_tokens=first.num_cached_tokens,
            metrics=first.metrics,
            prompt_logprobs=list(first.prompt_logprobs) if first.prompt_logprobs is not None else None,
        )
