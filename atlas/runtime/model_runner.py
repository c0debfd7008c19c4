"""The model runner: owns the model, the KV cache tensors and the sampler, and turns each scheduler
decision (a StepBatch of host numbers) into one flat forward pass.

Every step, whatever it mixes (prefill chunks, decodes, verify rows), becomes token ids [T],
positions [T] and one AttentionMetadata; only the rows that need a next token reach the LM head.
`launch` queues the whole step on the device (inputs, forward, sampling, logprobs, copies back) and
returns at once; `StepHandle.result()` waits for it and turns it into host lists. Between the two the
engine does its host work, so the device never waits for the host.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from atlas.config import DEFAULT_CPU_KV_CACHE_BYTES, EngineConfig, ModelConfig
from atlas.errors import ConfigError
from atlas.host_copy import to_device, to_device_tensor
from atlas.kernels import gemv
from atlas.kernels import settings as kernel_settings
from atlas.layers.attention import AttentionMetadata
from atlas.layers.attention_backend import AttentionBackend, attention_backend
from atlas.layers.embedding import linear_weights
from atlas.layers.linear_attention import allocate_state_pools, state_bytes_per_sequence
from atlas.layers.parallel import split_evenly
from atlas.models.base import CausalLM
from atlas.models.loader import build_model, load_full_vocab
from atlas.runtime import memory
from atlas.runtime.batch import StepBatch, StepResult
from atlas.runtime.capture import HiddenCapture
from atlas.runtime.cuda_graphs import StepGraphs, graph_pool_bytes, uniform_graph_bytes
from atlas.runtime.drafting import NextVerify, ProposerContext, VerifiedStep, flat_device_drafts
from atlas.runtime.mixed_graphs import DEFAULT_MAX_TOKENS as MIXED_GRAPH_MAX_TOKENS
from atlas.runtime.mixed_graphs import MixedStepGraphs, mixed_token_sizes
from atlas.runtime.pooling import Pooler, load_pooling_config
from atlas.runtime.request_state import RequestStates
from atlas.runtime.sampler import Sampler, SamplingRow, TokenLogprobs, gather_logprobs
from atlas.runtime.step_inputs import InputPreparer, StepInputs
from atlas.runtime.verify import accept_one_hot, accept_with_probs

if TYPE_CHECKING:
    from atlas.runtime.parallel import ParallelState

logger = logging.getLogger(__name__)

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# Rows of logits made at once for prompt logprobs (a [rows, vocab] float32 block each).
_LOGITS_ROWS_PER_CHUNK = 256


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            from atlas.errors import ConfigError

            raise ConfigError("--device cuda was given but no CUDA GPU is visible; use --device cpu")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(name)


def resolve_dtype(name: str, model_config: ModelConfig, device: torch.device) -> torch.dtype:
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cpu":
        return torch.float32  # half-precision matmuls are slow and lossy on most CPUs
    ckpt = str(model_config.torch_dtype or "bfloat16").replace("torch.", "")
    return _DTYPES.get(ckpt, torch.bfloat16) if ckpt != "float32" else torch.bfloat16


class StepHandle:
    """A launched step. result() waits for the device (only then) and returns host lists. A step launched
    with `masks_deferred` is sampled when apply_masks gives its grammar masks (before result())."""

    def __init__(self, finish: Callable[[], StepResult], sample: Callable[[object], StepHandle] | None = None):
        self._finish = finish
        self._sample = sample
        self._result: StepResult | None = None

    @property
    def awaits_masks(self) -> bool:
        return self._sample is not None

    def apply_masks(self, masks) -> None:
        """Sample the step under `masks` (TokenMasks or None): queued on the device after its forward."""
        sample, self._sample = self._sample, None
        self._finish = sample(masks).result

    def result(self) -> StepResult:
        if self._sample is not None:
            raise RuntimeError("a step launched with deferred grammar masks is read back before apply_masks")
        if self._result is None:
            self._result = self._finish()
        return self._result


_NO_RESULT = StepResult([], [], [])  # what a parallel worker's step handle returns (nobody reads it)


def _mib(tensor: torch.Tensor | None) -> float:
    return 0.0 if tensor is None else tensor.numel() * tensor.element_size() / 2**20


def _no_whole_head(hidden: torch.Tensor) -> torch.Tensor:
    raise RuntimeError("this drafter said it does not use the target's LM head (uses_target_head), so the "
                       "tensor-parallel driver holds no whole copy of it")


class ModelRunner:
    def __init__(self, engine_config: EngineConfig, model_config: ModelConfig, max_model_len: int,
                 parallel: ParallelState | None = None):
        """`parallel`: this rank's place in a tensor / pipeline-parallel engine (None: one device)."""
        # The kernels' settings (split-KV, tiles, PDL, MoE path, mask kernel) for this process, once, before
        # anything is built or launched; the runner's own knobs are read from engine_config.tuning.
        kernel_settings.configure(engine_config)
        self.config = engine_config
        self.parallel = parallel
        # Under tensor parallelism the driver broadcasts sampled ids (set when the next step may read them on
        # the device: asynchronous scheduling).
        self.share_samples = False
        self.model_config = model_config
        self.device = resolve_device(engine_config.device)
        # Each request's device state (its generator, drafts left on the device), updated by the steps' deltas.
        self.requests = RequestStates(self.device)
        self.dtype = resolve_dtype(engine_config.dtype, model_config, self.device)
        self.block_size = engine_config.block_size
        self.max_model_len = max_model_len
        default_budget = 8192 if self.device.type == "cuda" else 2048
        self.max_num_batched_tokens = engine_config.max_num_batched_tokens or default_budget
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            # What this engine adds is measured against these (other engines may share the process).
            gc.collect()
            torch.cuda.empty_cache()
            self.free_at_start, self.total_memory = torch.cuda.mem_get_info()
            self.allocated_at_start = torch.cuda.memory_allocated(self.device)
            self.reserved_at_start = torch.cuda.memory_reserved(self.device)
        # The element type of this model's KV caches (--kv-cache-dtype; drafters keep their own dtype), decided
        # from the constructed layers' cache specs before the checkpoint is read (a refusal costs no loading).
        self.kv_dtype = self.dtype

        # --runner pooling: pooled vectors of the final hidden states instead of logits (runtime/pooling.py).
        self.pooler: Pooler | None = None
        if engine_config.runner == "pooling":
            self.pooler = Pooler(load_pooling_config(model_config.path, model_config.raw))

        def choose_kv_dtype(model: CausalLM) -> None:
            self.kv_dtype = attention_backend(model.kv_cache_specs(), engine_config.block_size,
                                              model.attention_program_heads()).cache_dtype(
                engine_config.kv_cache_dtype, self.dtype)
            if self.pooler is not None:
                if not getattr(model, "supports_pooling", False):
                    raise ConfigError(f"--runner pooling: Atlas does not pool {model_config.architecture} models (it "
                                      "pools the Llama, Mistral, Qwen2 and Qwen3 families)")
                model.lm_head = None  # (pooling needs no LM head: a bare *Model checkpoint has none to load)

        self.model: CausalLM = build_model(model_config, self.device, self.dtype, max_positions=max_model_len,
                                           parallel=parallel.layer_view(self.device, self.dtype)
                                           if parallel is not None else None, before_loading=choose_kv_dtype,
                                           dummy=engine_config.dummy_weights,
                                           quantization=engine_config.quantization)
        if self.device.type == "cuda":
            # Before any CUDA graph is captured: graphs bake in the kernel each linear layer picks.
            gemv.tune_shapes(linear_weights(self.model), engine_config.tuning.gemv)
        # Hybrid models (linear-attention layers): one state slot per running sequence, plus a scratch slot, in pools
        # allocated beside the KV pages (allocate_kv_cache); the scheduler hands out the slot numbers.
        self.state_specs = self.model.state_specs()
        self.state_pools: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.num_state_slots = engine_config.max_num_seqs + 1 if self.state_specs else 0
        # ... and, with prefix caching, snapshot slots after them (set_state_snapshots): snapshot id s is slot
        # max_num_seqs + 1 + s of the same pools.
        self.num_state_snapshots = 0
        # ... and, with speculative decoding, one backup slot per running slot after those (set_state_backups): slot s
        # is backed up in slot num_state_slots + num_state_snapshots + s before a verify step (StepBatch.state_backups).
        self.num_state_backups = 0
        self.sampler = Sampler()
        self.kv_caches: list[torch.Tensor] = []
        self.capture_layers: tuple[int, ...] = ()
        self.capture: HiddenCapture | None = None
        self.step_graphs: dict[int, StepGraphs] = {}  # by query tokens per sequence
        self.mixed_graphs: MixedStepGraphs | None = None  # (steps of sequences with different query lengths)
        self.inputs: InputPreparer | None = None
        self.scratch_pages: list[int] = []
        self._attention: AttentionBackend | None = None
        self.num_pages = 0
        self._full_vocab: tuple[torch.nn.Module, torch.nn.Module] | None = None  # (see proposer_context)
        # A proposer's draft_after_verify, set by the engine: called right behind each uniform verify step.
        self.draft_after_verify: Callable[[VerifiedStep], NextVerify | None] | None = None
        # ... and whether that block reads the step's captured rows itself (then none are kept for commits).
        self.takes_captured_rows: Callable[[VerifiedStep], bool] | None = None
        # Set by the engine (opt-in, the prelaunch_verify tuning knob): whether the verify step that follows a drafted
        # block may be queued behind it before the host has scheduled it (_prelaunch), e.g. not while requests
        # wait to join the batch. None: never.
        self.prelaunch_allowed: Callable[[StepBatch], bool] | None = None
        # A proposer's write_context_behind, set by the engine: called right behind each step of a plain stretch
        # (StepBatch.plain_speculation) with the step's captured rows, positions and slots, so that nothing
        # captured has to outlive the step (the next one may launch before this one is read back).
        self.context_behind: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None] | None = None
        self._prelaunched: _Prelaunched | None = None
        # The block a drafter queued behind the last verify step and its requests: the next step's inputs, if it
        # verifies exactly that block (InputPreparer.prepare_behind). Steps prepared so: tests read it.
        self._block_behind: tuple[NextVerify, list] | None = None
        self.steps_behind = 0
        self.prelaunches = self.prelaunches_adopted = 0  # (verify steps queued ahead, and those a launch took)

    # ------------------------------------------------------------------ memory
    @property
    def state_bytes(self) -> int:
        """Bytes of the running sequences' recurrent-state slots (every linear-attention layer), their backups for
        speculative decoding included; 0 for other models."""
        return state_bytes_per_sequence(self.state_specs, self.dtype) * (self.num_state_slots + self.num_state_backups)

    @property
    def snapshot_bytes(self) -> int:
        """Bytes of the recurrent-state snapshot slots kept for prefix caching."""
        return state_bytes_per_sequence(self.state_specs, self.dtype) * self.num_state_snapshots

    def set_state_snapshots(self, n: int) -> None:
        """Keep n recurrent-state snapshots beside the running slots (before the memory plan, which counts them)."""
        # (a pipeline stage without linear-attention layers keeps none, but its page manager counts the model's)
        self.num_state_snapshots = n if self.model.keeps_recurrent_state else 0

    def set_state_backups(self, on: bool) -> None:
        """Keep a backup slot per running slot (speculative decoding; before the memory plan, which counts them)."""
        self.num_state_backups = self.num_state_slots if on else 0

    def _backup_slot(self, slot: int) -> int:
        if not self.num_state_backups:
            raise RuntimeError("a step backs up recurrent state, but no backup slots were allocated")
        return self.num_state_slots + self.num_state_snapshots + slot

    def copy_states(self, pairs: list[tuple[int, int]]) -> None:
        """Copy recurrent state between slots of every linear-attention layer's pools: (from slot, to slot) pairs."""
        if not pairs:
            return
        src = torch.tensor([a for a, _ in pairs], dtype=torch.long).to(self.device, non_blocking=True)
        dst = torch.tensor([b for _, b in pairs], dtype=torch.long).to(self.device, non_blocking=True)
        for conv, ssm in self.state_pools:
            conv.index_copy_(0, dst, conv.index_select(0, src))
            ssm.index_copy_(0, dst, ssm.index_select(0, src))

    @property
    def page_bytes(self) -> int:
        return self.attention.bytes_per_token(self.kv_dtype) * self.block_size

    def plan_memory(self, max_num_seqs: int, max_num_batched_tokens: int, extra_page_bytes: int = 0,
                    extra: dict[str, int] | None = None) -> memory.MemoryPlan:
        """Size the KV pool. `extra_page_bytes`: a drafter's KV per page, allocated beside the target's;
        `extra`: named buffers not allocated yet (e.g. the hidden-state capture buffer)."""
        cfg = self.config
        page_bytes = self.page_bytes + extra_page_bytes
        if self.state_bytes:  # (counted before the pages: one budget)
            extra = {**(extra or {}), "recurrent state": self.state_bytes}
        if self.snapshot_bytes:
            extra["recurrent-state snapshots"] = self.snapshot_bytes
        if cfg.num_gpu_blocks_override is not None:
            plan = memory.plan_fixed(self.device.type, page_bytes, self.block_size, cfg.num_gpu_blocks_override)
        elif self.device.type == "cpu":
            useful = max_num_seqs * -(-self.max_model_len // self.block_size) + 1
            plan = memory.plan_cpu(page_bytes, self.block_size, cfg.kv_cache_bytes, useful,
                                   DEFAULT_CPU_KV_CACHE_BYTES, self.state_bytes, self.snapshot_bytes)
        else:
            weights = torch.cuda.memory_allocated(self.device) - self.allocated_at_start
            peak = self.profile_activation_peak(max_num_seqs, max_num_batched_tokens)
            free_now, total = torch.cuda.mem_get_info()
            # Memory taken on the device since start-up outside PyTorch's allocator (CUDA context,
            # cuBLAS workspaces, other libraries).
            reserved_growth = torch.cuda.memory_reserved(self.device) - self.reserved_at_start
            non_torch = max(0, (self.free_at_start - free_now) - reserved_growth)
            plan = memory.plan_cuda(page_bytes, self.block_size, total, self.free_at_start,
                                    cfg.gpu_memory_utilization, weights, peak, non_torch, extra,
                                    useful_pages=max_num_seqs * -(-self.max_model_len // self.block_size) + 1)
        plan.breakdown.update({k: v for k, v in (extra or {}).items() if k not in plan.breakdown})
        if self.parallel is not None:  # page ids are the driver's: every rank holds as many pages
            pages = self.parallel.agree_min(plan.num_pages)
            if pages < plan.num_pages:
                plan.source += f", cut to {pages:,} pages, what every rank can hold"
            plan.num_pages = pages
            plan.source += f" (per rank, {self.parallel.world_size} ranks)"
        memory.check_fits(plan, self.max_model_len, self.device.type == "cuda")
        return plan

    @torch.inference_mode()
    def profile_activation_peak(self, max_num_seqs: int, num_tokens: int) -> int:
        """Peak bytes above the weights during the largest step: a forward over `num_tokens` tokens
        (as prompts of at most max-model-len) plus sampling for max_num_seqs rows."""
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        base = torch.cuda.memory_allocated(self.device)
        seq_lens = []
        left = num_tokens
        while left > 0:
            seq_lens.append(min(left, self.max_model_len))
            left -= seq_lens[-1]
        pages = [-(-n // self.block_size) for n in seq_lens]
        caches = self._allocate_caches(sum(pages))
        block_tables, slots, first = [], [], 0
        for n, p in zip(seq_lens, pages, strict=True):
            block_tables.append(list(range(first, first + p)))
            slots.extend(self.attention.slots(block_tables[-1], 0, n))
            first += p
        positions = [i for n in seq_lens for i in range(n)]
        meta = self.attention.metadata_for_query_lens(seq_lens, seq_lens, block_tables, slots, self.device)
        ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        par = self.parallel
        stage = {}
        if par is not None and not par.is_first_stage:  # (a later pipeline stage: its layers on zeros)
            stage["intermediate"] = torch.zeros(2, num_tokens, self.model_config.hidden_size, dtype=self.dtype,
                                                device=self.device)
        hidden, _ = self.model(ids, torch.tensor(positions, device=self.device), caches, meta, self.capture_layers,
                               **stage)
        if (par is None or par.is_first_stage) and self.pooler is None:  # (the LM head and sampler: first stage)
            rows = min(max_num_seqs, num_tokens)
            if par is not None and not par.is_last_stage:
                hidden = torch.zeros(rows, self.model_config.hidden_size, dtype=self.dtype, device=self.device)
            logits = self.model.compute_logits(hidden[:rows])
            probe = SamplingRow(1.0, 50, 0.9, 0.05, 1.1, 0.1, 0.1, None, 5, [1], [1], [])
            self.sampler(logits, [probe] * rows)
            del logits
        del caches, hidden
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - base
        torch.cuda.empty_cache()
        return peak

    def _allocate_caches(self, num_pages: int) -> list[torch.Tensor]:
        return self.attention.allocate(num_pages, self.kv_dtype, self.device)

    @property
    def attention(self) -> AttentionBackend:
        """The attention backend of the model's caches (made on first use: after the model is built)."""
        if self._attention is None:
            self._attention = attention_backend(self.model.kv_cache_specs(), self.block_size,
                                                 self.model.attention_program_heads())
        return self._attention

    @property
    def program_heads(self) -> tuple[int, int]:
        """(query heads, key heads) the attention kernels pack per program (shapes the program map)."""
        return self.attention.num_heads, self.attention.num_kv_heads

    def allocate_kv_cache(self, num_pages: int, num_scratch_pages: int = 1) -> None:
        """num_pages for the page pool, plus scratch pages (ids num_pages, num_pages + 1, ...) that only the
        padding sequences of captured graphs touch."""
        self.kv_caches = []
        self.kv_caches = self._allocate_caches(num_pages + num_scratch_pages)
        self.num_pages = num_pages
        self.scratch_pages = list(range(num_pages, num_pages + num_scratch_pages))
        if self.state_specs:
            self.model.bind_state_caches(None)
            self.state_pools = []
            self.state_pools = allocate_state_pools(
                self.state_specs, self.num_state_slots + self.num_state_snapshots + self.num_state_backups, self.dtype,
                self.device)
            self.model.bind_state_caches(self.state_pools)

    @property
    def graphs_enabled(self) -> bool:
        """CUDA graphs are used on CUDA unless --enforce-eager (and where attention runs in Triton and the
        model's forward can be captured on this device and dtype)."""
        if self.device.type != "cuda" or self.config.enforce_eager or self.pooler is not None:
            return False  # (--runner pooling: prefill steps, run eagerly)
        if self.state_specs:
            if not getattr(self, "_warned_graphs", False):
                self._warned_graphs = True
                logger.info("CUDA graphs are off for %s: %s; steps run eagerly", self.model_config.architecture,
                            self.model.cuda_graph_blocker)
            return False
        if self.parallel is not None and self.parallel.pp > 1 and not self.config.tuning.pp_graphs:
            # (Each stage's layers replay graphs by default: on two H200s they took PP=2 batch-1 decode from
            #  63 to 175 tok/s with equal greedy tokens; --tuning pp_graphs=0 runs stages eagerly.)
            if not getattr(self, "_warned_graphs", False):
                self._warned_graphs = True
                logger.warning("CUDA graphs are off with pipeline parallelism (--tuning pp_graphs=0); steps run "
                               "eagerly")
            return False
        from atlas.kernels import triton_available

        if not self.model.supports_cuda_graphs(self.dtype, self.device):
            if not getattr(self, "_warned_graphs", False):
                self._warned_graphs = True
                logger.warning("CUDA graphs are off: %s cannot be captured in %s on this GPU (%s); steps run eagerly",
                               self.model_config.architecture, str(self.dtype).replace("torch.", ""),
                               self.model.cuda_graph_blocker)
            return False
        return triton_available()

    def graph_memory_estimate(self, max_num_seqs: int, q_lens: list[int]) -> int:
        """Device memory of the step graphs' pools (one for each query length, one for the mixed steps)."""
        if not self.graphs_enabled:
            return 0
        cfg, size = self.model_config, self.dtype.itemsize
        hidden, vocab = cfg.hidden_size, cfg.vocab_size
        width = len(self.capture_layers) * hidden
        # Each set of graphs writes its logits into one buffer for its largest step (_logits_buffer), and keeps
        # the argmax and captured rows of every row of every captured size.
        kept_row = width * size + 8
        total = sum(max_num_seqs * q * vocab * size
                    + uniform_graph_bytes(max_num_seqs, q, hidden, cfg.intermediate_size, self.dtype, vocab, kept_row)
                    for q in q_lens)
        if self.mixed_graph_tokens:  # (sampled rows' argmax, every row's captured row)
            sizes = mixed_token_sizes(self.mixed_graph_tokens)
            sampled = max_num_seqs * max(q_lens)
            kept = sum(min(t, sampled) * 8 + t * width * size for t in sizes)
            total += min(sizes[-1], sampled) * vocab * size + graph_pool_bytes(
                sizes[-1], hidden, cfg.intermediate_size, self.dtype, min(sizes[-1], sampled), vocab, kept)
        return total

    @property
    def mixed_graph_tokens(self) -> int:
        """The largest mixed step replayed from a CUDA graph (0: none). --tuning mixed_graphs=0 runs them
        eagerly; one device only (a parallel engine's ranks run their mixed steps eagerly)."""
        if self.parallel is not None or not self.config.tuning.mixed_graphs:
            return 0
        return min(MIXED_GRAPH_MAX_TOKENS, self.max_num_batched_tokens)

    def _logits_buffer(self, rows: int) -> torch.Tensor:
        """Where a set of graphs writes its logits, every captured size into the head of the same rows: a
        graph's outputs stay in its pool, so logits of each size's own would keep the sum of all sizes' rows
        (4.9 times the largest step's on the decode ladder) alive. The outputs of a step are read before the
        next step of the same set runs, as they were when each size had its own."""
        return torch.empty(rows, self.model_config.vocab_size, dtype=self.dtype, device=self.device)

    def _graphed_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                         logits_out: torch.Tensor):
        """A uniform step inside a graph: every row is scored, and greedy rows need nothing more than
        the argmax taken here."""
        hidden, captured = self.model(input_ids, positions, self.kv_caches, meta, self.capture_layers)
        logits = self.model.compute_logits(hidden, out=logits_out[: hidden.shape[0]])
        return logits.argmax(-1), logits, captured

    def _mixed_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                       sample_idx: torch.Tensor, logits_out: torch.Tensor):
        """A mixed step inside a graph: logits for the sampled rows only (sample_idx, padded with row 0)."""
        hidden, captured = self.model(input_ids, positions, self.kv_caches, meta, self.capture_layers)
        logits = self.model.compute_logits(hidden[sample_idx], out=logits_out[: sample_idx.numel()])
        return logits.argmax(-1), logits, captured

    def _stage_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata):
        """Pipeline parallelism, a uniform step inside a graph: this stage's layers, from the static copy of
        the previous stage's [x | residual] on a later stage. Rows first, as StepGraphs slices its outputs:
        a stage that is not the last returns [rows, 2, hidden] (a view of its [2, rows, hidden])."""
        stage_in = None if self.parallel.is_first_stage else self._stage_in[:, : input_ids.shape[0]]
        out, captured = self.model(input_ids, positions, self.kv_caches, meta, self.capture_layers,
                                   intermediate=stage_in)
        out = out if self.parallel.is_last_stage else out.transpose(0, 1)
        # (With a drafter, the residual streams of this stage's capture layers too: [rows, n * hidden].)
        return (out,) if captured is None else (out, captured)

    def capture_step_graphs(self, max_num_seqs: int, q_lens: list[int], use_graphs: bool | None = None) -> None:
        """Graphs of the target forward for uniform steps of each query length in q_lens (1 = decode,
        1 + K = speculative verify); under pipeline parallelism, of this stage's layers. use_graphs=False
        builds the same static-buffer path without capturing (for testing it on CPU; the static_steps tuning
        knob does that on every rank of an engine where graphs are off)."""
        if self.state_specs:  # (no graphs, nor their static buffers: see graphs_enabled)
            return
        if use_graphs is None:
            if self.graphs_enabled:
                use_graphs = True
            elif self.config.tuning.static_steps:
                use_graphs = False
            else:
                return
        max_pages = self.max_pages_per_seq
        staged = self.parallel is not None and self.parallel.pp > 1
        if staged and not self.parallel.is_first_stage:
            self._stage_in = torch.zeros(2, max_num_seqs * max(q_lens), self.model_config.hidden_size,
                                         dtype=self.dtype, device=self.device)
        for q in q_lens:
            logits_out = None if staged else self._logits_buffer(max_num_seqs * q)
            forward = self._stage_forward if staged else functools.partial(self._graphed_forward,
                                                                           logits_out=logits_out)
            graphs = StepGraphs("target" if not staged else "stage", forward, q, self.attention, self.scratch_pages,
                                max_pages, max_num_seqs, self.device, use_graphs=use_graphs)
            graphs.capture()
            graphs.captured_mib += _mib(logits_out)  # (the graphs' share of the memory plan counts it)
            self.step_graphs[q] = graphs
        if self.mixed_graph_tokens and not staged:
            sampled = max_num_seqs * max(q_lens)
            logits_out = self._logits_buffer(min(mixed_token_sizes(self.mixed_graph_tokens)[-1], sampled))
            self.mixed_graphs = MixedStepGraphs(
                functools.partial(self._mixed_forward, logits_out=logits_out), self.attention, self.scratch_pages,
                max_pages, max_num_seqs, self.mixed_graph_tokens, sampled, self.device, use_graphs=use_graphs)
            self.mixed_graphs.capture()
            self.mixed_graphs.captured_mib += _mib(logits_out)

    def make_graphs(self, name: str, forward, q_len: int, attention: AttentionBackend, max_pages_per_seq: int,
                    use_graphs: bool) -> StepGraphs:
        """Static buffers (and CUDA graphs when use_graphs) for a forward over uniform q_len-token steps of
        up to max-num-seqs sequences of `attention`'s caches, padded into the scratch pages; capture() them
        before use."""
        return StepGraphs(name, forward, q_len, attention, self.scratch_pages, max_pages_per_seq,
                          self.config.max_num_seqs, self.device, use_graphs=use_graphs)

    def release_graphs(self) -> None:
        """Before a parallel engine leaves its process groups: the device idle, the step graphs dropped.
        NCCL communicators whose collectives are captured in live graphs can hang when they are torn down
        (pytorch/pytorch#115388)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        for graphs in self.step_graphs.values():
            graphs.release()
        self.step_graphs.clear()
        if self.mixed_graphs is not None:
            self.mixed_graphs.release()
            self.mixed_graphs = None

    def prepare_full_vocab(self, with_head: bool = True) -> None:
        """Under tensor parallelism, whole copies of the embedding and (with_head) the LM head for a drafter
        on the driver, which drafts alone (the model's are vocabulary shards whose outputs need collectives
        the workers would have to join); nothing to do otherwise. Before the memory plan, which counts them."""
        if self.parallel is not None and self.parallel.tp > 1 and self._full_vocab is None:
            self._full_vocab = load_full_vocab(self.model_config, self.model, self.device, self.dtype, with_head,
                                               dummy=self.config.dummy_weights)

    def proposer_context(self) -> ProposerContext:
        """What a proposer may use of the target and the runtime (with the whole embedding and LM head once
        prepare_full_vocab has run)."""
        model = self.model
        embed, compute_logits = model.embed, model.compute_logits
        head = getattr(model, "lm_head", None)
        if self._full_vocab is not None:
            embed, head = self._full_vocab
            compute_logits = head if head is not None else _no_whole_head
        return ProposerContext(
            target_config=self.model_config, embed=embed, compute_logits=compute_logits,
            device=self.device, dtype=self.dtype, max_model_len=self.max_model_len, block_size=self.block_size,
            max_num_seqs=self.config.max_num_seqs, graphs_enabled=self.graphs_enabled, make_graphs=self.make_graphs,
            scratch_pages=list(self.scratch_pages), build_mtp=getattr(model, "build_mtp", None),
            num_mtp_modules=getattr(model, "num_mtp_modules", 0),
            whole_embedding=None if self._full_vocab is None else self._full_vocab[0],
            head_rows=getattr(head, "weight_rows", None))

    @property
    def max_pages_per_seq(self) -> int:
        # (+ lookahead rows: a request near the end of its context may still carry drafts)
        return -(-(self.max_model_len + 64) // self.block_size)

    # ------------------------------------------------------------------ inputs
    def prepare_inputs(self, batch: StepBatch) -> StepInputs:
        if self.inputs is None:
            self.inputs = InputPreparer(self.max_num_batched_tokens, self.config.max_num_seqs,
                                        self.max_pages_per_seq, self.attention, self.device)
        behind, self._block_behind = self._block_behind, None
        if behind is not None:  # (the verify step of the block queued behind the last one: its inputs are there)
            inputs = self.inputs.prepare_behind(batch, *behind)
            if inputs is not None:
                self.steps_behind += 1
                return inputs
        inputs = self.inputs.prepare(batch)
        if self.state_specs:
            slots = list(batch.state_slots)
            if len(slots) != batch.num_seqs or any(s is None or not 0 <= s < self.num_state_slots for s in slots):
                raise RuntimeError(f"a step of a model with recurrent state needs a state slot per sequence, got "
                                   f"{slots}")
            inputs.meta.state_slots_cpu = slots
            inputs.meta.state_slots = to_device(slots, torch.long, self.device)
            # (a prefix hit resumes from the snapshot at its end: loaded before this step's forward reads the slot)
            base = self.num_state_slots
            self.copy_states([(base + snap, slot) for snap, slot in batch.state_loads])
            # (speculative decoding: a slot whose last verify step rejected drafts resumes from before that step; a
            #  slot that verifies drafts now is backed up first)
            self.copy_states([(self._backup_slot(slot), slot) for slot in batch.state_restores])
            self.copy_states([(slot, self._backup_slot(slot)) for slot in batch.state_backups])
        return inputs

    @staticmethod
    def sampling_row(seq, offset: int, num_outputs: int, generator: torch.Generator | None = None,
                     drafts: list[int] | None = None) -> SamplingRow:
        """The sampler's view of row `offset` of a sequence that has num_outputs output tokens before it (`drafts`:
        its drafts' values when they were read back from the device)."""
        p = seq.params
        drafts = seq.spec_token_ids if drafts is None else drafts
        outputs = seq.output_token_ids + drafts[:offset] if offset else seq.output_token_ids
        banned = seq.stop_token_ids if num_outputs + offset < p.min_tokens else []
        return SamplingRow(
            temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, min_p=p.min_p,
            repetition_penalty=p.repetition_penalty, presence_penalty=p.presence_penalty,
            frequency_penalty=p.frequency_penalty, generator=generator, num_logprobs=p.logprobs,
            prompt_token_ids=seq.prompt_token_ids, output_token_ids=outputs, banned_token_ids=banned,
            logit_bias=p.logit_bias)

    # ------------------------------------------------------------------ hidden-state capture
    def install_capture(self, layers: tuple[int, ...], rows: int, min_rows: int, allocator=torch.empty) -> None:
        """Capture the residual stream after `layers` into a buffer of `rows` rows (see HiddenCapture)."""
        self.capture_layers = tuple(layers)
        self.capture = HiddenCapture(self.capture_layers, self.model_config.hidden_size, rows, min_rows,
                                     self.dtype, self.device, allocator)

    def _keep_captured_rows(self, batch: StepBatch, inputs: StepInputs
                            ) -> tuple[torch.Tensor | int, list[tuple[int, int]], list[int]]:
        """Which rows of this step go into the capture buffer: all rows of decodes and verifies, and as
        many of the last rows of each prefill chunk as the buffer (and the prefill switch) allow.
        -> (flat row ids, or how many of the first rows when they are all kept in order; per sequence (offset in
        buffer, count); the sequences in buffer order)."""
        cap = self.capture
        space = cap.rows
        qsl = inputs.meta.query_start_loc_cpu
        is_prefill = [batch.num_sample_rows[i] != batch.num_scheduled[i] and not batch.num_draft_rows[i]
                      and batch.num_scheduled[i] > 1 for i in range(batch.num_seqs)]
        placed: list[tuple[int, int]] = [(0, 0)] * batch.num_seqs
        if not any(is_prefill) and qsl[-1] <= space:  # (decodes and verifies: every row, as they lie)
            return qsl[-1], [(qsl[i], qsl[i + 1] - qsl[i]) for i in range(batch.num_seqs)], list(range(batch.num_seqs))
        order = sorted(range(batch.num_seqs), key=lambda i: is_prefill[i])
        chunks: list[range] = []
        offset = 0
        for i in order:  # decode / verify sequences first: their rows always fit
            n = batch.num_scheduled[i]
            take = min(n, space - offset) if (not is_prefill[i] or cap.prefill_enabled) else 0
            if take > 0:
                chunks.append(range(qsl[i + 1] - take, qsl[i + 1]))
                placed[i] = (offset, take)
                offset += take
        rows = [r for c in chunks for r in c]
        return torch.tensor(rows, dtype=torch.long).to(self.device, non_blocking=True), placed, order

    # ------------------------------------------------------------------ prompt logprobs
    @staticmethod
    def _prompt_logprob_plan(batch: StepBatch) -> tuple[list[int], list[int], list[tuple[int, int]], int]:
        """For sequences with prompt_logprobs: at each prompt position p computed now (and not before),
        the flat row, the prompt token p + 1 it scores, (sequence, p), and the top-k wanted."""
        rows: list[int] = []
        targets: list[int] = []
        where: list[tuple[int, int]] = []
        first_row = 0
        for i, seq in enumerate(batch.seqs):
            start, n = batch.start[i], batch.num_scheduled[i]
            if seq.prompt_logprobs is not None:
                first = max(start, len(seq.prompt_logprobs) - 1)  # positions already scored are skipped
                last = min(start + n, len(seq.prompt_token_ids) - 1)
                for p in range(first, last):
                    rows.append(first_row + p - start)
                    targets.append(seq.prompt_token_ids[p + 1])
                    where.append((i, p))
            first_row += n
        top_k = max((batch.seqs[i].params.prompt_logprobs for i, _ in where), default=0)
        return rows, targets, where, top_k

    def _prompt_logprobs(self, hidden: torch.Tensor, plan) -> tuple[list[tuple[int, int]], list[TokenLogprobs]] | None:
        """The plan's logprobs, queued on the device: logits are made a bounded number of rows at a time,
        since a prefill chunk can be thousands of rows. -> ((sequence, position) per row, device results
        per chunk), or None. (A parallel worker's plan has rows only: it makes their logits, an all-gather,
        with the driver.)"""
        rows, targets, where, top_k = plan
        if not rows:
            return None
        chunks = []
        for c in range(0, len(rows), _LOGITS_ROWS_PER_CHUNK):
            index = to_device(rows[c: c + _LOGITS_ROWS_PER_CHUNK], torch.long, self.device)
            logits = self.model.compute_logits(hidden[index])
            if targets is not None:
                tokens = to_device(targets[c: c + _LOGITS_ROWS_PER_CHUNK], torch.long, self.device)
                chunks.append(_to_host(gather_logprobs(logits, tokens, top_k)))
        return (where, chunks) if targets is not None else None

    @staticmethod
    def _prompt_logprob_lists(batch: StepBatch, pending) -> list:
        out: list = [None] * batch.num_seqs
        if pending is None:
            return out
        where, chunks = pending
        for i, seq in enumerate(batch.seqs):
            if seq.prompt_logprobs is not None:
                out[i] = []
        e = 0
        for lp in chunks:
            values, ranks = lp.logprobs.tolist(), lp.ranks.tolist()
            top_ids = lp.top_token_ids.tolist() if lp.top_token_ids is not None else None
            top_lp = lp.top_logprobs.tolist() if lp.top_logprobs is not None else None
            for c in range(len(values)):
                i, p = where[e]
                k = batch.seqs[i].params.prompt_logprobs
                top = list(zip(top_ids[c][:k], top_lp[c][:k], strict=True)) if k and top_ids else []
                out[i].append((p, values[c], ranks[c], top))
                e += 1
        return out

    # ------------------------------------------------------------------ execution
    def execute(self, batch: StepBatch) -> StepResult:
        """Run one step and wait for it."""
        return self.launch(batch).result()

    @torch.inference_mode()
    def launch(self, batch: StepBatch) -> StepHandle:
        """Queue the whole step on the device and return without waiting for it. Under tensor or pipeline
        parallelism every rank launches each step: the driver sends it to the workers first."""
        par = self.parallel
        self.requests.bind(batch)
        plan = info = None  # (one device: the prompt-logprob plan is made when there are rows to score)
        if par is not None:
            plan = self._prompt_logprob_plan(batch) if par.is_driver else None
            info = par.begin_step(batch, plan[0] if plan is not None else [], self.share_samples)
            if plan is None:  # a worker: only the rows (it makes their logits with the driver)
                plan = (info.prompt_rows, None, None, 0)
        inputs = self.prepare_inputs(batch)
        if self.pooler is not None:
            return self._launch_pooling(batch, inputs)
        if par is not None and par.pp > 1:
            return self._launch_stage(batch, inputs, plan, info)
        meta = inputs.meta
        graphs = self.step_graphs.get(meta.max_query_len)
        hidden = None
        verified = None
        pre, self._prelaunched = self._prelaunched, None
        if graphs is not None and graphs.can_run(meta):
            if pre is not None and pre.graphs is graphs and pre.matches(batch):
                # This step already ran on the device, queued behind the last drafter block: its outputs stand.
                greedy, logits, captured = pre.outputs
                self.prelaunches_adopted += 1
            else:
                pre = None
                greedy, logits, captured = graphs.run(inputs.input_ids, inputs.positions, meta)
            if self.draft_after_verify is not None and graphs.q > 1:
                verified = self._verified_step(batch, inputs, greedy, captured, graphs, pre)
            if not inputs.all_rows_sampled:
                greedy, logits = greedy[inputs.sample_rows], logits[inputs.sample_rows]
        elif self._mixed_graph_fits(batch, inputs):
            greedy, logits, captured = self.mixed_graphs.run(inputs.input_ids, inputs.positions, meta,
                                                             inputs.sample_rows, inputs.num_sample_rows)
            if not inputs.num_sample_rows:
                greedy = logits = None
        else:
            hidden, captured = self.model(inputs.input_ids, inputs.positions, self.kv_caches, meta,
                                          self.capture_layers)
            logits = self.model.compute_logits(hidden[inputs.sample_rows]) if inputs.num_sample_rows else None
            greedy = logits.argmax(-1) if logits is not None else None
        if batch.state_saves:  # (states at the end of a prompt page, kept for the prefix cache)
            self.copy_states([(slot, self.num_state_slots + snap) for slot, snap in batch.state_saves])
        if verified is not None and self.takes_captured_rows is not None and self.takes_captured_rows(verified):
            captured = None  # (the block queued behind the step reads them; nothing keeps them for a commit)
        elif batch.plain_speculation and self.context_behind is not None and captured is not None:
            rows = meta.slot_mapping.shape[0]  # (the step's own rows: graph outputs carry padding after them)
            self.context_behind(captured[:rows], inputs.positions[:rows], meta.slot_mapping)
            captured = None
        handle = self._sample(batch, inputs, greedy, logits, captured, hidden, plan, info)
        if verified is not None:  # (behind the step's read-back, which the host waits for alone)
            following = self.draft_after_verify(verified)
            if following is not None:
                self._block_behind = (following, list(batch.seqs))
            if following is not None and self.prelaunch_allowed is not None and self.prelaunch_allowed(batch):
                self._prelaunch(graphs, batch, verified, following)
        return handle

    def _launch_pooling(self, batch: StepBatch, inputs: StepInputs) -> StepHandle:
        """--runner pooling: the forward (eagerly), then the pooled vector of each sequence whose prompt ends in
        this step; nothing is sampled."""
        hidden, _ = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta)
        pooled = self.pooler(hidden, batch.seqs, batch.start, batch.num_scheduled)
        index = [i for i, v in enumerate(pooled) if v is not None]
        host = torch.stack([pooled[i] for i in index]).to("cpu", non_blocking=True) if index else None
        done = None
        if self.device.type == "cuda":
            done = torch.cuda.Event()
            done.record()
        n = batch.num_seqs

        def finish() -> StepResult:
            if done is not None:
                done.synchronize()
            vectors: list[list[float] | None] = [None] * n
            if host is not None:
                for i, row in zip(index, host.tolist(), strict=True):
                    vectors[i] = row
            return StepResult([[] for _ in range(n)], [None] * n, [None] * n, [None] * n, vectors)

        return StepHandle(finish)

    def _mixed_graph_fits(self, batch: StepBatch, inputs: StepInputs) -> bool:
        """A step the mixed-step graphs can replay: small enough, and no prompt logprobs (they need every
        row's hidden state, which the graph does not keep)."""
        mixed = self.mixed_graphs
        return (mixed is not None and mixed.can_run(inputs.meta, inputs.num_sample_rows)
                and not batch.wants_prompt_logprobs)

    def _verified_step(self, batch: StepBatch, inputs: StepInputs, greedy, captured, graphs: StepGraphs,
                       pre: _Prelaunched | None = None) -> VerifiedStep | None:
        """A verify step whose accepted drafts the device can tell: every request greedy without logits
        processors or grammars, one-hot drafts, none of its input on the device from an earlier step. A step
        adopted from a pre-launch (`pre`) gives the ids and positions it ran with."""
        if self.parallel is not None or batch.token_masks is not None or batch.masks_deferred:
            return None
        q = inputs.meta.max_query_len
        plain = batch.plain_greedy
        for i in range(batch.num_seqs):
            if (batch.num_draft_rows[i] != q - 1 or batch.pending_input[i] or i in batch.draft_probs
                    or not plain[i]):
                return None
        meta = inputs.meta
        ids, positions = (pre.input_ids, pre.positions) if pre is not None else (inputs.input_ids, inputs.positions)
        # (A pre-launched step ran on the page tables of the step before it: the graphs' static tables are not
        #  this step's.)
        return VerifiedStep(batch.seqs, batch.start, batch.num_drafts, ids, positions, greedy, captured,
                            meta.slot_mapping, meta.block_tables, graphs if pre is None else None)

    def _prelaunch(self, graphs: StepGraphs, batch: StepBatch, verified: VerifiedStep, following: NextVerify) -> None:
        """Queue the verify step that follows a drafted block right behind it, from the block's ids, positions,
        slots and lengths on the device (its pages are the ones the step before reserved), before the host has
        read anything back. The next launch adopts its outputs if it schedules that very step (the same requests,
        each verifying the drafts of this block); otherwise they are dropped, and the rows it wrote to the
        cache, past every committed position, are written again before anything reads them."""
        meta = graphs.device_step_meta(following.seq_lens, verified.block_tables, following.slot_mapping,
                                       batch.start)
        ids = following.input_ids
        outputs = graphs.run(ids, following.positions, meta)
        self._prelaunched = _Prelaunched(graphs, list(batch.seqs), following.drafts, ids, following.positions,
                                         outputs)
        self.prelaunches += 1

    @functools.cached_property
    def stage_captures(self) -> list[list[int]]:
        """For each pipeline stage, the capture layers among its layers, in capture_layers' order (read at
        the first step: the engine sets capture_layers before any)."""
        total, pp = self.model_config.num_hidden_layers, self.parallel.pp
        spans = [split_evenly(total, pp, j) for j in range(pp)]
        return [[i for i in self.capture_layers if first <= i < first + count] for first, count in spans]

    def _launch_stage(self, batch: StepBatch, inputs: StepInputs, plan, info) -> StepHandle:
        """Pipeline parallelism: this stage's layers. A later stage starts from the previous stage's
        [x | residual]; the last one sends the rows that need logits (all rows when prompt logprobs are
        wanted) back to the first stage, which makes the logits and samples when the step is finished.
        With a drafter that reads captured layers, stage s >= 1 appends its layers' residual streams (one
        [rows, hidden] slab a layer) to what it sends on, and the last stage sends all those slabs to the
        first, which puts them beside its own in capture_layers' order (graphed steps return them too)."""
        par = self.parallel
        rows_total, width = inputs.input_ids.shape[0], self.model_config.hidden_size
        per_stage = self.stage_captures
        stage = par.pp_rank
        carried = sum(len(c) for c in per_stage[1:stage])  # slabs the previous stage sends on
        stage_in = carried_slabs = None
        if not par.is_first_stage:
            stage_in = par.receive_previous((2 + carried, rows_total, width), self.dtype, self.device)
            stage_in, carried_slabs = stage_in[:2], stage_in[2:]
        graphs = self.step_graphs.get(inputs.meta.max_query_len)
        captured = None
        if graphs is not None and graphs.can_run(inputs.meta):
            if stage_in is not None:
                self._stage_in[:, :rows_total].copy_(stage_in)
            out, *rest = graphs.run(inputs.input_ids, inputs.positions, inputs.meta)
            # Copies: the next replay rewrites the graph's outputs while this step's send may still read them,
            # and the first stage reads its captured rows only when the step finishes.
            out = out.clone() if par.is_last_stage else out.transpose(0, 1).contiguous()
            captured = rest[0].clone() if rest else None
        else:
            out, captured = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta,
                                       self.capture_layers, intermediate=stage_in)
        if batch.state_saves:  # (this stage's layers' states at the end of a prompt page: ModelRunner.launch)
            self.copy_states([(slot, self.num_state_slots + snap) for slot, snap in batch.state_saves])
        slabs = None
        if not par.is_first_stage and (carried or per_stage[stage]):
            own = (captured.view(rows_total, len(per_stage[stage]), width).transpose(0, 1)
                   if per_stage[stage] else carried_slabs[:0])
            slabs = torch.cat([carried_slabs, own])
        all_rows = bool(plan[0])
        if not par.is_last_stage:
            par.send_next(out if slabs is None else torch.cat([out, slabs]))
        else:
            if all_rows or inputs.num_sample_rows:
                par.send_to_first(out if all_rows else out[inputs.sample_rows])
            if slabs is not None:
                par.send_to_first(slabs.contiguous())
        if not par.is_first_stage:
            return StepHandle(lambda: _NO_RESULT)
        later = [i for c in per_stage[1:] for i in c]  # the layers of the slabs the last stage sends back

        @torch.inference_mode()
        def finish() -> StepResult:
            if par.is_driver:
                par.announce_finish(info)
            n = rows_total if all_rows else inputs.num_sample_rows
            rows = par.receive_from_last((n, width), self.dtype, self.device) if n else None
            step_captured = captured
            if later:
                back = par.receive_from_last((len(later), rows_total, width), self.dtype, self.device)
                by_layer = dict(zip(later, back.unbind(0), strict=True))
                if captured is not None:
                    by_layer.update(zip(per_stage[0], captured.view(rows_total, -1, width).unbind(1), strict=True))
                step_captured = torch.cat([by_layer[i] for i in self.capture_layers], dim=-1)
            hidden = rows if all_rows else None
            logits = greedy = None
            if inputs.num_sample_rows:
                logits = self.model.compute_logits(rows[inputs.sample_rows] if all_rows else rows)
                greedy = logits.argmax(-1)
            return self._sample(batch, inputs, greedy, logits, step_captured, hidden, plan, info).result()

        if par.is_driver:
            return self._tracked(StepHandle(finish), info)
        par.defer(info.number, finish)  # a first-stage worker: when the driver finishes the step
        return StepHandle(lambda: _NO_RESULT)

    def _sample(self, batch: StepBatch, inputs: StepInputs, greedy, logits, captured, hidden, plan, info
                ) -> StepHandle:
        """After the forward: captured rows, prompt logprobs, sampling, copies back. Sampling happens on
        the driver only; its tensor-parallel peers make the same logits (all-gathers) and, when the next
        step may read its input tokens on the device, receive the sampled ids."""
        par = self.parallel
        driver = par is None or par.is_driver
        hidden_views: list[torch.Tensor | None] = [None] * batch.num_seqs
        if captured is not None and self.capture is not None:
            keep, placed, order = self._keep_captured_rows(batch, inputs)
            stored = self.capture.store(captured, keep)
            # (one split for every sequence's view: a slicing a sequence costs the host more)
            for i, view in zip(order, stored.split([placed[i][1] for i in order]), strict=True):
                if placed[i][1]:
                    hidden_views[i] = view
        prompt_lp = None
        if hidden is not None:
            prompt_lp = self._prompt_logprobs(hidden, plan if plan is not None else self._prompt_logprob_plan(batch))
        if batch.masks_deferred and driver and par is None:
            def sample(masks) -> StepHandle:
                batch.token_masks = masks
                return self._sample_tokens(batch, inputs, greedy, logits, hidden_views, prompt_lp, info)

            return StepHandle(lambda: _NO_RESULT, sample)
        return self._sample_tokens(batch, inputs, greedy, logits, hidden_views, prompt_lp, info)

    def _sample_tokens(self, batch: StepBatch, inputs: StepInputs, greedy, logits, hidden_views, prompt_lp, info
                       ) -> StepHandle:
        """Sampling (under the step's grammar masks), logprobs, the copies back."""
        par = self.parallel
        driver = par is None or par.is_driver
        seqs = batch.seqs
        owner, offset = inputs.sample_owner, inputs.sample_offset
        rows: list[SamplingRow] | None = None
        tokens = greedy
        target_probs = None
        logprobs = None
        draft_values: dict[int, list[int]] = {}  # (drafts left on the device, once read back: their values)
        if inputs.num_sample_rows and driver:
            masks = batch.token_masks
            constrained = masks.seqs if masks is not None else frozenset()
            plain = [p and i not in constrained for i, p in enumerate(batch.plain_greedy)]
            if not all(p for p, m in zip(plain, batch.num_sample_rows, strict=True) if m):  # (rows' owners)
                for i in batch.device_drafts:  # (penalties count the drafts before a row: their values)
                    if seqs[i].params.needs_penalties and i in batch.draft_tokens:
                        device, placeholders = batch.draft_tokens.pop(i), seqs[i].spec_token_ids
                        n = min(len(placeholders), device.shape[0])
                        draft_values[i] = device[:n].tolist() + placeholders[n:]
                gens = batch.generators
                rows = [self.sampling_row(seqs[i], j, batch.num_output_tokens[i], gens[i] if gens else None,
                                          draft_values.get(i)) for i, j in zip(owner, offset, strict=True)]
                device_masks = None
                if masks is not None:  # grammar rows leave the argmax fast path for the masked logits
                    every_row = masks.rows == list(range(len(owner)))
                    device_masks = (to_device_tensor(masks.bitmask, self.device),
                                    None if every_row else to_device(masks.rows, torch.long, self.device))
                tokens = self.sampler(logits.float(), rows, device_masks)
                if any(batch.num_drafts[i] for i in batch.draft_probs):
                    target_probs = self.sampler.probabilities(logits.float(), rows, device_masks)
            wanted = [seqs[i].params.logprobs for i in owner]
            if any(k is not None for k in wanted):
                top_k = max(k for k in wanted if k is not None)
                logprobs = gather_logprobs(logits, tokens, top_k)
        if inputs.num_sample_rows and info is not None and info.share_samples:
            tokens = par.share_samples(tokens if driver else torch.empty(inputs.num_sample_rows, dtype=torch.long,
                                                                          device=self.device))
        if inputs.num_sample_rows and self.inputs is not None:
            self.inputs.remember_samples(batch, tokens, owner)
        if not driver:
            return StepHandle(lambda: _NO_RESULT)
        tokens_host = tokens.to("cpu", non_blocking=True) if tokens is not None else None
        # Drafts left on the device come back with the results, for the acceptance on the host.
        on_device = [i for i in batch.device_drafts if i in batch.draft_tokens]  # (not read yet)
        drafts_host = None
        if on_device:
            drafts_host = flat_device_drafts([batch.draft_tokens[i] for i in on_device],
                                             [batch.num_drafts[i] for i in on_device]).to("cpu", non_blocking=True)
        logprobs_host = _to_host(logprobs) if logprobs is not None else None
        done = None
        if self.device.type == "cuda":
            done = torch.cuda.Event()
            done.record()

        def finish() -> StepResult:
            if done is not None:
                if par is not None:
                    par.wait_event(done)  # (gives up if a worker fails meanwhile)
                else:
                    done.synchronize()
            if drafts_host is not None:
                draft_values.update(_read_back(batch, on_device, drafts_host.tolist()))
            return self._step_result(batch, inputs, tokens_host, logits, rows, target_probs, logprobs_host,
                                     hidden_views, prompt_lp, draft_values)

        handle = StepHandle(finish)
        return self._tracked(handle, info) if par is not None and par.pp == 1 else handle

    def _tracked(self, handle: StepHandle, info) -> StepHandle:
        """The driver's handle of a parallel step: reading it back ends the step's clock (the watchdog's)."""
        par = self.parallel

        def finish() -> StepResult:
            result = handle.result()
            par.end_step(info)
            return result

        return StepHandle(finish)

    def _step_result(self, batch: StepBatch, inputs: StepInputs, tokens_host, logits, rows, target_probs,
                     logprobs_host, hidden_views, prompt_lp, draft_values: dict[int, list[int]]) -> StepResult:
        n_seqs = batch.num_seqs
        result = StepResult([[] for _ in range(n_seqs)], [None] * n_seqs, hidden_views,
                            self._prompt_logprob_lists(batch, prompt_lp))
        if tokens_host is None:
            return result
        tokens = tokens_host.tolist()
        owner = inputs.sample_owner
        first_row: dict[int, int] = {}
        for r, i in enumerate(owner):
            first_row.setdefault(i, r)
        emitted_rows: list[int] = []
        emitted_tokens: list[int] = []
        for i, r0 in first_row.items():
            seq = batch.seqs[i]
            m = batch.num_sample_rows[i]
            drafts = draft_values.get(i, seq.spec_token_ids)[: batch.num_drafts[i]]
            probs = batch.draft_probs.get(i)
            if not drafts:
                emitted = [tokens[r0]]
            elif probs is None:
                emitted = accept_one_hot(drafts, tokens[r0: r0 + m])
            else:
                emitted = accept_with_probs(drafts, target_probs[r0: r0 + m], probs[: m - 1], tokens[r0 + m - 1],
                                            batch.generators[i] if batch.generators else None)
            result.sampled_token_ids[i] = emitted
            emitted_rows.extend(range(r0, r0 + len(emitted)))
            emitted_tokens.extend(emitted)
        if logprobs_host is None:
            return result
        if emitted_tokens != [tokens[r] for r in emitted_rows]:
            # Rejection sampling emitted tokens other than the target's samples: score those (rare).
            index = to_device(emitted_rows, torch.long, logits.device)
            top_k = logprobs_host.top_token_ids.shape[1] if logprobs_host.top_token_ids is not None else 0
            chosen = to_device(emitted_tokens, torch.long, logits.device)
            full = _to_host(gather_logprobs(logits[index], chosen, top_k))
            picks = list(range(len(emitted_rows)))
        else:
            full, picks = logprobs_host, emitted_rows
        values, ranks = full.logprobs.tolist(), full.ranks.tolist()
        top_ids = full.top_token_ids.tolist() if full.top_token_ids is not None else None
        top_lp = full.top_logprobs.tolist() if full.top_logprobs is not None else None
        for e, r in enumerate(emitted_rows):
            i = owner[r]
            k = batch.seqs[i].params.logprobs
            if k is None:
                continue
            c = picks[e]
            top = list(zip(top_ids[c][:k], top_lp[c][:k], strict=True)) if k and top_ids else []
            if result.logprobs[i] is None:
                result.logprobs[i] = []
            result.logprobs[i].append((values[c], ranks[c], top))
        return result


