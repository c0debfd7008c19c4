"""The model runner: owns the model, the KV cache tensors and the sampler, and turns each scheduler
decision (a StepBatch of host numbers) into one flat forward pass.

Every step, whatever it mixes (prefill chunks, decodes, verify rows), becomes token ids [T],
positions [T] and one AttentionMetadata; only the rows that need a next token reach the LM head.
`launch` queues the whole step on the device (inputs, forward, sampling, logprobs, copies back) and
returns at once; `StepHandle.result()` waits for it and turns it into host lists. Between the two the
engine does its host work, so the device never waits for the host.

The runner coordinates; each concern beside the forward dispatch has a module of its own: what happens to a
step after its forward (runtime/step_output.py), the CUDA graphs (runtime/graph_plan.py), the verify step queued
behind a drafted block (runtime/prelaunch.py), pipeline stages (runtime/stage_launch.py), the memory plan
(runtime/memory_planner.py) and the recurrent-state slots of hybrid models (runtime/state_slots.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from operator import attrgetter
from typing import TYPE_CHECKING

import torch

from atlas.config import MAX_DRAFT_TOKENS, EngineConfig, ModelConfig
from atlas.errors import ConfigError
from atlas.kernels import gemv
from atlas.kernels import settings as kernel_settings
from atlas.layers.attention_backend import AttentionBackend, attention_backend
from atlas.layers.embedding import linear_weights
from atlas.layers.lora import LoraSlots
from atlas.layers.moe import link_l2_prefetch
from atlas.models.base import CausalLM
from atlas.models.loader import build_model, load_full_vocab
from atlas.models.lora import (
    LoraAdapter,
    PlacedAdapter,
    adapter_leaves,
    attach_lora,
    place,
    read_adapter,
    write_slot,
)
from atlas.runtime import memory
from atlas.runtime.batch import StepBatch, StepResult
from atlas.runtime.capture import HiddenCapture
from atlas.runtime.cuda_graphs import graph_batch_sizes
from atlas.runtime.drafting import NextVerify, ProposerContext, VerifiedStep
from atlas.runtime.graph_plan import GraphPlan
from atlas.runtime.memory_planner import MemoryPlanner, PlannedModel, release_frames
from atlas.runtime.pooling import Pooler, PoolingConfig, load_pooling_config
from atlas.runtime.prelaunch import BlockBehind, Prelaunched, prelaunch, verified_step
from atlas.runtime.request_state import RequestStates
from atlas.runtime.request_tables import RequestTables
from atlas.runtime.sampler import Sampler
from atlas.runtime.stage_launch import StageLauncher
from atlas.runtime.state_slots import StateSlots
from atlas.runtime.step_inputs import InputPreparer, StepInputs
from atlas.runtime.step_output import PromptLogprobPlan, StepHandle, StepOutput, prompt_logprob_plan
from atlas.runtime.target_caches import TargetCaches

if TYPE_CHECKING:
    from atlas.runtime.parallel import ParallelState
    from atlas.runtime.parallel_protocol import StepInfo

logger = logging.getLogger(__name__)

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


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


def _part(path: str, doc: str) -> property:
    """A read-only attribute of the runner that one of its parts holds (`path`: "part.attribute")."""
    return property(attrgetter(path), doc=doc)


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
        # Each request's device state (its generator, drafts left on the device) and host tables (its page table, the
        # output tokens its penalties count), updated by the steps' deltas.
        self.requests = RequestStates(self.device)
        self.tables = RequestTables()
        # Models with KV cache groups (engine/kv_groups.py): how the windowed layers' pool grows (set_kv_cache_groups),
        # its page count (allocate_kv_cache) and the requests' tables there; None without.
        self.window_pool: memory.WindowPoolShape | None = None
        self.window_pages: int | None = None
        self.window_tables: RequestTables | None = None
        self.dtype = resolve_dtype(engine_config.dtype, model_config, self.device)
        self.block_size = engine_config.block_size
        self.max_model_len = max_model_len
        default_budget = 8192 if self.device.type == "cuda" else 2048
        self.max_num_batched_tokens = engine_config.max_num_batched_tokens or default_budget
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        # (on CUDA it measures the device now: what this engine adds is measured against that)
        self.memory_planner = MemoryPlanner(engine_config, model_config, self.device, self.dtype, self.block_size,
                                            max_model_len, parallel)
        # The element type of this model's KV caches (--kv-cache-dtype; drafters keep their own dtype), decided
        # from the constructed layers' cache specs before the checkpoint is read (a refusal costs no loading).
        self.kv_dtype = self.dtype

        # --runner pooling: pooled vectors of the final hidden states instead of logits (runtime/pooling.py).
        self.pooler: Pooler | None = None
        labels = model_config.classifier_labels
        if engine_config.runner == "pooling":
            self.pooler = Pooler(PoolingConfig.classifier() if labels else
                                 load_pooling_config(model_config.path, model_config.raw))
        elif labels:
            raise ConfigError(f"{model_config.architecture} is a sequence classifier ({len(labels)} classes): it "
                              "generates nothing; serve it with --runner pooling (POST /classify, LLM.classify)")

        def choose_kv_dtype(model: CausalLM) -> None:
            self.kv_dtype = attention_backend(model.kv_cache_specs(), engine_config.block_size,
                                              model.attention_program_heads()).cache_dtype(
                engine_config.kv_cache_dtype, self.dtype)
            if self.pooler is not None:
                if not getattr(model, "supports_pooling", False):
                    raise ConfigError(f"--runner pooling: Atlas does not pool {model_config.architecture} models (it "
                                      "pools the Llama, Mistral, Qwen2 and Qwen3 families)")
                model.lm_head = None  # (pooling needs no LM head: a bare *Model checkpoint has none to load)

        try:
            self.model: CausalLM = build_model(model_config, self.device, self.dtype, max_positions=max_model_len,
                                               parallel=parallel.layer_view(self.device, self.dtype)
                                               if parallel is not None else None, before_loading=choose_kv_dtype,
                                               dummy=engine_config.dummy_weights,
                                               quantization=engine_config.quantization)
        except torch.OutOfMemoryError as exc:  # (a model larger than the GPU: a refusal that names the ways out)
            if self.device.type != "cuda":
                raise
            release_frames(exc)
            raise memory.weights_ran_out(exc, str(self.device), self.memory_planner.free_at_start,
                                         self.memory_planner.total_memory,
                                         quantizing=engine_config.quantization is not None) from exc
        if self.device.type == "cuda":
            # Before any CUDA graph is captured: graphs bake in the kernel each linear layer picks.
            gemv.tune_shapes(linear_weights(self.model), engine_config.tuning.gemv)
            if engine_config.tuning.moe_l2_prefetch:
                logger.info("MXFP4 experts ask the L2 for the next layer's weight: %d linked",
                            len(link_l2_prefetch(self.model)))
        # --enable-lora: adapter slots in the layers that take them, and the table of each step row's slot
        # (layers/lora.py); the engine decides which adapter a slot holds (engine/lora.py).
        self.lora: LoraSlots | None = None
        self.lora_layers: dict = {}
        self.start_adapters: list[PlacedAdapter] = []
        if engine_config.enable_lora:
            self._attach_lora()
        # Hybrid models (linear-attention layers): one state slot per running sequence, plus a scratch slot, in pools
        # allocated beside the KV pages (allocate_kv_cache); the scheduler hands out the slot numbers.
        self.states = StateSlots(self.model, engine_config.max_num_seqs, self.dtype, self.device)
        self.sampler = Sampler()
        # What happens to a step after its forward: captured rows, prompt logprobs, sampling, the read-back.
        self.output = StepOutput(self.model, self.sampler, self.device, parallel, engine_config.logprobs_mode)
        # The KV caches, their scratch pages and the capture layers, set later (allocate_kv_cache, the engine):
        # one object that the graph plan and the stage launcher read too.
        self.caches = TargetCaches()
        self.capture: HiddenCapture | None = None
        # (the step graphs, by query tokens per sequence, and the mixed ones)
        self.graph_plan = GraphPlan(self.model, model_config, engine_config, self.device, self.dtype, parallel,
                                    self.caches, lambda: self.attention,  # (made on first use)
                                    pooling=self.pooler is not None,
                                    states=self.states,
                                    max_num_batched_tokens=self.max_num_batched_tokens,
                                    max_pages_per_seq=self.max_pages_per_seq, lora=self.lora)
        # (pipeline parallelism: this stage's share of each step)
        self.stages = StageLauncher(self.model, model_config, parallel, self.device, self.dtype, self.caches,
                                    self.graph_plan, self.states, self.output)
        self.inputs: InputPreparer | None = None
        self._attention: AttentionBackend | None = None
        self.num_pages = 0
        self._full_vocab: tuple[torch.nn.Module, torch.nn.Module] | None = None  # (see proposer_context)
        # A proposer's draft_after_verify, set by the engine: called right behind each uniform verify step.
        self.draft_after_verify: Callable[[VerifiedStep], NextVerify | None] | None = None
        # ... and whether that block reads the step's captured rows itself (then none are kept for commits).
        self.takes_captured_rows: Callable[[VerifiedStep], bool] | None = None
        # Set by the engine (opt-in, the prelaunch_verify tuning knob): whether the verify step that follows a drafted
        # block may be queued behind it before the host has scheduled it (prelaunch), e.g. not while requests
        # wait to join the batch. None: never.
        self.prelaunch_allowed: Callable[[StepBatch], bool] | None = None
        # A proposer's write_context_behind, set by the engine: called right behind each step of a plain stretch
        # (StepBatch.plain_speculation) with the step's captured rows, positions and slots, so that nothing
        # captured has to outlive the step (the next one may launch before this one is read back).
        self.context_behind: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None] | None = None
        self._prelaunched: Prelaunched | None = None
        # The block a drafter queued behind the last verify step and its requests: the next step's inputs, if it
        # verifies exactly that block (InputPreparer.prepare_behind). Steps prepared so: tests read it.
        self._block_behind: BlockBehind | None = None
        self.steps_behind = 0
        self.prelaunches = self.prelaunches_adopted = 0  # (verify steps queued ahead, and those a launch took)

    # ------------------------------------------------------------------ LoRA adapters (layers/lora.py)
    def _attach_lora(self) -> None:
        """Read the --lora-modules adapters and give the layers they adapt (every adaptable one without any) their
        slots, before the memory plan, which counts them with the weights."""
        cfg = self.config
        adapters = [read_adapter(m.name, m.path, cfg.hub) for m in cfg.lora_adapters]
        leaves = set().union(*(adapter_leaves(self.model, a) for a in adapters)) or None
        rows = max(self.max_num_batched_tokens, cfg.max_num_seqs * (MAX_DRAFT_TOKENS + 1))
        self.lora = LoraSlots(cfg.lora_slots, cfg.max_lora_rank, rows, self.device)
        self.lora_layers = attach_lora(self.model, self.lora, self.dtype, leaves)
        self.start_adapters = [self.prepare_lora(a) for a in adapters]
        size = sum(layer.lora.nbytes() for layer in self.lora_layers.values())
        logger.info("LoRA: %d adapter slots of rank %d on %d layers (%s)", cfg.lora_slots, cfg.max_lora_rank,
                    len(self.lora_layers), memory.fmt_bytes(size))

    def prepare_lora(self, adapter: LoraAdapter) -> PlacedAdapter:
        """An adapter checked against this model's slots (refused with its reason) and cut to this rank's share."""
        return place(self.model, self.lora_layers, adapter, self.config.max_lora_rank)

    def load_lora(self, slot: int, adapter: PlacedAdapter) -> None:
        """Write a prepared adapter into slot `slot` (0-based), replacing what it held. Queued behind the steps
        already launched, so a step in flight reads the slot as it was."""
        with torch.inference_mode():
            write_slot(self.lora_layers, slot, adapter)

    # ------------------------------------------------------------------ recurrent state (runtime/state_slots.py)
    state_specs = _part("states.specs", "One RecurrentStateSpec per layer that keeps recurrent state (none: [])")
    state_pools = _part("states.pools", "(conv state pool, delta-rule state pool) per linear-attention layer")
    num_state_slots = _part("states.num_slots", "Running slots: one per sequence, plus a scratch slot")
    num_state_snapshots = _part("states.num_snapshots", "Snapshot slots kept for prefix caching")
    num_state_backups = _part("states.num_backups", "Backup slots for speculative decoding")
    state_bytes = _part("states.bytes", "Bytes of the running slots and their backups (0 for other models)")
    snapshot_bytes = _part("states.snapshot_bytes", "Bytes of the recurrent-state snapshot slots")

    def set_state_snapshots(self, n: int) -> None:
        """Keep n recurrent-state snapshots beside the running slots (before the memory plan, which counts them)."""
        self.states.set_snapshots(n)

    def set_state_backups(self, on: bool, verify_rows: int = 0) -> None:
        """Keep a backup slot per running slot and the inputs of the rows of its last verify step (speculative
        decoding: `verify_rows`, 1 + the most drafts; before the memory plan, which counts them)."""
        self.states.set_backups(on, verify_rows)

    def copy_states(self, pairs: list[tuple[int, int]]) -> None:
        """Copy recurrent state between slots of every linear-attention layer's pools: (from slot, to slot) pairs."""
        self.states.copy(pairs)

    # ------------------------------------------------------------------ the caches (runtime/target_caches.py)
    kv_caches = _part("caches.kv_caches", "The KV cache tensors, one per layer (allocate_kv_cache)")
    scratch_pages = _part("caches.scratch_pages", "Page ids past the pool that only padding sequences write")

    @property
    def capture_layers(self) -> tuple[int, ...]:
        """The layers whose residual stream each forward captures (set by the engine, for its drafter)."""
        return self.caches.capture_layers

    @capture_layers.setter
    def capture_layers(self, layers: tuple[int, ...]) -> None:
        self.caches.capture_layers = layers

    # ------------------------------------------------------------------ memory (runtime/memory_planner.py)
    @property
    def page_bytes(self) -> int:
        """KV bytes of one page of the page pool the memory plan sizes (with KV cache groups: the global layers')."""
        group = "full" if self.window_pool is not None else None
        return self.attention.bytes_per_token(self.kv_dtype, group) * self.block_size

    @property
    def window_page_bytes(self) -> int:
        """KV bytes of one page of the window group's pool (0 without KV cache groups)."""
        if self.window_pool is None:
            return 0
        return self.attention.bytes_per_token(self.kv_dtype, "window") * self.block_size

    def set_kv_cache_groups(self, window_pool: memory.WindowPoolShape) -> None:
        """Keep the windowed layers' caches in a pool of their own (KV cache groups: engine/kv_groups.py), before
        the memory plan, which sizes it. Steps then carry the window group's page tables and slots (and so do the
        CUDA graphs' static inputs)."""
        self.window_pool = window_pool
        self.window_tables = RequestTables()

    def plan_memory(self, max_num_seqs: int, max_num_batched_tokens: int, extra_page_bytes: int = 0,
                    extra: dict[str, int] | None = None) -> memory.MemoryPlan:
        """Size the KV pool. `extra_page_bytes`: a drafter's KV per page, allocated beside the target's;
        `extra`: named buffers not allocated yet (e.g. the hidden-state capture buffer)."""
        target = PlannedModel(self.model, self.attention, self.kv_dtype, self.page_bytes, self.state_bytes,
                              self.snapshot_bytes, self.capture_layers, self.pooler is not None, self.sampler,
                              self.window_pool, self.window_page_bytes)
        return self.memory_planner.plan(target, max_num_seqs, max_num_batched_tokens, extra_page_bytes, extra)

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

    def allocate_kv_cache(self, num_pages: int, num_scratch_pages: int = 1, window_pages: int | None = None) -> None:
        """num_pages for the page pool, plus scratch pages (ids num_pages, num_pages + 1, ...) that only the
        padding sequences of captured graphs touch; with KV cache groups, window_pages for the windowed layers'
        pool (and as many scratch pages past them)."""
        assert (window_pages is None) == (self.window_pool is None), "KV cache groups: set_kv_cache_groups first"
        self.caches.kv_caches = []  # (the old cache freed before the new one is allocated)
        self.window_pages = window_pages
        self.caches.kv_caches = self.attention.allocate(
            num_pages + num_scratch_pages, self.kv_dtype, self.device,
            None if window_pages is None else window_pages + num_scratch_pages)
        if window_pages is not None:
            self.caches.window_scratch_pages = list(range(window_pages, window_pages + num_scratch_pages))
        self.num_pages = num_pages
        self.caches.scratch_pages = list(range(num_pages, num_pages + num_scratch_pages))
        if self.states.specs:
            self.states.allocate()

    # ------------------------------------------------------------------ CUDA graphs (runtime/graph_plan.py)
    step_graphs = _part("graph_plan.step_graphs", "The uniform steps' graphs, by query tokens per sequence")
    mixed_graphs = _part("graph_plan.mixed_graphs", "The graphs of steps of different query lengths (or None)")
    graphs_enabled = _part("graph_plan.enabled", "Whether steps replay CUDA graphs (GraphPlan.enabled)")
    mixed_graph_tokens = _part("graph_plan.mixed_graph_tokens", "The largest mixed step a graph replays (0: none)")

    def graph_memory_estimate(self, max_num_seqs: int, q_lens: list[int]) -> int:
        """Device memory of the step graphs' pools (one for each query length, one for the mixed steps, one for
        the recurrent state's replays)."""
        replays = self.states.replay_graph_bytes(max_num_seqs) if self.graphs_enabled else 0
        return self.graph_plan.memory_estimate(max_num_seqs, q_lens) + replays

    def capture_step_graphs(self, max_num_seqs: int, q_lens: list[int], use_graphs: bool | None = None) -> None:
        """Graphs of the target forward for uniform steps of each query length in q_lens (GraphPlan.capture), and
        of the recurrent state's replay after rejected drafts (StateSlots.capture_replays)."""
        self.graph_plan.capture(max_num_seqs, q_lens, use_graphs)
        if use_graphs is not False and self.graphs_enabled:
            self.states.capture_replays(graph_batch_sizes(max_num_seqs))

    def release_graphs(self) -> None:
        """Before a parallel engine leaves its process groups: the device idle, the step graphs dropped."""
        self.graph_plan.release()

    # ------------------------------------------------------------------ proposers
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
            max_num_seqs=self.config.max_num_seqs, graphs_enabled=self.graphs_enabled,
            make_graphs=self.graph_plan.make_graphs, scratch_pages=list(self.scratch_pages),
            build_mtp=getattr(model, "build_mtp", None), num_mtp_modules=getattr(model, "num_mtp_modules", 0),
            whole_embedding=None if self._full_vocab is None else self._full_vocab[0],
            whole_lm_head=None if self._full_vocab is None else self._full_vocab[1],
            head_rows=getattr(head, "weight_rows", None))

    @property
    def max_pages_per_seq(self) -> int:
        # (+ lookahead rows: a request near the end of its context may still carry drafts)
        return -(-(self.max_model_len + 64) // self.block_size)

    # ------------------------------------------------------------------ inputs
    def prepare_inputs(self, batch: StepBatch) -> StepInputs:
        if self.inputs is None:
            self.inputs = InputPreparer(self.max_num_batched_tokens, self.config.max_num_seqs,
                                        self.max_pages_per_seq, self.attention, self.device,
                                        kv_groups=1 if self.window_tables is None else 2)
        behind, self._block_behind = self._block_behind, None
        if behind is not None:  # (the verify step of the block queued behind the last one: its inputs are there)
            inputs = self.inputs.prepare_behind(batch, behind.following, behind.request_ids)
            if inputs is not None:
                self.steps_behind += 1
                return inputs
        inputs = self.inputs.prepare(batch)
        if self.states.specs:
            self.states.prepare(batch, inputs.meta)
        return inputs

    # ------------------------------------------------------------------ hidden-state capture
    def install_capture(self, layers: tuple[int, ...], rows: int, min_rows: int, allocator=torch.empty) -> None:
        """Capture the residual stream after `layers` into a buffer of `rows` rows (see HiddenCapture)."""
        self.capture_layers = tuple(layers)
        self.capture = HiddenCapture(self.capture_layers, self.model.captured_width(), rows, min_rows,
                                     self.dtype, self.device, allocator)

    # ------------------------------------------------------------------ execution
    def bind(self, batch: StepBatch) -> None:
        """At a step's launch: bring the per-request state up to date with its deltas and records, and bind to it
        what it reads of that state."""
        self.tables.bind(batch)
        if self.window_tables is not None:
            self.window_tables.bind_window_group(batch)
        self.requests.bind(batch)

    def execute(self, batch: StepBatch) -> StepResult:
        """Run one step and wait for it."""
        return self.launch(batch).result()

    @torch.inference_mode()
    def launch(self, batch: StepBatch) -> StepHandle:
        """Queue the whole step on the device and return without waiting for it. Under tensor or pipeline
        parallelism every rank launches each step: the driver sends it to the workers first."""
        par = self.parallel
        self.bind(batch)
        # (one device: the prompt-logprob plan is made when there are rows to score)
        plan: PromptLogprobPlan | None = None
        info: StepInfo | None = None
        if par is not None:
            plan = prompt_logprob_plan(batch) if par.is_driver else None
            info = par.begin_step(batch, plan.rows if plan is not None else [], self.share_samples)
            if plan is None:  # a worker: only the rows (it makes their logits with the driver)
                plan = PromptLogprobPlan(info.prompt_rows, None, None, 0)
        inputs = self.prepare_inputs(batch)
        if self.lora is not None:  # (every forward of the step, eager or a graph's, reads this table)
            self.lora.set_rows(batch.lora_slots or [0] * batch.num_seqs, batch.num_scheduled)
            self.graph_plan.select(self.lora.apply)  # (a base-model step: the graphs without the slots)
        if self.pooler is not None:
            return self._launch_pooling(batch, inputs)
        if par is not None and par.pp > 1:
            return self.stages.launch(batch, inputs, plan, info, self.capture, self.inputs)
        meta = inputs.meta
        graphs = self.graph_plan.step_graphs.get(meta.max_query_len)
        hidden = None
        verified = None
        pre, self._prelaunched = self._prelaunched, None
        # (a prefix-cache snapshot inside a prompt chunk is taken between two passes of each linear-attention layer:
        #  such a step runs eagerly)
        if graphs is not None and graphs.can_run(meta) and not meta.state_splits:
            if pre is not None and pre.graphs is graphs and pre.matches(batch):
                # This step already ran on the device, queued behind the last drafter block: its outputs stand.
                greedy, logits, captured = pre.outputs
                self.prelaunches_adopted += 1
            else:
                pre = None
                greedy, logits, captured = graphs.run(inputs.input_ids, inputs.positions, meta)
            if self.draft_after_verify is not None and graphs.q > 1:
                verified = verified_step(par, batch, inputs, greedy, captured, graphs, pre)
            if not inputs.all_rows_sampled:
                greedy, logits = greedy[inputs.sample_rows], logits[inputs.sample_rows]
        elif self._mixed_graph_fits(batch, inputs):
            greedy, logits, captured = self.graph_plan.mixed_graphs.run(inputs.input_ids, inputs.positions, meta,
                                                                        inputs.sample_rows, inputs.num_sample_rows)
            if not inputs.num_sample_rows:
                greedy = logits = None
        else:
            hidden, captured = self.model(inputs.input_ids, inputs.positions, self.kv_caches, meta,
                                          self.capture_layers)
            logits = self.model.compute_logits(hidden[inputs.sample_rows]) if inputs.num_sample_rows else None
            greedy = logits.argmax(-1) if logits is not None else None
        if batch.state_saves:  # (states at the end of a prompt page, kept for the prefix cache)
            self.states.save(batch)
        if verified is not None and self.takes_captured_rows is not None and self.takes_captured_rows(verified):
            captured = None  # (the block queued behind the step reads them; nothing keeps them for a commit)
        elif batch.plain_speculation and self.context_behind is not None and captured is not None:
            rows = meta.slot_mapping.shape[0]  # (the step's own rows: graph outputs carry padding after them)
            self.context_behind(captured[:rows], inputs.positions[:rows], meta.slot_mapping)
            captured = None
        handle = self.output.sample(batch, inputs, greedy, logits, captured, hidden, plan, info, self.capture,
                                    self.inputs)
        if verified is not None:  # (behind the step's read-back, which the host waits for alone)
            following = self.draft_after_verify(verified)
            if following is not None:
                self._block_behind = BlockBehind(following, verified.request_ids)
            if following is not None and self.prelaunch_allowed is not None and self.prelaunch_allowed(batch):
                self._prelaunched = prelaunch(graphs, batch, verified, following)
                self.prelaunches += 1
        return handle

    def _launch_pooling(self, batch: StepBatch, inputs: StepInputs) -> StepHandle:
        """--runner pooling: the forward (eagerly), then the pooled vector of each sequence whose prompt ends in
        this step; nothing is sampled."""
        hidden, _ = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta)
        # (requests aborted in the middle of their prompt, or preempted there: recomputed from its start)
        self.pooler.forget(batch.finished_request_ids + batch.preempted_request_ids)
        pooled = self.pooler(hidden, batch.seqs, batch.start, batch.num_scheduled)
        index = [i for i, v in enumerate(pooled) if v is not None]
        rows = torch.stack([pooled[i] for i in index]) if index else None
        if rows is not None and getattr(self.model, "score", None) is not None:  # (a sequence classifier: class logits)
            rows = self.model.score(rows.to(self.dtype)).float()
        host = rows.to("cpu", non_blocking=True) if rows is not None else None
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
        mixed = self.graph_plan.mixed_graphs
        return (mixed is not None and mixed.can_run(inputs.meta, inputs.num_sample_rows)
                and not batch.wants_prompt_logprobs)

    # (pipeline parallelism: runtime/stage_launch.py)
    stage_captures = _part("stages.stage_captures", "Each pipeline stage's capture layers, in capture_layers' order")
