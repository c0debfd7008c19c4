"""The runner's CUDA graphs: whether steps replay graphs at all, the device memory their pools take (for the memory
plan), and their capture: uniform steps of each query length (decode, speculative verify; under pipeline parallelism
this stage's layers), mixed steps, and the graphs a proposer makes of its own forwards. With LoRA adapters, two sets
of them: one that runs the adapter slots, one for steps in which no row reads an adapter."""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from atlas.layers.attention import AttentionMetadata
from atlas.layers.attention_backend import AttentionBackend
from atlas.runtime.cuda_graphs import (
    ForwardFn,
    StepGraphs,
    graph_batch_sizes,
    graph_pool_bytes,
    uniform_graph_bytes,
)
from atlas.runtime.mixed_graphs import DEFAULT_MAX_TOKENS as MIXED_GRAPH_MAX_TOKENS
from atlas.runtime.mixed_graphs import MixedGraphStates, MixedStepGraphs, mixed_token_sizes

if TYPE_CHECKING:
    from atlas.config import EngineConfig, ModelConfig
    from atlas.layers.lora import LoraSlots
    from atlas.models.base import CausalLM
    from atlas.runtime.parallel import ParallelState
    from atlas.runtime.state_slots import StateSlots
    from atlas.runtime.target_caches import TargetCaches

logger = logging.getLogger(__name__)


def _mib(tensor: torch.Tensor | None) -> float:
    return 0.0 if tensor is None else tensor.numel() * tensor.element_size() / 2**20