@dataclasses.dataclass
class _Prelaunched:
    """A verify step queued behind a drafted block before the host scheduled it (ModelRunner._prelaunch)."""

    graphs: StepGraphs
    seqs: list  # the requests it verifies, in order
    drafts: torch.Tensor  # [n, K] the block's drafts, which it verifies
    input_ids: torch.Tensor  # [n * q]
    positions: torch.Tensor  # [n * q]
    outputs: tuple  # (greedy, logits, captured) of its rows

    def matches(self, batch: StepBatch) -> bool:
        """Whether `batch` is this very step: the same requests in the same order, each verifying this block's
        drafts (left on the device, handed out by the proposer from this block) after its one known token.
        Drafts the host cut (grammar, length) are a prefix of the block's; the rows after them are padding whose
        outputs are not read."""
        q = self.drafts.shape[1] + 1
        if len(batch.seqs) != len(self.seqs) or any(a is not b for a, b in zip(batch.seqs, self.seqs, strict=True)):
            return False
        on_device = set(batch.device_drafts)
        for i in range(batch.num_seqs):
            drafts = batch.draft_tokens.get(i)
            if (batch.num_scheduled[i] != q or batch.num_draft_rows[i] != q - 1 or batch.pending_input[i]
                    or (batch.num_drafts[i] and (i not in on_device or drafts is None
                                                 or drafts.data_ptr() != self.drafts[i].data_ptr()))):
                return False
        return True


def _read_back(batch: StepBatch, on_device: list[int], values: list[int]) -> dict[int, list[int]]:
    """The drafts of sequences on_device, read back (flat, num_drafts each): each one's drafts with the values in
    place of their placeholders."""
    out, o = {}, 0
    for i in on_device:
        k = batch.num_drafts[i]
        placeholders = batch.seqs[i].spec_token_ids
        out[i] = values[o: o + k] + placeholders[k:]
        o += k
    return out


def _to_host(lp: TokenLogprobs) -> TokenLogprobs:
    """Queue the copy of logprob results to the host (read once the step's event has passed)."""
    def host(t):
        return t.to("cpu", non_blocking=True) if t is not None else None

    return TokenLogprobs(host(lp.logprobs), host(lp.ranks), host(lp.top_token_ids), host(lp.top_logprobs))
