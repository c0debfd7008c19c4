"""EngineCore: the step loop that ties scheduler, KV pages, model runner and outputs together.

Everything here is host-side bookkeeping; the one device call per step is ModelRunner.execute().
Under tensor or pipeline parallelism (runtime/parallel.py) the driver's EngineCore starts the workers,
and each worker builds an EngineCore of its own (same memory plan and graphs, no tokenizer) whose runner
runs the driver's steps.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from atlas.config import EngineConfig, ModelConfig
from atlas.engine import workers
from atlas.engine.cpu_threads import configure_cpu_threads, grammar_mask_threads
from atlas.engine.device_clock import DeviceClock
from atlas.engine.generation_config import sampling_defaults
from atlas.engine.info import check_pooled_length, check_prompt_length, check_token_ids
from atlas.engine.kv_cache import KVCacheManager, StateSlotPool
from atlas.engine.kv_groups import GroupedKVCacheManager
from atlas.engine.lora import LoraRegistry
from atlas.engine.output_processor import OutputProcessor, ParentRequest
from atlas.engine.request import Request, RequestStatus
from atlas.engine.scheduler import EngineStats, Scheduler, SchedulerConfig
from atlas.engine.tokenizer import IncrementalDetokenizer, Tokenizer, resolve_chat_template
from atlas.errors import AtlasError, ConfigError, InvalidRequestError, ModelLoadError, UnsupportedModelError
from atlas.layers.attention import release_window
from atlas.lora_request import LoRARequest
from atlas.models.loader import resolve_model_path
from atlas.models.quantization import refuse_quantized
from atlas.models.registry import model_class
from atlas.outputs import RequestOutput
from atlas.runtime import memory, parallel_groups
from atlas.runtime import parallel as parallel_runtime
from atlas.runtime.batch import TokenMasks
from atlas.runtime.capture import HiddenCapture
from atlas.runtime.cuda_graphs import scratch_pages_needed
from atlas.runtime.model_runner import ModelRunner, resolve_device
from atlas.sampling_params import SamplingParams
from atlas.speculative import build_proposer, proposer_class, verify_only
from atlas.speculative.policy import SpeculationPolicy

if TYPE_CHECKING:
    from atlas.models.lora import PlacedAdapter

logger = logging.getLogger(__name__)

PromptInput = str | dict | list[int]


def check_recurrent_support(config: EngineConfig, model_config: ModelConfig) -> None:
    """Refuse, naming it, what Atlas does not do yet for models with recurrent state (linear-attention layers),
    before any weight is read. (Every drafter works with them: a verify step backs the state up and a rejection
    restores it, whatever proposed the drafts.)"""
    arch = model_config.architecture
    if config.runner == "pooling":
        raise ConfigError(f"--runner pooling: Atlas does not pool {arch} models")
    if config.tuning.gdn_prefill == "fla":
        from atlas.kernels.gated_delta_rule import fla_chunk_kernel

        fla_chunk_kernel()  # (a ConfigError naming the package where it does not import)


def default_model_path() -> Path:
    """The small model shipped inside the package, used when --model is not given."""
    return Path(__file__).resolve().parent.parent / "assets" / "default-model"


class EngineCore:
    def __init__(self, config: EngineConfig, parallel: parallel_runtime.ParallelState | None = None):
        """`parallel`: given to a worker of a parallel engine; the driver (tensor or pipeline parallel size
        above 1, no `parallel`) starts its workers here."""
        self.config = config
        model_ref = config.model or str(default_model_path())
        self.model_path = resolve_model_path(model_ref, config.revision, weights=not config.dummy_weights,
                                             hub=config.hub)
        self.model_config = ModelConfig.from_path(self.model_path, config.hf_overrides)
        # (before tensor-parallel workers start, each of which would refuse it alone)
        refuse_quantized(self.model_config.raw, self.model_path, self.model_config.architecture, dequantizes=True)
        self.max_model_len = self._resolve_max_model_len()
        limit = self.config.max_logprobs
        self.max_logprobs = self.model_config.vocab_size if limit == -1 else min(limit, self.model_config.vocab_size)
        worker = parallel is not None and not parallel.is_driver

        self.tokenizer: Tokenizer | None = None

        def tokenizer_path() -> Path:
            return (resolve_model_path(config.tokenizer, config.tokenizer_revision or config.revision, hub=config.hub)
                    if config.tokenizer else self.model_path)

        if not config.skip_tokenizer_init and not worker:
            self.tokenizer = Tokenizer(tokenizer_path(), chat_template=resolve_chat_template(config.chat_template),
                                       trust_remote_code=config.trust_remote_code)
            self.tokenizer.prepare_detokenizer()
            self.tokenizer.chat_encoding = self._chat_encoding(self.tokenizer)
        self._resolve_classifier_tokens(tokenizer_path)
        self.eos_token_ids = list(self.model_config.eos_token_ids)
        tokenizer_eos = self.tokenizer.eos_token_id if self.tokenizer is not None else None
        if tokenizer_eos is not None and tokenizer_eos not in self.eos_token_ids:
            self.eos_token_ids.append(tokenizer_eos)
        self._load_generation_config()
        self.sampling_defaults = sampling_defaults(
            config.generation_config, self.model_path, config.override_generation_config) if not worker else {}

        torch.manual_seed(config.seed)
        ranks = parallel_groups.world_size(config)
        if resolve_device(config.device).type == "cpu":  # before loading: torch's default may oversubscribe
            configure_cpu_threads(config.num_cpu_threads, ranks // config.nnodes)
        t0 = time.perf_counter()
        self.recurrent = model_class(self.model_config).keeps_recurrent_state
        if self.recurrent:
            check_recurrent_support(config, self.model_config)
        if ranks > 1 and parallel is None:
            parallel_groups.check_model(config, self.model_config)
            parallel = workers.start(config)
        self.parallel = parallel
        try:
            self._build(config, parallel)
        except BaseException as exc:
            if parallel is None or not parallel.is_driver:
                raise
            # A collective that broke because a worker failed: that worker's error (it names the rank).
            error = parallel.failure_from(exc) if isinstance(exc, RuntimeError) else None
            parallel.abort()
            parallel.shutdown()
            if error is not None and error.rank:
                raise error from exc
            raise
        if parallel is not None and parallel.is_driver:
            # Workers stop with the engine (or at the latest when the process ends).
            self._finalizer = weakref.finalize(self, parallel.shutdown)
        logger.info("model %s (%s) on %s in %s, loaded in %.1fs", model_ref, self.model_config.architecture,
                    self.device if parallel is None else self._parallel_words(), str(self.runner.dtype).replace(
                        "torch.", ""), time.perf_counter() - t0)
        logger.info(self.plan.describe())
        if self.runner.pooler is not None:
            logger.info("--runner pooling: embeddings only, %s; CUDA graphs off (prompt steps run eagerly)",
                        self.runner.pooler.config.describe())
        if self.runner.kv_dtype != self.runner.dtype:
            logger.info("KV cache in %s (--kv-cache-dtype %s)", str(self.runner.kv_dtype).replace("torch.", ""),
                        config.kv_cache_dtype)
        logger.info("max model len %d, max num seqs %d, token budget per step %d, prefix caching %s",
                    self.max_model_len, config.max_num_seqs, self.max_num_batched_tokens,
                    "on" if self.kv.enable_prefix_caching else "off")

    def _chat_encoding(self, tokenizer: Tokenizer) -> str | None:
        """The chat format written in code that chats render with (engine/chat_encodings.py), if any: the one
        --tokenizer-mode names, or DeepSeek-V3.2's for a deepseek_v32 checkpoint whose tokenizer has no chat
        template (and no --chat-template is given), as its publishers render it."""
        mode = self.config.tokenizer_mode
        if mode == "deepseek_v32":
            return mode
        if self.model_config.model_type == "deepseek_v32" and not tokenizer.has_chat_template:
            logger.info("chat format: DeepSeek-V3.2's (the checkpoint ships no chat template; --tokenizer-mode "
                        "deepseek_v32)")
            return "deepseek_v32"
        return None

    def _resolve_classifier_tokens(self, tokenizer_path: Callable[[], Path]) -> None:
        """A causal LM read as a sequence classifier (ModelConfig.classifier_from_tokens): its tokens' ids, through
        the tokenizer (read for this alone where the engine keeps none: --skip-tokenizer-init)."""
        converted = self.model_config.classifier_from_tokens
        if converted is None:
            return
        tokens = converted[1]
        vocab = None
        if any(isinstance(t, str) for t in tokens):
            tokenizer = self.tokenizer or Tokenizer(tokenizer_path(), trust_remote_code=self.config.trust_remote_code)
            vocab = tokenizer.hf.get_vocab()
        ids = []
        for token in tokens:
            token_id = token if isinstance(token, int) else vocab.get(token)
            if token_id is None or not 0 <= token_id < self.model_config.vocab_size:
                raise ModelLoadError(f"classifier_from_token: {token!r} is not a token of this model's vocabulary "
                                     f"({self.model_config.vocab_size:,} ids); give a token as the tokenizer "
                                     "spells it, or its id")
            ids.append(token_id)
        self.model_config.classifier_token_ids = tuple(ids)

    def _build(self, config: EngineConfig, parallel) -> None:
        self.runner = ModelRunner(config, self.model_config, self.max_model_len, parallel)
        if parallel is not None:
            parallel.before_leaving.append(self.runner.release_graphs)
        self.device = self.runner.device
        self.max_num_batched_tokens = self.runner.max_num_batched_tokens
        self.proposer = None
        if config.speculative and parallel is not None and not parallel.is_driver:
            self.proposer = verify_only(config, self.model_config)  # (the driver drafts; workers verify)
        elif config.speculative:
            cls = proposer_class(config.speculative)
            if cls.uses_target_vocab:  # (before building: MTP shares the whole embedding)
                self.runner.prepare_full_vocab(with_head=cls.needs_target_head(self.runner.model))
            self.proposer = build_proposer(config, self.runner.proposer_context())
            layers = self.proposer.capture_layers()
            blocker = layers and self.runner.model.capture_blocker(layers, self.proposer.reads_mtp_input)
            if blocker:
                raise UnsupportedModelError(
                    f"--speculative {config.speculative} reads the hidden states of target layers "
                    f"{list(layers)}, which {self.model_path} cannot give: {blocker}")
            # One device: drafts stay on it, read back with the verify step's results (one host wait a
            # speculative step instead of two; --tuning device_drafts=0 reads them back at once). The workers of
            # a parallel engine get every input id from the driver's host.
            self.proposer.device_drafts = parallel is None and config.tuning.device_drafts
            # And where the drafter can tell the accepted drafts on the device, its next block is queued right
            # behind each verify step, so the host's bookkeeping overlaps it (--tuning draft_after_verify=0: after
            # the read-back, as before).
            # (Not for a model with recurrent state: a verify step's slots are backed up, and a rejection's restored,
            #  as the host prepares it, which a step prepared on the device behind a block skips; nor where the step
            #  graphs are captured per context bound: the block's graphs follow the verify step's by batch size.)
            # (nor with a draft-length ladder: the block behind a verify step reads a step of K + 1 rows a request)
            self.proposer.drafts_after_verify = (self.proposer.device_drafts and self.proposer.can_draft_after_verify
                                                 and config.tuning.draft_after_verify and not self.recurrent
                                                 and self.runner.graph_plan.context_buckets is None
                                                 and not self.draft_ladder())
            if self.proposer.drafts_after_verify:
                self.runner.draft_after_verify = self.proposer.draft_after_verify
                self.runner.takes_captured_rows = self.proposer.takes_captured_rows
                # (opt-in: runtime/prelaunch.py; not where the windowed layers keep pages of their own, engine/
                #  kv_groups.py: a step queued from the block's device-side slots has none of the window group's)
                # (nor with adapters: a step queued ahead reads the slot table of the step before)
                if config.tuning.prelaunch_verify and not self._kv_cache_groups_blocker()[0] and not config.enable_lora:
                    self.runner.prelaunch_allowed = self._prelaunch_allowed
        # Hybrid models: prefix caching resumes a cached prefix from a snapshot of the recurrent state at its end
        # (engine/kv_cache.py), --state-snapshots of them (default: one per sequence slot), counted in the plan.
        snapshots = max(1, config.max_num_seqs // 4) if config.state_snapshots is None else config.state_snapshots
        if self.recurrent and config.enable_prefix_caching:
            self.runner.set_state_snapshots(snapshots)
        # ... and with speculative decoding a backup of each running slot, taken before a verify step and restored
        # after one that rejected drafts (Scheduler.update_from_output), also counted in the plan.
        if self.recurrent and self.proposer is not None:
            self.runner.set_state_backups(True, self.proposer.num_draft_tokens + 1)
        # Sliding-window layers beside global ones: the windowed layers' pages in a pool of their own (KV cache
        # groups, engine/kv_groups.py), sized before the plan, which counts it.
        window_pool = self._window_pool_shape()
        if window_pool is not None:
            self.runner.set_kv_cache_groups(window_pool)
        self.plan = self._plan_and_allocate()
        # --runner pooling: prompts only. Mean and cls pooling read every prompt row, so no prefix is reused there.
        pooler = self.runner.pooler
        self.pooling = pooler is not None
        # (a sequence classifier under --runner pooling: its class labels, and its pooled vectors are their logits)
        self.class_labels = self.model_config.classifier_labels if self.pooling else None
        prefix_caching = config.enable_prefix_caching and (pooler is None or pooler.config.mode == "last")
        if prefix_caching and self.recurrent and not snapshots:
            # (exactness first: a cached prefix also needs the recurrent state at its end)
            logger.info("prefix caching is off for %s: --state-snapshots 0 keeps no recurrent state of its "
                        "linear-attention layers at the end of a cached prefix, so a prefix hit could not resume",
                        self.model_config.architecture)
            prefix_caching = False
        elif prefix_caching and self.recurrent:
            logger.info("prefix caching for %s: %d recurrent-state snapshots (%s) at the ends of prompts' last full "
                        "pages; a prefix hit resumes from the last cached page with one", self.model_config.architecture,
                        snapshots, memory.fmt_bytes(self.runner.snapshot_bytes))
        if window_pool is not None:
            self.kv = GroupedKVCacheManager(self.plan.num_pages, config.block_size, prefix_caching, window_pool.window,
                                            self.plan.window_pages)
        else:
            self.kv = KVCacheManager(self.plan.num_pages, config.block_size, prefix_caching,
                                     self._page_release_window(), num_snapshots=self.runner.num_state_snapshots)
        # Verify steps are padded to K drafts where a uniform verify step replays a CUDA graph.
        pad = self.proposer.num_draft_tokens if self.proposer is not None and len(self.runner.step_graphs) > 1 else None
        stages = config.pipeline_parallel_size
        # With pipeline stages, a request whose token is in flight waits for it (its next input is unknown),
        # so successive steps carry disjoint requests, one micro-batch per stage (see _overlap_changed).
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, self.max_num_batched_tokens, self.max_model_len, pad,
                            schedule_pending=stages == 1, priority=config.scheduling_policy == "priority",
                            max_seqs_per_request=config.seqs_per_request,
                            long_prefill_tokens=config.prompt_chunk_cap(self.max_num_batched_tokens),
                            lora=config.enable_lora),
            # (every rank's slots: a pipeline stage with no linear-attention layer of its own still hands them out)
            self.kv, self.proposer, StateSlotPool(config.max_num_seqs) if self.recurrent else None)
        self.parents: dict[str, ParentRequest] = {}
        self.output_processor = OutputProcessor(self.tokenizer, self.scheduler, self.parents)
        # (A pooled request ends in the step that computes its last prompt token: nothing to overlap.)
        self.async_scheduling = config.async_scheduling and self.proposer is None and not self.pooling
        self._install_policy()
        # Launched steps not read back yet, oldest first (SchedulerOutput, StepHandle); after a step() as many
        # as there are pipeline stages less one (at least one: the step the device is running).
        self._inflight: deque = deque()
        self._keep_inflight = max(1, stages - 1)
        # --tuning late_scheduling: the steps' launches and read-backs, for when the device runs dry (one stage)
        self.device_clock = DeviceClock() if config.tuning.late_scheduling and stages == 1 else None
        self._structured = None  # StructuredOutputManager, made on first use
        self._structured_lock = threading.Lock()
        self._awaiting_grammar: list[str] = []  # parents whose grammar is still compiling (not scheduled yet)
        # --enable-lora: the adapter slots' registry, and (parent, adapter) of requests waiting for a free slot
        self.lora = (LoraRegistry(config.lora_slots, self.runner.prepare_lora, self._load_lora_slot,
                                  self.runner.start_adapters, runtime_loading=config.nnodes == 1, hub=config.hub)
                     if config.enable_lora else None)
        self._awaiting_lora: list[tuple[str, str]] = []
        self._ids = itertools.count()
        self._overlap_changed()

    def _parallel_words(self) -> str:
        par = self.parallel
        return (f"{par.world_size} {self.device.type} ranks (tensor parallel {par.tp} x pipeline parallel "
                f"{par.pp}, {self.config.nnodes} node{'s' if self.config.nnodes > 1 else ''})")

    def shutdown(self) -> None:
        """Stop a parallel engine's workers (nothing to do on one device). The engine is unusable after."""
        if self.parallel is not None and self.parallel.is_driver:
            self.parallel.shutdown()

    def check_alive(self) -> None:
        """Raise the WorkerError that ended a parallel engine, if one did."""
        if self.parallel is not None:
            self.parallel.raise_if_failed()

    # ------------------------------------------------------------------ set-up helpers
    def _plan_and_allocate(self):
        """Count every buffer, size the KV pages, allocate them; then install the proposer."""
        runner, proposer = self.runner, self.proposer
        extra: dict[str, int] = {}
        extra_page_bytes = 0
        layers: tuple[int, ...] = ()
        # (The driver keeps captured rows for its drafter; a later pipeline stage only captures its own
        #  layers' rows for a step and sends them on.)
        keeps_capture = self.parallel is None or self.parallel.is_driver
        if proposer is not None:
            layers = proposer.capture_layers()
            extra_page_bytes = proposer.kv_bytes_per_token() * self.config.block_size
            if layers:
                runner.capture_layers = layers
            if layers and keeps_capture:
                # Planned for a full step of captured rows, before the proposer says what it needs.
                extra["hidden capture"] = HiddenCapture.bytes_for(
                    len(layers), runner.model.captured_width(), self.max_num_batched_tokens, runner.dtype)
        # Uniform steps worth a CUDA graph: decodes, and verifies of a full set of drafts.
        q_lens = [1] + ([k + 1 for k in (*self.draft_ladder(), proposer.num_draft_tokens)]
                        if proposer is not None else [])
        graphs = runner.graph_memory_estimate(self.config.max_num_seqs, q_lens)
        if graphs:
            extra["cuda graphs"] = graphs
        if proposer is not None and runner.graphs_enabled:
            drafter_graphs = proposer.graph_bytes(self.model_config, self.config.max_num_seqs)
            if drafter_graphs:
                extra["drafter cuda graphs"] = drafter_graphs
        plan = runner.plan_memory(self.config.max_num_seqs, self.max_num_batched_tokens,
                                  extra_page_bytes=extra_page_bytes, extra=extra)
        # (A block drafted behind a verify step of a padding sequence reaches position 2q - 1.)
        behind = proposer is not None and proposer.drafts_after_verify
        num_scratch = scratch_pages_needed(max(q_lens) * (2 if behind else 1), self.config.block_size)
        runner.allocate_kv_cache(plan.num_pages, num_scratch, plan.window_pages if runner.window_pool else None)
        if proposer is not None:
            # The drafter's cache has the same page ids as the target's, scratch pages included.
            proposer.allocate_kv_cache(plan.num_pages + num_scratch, self.config.block_size)
            if layers and keeps_capture:
                min_rows = self.config.max_num_seqs * (proposer.num_draft_tokens + 1)
                runner.install_capture(layers, self.max_num_batched_tokens, min_rows)
                runner.capture.rightsize(proposer.prefill_hidden_rows(self.max_num_batched_tokens))
            proposer.bind(runner.proposer_context())
        runner.capture_step_graphs(self.config.max_num_seqs, q_lens)
        if proposer is not None and proposer.drafts_after_verify:
            proposer.bind_verify_graphs(runner.step_graphs.get(proposer.num_draft_tokens + 1))
        return plan

    def _kv_cache_groups_blocker(self) -> tuple[bool, str]:
        """(whether the model's windowed layers keep a page pool of their own: KV cache groups, engine/kv_groups.py;
        why not where its sliding-window layers sit beside global ones and they do not, else "")."""
        model = self.runner.model
        windows = model.attention_windows()
        windowed = sum(w is not None for w in windows)
        if not windowed or windowed == len(windows):
            return False, ""  # (no window, or every layer windowed: one pool whose pages are released: KVCacheManager)
        if not self.config.tuning.kv_cache_groups:
            return False, "--tuning kv_cache_groups=0"
        if not model.supports_kv_cache_groups:
            return False, f"{self.model_config.architecture}'s layers read one page table"
        if self.recurrent:
            return False, "its recurrent-state snapshots are kept with the pages of one pool"
        return True, ""

    def _window_pool_shape(self) -> memory.WindowPoolShape | None:
        """The window group's pool where the model's sliding-window layers keep a page pool of their own
        (engine/kv_groups.py; W the largest window of its windowed layers; the memory plan sizes it). None: one
        page table for every layer."""
        windows = self.runner.model.attention_windows()
        windowed = [w for w in windows if w is not None]
        groups, why_not = self._kv_cache_groups_blocker()
        proposer = self.proposer
        if groups and self.config.tuning.prelaunch_verify and getattr(proposer, "drafts_after_verify", False):
            logger.info("--tuning prelaunch_verify is off for this model: a verify step queued from a drafter block's "
                        "device-side slots has none of the windowed layers' own pool")
        if why_not:
            logger.info("sliding-window layers (%d of %d) with global ones: a sequence keeps every KV page (the "
                        "memory of full attention), since %s", len(windowed), len(windows), why_not)
        if not groups:
            return None
        window = max(windowed)
        ahead = proposer.lookahead_slots + proposer.num_draft_tokens + 1 if proposer is not None else 0
        logger.info("KV cache groups: the %d sliding-window layers (window %d) of %d keep their KV in a page pool "
                    "of their own, released out of the window as sequences advance; the global layers keep every page",
                    len(windowed), window, len(windows))
        return memory.window_pool_shape(window, self.config.block_size,
                                        min(self.max_num_batched_tokens, self.max_model_len), ahead,
                                        self.config.pipeline_parallel_size)

    def _page_release_window(self) -> int | None:
        """The window past which a sequence's pages go back to the pool while it runs (KVCacheManager), or None."""
        window = release_window(self.runner.model.attention_windows())
        if window is None:  # (no window, or global layers too: KV cache groups, _window_pool_shape)
            return None
        proposer = self.proposer
        if proposer is not None and proposer.kv_bytes_per_token():
            logger.info("sliding window of %d: KV pages are kept (not released out of the window) since the "
                        "drafter's own cache is addressed by the same pages and reads the whole context", window)
            return None
        logger.info("sliding window of %d on every layer: KV pages out of the window go back to the pool as "
                    "sequences advance", window)
        return window

    def _resolve_max_model_len(self) -> int:
        limit = self.model_config.context_limit
        wanted = self.config.max_model_len
        if wanted is None:
            return limit
        if wanted > limit:
            scaled = limit != self.model_config.max_position_embeddings
            raise ConfigError(f"--max-model-len {wanted} exceeds the model's "
                              f"{'context with its scaled RoPE' if scaled else 'max_position_embeddings'} {limit}; "
                              f"use --max-model-len {limit} or less, or scale its RoPE (--hf-overrides "
                              "'{\"rope_scaling\": ...}', e.g. YaRN)")
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

    # ------------------------------------------------------------------ structured outputs
    @property
    def structured(self):
        """The grammar compiler and cache for this model's tokenizer (made on first use)."""
        if self._structured is None:
            with self._structured_lock:
                if self._structured is None:
                    if self.tokenizer is None:
                        raise InvalidRequestError("structured outputs need a tokenizer; this engine runs without "
                                                  "one (skip_tokenizer_init)", param="structured_outputs")
                    from atlas.structured import StructuredOutputManager

                    self._structured = StructuredOutputManager(
                        self.tokenizer.hf, self.model_config.vocab_size, self.eos_token_ids,
                        backend=self.config.structured_outputs_backend,
                        compile_timeout=self.config.structured_outputs_compile_timeout,
                        compile_memory=self.config.compile_memory_bytes,
                        cache_bytes=self.config.grammar_cache_bytes,
                        mask_threads=grammar_mask_threads(self.config.structured_outputs_mask_threads))
        return self._structured

    def prepare_structured_outputs(self) -> None:
        """A server's engine: make the grammar compiler (and start its trial-compile worker, which takes seconds to
        start) in the background now, not when the first constrained request waits for it."""
        if self.tokenizer is not None and self.config.runner == "generate":
            threading.Thread(target=lambda: self.structured, name="atlas-grammar-prepare", daemon=True).start()

    def _admit_compiled(self) -> list[RequestOutput]:
        """Move requests whose grammar has compiled into the scheduler; end those whose grammar failed.
        -> the final outputs of the failed ones."""
        outputs = []
        still = []
        for request_id in self._awaiting_grammar:
            parent = self.parents.get(request_id)
            if parent is None:
                continue  # aborted meanwhile
            grammar = parent.children[0].grammar
            if not grammar.ready and not grammar.overdue:
                still.append(request_id)
                continue
            try:
                for child in parent.children:
                    child.grammar.start()
            except Exception as exc:  # noqa: BLE001 - the caller did not check the grammar first
                logger.warning("request %s: its grammar did not compile (%s); it ends without output",
                               request_id, exc)
                for child in parent.children:
                    child.status = RequestStatus.FINISHED_ERROR
                    child.error = str(exc)
                outputs.append(self.output_processor.emit(parent, True))
                continue
            for child in parent.children:
                self.scheduler.add(child)
        self._awaiting_grammar = still
        return outputs

    def _wait_for_grammars(self, timeout: float) -> None:
        futures = [self.parents[r].children[0].grammar.compiled for r in self._awaiting_grammar if r in self.parents]
        if futures:
            concurrent.futures.wait(futures, timeout=timeout, return_when=concurrent.futures.FIRST_COMPLETED)

    def _advance_grammars(self, updates: list) -> None:
        """Advance constrained sequences by the tokens they kept, then cut their next drafts to the ones
        the grammar accepts, so that verification only ever sees drafts it could keep. A sequence whose grammar
        refuses a token (its state allowed none, so the token was drawn from an empty mask) ends there with an
        error: the refused tokens are taken back, and nothing unconstrained is emitted."""
        for u in updates:
            grammar = u.request.grammar
            if grammar is not None and u.new_token_ids:
                kept = grammar.accept(u.new_token_ids)
                if grammar.error is not None:
                    self._end_with_grammar_error(u, kept)
        if self.proposer is None:
            return
        for req in self.scheduler.running:
            grammar = req.grammar
            if grammar is None or not req.spec_token_ids:
                continue
            states = self.runner.requests
            if req.spec_on_device:  # (the grammar reads the drafts' values: they come back from the device)
                values = states.read_drafts(req.request_id, len(req.spec_token_ids))
                if values is not None:
                    req.spec_token_ids[: len(values)] = values
                req.spec_on_device = False
            k = grammar.check_drafts(req.spec_token_ids)
            if k < len(req.spec_token_ids):
                if states.has_draft_probs(req.request_id):
                    # Sampled drafts: the first refused one stays, so that rejection sampling rejects it
                    # (the target gives it probability 0) and draws from the residual, as without a grammar.
                    k += 1
                    states.cut_draft_probs(req.request_id, k)
                del req.spec_token_ids[k:]
                if not req.spec_token_ids:
                    states.cut_draft_probs(req.request_id, 0)

    def _end_with_grammar_error(self, update, kept: int) -> None:
        req = update.request
        dropped = len(update.new_token_ids) - kept
        if dropped:
            del req.output_token_ids[len(req.output_token_ids) - dropped:]
            del req.all_token_ids[len(req.all_token_ids) - dropped:]
            del update.new_token_ids[kept:]
            if update.logprobs is not None:
                del update.logprobs[kept:]
            self.scheduler.stats.num_generation_tokens -= dropped
        req.error = req.grammar.error
        req.stop_reason = None
        if req.is_finished:  # (a stop token drawn from the empty mask had ended it)
            stats = self.scheduler.stats
            stats.finished_reasons[req.status.value] -= 1
            stats.finished_reasons["error"] = stats.finished_reasons.get("error", 0) + 1
        logger.warning("request %s: %s", req.request_id, req.error)
        self.scheduler.finish(req, RequestStatus.FINISHED_ERROR)

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
            ids, text = check_token_ids(prompt, self.model_config.vocab_size), None
        else:
            raise InvalidRequestError(f"unsupported prompt type {type(prompt).__name__}", param="prompt")
        if not ids:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        return text, ids

    def check_prompt_length(self, num_prompt_tokens: int) -> None:
        if self.pooling:  # (nothing is generated: the prompt may fill the context)
            check_pooled_length(num_prompt_tokens, self.max_model_len)
            return
        check_prompt_length(num_prompt_tokens, self.max_model_len)

    def add_request(self, prompt: PromptInput, params: SamplingParams, request_id: str | None = None,
                    arrival_time: float | None = None, group: str | None = None,
                    lora: LoRARequest | str | None = None) -> str:
        """Validate and queue a request; raises InvalidRequestError (nothing is queued) on bad input. group: the
        id of the user request it is one prompt of (its fair share of slots counts them together; default: its
        own). lora: its LoRA adapter (a LoRARequest, or a loaded adapter's name; None: the base model)."""
        params.validate()
        if params.bad_words and params.bad_words_token_ids is None:  # (a front end may have tokenized them)
            if self.tokenizer is None:
                raise InvalidRequestError("bad_words are words: this engine runs without a tokenizer "
                                          "(skip_tokenizer_init); give bad_words_token_ids", param="bad_words")
            params = dataclasses.replace(params, bad_words_token_ids=self.tokenizer.bad_words_ids(params.bad_words))
        params.check_token_ids(self.model_config.vocab_size)
        params.check_logprobs_limit(self.max_logprobs)
        if params.priority and self.config.scheduling_policy != "priority":
            raise InvalidRequestError("priority: this engine schedules first come, first served; a priority other "
                                      "than 0 needs --scheduling-policy priority", param="priority")
        if self.pooling and (params.n != 1 or params.structured_outputs is not None or params.prompt_logprobs):
            raise InvalidRequestError("this engine runs --runner pooling: a request is one prompt to embed (n 1, no "
                                      "constraint, no prompt logprobs)", param="n")
        text, ids = self.tokenize_prompt(prompt)
        self.check_prompt_length(len(ids))
        request_id = request_id or self.new_request_id()
        if request_id in self.parents:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", param="request_id")
        children = []
        for index in range(params.n):
            child = Request(f"{request_id}#{index}" if params.n > 1 else request_id, request_id, index, text, ids,
                            params, self.eos_token_ids, arrival_time, group)
            if self.tokenizer is not None and params.detokenize:
                child.detokenizer = IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens)
            # (a sibling's pages hold no recurrent state: with a hybrid model the others wait for the first one's prompt
            #  and resume from its state snapshot through the prefix cache, or, without prefix caching, compute their own)
            if index > 0 and (not self.recurrent or self.kv.num_snapshots):
                child.share_from = children[0]
            children.append(child)
        if params.structured_outputs is not None:
            compiled = self.structured.compile(params.structured_outputs)
            if compiled.done() and compiled.exception() is not None:
                raise compiled.exception()
            for child in children:
                child.grammar = self.structured.request_grammar(params.structured_outputs)
        adapter = self._adapter_name(lora) if lora is not None else None
        # (behind requests that wait for a slot, an adapter's request waits its turn even when its adapter is on the
        #  device: a steady stream of one adapter's requests cannot keep another's waiting forever)
        got = self._acquire_adapter(adapter) if adapter is not None and not self._awaiting_lora else None
        parent = self.parents[request_id] = ParentRequest(request_id, text, ids, children)
        if adapter is not None and got is None:
            self._awaiting_lora.append((request_id, adapter))  # every slot is busy: it joins when one frees
            return request_id
        self._enqueue(parent, got)
        return request_id

    def _enqueue(self, parent: ParentRequest, adapter: tuple[int, str] | None) -> None:
        """Hand a new request's sequences to the scheduler (with their adapter slot and prefix-cache key), or keep
        them aside while their grammar compiles."""
        children = parent.children
        if adapter is not None:
            for child in children:
                child.lora_slot, child.lora_key = adapter
        if children[0].params.structured_outputs is not None and not children[0].grammar.ready:
            self._awaiting_grammar.append(parent.request_id)  # scheduled once compiled; the others go on meanwhile
            return
        for child in children:
            if child.grammar is not None:
                child.grammar.start()
            self.scheduler.add(child)

    # ------------------------------------------------------------------ LoRA adapters (engine/lora.py)
    def _adapter_name(self, lora: LoRARequest | str) -> str:
        if self.lora is None:
            name = lora.lora_name if isinstance(lora, LoRARequest) else lora
            raise InvalidRequestError(f"the LoRA adapter {name!r} cannot run: this engine was started without "
                                      "--enable-lora", param="model")
        return self.lora.resolve(lora)

    def _adapter_slots_in_use(self) -> set[int]:
        return {c.lora_slot for p in self.parents.values() for c in p.children if c.lora_slot and not c.is_finished}

    def _acquire_adapter(self, name: str) -> tuple[int, str] | None:
        return self.lora.acquire(name, self._adapter_slots_in_use)

    def _admit_adapters(self) -> list[RequestOutput]:
        """Requests that waited for an adapter slot, in order, while slots free up. -> the final outputs of those
        whose adapter was unloaded meanwhile."""
        outputs = []
        while self._awaiting_lora:
            request_id, name = self._awaiting_lora[0]
            parent = self.parents.get(request_id)
            if parent is None:  # (aborted meanwhile)
                self._awaiting_lora.pop(0)
                continue
            if name not in self.lora.known:
                for child in parent.children:
                    child.status = RequestStatus.FINISHED_ERROR
                    child.error = f"the LoRA adapter {name!r} was unloaded before the request could run"
                self._awaiting_lora.pop(0)
                outputs.append(self.output_processor.emit(parent, True))
                continue
            got = self._acquire_adapter(name)
            if got is None:
                break
            self._awaiting_lora.pop(0)
            self._enqueue(parent, got)
        return outputs

    def _registry(self) -> LoraRegistry:
        if self.lora is None:
            raise InvalidRequestError("this engine was started without --enable-lora", param="lora_name")
        return self.lora

    def _load_lora_slot(self, slot: int, adapter: PlacedAdapter) -> None:
        """An adapter written into a device slot: here, and on a tensor-parallel engine's workers (their shares, read
        from the adapter's folder) before the next step. Every rank loads --lora-modules at start by itself (the
        registry is still being made then, so nothing is sent)."""
        self.runner.load_lora(slot, adapter)
        if self.parallel is not None and self.parallel.is_driver and getattr(self, "lora", None) is not None:
            self.parallel.load_lora(slot, adapter.name, str(adapter.path))

    def load_lora_adapter(self, name: str, path: str) -> None:
        """Register an adapter (the server's /v1/load_lora_adapter): read and checked now, written into a slot on
        first use. The server runs the two parts apart: read_lora_adapter off the engine's thread, then
        add_lora_adapter on it."""
        self.add_lora_adapter(name, self.read_lora_adapter(name, path))

    def read_lora_adapter(self, name: str, path: str) -> PlacedAdapter:
        """load_lora_adapter's slow part (the files read, checked against the model, cut to this rank), which
        changes no engine state: safe on another thread while steps run."""
        registry = self._registry()
        try:
            return registry.read(name, path)
        except InvalidRequestError:
            raise
        except AtlasError as exc:  # (not a folder, not an adapter, or one Atlas cannot apply: says which)
            raise InvalidRequestError(str(exc), param="lora_path") from None

    def add_lora_adapter(self, name: str, prepared: PlacedAdapter) -> None:
        """load_lora_adapter's last part, on the engine's thread."""
        self._registry().add(name, prepared)

    def unload_lora_adapter(self, name: str) -> None:
        self._registry().unregister(name, self._adapter_slots_in_use())

    def lora_requests(self) -> tuple[list[str], list[str]]:
        """(adapters of the running sequences, adapters of the waiting ones and of requests waiting for a slot)."""
        names = self.lora.slot_names
        running = {names[r.lora_slot - 1] for r in self.scheduler.running if r.lora_slot}
        waiting = {names[r.lora_slot - 1] for r in self.scheduler.waiting if r.lora_slot}
        waiting |= {name for _, name in self._awaiting_lora}
        return sorted(n for n in running if n), sorted(n for n in waiting if n)

    def lora_adapters(self) -> list[tuple[str, str]]:
        """(name, path) of the adapters requests may name as their model, in the order they were loaded."""
        return self.lora.adapters() if self.lora is not None else []

    def abort_request(self, request_id: str) -> bool:
        """Stop a request now and free its pages. Returns False if it is unknown or already done."""
        parent = self.parents.pop(request_id, None)
        if parent is None:
            return False
        waiting_adapter = [w for w in self._awaiting_lora if w[0] == request_id]
        if request_id in self._awaiting_grammar or waiting_adapter:  # never reached the scheduler
            if waiting_adapter:
                self._awaiting_lora.remove(waiting_adapter[0])
            else:
                self._awaiting_grammar.remove(request_id)
            for child in parent.children:
                child.status = RequestStatus.FINISHED_ABORTED
            return True
        for child in parent.children:
            self.scheduler.finish(child, RequestStatus.FINISHED_ABORTED)
        return True

    def fail_running(self) -> list[str]:
        """After a step raised: abort the requests that were running (their pages are freed) and keep the waiting
        ones. -> the ids of the requests that failed (their streams must be told)."""
        self.discard_inflight()
        running = {req.parent_id for req in self.scheduler.running}
        # Requests whose every sequence finished in the broken step never got their last output.
        running |= {rid for rid, p in self.parents.items() if all(c.is_finished for c in p.children)}
        for rid in running:
            self.abort_request(rid)
        # A request whose parent entry is gone (the step broke half-way) is finished by hand.
        for req in list(self.scheduler.running):
            self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)
        return sorted(running)

    def has_unfinished(self) -> bool:
        # Steps in flight whose every request was aborted have nothing to read, except under pipeline
        # parallelism, where the last stage sends their rows back all the same: those are read.
        while (self._inflight and self.parallel_stages == 1
               and all(r.is_finished for r in self._inflight[0][0].requests)):
            _, handle = self._inflight.popleft()
            if self.device_clock is not None:
                self.device_clock.dropped()
            if self.parallel is not None:
                handle.result()  # (a parallel step's bookkeeping ends when it is read)
        return (self.scheduler.has_unfinished() or bool(self._inflight) or bool(self._awaiting_grammar)
                or bool(self._awaiting_lora))

    @property
    def parallel_stages(self) -> int:
        return self.config.pipeline_parallel_size

    @property
    def proposer(self):
        return self._proposer

    @proposer.setter
    def proposer(self, proposer) -> None:
        """(A proposer installed after start-up also drives the scheduler and turns off overlap.)"""
        self._proposer = proposer
        if hasattr(self, "scheduler"):
            self.scheduler.proposer = proposer
            self.async_scheduling = self.async_scheduling and proposer is None
            self._overlap_changed()
            self._install_policy()

    def draft_ladder(self) -> tuple[int, ...]:
        """The draft lengths below K that the adaptive policy may give a drafting step (--tuning draft_lengths);
        a ConfigError for one that is not below K."""
        lengths, proposer = self.config.tuning.draft_ladder, self._proposer
        if not lengths or proposer is None or self.config.speculative_policy == "always":
            return ()
        k = proposer.num_draft_tokens
        if lengths[-1] >= k:
            raise ConfigError(f"--tuning draft_lengths={self.config.tuning.draft_lengths}: each length must be below "
                              f"--num-draft-tokens ({k}), which is the ladder's top")
        return lengths

    def _install_policy(self) -> None:
        """The speculation policy of an engine that drafts (its driver), and whether its plain steps may overlap:
        on one device, when nothing the proposer keeps has to be read after the next step launched (it captures
        nothing, or takes a plain step's captured rows right behind the step)."""
        proposer, scheduler = self._proposer, self.scheduler
        self.policy: SpeculationPolicy | None = None
        self._plain_overlap = False
        self._policy_batch: tuple[int, bool] | None = None  # (_decide_drafting's last full decision was for this batch)
        self._last_launch: tuple[float, bool | None, int, int | None] | None = None
        scheduler.drafting = True
        if proposer is None or not (self.parallel is None or self.parallel.is_driver):
            scheduler.policy = self.runner.context_behind = None
            return
        self.policy = SpeculationPolicy(proposer.num_draft_tokens,
                                        always=self.config.speculative_policy == "always", lengths=self.draft_ladder())
        scheduler.policy = self.policy
        behind = proposer.can_write_context_behind
        self._plain_overlap = self.config.async_scheduling and self.parallel is None and (
            behind or not proposer.capture_layers())
        self.runner.context_behind = proposer.write_context_behind if self._plain_overlap and behind else None
        scheduler.stats.spec_draft_length = proposer.num_draft_tokens

    @property
    def stats(self) -> EngineStats:
        return self.scheduler.stats

    def _overlap_changed(self) -> None:
        """Tensor-parallel peers need the sampled ids when the next step may read them on the device;
        pipeline stages get micro-batches when steps overlap (without overlap they would only be smaller)."""
        self.runner.share_samples = self.async_scheduling and self.config.tensor_parallel_size > 1 and (
            self.parallel_stages == 1)
        self.scheduler.config.micro_batches = self.parallel_stages if self.async_scheduling else 1

    # ------------------------------------------------------------------ the step
    def step(self, final_only: bool = False) -> list[RequestOutput]:
        """Schedule and launch the next step, then finish the previous one while the device runs.

        With asynchronous scheduling the next step is launched before the last one's tokens are read
        (its decodes take their input tokens from the device), so scheduling, input preparation, output
        processing and detokenization all overlap the device's work. Steps that need the last tokens
        on the host first (speculative drafting, penalties) finish the previous step before scheduling;
        their output processing still overlaps the launched step. With pipeline stages, up to one step
        per stage is in flight. -> outputs of the finished step (only finished requests with final_only).

        In a parallel engine any failure of a step ends the engine with a WorkerError (naming the rank
        that failed when one did): the ranks cannot be brought back in step.
        """
        if self.parallel is None:
            return self._step(final_only)
        self.parallel.raise_if_failed()
        try:
            return self._step(final_only)
        except Exception as exc:
            raise self.parallel.failure_from(exc) from exc
        except BaseException:  # Ctrl-C mid-step: the ranks may be half-way through it, and cannot go on
            self.parallel.interrupted()
            raise

    def _step(self, final_only: bool) -> list[RequestOutput]:
        entered_at = time.monotonic() if self.device_clock is not None else 0.0
        updates = []
        failed = self._admit_compiled() if self._awaiting_grammar else []
        if self._awaiting_lora:
            failed += self._admit_adapters()
        if self.policy is not None:
            self._decide_drafting()
        if self._inflight and not self._can_overlap():
            while self._inflight:
                updates += self._complete_inflight()
        sched = self.scheduler.schedule()
        if not sched.is_empty:
            if self._structured is not None:
                if self._masks_wait_for_inflight(sched):
                    sched.batch.masks_deferred = True  # (sampled below, once the step before is read back)
                else:
                    sched.batch.token_masks = self._step_masks(sched)
            self._inflight.append((sched, self.runner.launch(sched.batch)))
            if self.device_clock is not None:
                self.device_clock.launched(sum(sched.batch.num_scheduled), entered_at)
            self.scheduler.stats.num_steps += 1
            keep = self._keep_inflight
            if self.policy is not None:
                self._time_step(sched.batch)
        else:
            keep = len(self._inflight) - 1  # nothing new: read back the oldest
            self._last_launch = None
        while len(self._inflight) > max(0, keep):
            updates += self._complete_inflight()
        for step, handle in self._inflight:  # the grammars now include the tokens read back: sample
            if handle.awaits_masks:
                handle.apply_masks(self._step_masks(step))
        if sched.is_empty and not updates and self._awaiting_grammar:
            self._wait_for_grammars(0.05)  # nothing else to run: wait for a compile instead of spinning
        return failed + self.output_processor.process(updates, final_only)

    def _decide_drafting(self) -> None:
        """Ask the speculation policy whether the next step drafts (before the step in flight is read back: that
        read-back makes the drafts)."""
        scheduler = self.scheduler
        # (the same running requests and the same "some wait" as at the last full decision: the policy may repeat it
        #  without this pass over every request; a request whose prefill ended since joins at the next full one)
        batch = (scheduler.running_changes, bool(scheduler.waiting))
        if batch == self._policy_batch and self.policy.decide_same_batch() is not None:
            return  # (plain again: the stats' draft length, probes and switches are as the last decision left them)
        decoding = scheduler.decoding_requests()
        if not decoding:
            return
        self._policy_batch = batch
        # (requests waiting for a slot: the batch's throughput counts; none: when the last one ends; `always`
        #  reads neither, so the per-request pass stays off its step loop)
        remaining = (None if scheduler.waiting or self.policy.always
                     else [scheduler.remaining_tokens(r) for r in decoding])
        drafting = self.policy.decide([r.request_id for r in decoding], remaining)
        stats = self.scheduler.stats
        stats.spec_draft_length = self.policy.draft_length
        length = self.policy.length
        scheduler.draft_length = length if length < self.policy.num_draft_tokens else None
        stats.spec_policy_probes, stats.spec_policy_switches = self.policy.probes, self.policy.switches
        if drafting != self.scheduler.drafting:
            self.scheduler.set_drafting(drafting)

    def _time_step(self, batch) -> None:
        """Give the policy the time since the last launch as the cost of the step launched then (steps of
        decodes only: a verify step, or a plain one while drafting is off)."""
        now = time.perf_counter()
        kind = None
        # (every sequence computes at least one row beside its draft rows, so the sums are equal only when every
        #  sequence is a decode: its last token and its drafts)
        if sum(batch.num_scheduled) == len(batch.num_scheduled) + sum(batch.num_draft_rows):
            kind = True if any(batch.num_draft_rows) else (False if batch.plain_speculation else None)
        length = max(batch.num_draft_rows) if kind else None
        last, self._last_launch = self._last_launch, (now, kind, len(batch.seqs), length)
        if last is not None and last[1] is not None:
            self.policy.observe_step(last[1], last[2], now - last[0], last[3])
        else:
            self.policy.observe_gap()

    def _can_overlap(self) -> bool:
        """May the next step be scheduled before the ones in flight are read back?"""
        if self._proposer is not None:
            # Plain stretches of a drafting engine overlap (a verify step's accepted count is needed first).
            if not (self._plain_overlap and not self.scheduler.drafting) or any(
                    any(step.batch.num_draft_rows) for step, _ in self._inflight):
                return False
        elif not self.async_scheduling:
            return False
        if self.parallel_stages > 1:
            return True  # requests with a token in flight are not scheduled
        # Penalties need the pending token on the host before the next step's logits are processed. So do
        # grammars (the next mask is built from the state that includes it), but on one device the next
        # step is launched with its sampling deferred until the masks are known (_masks_wait_for_inflight).
        return not any(r.num_pending_tokens
                       and (r.params.needs_output_history or (r.grammar is not None and self.parallel is not None))
                       for r in self.scheduler.running)

    def _prelaunch_allowed(self, batch) -> bool:
        """May the verify step after this one be queued on the device before it is scheduled? Only when the
        next step is likely to be that very step: nothing waits to join the batch, and no request of it ends
        by length within two more steps (an early stop token still drops the queued step, at the cost of its
        device time)."""
        running = self.scheduler.running
        if self.scheduler.waiting or self._awaiting_grammar or len(batch.seqs) != len(running):
            return False
        in_batch = {seq.request_id for seq in batch.seqs}
        ahead = 2 * (self.proposer.num_draft_tokens + 1)
        # (every running request is one of the batch's, and so the batch's requests are the running ones)
        return all(r.request_id in in_batch and r.num_tokens + ahead < self.max_model_len and (
            r.params.max_tokens is None or r.num_output_tokens + ahead <= r.params.max_tokens) for r in running)

    def _masks_wait_for_inflight(self, step) -> bool:
        """Whether a constrained sequence of this step (a SchedulerOutput) has a token still in flight (its mask
        needs it)."""
        pending_input = step.batch.pending_input
        return self.parallel is None and any(
            pending and req.grammar is not None for req, pending in zip(step.requests, pending_input, strict=True))

    def _step_masks(self, step) -> TokenMasks | None:
        """The grammar bitmasks of the step's (a SchedulerOutput's) constrained rows, from the grammars' current
        states."""
        masks = self._structured.fill_step_bitmask(step.requests, step.batch.num_sample_rows, step.batch.num_drafts)
        return TokenMasks(*masks) if masks is not None else None

    def _complete_inflight(self) -> list:
        sched, handle = self._inflight.popleft()
        waited_from = time.monotonic() if self.device_clock is not None else 0.0
        result = handle.result()
        if self.device_clock is not None:
            self.device_clock.read_back(waited_from)
        updates = self.scheduler.update_from_output(sched, result)
        if self.proposer is not None:  # (the step verified its sequences' drafts; the next ones are the runner's)
            self.runner.requests.consumed(sched.batch.seqs)
            self.runner.requests.set_drafts(self.scheduler.take_drafts())
        if self._structured is not None:
            self._advance_grammars(updates)
        return updates

    def discard_inflight(self) -> None:
        """Forget the steps in flight (after a failure): their requests wait for no token."""
        if self.device_clock is not None:
            self.device_clock.forget()
        while self._inflight:
            for req in self._inflight.popleft()[0].requests:
                req.num_pending_tokens = 0