class GraphPlan:
    """The step graphs of a runner's model (its caches and capture layers), by query tokens per sequence, and the
    mixed-step graphs; made by capture()."""

    def __init__(self, model: CausalLM, model_config: ModelConfig, config: EngineConfig, device: torch.device,
                 dtype: torch.dtype, parallel: ParallelState | None, caches: TargetCaches,
                 attention: Callable[[], AttentionBackend], *, pooling: bool, states: StateSlots,
                 max_num_batched_tokens: int, max_pages_per_seq: int, lora: LoraSlots | None = None):
        """`caches`: the runner's, filled in after this is made. `attention` gives the runner's attention
        backend, asked for at capture (the runner makes it on first use). `config` is the runner's own, read at
        each use. `lora`: the adapter slots (--enable-lora), whose base-model steps get graphs of their own."""
        self.model, self.model_config, self.config = model, model_config, config
        self.device, self.dtype, self.parallel = device, dtype, parallel
        self.caches = caches
        self._attention = attention
        self.pooling = pooling  # (--runner pooling: prefill steps, run eagerly)
        self.states = states  # (a hybrid model's recurrent-state slots)
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_pages_per_seq = max_pages_per_seq
        # (a model whose shapes follow a bound on the step's longest context: the bounds its graphs are captured for)
        self.context_buckets = model.graph_context_buckets(max_pages_per_seq * config.block_size)
        self.step_graphs: dict[int, StepGraphs] = {}  # by query tokens per sequence
        self.mixed_graphs: MixedStepGraphs | None = None  # (steps of sequences with different query lengths)
        # Pipeline parallelism, a later stage: the static copy of the previous stage's [x | residual] its graphs read.
        self.stage_in: torch.Tensor | None = None
        # --enable-lora: the two sets (step graphs, mixed graphs), by whether a step's rows read adapters; select()
        # points step_graphs and mixed_graphs at one. A graph replays the slots' kernels it captured whatever the
        # rows read, and they cost a base-model step 1.30-1.34x (BENCHMARKS.md 15).
        self.lora = lora
        self._sets: dict[bool, tuple[dict[int, StepGraphs], MixedStepGraphs | None]] = {}
        self._warned = False

    @property
    def enabled(self) -> bool:
        """CUDA graphs are used on CUDA unless --enforce-eager (and where attention runs in Triton and the
        model's forward can be captured on this device and dtype)."""
        if self.device.type != "cuda" or self.config.enforce_eager or self.pooling:
            return False
        if self.parallel is not None and self.parallel.pp > 1 and not self.config.tuning.pp_graphs:
            # (Each stage's layers replay graphs by default: on two H200s they took PP=2 batch-1 decode from
            #  63 to 175 tok/s with equal greedy tokens; --tuning pp_graphs=0 runs stages eagerly.)
            if not self._warned:
                self._warned = True
                logger.warning("CUDA graphs are off with pipeline parallelism (--tuning pp_graphs=0); steps run "
                               "eagerly")
            return False
        from atlas.kernels import triton_available

        if not self.model.supports_cuda_graphs(self.dtype, self.device):
            if not self._warned:
                self._warned = True
                logger.warning("CUDA graphs are off: %s cannot be captured in %s on this GPU (%s); steps run eagerly",
                               self.model_config.architecture, str(self.dtype).replace("torch.", ""),
                               self.model.cuda_graph_blocker)
            return False
        return triton_available()

    @property
    def lora_sets(self) -> bool:
        """Whether the graphs come in two sets, with and without the adapter slots (--tuning lora_base_graphs)."""
        return self.lora is not None and self.config.tuning.lora_base_graphs

    def select(self, adapter_rows: bool) -> None:
        """The set of graphs the next step replays: the one with the adapter slots if some row reads an adapter
        (LoraSlots.apply). No-op with one set."""
        if self._sets:
            self.step_graphs, self.mixed_graphs = self._sets[adapter_rows]

    def memory_estimate(self, max_num_seqs: int, q_lens: list[int]) -> int:
        """Device memory of the step graphs' pools (one for each query length, one for the mixed steps; a second
        set of graphs shares them, adding the outputs each of its graphs keeps)."""
        if not self.enabled:
            return 0
        cfg, size = self.model_config, self.dtype.itemsize
        hidden, vocab = cfg.hidden_size, cfg.vocab_size
        width = len(self.caches.capture_layers) * hidden
        # Each set of graphs writes its logits into one buffer for its largest step (_logits_buffer), and keeps
        # the argmax and captured rows of every row of every captured size.
        # (a graph per context bound too, each keeping its outputs)
        kept_row = (width * size + 8) * (len(self.context_buckets) if self.context_buckets else 1)
        total = sum(max_num_seqs * q * vocab * size
                    + uniform_graph_bytes(max_num_seqs, q, hidden, cfg.intermediate_size, self.dtype, vocab, kept_row)
                    for q in q_lens)
        second_set = sum(graph_batch_sizes(max_num_seqs)) * sum(q_lens) * kept_row + len(q_lens) * (64 << 20)
        if self.mixed_graph_tokens:  # (sampled rows' argmax, every row's captured row)
            sizes = mixed_token_sizes(self.mixed_graph_tokens, self.kernel_row_boundaries)
            sampled = max_num_seqs * max(q_lens)
            kept = sum(min(t, sampled) * 8 + t * width * size for t in sizes)
            total += min(sizes[-1], sampled) * vocab * size + graph_pool_bytes(
                sizes[-1], hidden, cfg.intermediate_size, self.dtype, min(sizes[-1], sampled), vocab, kept)
            second_set += kept + (64 << 20)
        # (the base-model set's graphs reuse their twins' pools: the kept outputs, and room for the allocator's
        # rounding, are what it adds)
        return total + (second_set if self.lora_sets else 0)

    @property
    def mixed_graph_tokens(self) -> int:
        """The largest mixed step replayed from a CUDA graph (0: none). --tuning mixed_graphs=0 runs them
        eagerly; one device only (a parallel engine's ranks run their mixed steps eagerly). A model with recurrent
        state only with --tuning mixed_graph_recurrent_rows (recurrent_mixed_rows); not for a model whose shapes
        follow a bound on the step's context (DeepSeek sparse attention): its uniform steps' graphs are captured per
        bound already, which mixed steps' token ladder would multiply."""
        if (self.parallel is not None or not self.config.tuning.mixed_graphs or self.context_buckets is not None
                or (self.state_scratch_slot is not None and not self.recurrent_mixed_rows)):
            return 0
        return min(MIXED_GRAPH_MAX_TOKENS, self.max_num_batched_tokens)

    @property
    def kernel_row_boundaries(self) -> tuple[int, ...]:
        """Row counts at which the model's kernels change, captured among the mixed-step sizes: with FP8 linear
        weights, fp8_linear.SMALL_M (a 3-token step padded to 32 rows would take the W8A8 path where its eager run
        takes W8A16)."""
        from atlas.kernels.fp8_linear import FP8, SMALL_M

        fp8 = any(t.dtype == FP8 for t in (*self.model.parameters(), *self.model.buffers()))
        return (SMALL_M,) if fp8 else ()

    @property
    def state_scratch_slot(self) -> int | None:
        """A hybrid model's recurrent-state slot that its graphs' padding sequences use; None for other models."""
        return self.states.scratch_slot

    @property
    def recurrent_mixed_rows(self) -> int:
        """A model with recurrent state: the most rows a sequence of a mixed step replayed from a graph may have
        (its linear-attention layers take them token by token there; --tuning mixed_graph_recurrent_rows; 0:
        none)."""
        if self.state_scratch_slot is None or not self.model.recurrent_state_in_mixed_graphs:
            return 0
        return self.config.tuning.mixed_graph_recurrent_rows

    def _logits_buffer(self, rows: int) -> torch.Tensor:
        """Where a set of graphs writes its logits, every captured size into the head of the same rows: a
        graph's outputs stay in its pool, so logits of each size's own would keep the sum of all sizes' rows
        (4.9 times the largest step's on the decode ladder) alive. The outputs of a step are read before the
        next step of the same set runs, as they were when each size had its own."""
        return torch.empty(rows, self.model_config.vocab_size, dtype=self.dtype, device=self.device)

    def _graphed_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                         logits_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """A uniform step inside a graph: every row is scored, and greedy rows need nothing more than
        the argmax taken here."""
        hidden, captured = self.model(input_ids, positions, self.caches.kv_caches, meta, self.caches.capture_layers)
        logits = self.model.compute_logits(hidden, out=logits_out[: hidden.shape[0]])
        return logits.argmax(-1), logits, captured

    def _mixed_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                       sample_idx: torch.Tensor, logits_out: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """A mixed step inside a graph: logits for the sampled rows only (sample_idx, padded with row 0)."""
        hidden, captured = self.model(input_ids, positions, self.caches.kv_caches, meta, self.caches.capture_layers)
        logits = self.model.compute_logits(hidden[sample_idx], out=logits_out[: sample_idx.numel()])
        return logits.argmax(-1), logits, captured

    def _stage_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
                       ) -> tuple[torch.Tensor, ...]:
        """Pipeline parallelism, a uniform step inside a graph: this stage's layers, from the static copy of
        the previous stage's [x | residual] on a later stage. Rows first, as StepGraphs slices its outputs:
        a stage that is not the last returns [rows, 2, hidden] (a view of its [2, rows, hidden])."""
        stage_in = None if self.parallel.is_first_stage else self.stage_in[:, : input_ids.shape[0]]
        out, captured = self.model(input_ids, positions, self.caches.kv_caches, meta, self.caches.capture_layers,
                                   intermediate=stage_in)
        out = out if self.parallel.is_last_stage else out.transpose(0, 1)
        # (With a drafter, the residual streams of this stage's capture layers too: [rows, n * hidden].)
        return (out,) if captured is None else (out, captured)

    def capture(self, max_num_seqs: int, q_lens: list[int], use_graphs: bool | None = None) -> None:
        """Graphs of the target forward for uniform steps of each query length in q_lens (1 = decode,
        1 + K = speculative verify); under pipeline parallelism, of this stage's layers. use_graphs=False
        builds the same static-buffer path without capturing (for testing it on CPU; the static_steps tuning
        knob does that on every rank of an engine where graphs are off)."""
        if use_graphs is None:
            if self.enabled:
                use_graphs = True
            elif self.config.tuning.static_steps:
                use_graphs = False
            else:
                return
        staged = self.parallel is not None and self.parallel.pp > 1
        if staged and not self.parallel.is_first_stage:
            self.stage_in = torch.zeros(2, max_num_seqs * max(q_lens), self.model_config.hidden_size,
                                        dtype=self.dtype, device=self.device)
        if not self.lora_sets:
            # (one set: with the adapter slots, if any, since every step replays it)
            with self.lora.applying(True) if self.lora is not None else contextlib.nullcontext():
                self._capture_set(max_num_seqs, q_lens, use_graphs, staged, None)
            return
        # The adapters' set first (its pools sized by the larger forward), then the base model's into its pools.
        self._sets.clear()
        for adapter_rows in (True, False):
            with self.lora.applying(adapter_rows):
                self._capture_set(max_num_seqs, q_lens, use_graphs, staged, self._sets.get(True))
            self._sets[adapter_rows] = (self.step_graphs, self.mixed_graphs)
            self.step_graphs, self.mixed_graphs = {}, None
        self.select(True)  # (what a proposer binds for its verify steps: the set that runs every row's adapter)

    def _capture_set(self, max_num_seqs: int, q_lens: list[int], use_graphs: bool, staged: bool,
                     twin: tuple[dict[int, StepGraphs], MixedStepGraphs | None] | None) -> None:
        """One set of graphs into step_graphs and mixed_graphs; twin: a set over the same shapes whose pools and
        logits buffers these share (the two never run at once, and a step's outputs are read before the next
        step's replay, whichever set it takes)."""
        attention, scratch_pages = self._attention(), self.caches.scratch_pages
        max_pages_per_seq = self.max_pages_per_seq
        for q in q_lens:
            other = twin[0][q] if twin is not None else None
            logits_out = None if staged else (self._logits_buffer(max_num_seqs * q) if other is None
                                              else other.forward.keywords["logits_out"])
            forward = self._stage_forward if staged else functools.partial(self._graphed_forward,
                                                                           logits_out=logits_out)
            graphs = StepGraphs("target" if not staged else "stage", forward, q, attention, scratch_pages,
                                max_pages_per_seq, max_num_seqs, self.device,
                                use_graphs=use_graphs, window_scratch_pages=self.caches.window_scratch_pages,
                                state_scratch_slot=self.state_scratch_slot, context_buckets=self.context_buckets)
            graphs.capture(other.pool if other is not None else None)
            if other is None:
                graphs.captured_mib += _mib(logits_out)  # (the graphs' share of the memory plan counts it)
            self.step_graphs[q] = graphs
        if self.mixed_graph_tokens and not staged:
            other = twin[1] if twin is not None else None
            sampled = max_num_seqs * max(q_lens)
            logits_out = (self._logits_buffer(min(mixed_token_sizes(self.mixed_graph_tokens)[-1], sampled))
                          if other is None else other.forward.keywords["logits_out"])
            states = None
            if self.state_scratch_slot is not None:
                states = MixedGraphStates(self.mixed_graph_tokens, max_num_seqs, self.state_scratch_slot,
                                          self.recurrent_mixed_rows, self.device, self.states.verify_rows)
            self.mixed_graphs = MixedStepGraphs(
                functools.partial(self._mixed_forward, logits_out=logits_out), attention, scratch_pages,
                max_pages_per_seq, max_num_seqs, self.mixed_graph_tokens, sampled, self.device,
                use_graphs=use_graphs, window_scratch_pages=self.caches.window_scratch_pages, states=states,
                boundaries=self.kernel_row_boundaries)
            self.mixed_graphs.capture(other.pool if other is not None else None)
            if other is None:
                self.mixed_graphs.captured_mib += _mib(logits_out)

    def make_graphs(self, name: str, forward: ForwardFn, q_len: int, attention: AttentionBackend,
                    max_pages_per_seq: int, use_graphs: bool) -> StepGraphs:
        """Static buffers (and CUDA graphs when use_graphs) for a forward over uniform q_len-token steps of
        up to max-num-seqs sequences of `attention`'s caches, padded into the scratch pages; capture() them
        before use."""
        return StepGraphs(name, forward, q_len, attention, self.caches.scratch_pages, max_pages_per_seq,
                          self.config.max_num_seqs, self.device, use_graphs=use_graphs,
                          context_buckets=self.context_buckets)

    def release(self) -> None:
        """Before a parallel engine leaves its process groups: the device idle, the step graphs dropped.
        NCCL communicators whose collectives are captured in live graphs can hang when they are torn down
        (pytorch/pytorch#115388)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        sets = list(self._sets.values()) or [(self.step_graphs, self.mixed_graphs)]
        for step_graphs, mixed_graphs in sets:
            for graphs in step_graphs.values():
                graphs.release()
            step_graphs.clear()
            if mixed_graphs is not None:
                mixed_graphs.release()
        self._sets.clear()
        self.step_graphs, self.mixed_graphs = {}, None
