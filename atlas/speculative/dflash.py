"""DFlash drafting (`--speculative dflash`): a block-diffusion drafter proposes K tokens in one forward.

Per request, the drafter's paged cache holds the injected context K/V of every committed token, at
the same slots as the target's KV (same page ids, its own tensors). `on_commit` writes them from the
residual streams the runner captured after `target_layer_ids`; `propose` runs the block
[x0, MASK x K] at positions start..start+K (x0 = the last, not yet computed token; start = tokens in
the target cache) for all requests in one flat forward, with the block's own K/V in the lookahead
slots the engine reserved, and takes the argmax of the target's LM head on block rows 1..K.

On one device, after a uniform verify step of greedy rows, the next block does not wait for the host:
`draft_after_verify` queues it right behind the step, its x0 (the bonus token), positions, slots and
lengths computed on the device from the step's argmax and input ids, the step's captured rows written as
its context rows; `propose` then hands those drafts out once the host has read the step back.

A position whose captured row was not kept (capture buffer too small, prefill capture off) keeps
whatever its slot held: drafts get worse, outputs do not change, since every draft is verified.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from atlas.errors import ConfigError
from atlas.host_copy import to_device
from atlas.kernels.draft_prologue import BlockInputs, next_block_inputs
from atlas.layers.attention import AttentionMetadata
from atlas.models.dflash import DFlashConfig, DFlashDraftModel
from atlas.models.loader import (
    constructing,
    fill_dummy_weights,
    iterate_weights,
    resolve_model_path,
    safetensors_files,
)
from atlas.runtime.cuda_graphs import StepGraphs, graph_batch_sizes, graph_pool_bytes
from atlas.speculative.proposer import (
    CommittedTokens,
    Draft,
    DraftsBehind,
    NextVerify,
    PagedDrafter,
    ProposerContext,
    VerifiedStep,
    device_draft,
)
from atlas.speculative.token_map import MappedHead, load_token_map

if TYPE_CHECKING:
    from atlas.config import EngineConfig, ModelConfig
    from atlas.engine.request import Request

logger = logging.getLogger(__name__)

#: folder inside a target checkpoint that holds a drafter shipped with it
BUNDLED_DRAFTER_DIR = "dflash-drafter"
#: most logits elements materialised at once when scoring drafts (rows are chunked above it)
_MAX_LOGITS_ELEMENTS = 1 << 26
_MIN_BACKLOG_ROWS = 256  # (draft_context_backlog: rows kept at the least, whatever --max-num-seqs)


def find_draft_model(config: EngineConfig, target_path: Path) -> Path:
    """--draft-model (folder or hub id), else the drafter shipped inside the target checkpoint."""
    if config.draft_model:
        return resolve_model_path(config.draft_model, hub=config.hub)
    bundled = target_path / BUNDLED_DRAFTER_DIR
    if (bundled / "config.json").is_file():
        logger.info("using the DFlash drafter shipped with the model: %s", bundled)
        return bundled
    raise ConfigError(f"--speculative dflash needs --draft-model PATH (a DFlash drafter trained for this model); "
                      f"{target_path} ships none (no {BUNDLED_DRAFTER_DIR}/ folder)")


def check_against_target(cfg: DFlashConfig, target: ModelConfig, num_draft_tokens: int | None) -> int:
    """Refuse a drafter that cannot drive this target; -> K (draft tokens per step)."""
    where = f"DFlash drafter {cfg.path}"
    fix = "pass a --draft-model trained for this target model"
    if cfg.hidden_size != target.hidden_size:
        raise ConfigError(f"{where} has hidden size {cfg.hidden_size}, the target {target.path} has "
                          f"{target.hidden_size}: it shares the target's embedding and LM head, so they must "
                          f"match; {fix}")
    bad = [i for i in cfg.target_layer_ids if i >= target.num_hidden_layers]
    if bad:
        raise ConfigError(f"{where} reads target layers {cfg.target_layer_ids}, but the target has only "
                          f"{target.num_hidden_layers} layers (ids 0..{target.num_hidden_layers - 1}); {fix}")
    if cfg.mask_token_id >= target.vocab_size:
        raise ConfigError(f"{where} has mask_token_id {cfg.mask_token_id}, outside the target's vocabulary of "
                          f"{target.vocab_size}; {fix}")
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        raise ConfigError(f"{where}: num_attention_heads ({cfg.num_attention_heads}) is not a multiple of "
                          f"num_key_value_heads ({cfg.num_key_value_heads}); Atlas cannot run it")
    rotary_dim = int(cfg.head_dim * cfg.rope.partial_rotary_factor)
    if rotary_dim % 2:
        raise ConfigError(f"{where}: head_dim {cfg.head_dim} gives an odd rotary dimension {rotary_dim}; "
                          "Atlas cannot run it")
    limit = cfg.block_size - 1
    k = limit if num_draft_tokens is None else num_draft_tokens
    if not 1 <= k <= limit:
        raise ConfigError(f"--num-draft-tokens {k} does not fit {where}: its block size {cfg.block_size} allows "
                          f"1 to {limit} draft tokens")
    return k


class DFlashProposer(PagedDrafter):
    uses_target_vocab = True
    can_draft_after_verify = True
    can_write_context_behind = True

    def __init__(self, model: DFlashDraftModel, num_draft_tokens: int, device: torch.device, dtype: torch.dtype,
                 max_num_seqs: int, backlog: bool = True):
        self.model = model
        self.config: DFlashConfig = model.config
        self.num_draft_tokens = num_draft_tokens
        self.lookahead_slots = num_draft_tokens + 1  # the whole block's scratch K/V
        self.device = device
        self.dtype = dtype
        self.max_num_seqs = max_num_seqs
        self.kv_caches: list[torch.Tensor] = []
        self.block_size = 0
        self.target: Any = None
        self.ctx: ProposerContext | None = None
        self.vocab_size = 1
        self.graphs: StepGraphs | None = None
        # Context rows of decode / verify commits, written with the next block (inside its graph).
        self._pending: list[tuple[Any, int, torch.Tensor]] = []
        self._ctx_feats: torch.Tensor | None = None
        self._ctx_positions: torch.Tensor | None = None
        self._ctx_slots: torch.Tensor | None = None
        self.behind = DraftsBehind()  # (blocks queued right behind verify steps)
        # Plain steps' captured rows (write_context_behind), their positions and slots, written as context K/V in one
        # batch before the drafter next reads its cache (--tuning draft_context_backlog; allocated in bind).
        self.backlog_capacity = max(_MIN_BACKLOG_ROWS, 2 * max_num_seqs) if backlog else 0
        self._backlog: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._backlog_rows = 0
        self.backlog_flushes = 0  # (batched writes: tests read it)
        # The target's verify graphs, and the block behind each of their batch sizes as one graph: the block's
        # inputs computed from those graphs' static buffers and outputs, the context K/V of the step's rows,
        # the drafter (see bind_verify_graphs). None: the block's inputs are prepared by separate calls.
        self._verify: StepGraphs | None = None
        self._behind: dict[int, tuple[torch.cuda.CUDAGraph, tuple]] | None = None
        self._bonus: torch.Tensor | None = None  # [max batch] the bonus tokens the block-behind graphs compute
        self.blocks_behind = 0  # (blocks that took that one replay: tests read it)
        # --speculative-token-map: the ids drafts are drawn from, and the target LM head's rows for them.
        self.token_map: MappedHead | None = None

    @staticmethod
    def draft_count(config: EngineConfig, target: ModelConfig) -> int:
        """K for this drafter and target, from the drafter's config.json alone (no weights)."""
        cfg = DFlashConfig.from_path(find_draft_model(config, target.path), target.num_hidden_layers)
        return check_against_target(cfg, target, config.num_draft_tokens)

    @classmethod
    def from_config(cls, config: EngineConfig, ctx: ProposerContext) -> DFlashProposer:
        target = ctx.target_config
        path = find_draft_model(config, target.path)
        cfg = DFlashConfig.from_path(path, target.num_hidden_layers)
        k = check_against_target(cfg, target, config.num_draft_tokens)
        max_positions = ctx.max_model_len + cfg.block_size
        with constructing(ctx.device, ctx.dtype):  # (whole: on a tensor-parallel driver it drafts alone)
            model = DFlashDraftModel(cfg, max_positions)
        if config.dummy_weights:
            fill_dummy_weights(model)
        else:
            with torch.no_grad():
                model.load_weights(iterate_weights(safetensors_files(path), desc="loading drafter"))
        model.eval().requires_grad_(False)
        proposer = cls(model, k, ctx.device, ctx.dtype, config.max_num_seqs,
                       backlog=config.tuning.draft_context_backlog)
        if config.speculative_token_map is not None:
            proposer.use_token_map(load_token_map(config.speculative_token_map, target.vocab_size), ctx)
        logger.info("DFlash drafter %s: %d layers, block size %d, K=%d, target layers %s, mask token %d, "
                    "%.1f M parameters", path, cfg.num_hidden_layers, cfg.block_size, k, cfg.target_layer_ids,
                    cfg.mask_token_id, sum(p.numel() for p in model.parameters()) / 1e6)
        return proposer

    # ------------------------------------------------------------------ what the engine asks
    def capture_layers(self) -> tuple[int, ...]:
        # Runner capture id i = the residual stream after decoder layer i = HF hidden_states[i + 1],
        # exactly what DFlash's target_layer_ids name.
        return tuple(self.config.target_layer_ids)

    def prefill_hidden_rows(self, max_rows: int) -> int:
        """With sliding-window attention in every layer, only the last (window) rows of each prefill
        chunk can ever be seen by a block; with any full-attention layer, every row is useful."""
        windows = self.config.sliding_windows
        if not windows or any(w is None for w in windows) or self.config.causal:
            return max_rows
        per_seq = max(w for w in windows if w is not None) + self.lookahead_slots
        return min(max_rows, self.max_num_seqs * per_seq)

    def use_token_map(self, token_ids: torch.Tensor, ctx: ProposerContext) -> None:
        """Draft from these token ids only: the target LM head's rows for them, copied once."""
        rows = ctx.head_rows(token_ids) if ctx.head_rows is not None else None
        self.token_map = MappedHead.make(rows, token_ids, self.device, self.dtype, "DFlash drafter")

    def weight_bytes(self) -> int:
        head = 0 if self.token_map is None else self.token_map.nbytes
        return sum(p.numel() * p.element_size() for p in self.model.parameters()) + head

    def graph_bytes(self, target: ModelConfig, max_num_seqs: int) -> int:
        # One pool: the block graphs (their logits made a chunk of rows at a time, _argmax_logits) and, drafting
        # behind verify steps, the block behind them, captured into the same pool after it (on the H200 it
        # reserved 0-2 MiB more); each keeps the drafts of every captured size. Then the context rows' buffers.
        cfg, q = self.config, self.num_draft_tokens + 1
        head = target.vocab_size if self.token_map is None else self.token_map.rows.shape[0]
        rows = max_num_seqs * q
        sets = 2 if self.drafts_after_verify else 1
        kept = sets * sum(graph_batch_sizes(max_num_seqs)) * q * 8
        logit_rows = rows if self.token_map is not None else min(rows, max(1, _MAX_LOGITS_ELEMENTS // head))
        pool = graph_pool_bytes(rows, cfg.hidden_size, cfg.intermediate_size, self.dtype, logit_rows, head, kept)
        width = len(cfg.target_layer_ids) * target.hidden_size
        return pool + (rows + self.backlog_capacity) * (width * self.dtype.itemsize + 2 * 8)

    def bind(self, ctx: ProposerContext) -> None:
        self.target = ctx  # embed() and compute_logits() of the target
        self.vocab_size = ctx.target_config.vocab_size
        self.ctx = ctx
        if self.backlog_capacity:
            n, width = self.backlog_capacity, len(self.config.target_layer_ids) * ctx.target_config.hidden_size
            self._backlog = (torch.empty(n, width, dtype=self.dtype, device=self.device),
                             torch.empty(n, dtype=torch.long, device=self.device),
                             torch.empty(n, dtype=torch.long, device=self.device))
        if ctx.graphs_enabled:
            self.capture_block_graphs(use_graphs=True)

    def capture_block_graphs(self, use_graphs: bool) -> None:
        """The drafting step (context K/V of the last commit, then the block: embed, drafter, LM head,
        argmax) as CUDA graphs of uniform K + 1-row steps; use_graphs=False runs the same static-buffer
        path eagerly (for CPU tests)."""
        ctx, cfg = self.ctx, self.config
        rows = self.max_num_seqs * (self.num_draft_tokens + 1)
        width = len(cfg.target_layer_ids) * ctx.target_config.hidden_size
        self._ctx_feats = torch.zeros(rows, width, dtype=self.dtype, device=self.device)
        self._ctx_positions = torch.zeros(rows, dtype=torch.long, device=self.device)
        self._ctx_slots = torch.full((rows,), -1, dtype=torch.long, device=self.device)
        self._prologue_views: dict[int, tuple] = {}  # (draft_after_verify's views, by batch size)
        self._verify = self._behind = None  # (bind_verify_graphs again: the block's buffers are new)
        self.graphs = ctx.make_graphs("dflash block", self._graphed_block, self.num_draft_tokens + 1,
                                      self.attention,
                                      -(-(ctx.max_model_len + self.num_draft_tokens) // self.block_size), use_graphs)
        self.graphs.capture()

    def bind_verify_graphs(self, graphs: StepGraphs | None) -> None:
        """Capture the block behind each batch size of the target's verify graphs (the same sizes as the
        block's): its inputs from the verify step's static buffers and outputs (the prologue kernel), the
        step's rows as context K/V, then the drafter, in one graph, so a block behind a verify step is one
        replay. Padding sequences of the verify step draft in the scratch pages (the engine gives them 2q
        positions). Without CUDA graphs (the CPU's static-buffer path) the same function runs eagerly."""
        self._verify = self._behind = None
        g = self.graphs
        if graphs is None or g is None or graphs.q != g.q or graphs.sizes != g.sizes or (
                len(graphs.attn.scratch_row) * self.block_size < 2 * g.q):
            return
        self._verify = graphs
        self._bonus = torch.zeros(g.max_batch, dtype=torch.long, device=self.device)
        # Each request's real drafts: K, except for a step whose drafts the host cut (set for it, then reset).
        self._num_drafts = torch.full((g.max_batch,), self.num_draft_tokens, dtype=torch.long, device=self.device)
        self._behind_views: dict[int, tuple] = {}
        if g.use_graphs and graphs.use_graphs:
            self._behind = g.capture_sized(lambda size: self._block_behind(size, *graphs.graphs[size][1][::2]),
                                           "dflash block behind verify")

    def _block_behind(self, size: int, target_tokens: torch.Tensor, captured: torch.Tensor,
                      eager: bool = False) -> tuple[torch.Tensor]:
        """The block behind a verify step of `size` sequences (padded), from the verify graphs' static
        buffers and the step's target tokens and captured rows: -> (the block's argmax ids [size * q],)."""
        g, v, q = self.graphs, self._verify, self.num_draft_tokens + 1
        ga, va = g.attn, v.attn
        rows = size * q
        ids, positions = g.input_ids[:rows], g.positions[:rows]
        out = self._block_buffers(size, self._bonus[:size])
        step_positions, step_slots = v.positions[:rows], va.slot_mapping[:rows]
        next_block_inputs(v.input_ids[:rows], target_tokens, step_positions, step_slots, self._num_drafts[:size],
                          va.page_tables[:size], self.block_size, self.config.mask_token_id, out)
        width = min(ga.page_tables.shape[1], va.page_tables.shape[1])
        ga.page_tables[:size, :width].copy_(va.page_tables[:size, :width])
        self.model.write_context(captured, step_positions, step_slots, self.kv_caches)
        meta = ga.meta(size, ga.seq_lens[:size].tolist() if eager else None)
        hidden = self.model(self.target.embed(ids), positions, self.kv_caches, meta)
        return (self._argmax_logits(hidden),)

    def _block_buffers(self, n: int, bonus: torch.Tensor | None) -> BlockInputs:
        """The block graphs' static inputs for n requests (and the context rows' buffers), as the prologue kernel
        writes them."""
        g, rows = self.graphs, n * (self.num_draft_tokens + 1)
        return BlockInputs(g.input_ids[:rows], g.positions[:rows], g.attn.slot_mapping[:rows], g.attn.seq_lens[:n],
                           bonus, self._ctx_positions[:rows], self._ctx_slots[:rows])

    def _graphed_block(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata):
        rows = ids.shape[0]  # (K + 1 context rows a sequence too; padding rows have slot -1)
        self.model.write_context(self._ctx_feats[:rows], self._ctx_positions[:rows], self._ctx_slots[:rows],
                                 self.kv_caches)
        hidden = self.model(self.target.embed(ids), positions, self.kv_caches, meta)
        return (self._argmax_logits(hidden),)

    # ------------------------------------------------------------------ hooks
    @torch.inference_mode()
    def on_commit(self, commits: list[CommittedTokens]) -> None:
        """Context K/V of the committed tokens whose residual streams were captured (the last rows).
        Commits of decodes and verifies (at most K + 1 rows) wait for the next block, whose graph writes
        them; longer ones (prefill chunks) are written now. A request drafted right after its verify step
        has had those rows written there."""
        self._flush_pending()
        self.behind.read_back()
        now: list[tuple[Any, int, torch.Tensor]] = []
        for c in commits:
            if c.captured is None or c.num_tokens <= 0 or c.request.request_id in self.behind.ready:
                continue
            hidden = c.hidden
            rows = min(hidden.shape[0], c.num_tokens)
            if rows <= 0:
                continue
            entry = (c.request, c.start_position + c.num_tokens - rows,
                     hidden if rows == hidden.shape[0] else hidden[hidden.shape[0] - rows:])
            small = self.graphs is not None and rows <= self.num_draft_tokens + 1
            (self._pending if small else now).append(entry)
        self._write_context(now)

    @torch.inference_mode()
    def write_context_behind(self, captured: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor
                             ) -> None:
        """A plain step's captured rows (views of buffers the next step rewrites): kept in the backlog, or, without
        one or too many to fit it, written as context K/V now."""
        self._flush_pending()  # (rows of an earlier step still waiting: in position order, before these)
        rows = captured.shape[0]
        if self._backlog is None or rows > self.backlog_capacity:
            self.flush_backlog()
            self.model.write_context(captured, positions, slot_mapping, self.kv_caches)
            return
        if self._backlog_rows + rows > self.backlog_capacity:
            self.flush_backlog()
        feats, pos, slots = self._backlog
        end = self._backlog_rows + rows
        feats[self._backlog_rows:end].copy_(captured)
        pos[self._backlog_rows:end].copy_(positions)
        slots[self._backlog_rows:end].copy_(slot_mapping)
        self._backlog_rows = end

    def flush_backlog(self) -> None:
        """Write the backlog's rows as context K/V (one batch: the drafter's weights read once for them)."""
        if self._backlog_rows:
            n, self._backlog_rows = self._backlog_rows, 0
            feats, pos, slots = self._backlog
            with torch.inference_mode():
                self.model.write_context(feats[:n], pos[:n], slots[:n], self.kv_caches)
            self.backlog_flushes += 1

    def on_pages_released(self) -> None:
        self.flush_backlog()  # (the backlog may hold rows for them, and keeps no owners)

    def allocate_kv_cache(self, num_pages: int, block_size: int) -> None:
        self._backlog_rows = 0  # (slots of the cache before)
        super().allocate_kv_cache(num_pages, block_size)

    def on_request_finish(self, req: Request) -> None:
        # Its pages go back to the pool: context rows still waiting must not be written there (the backlog, which
        # keeps no owners, is written before they go).
        self.flush_backlog()
        self._pending = [e for e in self._pending if e[0] is not req]
        self.behind.forget(req.request_id)

    # (preempted, it gives its pages back too; its context rows are written again as it recomputes them)
    on_request_preempt = on_request_finish

    def _flush_pending(self) -> None:
        pending, self._pending = self._pending, []
        self._write_context(pending)

    def _write_context(self, entries: list[tuple[Any, int, torch.Tensor]]) -> None:
        """Write context K/V of (request, first position, captured rows) entries now."""
        if not entries:
            return
        positions: list[int] = []
        slots: list[int] = []
        for req, first, hidden in entries:
            rows = hidden.shape[0]
            positions.extend(range(first, first + rows))
            slots.extend(self.attention.slots(req.page_ids, first, rows))
        feats = torch.cat([h for _, _, h in entries]) if len(entries) > 1 else entries[0][2]
        both = to_device(positions + slots, torch.long, self.device)
        self.model.write_context(feats, both[: len(positions)], both[len(positions):], self.kv_caches)

    def _stage_context(self, requests: list[Request]) -> None:
        """Put the pending context rows of `requests` into the graph's static buffers (K + 1 rows a
        request, unused rows with slot -1); pending rows of other requests are written now."""
        n = self.num_draft_tokens + 1
        index = {id(r): i for i, r in enumerate(requests)}
        staged, others = {}, []
        for entry in self._pending:
            i = index.get(id(entry[0]))
            (others.append(entry) if i is None or i in staged else staged.__setitem__(i, entry))
        self._pending = []
        self._write_context(others)
        total = len(requests) * n
        positions = torch.zeros(total, dtype=torch.long)
        slots = torch.full((total,), -1, dtype=torch.long)
        dst: list[int] = []
        feats: list[torch.Tensor] = []
        for i, (req, first, hidden) in staged.items():
            rows = hidden.shape[0]
            positions[i * n: i * n + rows] = torch.arange(first, first + rows)
            slots[i * n: i * n + rows] = torch.tensor(self.attention.slots(req.page_ids, first, rows))
            dst.extend(range(i * n, i * n + rows))
            feats.append(hidden)
        both = to_device(torch.cat([positions, slots, torch.tensor(dst, dtype=torch.long)]), torch.long, self.device)
        self._ctx_positions[:total].copy_(both[:total])
        self._ctx_slots[:total].copy_(both[total: 2 * total])
        self._ctx_slots[total:].fill_(-1)
        if feats:
            self._ctx_feats.index_copy_(0, both[2 * total:], torch.cat(feats))

    @torch.inference_mode()
    def propose(self, requests: list[Request]) -> list[Draft]:
        self.flush_backlog()  # (every row before the drafter reads its cache)
        ready = self.behind.take()
        drafts: dict[int, Draft] = {}
        for req in requests:
            entry = ready.get(req.request_id)
            draft = DraftsBehind.draft(entry, req, self.num_draft_tokens) if entry is not None else None
            if draft is not None:
                drafts[id(req)] = draft
        rest = [r for r in requests if id(r) not in drafts]
        for req, draft in zip(rest, self._propose(rest), strict=True):
            drafts[id(req)] = draft
        return [drafts[id(r)] for r in requests]

    def _propose(self, requests: list[Request]) -> list[Draft]:
        if not requests:
            return []
        ids, positions, meta = self._block_inputs(requests)
        if self.graphs is not None and self.graphs.can_run(meta):
            self._stage_context(requests)
            n = self.num_draft_tokens + 1
            tokens = self.graphs.run(ids, positions, meta)[0].view(len(requests), n)[:, 1:]
        else:
            self._flush_pending()
            rows = self._block_forward(ids, positions, meta)
            tokens = self._argmax_logits(rows.flatten(0, 1)).view(len(requests), self.num_draft_tokens)
        if self.device_drafts:  # (a copy: the graph's output buffer is rewritten by its next replay)
            tokens = tokens.clone()
            return [device_draft(t, req.all_token_ids[-1]) for t, req in zip(tokens.unbind(0), requests, strict=True)]
        return [Draft(t, None) for t in tokens.tolist()]

    @torch.inference_mode()
    def draft_after_verify(self, step: VerifiedStep) -> NextVerify | None:
        """The next block of every request of a verify step, queued behind it: which drafts the target
        accepted, the bonus token x0 and the block's positions and slots are computed on the device from the
        step's outputs. The step's captured rows are its context rows (rows past the accepted ones lie at the
        block's positions, whose K/V the block then overwrites)."""
        if not self.can_draft_behind(step):
            return None
        self._flush_pending()  # (context rows still waiting, of any request: before the block reads them)
        self.flush_backlog()
        k = self.num_draft_tokens
        # (drafts the host cut, at the end of a request: their padding is never accepted)
        cut = to_device(step.num_drafts, torch.long, self.device) if any(d != k for d in step.num_drafts) else None
        if self._verify is not None and step.graphs is self._verify:  # (one replay: the usual case)
            following = self._replay_behind(step, cut)
        else:
            following = self._draft_behind_in_calls(step, cut)
        self.behind.record(step, following.drafts)
        return following

    def _replay_behind(self, step: VerifiedStep, cut: torch.Tensor | None) -> NextVerify:
        """The block behind `step` as one replay of its graph (bind_verify_graphs), which reads the verify
        graphs' buffers; draft counts of a step whose drafts the host cut are set for that replay."""
        graphs, k = self.graphs, self.num_draft_tokens
        n, q = len(step.request_ids), k + 1
        rows = n * q
        if cut is not None:
            self._num_drafts[:n].copy_(cut)
        if self._behind is not None:
            graph, outputs = self._behind[graphs.size_for(n)]
            graph.replay()
            block = outputs[0]
        else:
            block = self._block_behind(n, step.target_tokens, step.captured, eager=True)[0]
        if cut is not None:
            self._num_drafts[:n].fill_(k)
        self.blocks_behind += 1
        tokens = block[:rows].view(n, q)[:, 1:].clone()
        views = self._behind_views.get(n)
        if views is None:
            views = self._behind_views[n] = (self._bonus[:n, None], graphs.positions[:rows],
                                             graphs.attn.slot_mapping[:rows], graphs.attn.seq_lens[:n])
        steps = graphs.steps_run  # (a block drafted by `propose` before the next verify rewrites the buffers)
        return NextVerify(views[0], tokens, *views[1:], still_valid=lambda: graphs.steps_run == steps)

    def _draft_behind_in_calls(self, step: VerifiedStep, cut: torch.Tensor | None) -> NextVerify:
        """The block behind `step` from the step's own tensors: the prologue kernel writes the block's inputs
        into the block graphs' buffers, then their graph runs (a step adopted from a pre-launch, or verify graphs
        the block graphs do not follow)."""
        graphs = self.graphs
        n, q = len(step.request_ids), self.num_draft_tokens + 1
        rows = n * q
        # The block's ids, positions, slots and lengths straight into the graph's static buffers, and the step's
        # rows as its context rows: one kernel (kernels/draft_prologue.py).
        views = self._prologue_views.get(n)
        if views is None:  # (the static buffers' views for n requests: made once a batch size)
            views = self._prologue_views[n] = (self._block_buffers(n, None), self._ctx_feats[:rows],
                                               self._ctx_slots[rows:])
        out = dataclasses.replace(views[0], bonus=torch.empty(n, dtype=torch.long, device=self.device))
        ctx_feats, unused_ctx_slots = views[1:]
        next_block_inputs(step.input_ids, step.target_tokens, step.positions, step.slot_mapping, cut,
                          step.page_tables, self.block_size, self.config.mask_token_id, out)
        ctx_feats.copy_(step.captured)
        unused_ctx_slots.fill_(-1)
        lens = graphs.host_lens(out.seq_lens, step.start)
        tokens = graphs.run_staged(n, step.page_tables, lens)[0].view(n, q)[:, 1:].clone()
        return NextVerify(out.bonus[:, None], tokens, out.positions, out.slots, out.seq_lens)

    def can_draft_behind(self, step: VerifiedStep) -> bool:
        """Whether draft_after_verify queues the block of every request of `step`: the block graphs fit it and
        the engine reserved each request's pages through the block's last position."""
        graphs = self.graphs
        return (graphs is not None and step.captured is not None
                and graphs.holds(len(step.request_ids), step.page_tables.shape[1])
                and step.pages_hold_next_step(self.block_size))

    def takes_captured_rows(self, step: VerifiedStep) -> bool:
        return self.can_draft_behind(step)

    @torch.inference_mode()
    def block_hidden(self, requests: list[Request]) -> torch.Tensor:
        """Run the block [x0, MASK x K] of every request in one flat forward; -> the final-normed
        hidden states of block rows 1..K, [len(requests), K, H] (row j predicts position start + j)."""
        self._flush_pending()
        self.flush_backlog()
        return self._block_forward(*self._block_inputs(requests))

    def _block_forward(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        hidden = self.model(self.target.embed(ids), positions, self.kv_caches, meta)
        return hidden.view(meta.num_reqs, self.num_draft_tokens + 1, -1)[:, 1:]

    def _block_inputs(self, requests: list[Request]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Token ids [x0, MASK x K] per request, their positions start..start+K, and the metadata."""
        k = self.num_draft_tokens
        n = k + 1
        mask = self.config.mask_token_id
        ids: list[int] = []
        step = self.attention.rows()
        for req in requests:
            ids.append(req.all_token_ids[-1])
            ids.extend([mask] * k)
            step.add(req.page_ids, req.num_computed_tokens, n)
        meta = step.metadata(self.device)
        both = to_device(ids + step.positions, torch.long, self.device)
        return both[: len(ids)], both[len(ids):], meta

    def _argmax_logits(self, rows: torch.Tensor) -> torch.Tensor:
        if self.token_map is not None:  # (the argmax over the mapped ids' logits, as token ids)
            return self.token_map.argmax(rows)
        chunk = max(1, _MAX_LOGITS_ELEMENTS // self.vocab_size)
        out = [self.target.compute_logits(rows[i:i + chunk]).argmax(-1) for i in range(0, rows.shape[0], chunk)]
        return torch.cat(out) if len(out) > 1 else out[0]
