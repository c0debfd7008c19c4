"""The model runner: owns the model, the KV cache tensors and the sampler, and turns each scheduler
decision (a StepBatch of host numbers) into one flat forward pass.

Every step, whatever it mixes (prefill chunks, decodes, verify rows), becomes token ids [T],
positions [T] and one AttentionMetadata; only the rows that need a next token reach the LM head.
"""

from __future__ import annotations

import gc
import logging
from dataclasses import dataclass

import torch

from atlas.config import DEFAULT_CPU_KV_CACHE_BYTES, EngineConfig, ModelConfig
from atlas.layers.attention import AttentionMetadata
from atlas.models.base import CausalLM
from atlas.models.loader import build_model
from atlas.runtime import memory
from atlas.runtime.batch import StepBatch, StepResult
from atlas.runtime.capture import HiddenCapture
from atlas.runtime.cuda_graphs import StepGraphs, graph_memory_estimate
from atlas.runtime.sampler import Sampler, SamplingRow, gather_logprobs
from atlas.speculative.verify import accept_one_hot, accept_with_probs

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


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # flat row index of every row that needs a next token
    sample_owner: list[int]  # batch index of the sequence each sample row belongs to
    sample_offset: list[int]  # 0 for the row after the last known token, j for the j-th draft


class ModelRunner:
    def __init__(self, engine_config: EngineConfig, model_config: ModelConfig, max_model_len: int):
        self.config = engine_config
        self.model_config = model_config
        self.device = resolve_device(engine_config.device)
        self.dtype = resolve_dtype(engine_config.dtype, model_config, self.device)
        self.block_size = engine_config.block_size
        self.max_model_len = max_model_len
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            # What this engine adds is measured against these (other engines may share the process).
            gc.collect()
            torch.cuda.empty_cache()
            self.free_at_start, self.total_memory = torch.cuda.mem_get_info()
            self.allocated_at_start = torch.cuda.memory_allocated(self.device)
            self.reserved_at_start = torch.cuda.memory_reserved(self.device)
        self.model: CausalLM = build_model(model_config, self.device, self.dtype, max_positions=max_model_len)
        self.sampler = Sampler()
        self.kv_caches: list[torch.Tensor] = []
        self.capture_layers: tuple[int, ...] = ()
        self.capture: HiddenCapture | None = None
        self.step_graphs: dict[int, StepGraphs] = {}  # by query tokens per sequence
        self.scratch_pages: list[int] = []
        self.num_pages = 0

    # ------------------------------------------------------------------ memory
    @property
    def page_bytes(self) -> int:
        return sum(spec.bytes_per_token(self.dtype) for spec in self.model.kv_cache_specs()) * self.block_size

    def plan_memory(self, max_num_seqs: int, max_num_batched_tokens: int, extra_page_bytes: int = 0,
                    extra: dict[str, int] | None = None) -> memory.MemoryPlan:
        """Size the KV pool. `extra_page_bytes`: a drafter's KV per page, allocated beside the target's;
        `extra`: named buffers not allocated yet (e.g. the hidden-state capture buffer)."""
        cfg = self.config
        page_bytes = self.page_bytes + extra_page_bytes
        if cfg.num_gpu_blocks_override is not None:
            plan = memory.plan_fixed(self.device.type, page_bytes, self.block_size, cfg.num_gpu_blocks_override)
        elif self.device.type == "cpu":
            useful = max_num_seqs * -(-self.max_model_len // self.block_size) + 1
            plan = memory.plan_cpu(page_bytes, self.block_size, cfg.kv_cache_bytes, useful,
                                   DEFAULT_CPU_KV_CACHE_BYTES)
        else:
            weights = torch.cuda.memory_allocated(self.device) - self.allocated_at_start
            peak = self.profile_activation_peak(max_num_seqs, max_num_batched_tokens)
            free_now, total = torch.cuda.mem_get_info()
            # Memory taken on the device since start-up outside PyTorch's allocator (CUDA context,
            # cuBLAS workspaces, other libraries).
            reserved_growth = torch.cuda.memory_reserved(self.device) - self.reserved_at_start
            non_torch = max(0, (self.free_at_start - free_now) - reserved_growth)
            plan = memory.plan_cuda(page_bytes, self.block_size, total, self.free_at_start,
                                    cfg.gpu_memory_utilization, weights, peak, non_torch, extra)
        plan.breakdown.update({k: v for k, v in (extra or {}).items() if k not in plan.breakdown})
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
            slots.extend(first * self.block_size + i for i in range(n))
            first += p
        positions = [i for n in seq_lens for i in range(n)]
        meta = self._metadata([0, *torch.tensor(seq_lens).cumsum(0).tolist()], seq_lens, block_tables, slots)
        ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        hidden, _ = self.model(ids, torch.tensor(positions, device=self.device), caches, meta, self.capture_layers)
        rows = min(max_num_seqs, num_tokens)
        logits = self.model.compute_logits(hidden[:rows])
        probe = SamplingRow(1.0, 50, 0.9, 0.05, 1.1, 0.1, 0.1, None, 5, [1], [1], [])
        self.sampler(logits, [probe] * rows)
        del caches, hidden, logits
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - base
        torch.cuda.empty_cache()
        return peak

    def _allocate_caches(self, num_pages: int) -> list[torch.Tensor]:
        return [torch.zeros(2, num_pages, self.block_size, spec.num_kv_heads, spec.head_dim,
                            dtype=self.dtype, device=self.device)
                for spec in self.model.kv_cache_specs()]

    def allocate_kv_cache(self, num_pages: int, num_scratch_pages: int = 1) -> None:
        """num_pages for the page pool, plus scratch pages (ids num_pages, num_pages + 1, ...) that only the
        padding sequences of captured graphs touch."""
        self.kv_caches = []
        self.kv_caches = self._allocate_caches(num_pages + num_scratch_pages)
        self.num_pages = num_pages
        self.scratch_pages = list(range(num_pages, num_pages + num_scratch_pages))

    @property
    def graphs_enabled(self) -> bool:
        """CUDA graphs are used on CUDA unless --enforce-eager (and where attention runs in Triton)."""
        if self.device.type != "cuda" or self.config.enforce_eager:
            return False
        from atlas.kernels.paged_attention import triton_available

        return triton_available()

    def graph_memory_estimate(self, max_num_seqs: int, max_q_len: int) -> int:
        if not self.graphs_enabled:
            return 0
        width = len(self.capture_layers) * self.model_config.hidden_size
        return graph_memory_estimate(max_num_seqs * max_q_len, self.model_config.hidden_size,
                                     self.model_config.intermediate_size, width, self.dtype)

    def _graphed_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata):
        return self.model(input_ids, positions, self.kv_caches, meta, self.capture_layers)

    def capture_step_graphs(self, max_num_seqs: int, q_lens: list[int], use_graphs: bool | None = None) -> None:
        """Graphs of the target forward for uniform steps of each query length in q_lens (1 = decode,
        1 + K = speculative verify). use_graphs=False builds the same static-buffer path without
        capturing (for testing it on CPU)."""
        if use_graphs is None:
            if not self.graphs_enabled:
                return
            use_graphs = True
        cfg = self.model_config
        max_pages = -(-self.max_model_len // self.block_size)
        for q in q_lens:
            graphs = StepGraphs("target", self._graphed_forward, q, cfg.num_attention_heads, cfg.num_key_value_heads,
                                self.scratch_pages, self.block_size, max_pages, max_num_seqs, self.device,
                                use_graphs=use_graphs)
            graphs.capture()
            self.step_graphs[q] = graphs

    # ------------------------------------------------------------------ inputs
    def _metadata(self, query_start_loc: list[int], seq_lens: list[int], block_tables: list[list[int]],
                  slots: list[int]) -> AttentionMetadata:
        return AttentionMetadata.build(query_start_loc, seq_lens, block_tables, slots, self.block_size, self.device)

    def prepare_inputs(self, batch: StepBatch) -> StepInputs:
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        qsl = [0]
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        sample_rows: list[int] = []
        sample_owner: list[int] = []
        sample_offset: list[int] = []
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_scheduled, strict=True)):
            start = seq.num_computed_tokens
            tokens = seq.all_token_ids + seq.spec_token_ids if seq.spec_token_ids else seq.all_token_ids
            ids.extend(tokens[start: start + n])
            positions.extend(range(start, start + n))
            pages = seq.block_ids
            slots.extend(pages[p // bs] * bs + p % bs for p in range(start, start + n))
            row0 = qsl[-1]
            qsl.append(row0 + n)
            seq_lens.append(start + n)
            tables.append(pages)
            for j in range(batch.num_sample_rows(i)):
                sample_rows.append(row0 + (seq.num_tokens - 1 - start) + j)
                sample_owner.append(i)
                sample_offset.append(j)
        dev = self.device
        return StepInputs(
            input_ids=torch.tensor(ids, dtype=torch.long, device=dev),
            positions=torch.tensor(positions, dtype=torch.long, device=dev),
            meta=self._metadata(qsl, seq_lens, tables, slots),
            sample_rows=torch.tensor(sample_rows, dtype=torch.long, device=dev),
            sample_owner=sample_owner,
            sample_offset=sample_offset,
        )

    @staticmethod
    def sampling_row(seq, offset: int) -> SamplingRow:
        p = seq.params
        outputs = seq.output_token_ids + seq.spec_token_ids[:offset] if offset else seq.output_token_ids
        banned = seq.stop_token_ids if len(outputs) < p.min_tokens else []
        return SamplingRow(
            temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, min_p=p.min_p,
            repetition_penalty=p.repetition_penalty, presence_penalty=p.presence_penalty,
            frequency_penalty=p.frequency_penalty, generator=seq.generator, num_logprobs=p.logprobs,
            prompt_token_ids=seq.prompt_token_ids, output_token_ids=outputs, banned_token_ids=banned)

    # ------------------------------------------------------------------ hidden-state capture
    def install_capture(self, layers: tuple[int, ...], rows: int, min_rows: int, allocator=torch.empty) -> None:
        """Capture the residual stream after `layers` into a buffer of `rows` rows (see HiddenCapture)."""
        self.capture_layers = tuple(layers)
        self.capture = HiddenCapture(self.capture_layers, self.model_config.hidden_size, rows, min_rows,
                                     self.dtype, self.device, allocator)

    def _keep_captured_rows(self, batch: StepBatch, inputs: StepInputs) -> tuple[torch.Tensor, list[tuple[int, int]]]:
        """Which rows of this step go into the capture buffer: all rows of decodes and verifies, and as
        many of the last rows of each prefill chunk as the buffer (and the prefill switch) allow.
        -> (flat row ids, per sequence (offset in buffer, count))."""
        cap = self.capture
        space = cap.rows
        qsl = inputs.meta.query_start_loc_cpu
        placed: list[tuple[int, int]] = [(0, 0)] * len(batch.seqs)
        order = sorted(range(len(batch.seqs)), key=lambda i: batch.num_sample_rows(i) != batch.num_scheduled[i])
        chunks: list[range] = []
        offset = 0
        for i in order:  # decode / verify sequences first: their rows always fit
            n = batch.num_scheduled[i]
            is_prefill = batch.num_sample_rows(i) != n
            take = min(n, space - offset) if (not is_prefill or cap.prefill_enabled) else 0
            if take > 0:
                chunks.append(range(qsl[i + 1] - take, qsl[i + 1]))
                placed[i] = (offset, take)
                offset += take
        rows = [r for c in chunks for r in c]
        return torch.tensor(rows, dtype=torch.long, device=self.device), placed

    # ------------------------------------------------------------------ prompt logprobs
    def _prompt_logprobs(self, batch: StepBatch, inputs: StepInputs, hidden: torch.Tensor) -> list:
        """For sequences with prompt_logprobs: at each prompt position p computed now (and not before),
        the logprob of prompt token p + 1, its rank and the top ones. Logits are made a bounded number of
        rows at a time, since a prefill chunk can be thousands of rows."""
        out: list = [None] * len(batch.seqs)
        rows: list[int] = []
        targets: list[int] = []
        where: list[tuple[int, int]] = []  # (sequence, position)
        qsl = inputs.meta.query_start_loc_cpu
        for i, seq in enumerate(batch.seqs):
            if seq.prompt_logprobs is None:
                continue
            start, n = seq.num_computed_tokens, batch.num_scheduled[i]
            first = max(start, len(seq.prompt_logprobs) - 1)  # positions already scored are skipped
            last = min(start + n, len(seq.prompt_token_ids) - 1)
            for p in range(first, last):
                rows.append(qsl[i] + p - start)
                targets.append(seq.prompt_token_ids[p + 1])
                where.append((i, p))
            out[i] = []
        if not rows:
            return out
        top_k = max(batch.seqs[i].params.prompt_logprobs for i, _ in where)
        for c in range(0, len(rows), _LOGITS_ROWS_PER_CHUNK):
            index = torch.tensor(rows[c: c + _LOGITS_ROWS_PER_CHUNK], device=hidden.device)
            tokens = torch.tensor(targets[c: c + _LOGITS_ROWS_PER_CHUNK], device=hidden.device)
            lp = gather_logprobs(self.model.compute_logits(hidden[index]), tokens, top_k)
            values, ranks = lp.logprobs.tolist(), lp.ranks.tolist()
            top_ids = lp.top_token_ids.tolist() if lp.top_token_ids is not None else None
            top_lp = lp.top_logprobs.tolist() if lp.top_logprobs is not None else None
            for e, (i, p) in enumerate(where[c: c + _LOGITS_ROWS_PER_CHUNK]):
                k = batch.seqs[i].params.prompt_logprobs
                top = list(zip(top_ids[e][:k], top_lp[e][:k], strict=True)) if k and top_ids else []
                out[i].append((p, values[e], ranks[e], top))
        return out

    # ------------------------------------------------------------------ execution
    @torch.inference_mode()
    def execute(self, batch: StepBatch) -> StepResult:
        inputs = self.prepare_inputs(batch)
        graphs = self.step_graphs.get(inputs.meta.max_query_len)
        if graphs is not None and graphs.can_run(inputs.meta):
            hidden, captured = graphs.run(inputs.input_ids, inputs.positions, inputs.meta)
        else:
            hidden, captured = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta,
                                          self.capture_layers)
        n_seqs = len(batch.seqs)
        result = StepResult([[] for _ in range(n_seqs)], [None] * n_seqs, [None] * n_seqs)
        if captured is not None and self.capture is not None:
            keep, placed = self._keep_captured_rows(batch, inputs)
            stored = self.capture.store(captured, keep)
            result.hidden = [stored[o: o + c] if c else None for o, c in placed]
        result.prompt_logprobs = self._prompt_logprobs(batch, inputs, hidden)
        if not inputs.sample_owner:
            return result

        logits = self.model.compute_logits(hidden[inputs.sample_rows])
        rows = [self.sampling_row(batch.seqs[i], j)
                for i, j in zip(inputs.sample_owner, inputs.sample_offset, strict=True)]
        tokens = self.sampler(logits, rows).tolist()

        # Group rows by sequence, then keep what verification accepts.
        first_row: dict[int, int] = {}
        for r, owner in enumerate(inputs.sample_owner):
            first_row.setdefault(owner, r)
        emitted_rows: list[int] = []
        emitted_tokens: list[int] = []
        for i, r0 in first_row.items():
            seq = batch.seqs[i]
            m = batch.num_sample_rows(i)
            drafts = seq.spec_token_ids[: m - 1]
            if not drafts:
                emitted = [tokens[r0]]
            elif seq.spec_draft_probs is None:
                emitted = accept_one_hot(drafts, tokens[r0: r0 + m])
            else:
                probs = self.sampler.probabilities(logits[r0: r0 + m], rows[r0: r0 + m])
                emitted = accept_with_probs(drafts, probs, seq.spec_draft_probs[: m - 1], tokens[r0 + m - 1],
                                            seq.generator)
            result.sampled_token_ids[i] = emitted
            emitted_rows.extend(range(r0, r0 + len(emitted)))
            emitted_tokens.extend(emitted)

        wanted = [rows[r].num_logprobs for r in emitted_rows]
        if any(k is not None for k in wanted):
            top_k = max(k for k in wanted if k is not None)
            index = torch.tensor(emitted_rows, device=logits.device)
            lp = gather_logprobs(logits[index], torch.tensor(emitted_tokens, device=logits.device), top_k)
            values, ranks = lp.logprobs.tolist(), lp.ranks.tolist()
            top_ids = lp.top_token_ids.tolist() if lp.top_token_ids is not None else None
            top_lp = lp.top_logprobs.tolist() if lp.top_logprobs is not None else None
            for e, r in enumerate(emitted_rows):
                k = wanted[e]
                if k is None:
                    continue
                owner = inputs.sample_owner[r]
                top = list(zip(top_ids[e][:k], top_lp[e][:k], strict=True)) if k and top_ids else []
                if result.logprobs[owner] is None:
                    result.logprobs[owner] = []
                result.logprobs[owner].append((values[e], ranks[e], top))
        return result
