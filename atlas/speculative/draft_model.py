"""Draft-model drafting (`--speculative draft_model --draft-model PATH`): a smaller checkpoint of an architecture
Atlas loads, with the target's tokenizer (e.g. Qwen3-0.6B drafting for Qwen3-8B), proposes K tokens by K greedy
decode steps of its own.

The drafter keeps its own paged KV cache (its layers' K/V), addressed by the target's page ids and slots, so it
is allocated, freed, preempted and served from the prefix cache with the request's pages, and the memory plan
counts it through `kv_bytes_per_token`. It reads token ids only (no captured hidden states).

- `on_commit`: the drafter's forward over the committed tokens (prefill chunks, accepted tokens) whose K/V it
  has not written yet, at their slots, all requests in one flat forward. Positions its last `propose` already
  wrote with the same tokens (the last token and the accepted drafts) are skipped.
- `propose`: K single-token decode steps, every request in one batched forward per step: step j feeds the
  request's last token (j = 0) or the previous draft at position num_computed_tokens + j, writing its K/V in
  the lookahead slots the engine reserved (`lookahead_slots = K`); the draft is the argmax of the drafter's
  logits. The target verifies every draft, so outputs never change; those slots are overwritten once the
  target has verified the positions.

On CUDA the K decode steps replay CUDA graphs (one row a request). `on_commit` runs eagerly: after a verify step it
usually has nothing left to write (its `propose` wrote the last token and the accepted drafts; the bonus token is
the next `propose`'s first row), so it runs for prompt chunks. On one device the steps are queued right behind each
uniform greedy verify step (`draft_after_verify`): the accepted count and the bonus token come from the step's
outputs there, one more step writes the last accepted token's row (which no earlier step may have written), then
the K steps draft from the bonus token, at the next verify step's positions.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from atlas.config import ModelConfig, read_config_json
from atlas.errors import ConfigError, UnsupportedModelError
from atlas.host_copy import to_device
from atlas.models.loader import (
    constructing,
    fill_dummy_weights,
    iterate_weights,
    resolve_model_path,
    safetensors_files,
)
from atlas.models.quantization import refuse_quantized
from atlas.models.registry import model_class
from atlas.runtime.cuda_graphs import uniform_graph_bytes
from atlas.runtime.drafting import NextVerify, VerifiedStep
from atlas.speculative.proposer import (
    CommittedTokens,
    Draft,
    DraftsBehind,
    PagedDrafter,
    ProposerContext,
    device_draft,
    run_rows_behind,
    verify_outcome,
)

if TYPE_CHECKING:
    from atlas.config import EngineConfig
    from atlas.engine.request import Request
    from atlas.layers.attention import AttentionMetadata
    from atlas.models.base import CausalLM
    from atlas.runtime.cuda_graphs import StepGraphs

logger = logging.getLogger(__name__)

#: draft tokens per verify step when --num-draft-tokens is not given
DEFAULT_DRAFT_TOKENS = 4


def draft_count(config: EngineConfig) -> int:
    """K: --num-draft-tokens, else DEFAULT_DRAFT_TOKENS (what a parallel worker's stand-in says too)."""
    return config.num_draft_tokens or DEFAULT_DRAFT_TOKENS


def find_draft_checkpoint(config: EngineConfig) -> Path:
    """The --draft-model folder (or hub id, fetched)."""
    if not config.draft_model:
        raise ConfigError("--speculative draft_model needs --draft-model PATH: a smaller checkpoint with the target's "
                          "tokenizer and vocabulary (e.g. Qwen/Qwen3-0.6B drafting for Qwen/Qwen3-8B)")
    try:
        return resolve_model_path(config.draft_model, weights=not config.dummy_weights,
                                  hub=config.hub)
    except UnsupportedModelError as exc:
        raise ConfigError(f"--draft-model {config.draft_model}: {exc}") from None


def parameter_count(cfg: ModelConfig) -> int:
    """Parameters of the whole model that config.json describes (built on the meta device: nothing allocated)."""
    with constructing(torch.device("meta"), torch.float32):
        model = model_class(cfg)(cfg, 1)
    return sum(p.numel() for p in model.parameters())


def check_against_target(path: Path, target: ModelConfig) -> ModelConfig:
    """Refuse a draft checkpoint that cannot draft for this target; -> its config."""
    where = f"--draft-model {path}"
    cfg = ModelConfig.from_dict(read_config_json(path, "--draft-model", "a Hugging Face checkpoint", "checkpoint"),
                                path)
    try:
        refuse_quantized(cfg.raw, path, "draft model")
    except UnsupportedModelError as exc:
        raise ConfigError(f"{exc} (--speculative draft_model runs unquantized drafters only)") from None
    try:
        cls = model_class(cfg)
    except UnsupportedModelError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    if cls.keeps_recurrent_state:
        # (its linear-attention layers would need state slots of their own, carried from one of its steps to the
        #  next; without them its drafts would quietly be those of another model)
        raise ConfigError(f"{where} ({cfg.architecture}) has linear-attention layers with recurrent state, which "
                          "--speculative draft_model does not run: pass a drafter of full-attention layers (e.g. a "
                          "small Qwen3), or use the target's own MTP module (--speculative mtp)")
    if cfg.vocab_size != target.vocab_size:
        raise ConfigError(f"{where} has a vocabulary of {cfg.vocab_size} tokens, the target {target.path} has "
                          f"{target.vocab_size}: a draft model must share the target's tokenizer and vocabulary "
                          "(e.g. a smaller model of the same family)")
    drafter, full = parameter_count(cfg), parameter_count(target)
    if drafter > full:
        raise ConfigError(f"{where} ({drafter / 1e6:.1f} M parameters) is bigger than the target {target.path} "
                          f"({full / 1e6:.1f} M): a draft model must be smaller than the model it drafts for")
    return cfg


@dataclass
class _Written:
    """What one `propose` wrote into a request's drafter cache: positions first .. first + K - 1 at `slots`,
    with its last token then drafts[:K - 1] (the drafts of every request of that call, on the device, read
    back at most once, by the first commit that needs them)."""

    first: int
    slots: list[int]
    last_token: int
    batch: _DraftBatch
    row: int


class _DraftBatch:
    def __init__(self, drafts: torch.Tensor):
        self.drafts = drafts  # [n, K]
        self._host: list[list[int]] | None = None

    def host(self) -> list[list[int]]:
        if self._host is None:
            self._host = self.drafts.tolist()
        return self._host


class DraftModelProposer(PagedDrafter):
    uses_target_vocab = False  # (its own embedding and LM head)
    uses_target_head = False
    can_draft_after_verify = True

    @property
    def lookahead_slots(self) -> int:
        """Positions num_computed .. num_computed + K - 1 (its steps' rows); drafting right behind a verify step,
        the next verify step's rows too, which reach K + 1 past the step's."""
        return self.num_draft_tokens + 1 if self.drafts_after_verify else self.num_draft_tokens

    def __init__(self, model: CausalLM, num_draft_tokens: int, device: torch.device, dtype: torch.dtype):
        self.model = model
        self.num_draft_tokens = num_draft_tokens
        self.device = device
        self.dtype = dtype
        self.kv_caches: list[torch.Tensor] = []
        self.block_size = 0
        self._written: dict[str, _Written] = {}
        self.positions_written = 0  # (drafter rows run by on_commit: tests read it)
        self.positions_skipped = 0  # (committed positions its propose had already written)
        self.graphs: StepGraphs | None = None  # its decode steps (one row a request: the drafter, head, argmax)
        self.behind = DraftsBehind()  # (steps queued right behind verify steps)
        self.blocks_behind = 0  # (verify steps drafted behind: tests read it)

    @classmethod
    def from_config(cls, config: EngineConfig, ctx: ProposerContext) -> DraftModelProposer:
        target = ctx.target_config
        path = find_draft_checkpoint(config)
        cfg = check_against_target(path, target)
        k = draft_count(config)
        if cfg.max_position_embeddings < ctx.max_model_len:
            logger.warning("draft model %s has max_position_embeddings %d < max model length %d: its drafts past "
                           "that position will be poor (outputs are unchanged)", path, cfg.max_position_embeddings,
                           ctx.max_model_len)
        # Built whole (no parallel view): on a tensor-parallel driver it drafts alone, calling no collective.
        with constructing(ctx.device, ctx.dtype):
            model = model_class(cfg)(cfg, ctx.max_model_len + k + 1)
        if config.dummy_weights:
            fill_dummy_weights(model)
        else:
            with torch.no_grad():
                model.load_weights(iterate_weights(safetensors_files(path), desc="loading draft model"))
        model.eval().requires_grad_(False)
        logger.info("draft model %s (%s): %d layers, K=%d, %.1f M parameters", path, cfg.architecture,
                    cfg.num_hidden_layers, k, sum(p.numel() for p in model.parameters()) / 1e6)
        return cls(model, k, ctx.device, ctx.dtype)

    # ------------------------------------------------------------------ what the engine asks
    def weight_bytes(self) -> int:
        tensors = [*self.model.parameters(), *self.model.buffers()]
        return sum(t.numel() * t.element_size() for t in tensors)

    def graph_bytes(self, target: ModelConfig, max_num_seqs: int) -> int:
        cfg = self.model.config  # (its decode graphs keep each captured size's drafts: 8 bytes a row)
        return uniform_graph_bytes(max_num_seqs, 1, cfg.hidden_size, cfg.intermediate_size, self.dtype,
                                   cfg.vocab_size, 8, logit_rows_per_seq=1)

    def bind(self, ctx: ProposerContext) -> None:
        if ctx.graphs_enabled:
            self.capture_step_graphs(ctx, use_graphs=True)

    def capture_step_graphs(self, ctx: ProposerContext, use_graphs: bool) -> None:
        """Its decode step (one row a request) as CUDA graphs; use_graphs=False runs the same static-buffer path
        eagerly (for CPU tests)."""
        self.graphs = ctx.make_graphs("draft model", self._graphed_step, 1, self.attention, self._graph_width(ctx),
                                      use_graphs)
        self.graphs.capture()

    def _graphed_step(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata):
        hidden, _ = self.model(ids, positions, self.kv_caches, meta)
        return (self.model.compute_logits(hidden).argmax(-1),)

    # ------------------------------------------------------------------ hooks
    def on_request_finish(self, req: Request) -> None:
        self._written.pop(req.request_id, None)
        self.behind.forget(req.request_id)

    # (preempted, its pages go back: its rows are written again as it recomputes them)
    on_request_preempt = on_request_finish

    def _forward(self, tokens: list[int] | torch.Tensor, positions: list[int], meta: AttentionMetadata
                 ) -> torch.Tensor:
        """The drafter over the flat batch `meta` describes (writing its K/V at its slots) -> its final hidden rows."""
        ids = tokens if isinstance(tokens, torch.Tensor) else to_device(tokens, torch.long, self.device)
        hidden, _ = self.model(ids, to_device(positions, torch.long, self.device), self.kv_caches, meta)
        return hidden

    def _already_written(self, c: CommittedTokens, end: int) -> int:
        """How many committed positions from c.start_position on its last propose wrote with these tokens, at
        these slots."""
        req = c.request
        w = self._written.pop(req.request_id, None)
        if w is None or w.first != c.start_position:
            return 0
        n = min(end - w.first, len(w.slots))
        if n <= 0 or self.attention.slots(req.page_ids, w.first, n) != w.slots[:n]:
            return 0  # (preempted and recomputed: other pages)
        tokens = req.all_token_ids
        if tokens[w.first] != w.last_token:
            return 0
        drafts = w.batch.host()[w.row]
        same = 1
        while same < n and tokens[w.first + same] == drafts[same - 1]:
            same += 1
        return same

    @torch.inference_mode()
    def on_commit(self, commits: list[CommittedTokens]) -> None:
        """The drafter's K/V of every committed position it has not written yet, in one flat forward (a request
        drafted right behind its verify step had every committed row written there)."""
        self.behind.read_back()
        tokens: list[int] = []
        rows = self.attention.rows()
        for c in commits:
            req = c.request
            if req.request_id in self.behind.ready:
                self._written.pop(req.request_id, None)
                continue
            end = min(c.start_position + c.num_tokens, len(req.all_token_ids))
            if end <= c.start_position:
                continue
            skip = self._already_written(c, end)
            first = c.start_position + skip
            self.positions_skipped += skip
            if first >= end:
                continue
            tokens.extend(req.all_token_ids[first:end])
            rows.add(req.page_ids, first, end - first)
        if rows:
            self.positions_written += len(tokens)
            self._forward(tokens, rows.positions, rows.metadata(self.device))

    @torch.inference_mode()
    def propose(self, requests: list[Request]) -> list[Draft]:
        """K chained greedy decode steps of the drafter, all requests in one forward a step."""
        if not requests:
            return []
        behind = self.behind.take()
        if behind:
            return self._hand_out(requests, behind)
        n = len(requests)
        starts = [req.num_computed_tokens for req in requests]
        tables = [req.page_ids for req in requests]
        last = [req.all_token_ids[-1] for req in requests]
        ids: torch.Tensor | list[int] = last
        steps: list[torch.Tensor] = []
        all_slots = [self.attention.slots(req.page_ids, s, self.num_draft_tokens)
                     for req, s in zip(requests, starts, strict=True)]
        for j in range(self.num_draft_tokens):
            positions = [s + j for s in starts]
            meta = self.attention.decode_metadata(tables, positions, self.device, [s[j] for s in all_slots])
            if self.graphs is not None and self.graphs.can_run(meta):
                if not isinstance(ids, torch.Tensor):
                    ids = to_device(ids, torch.long, self.device)
                # (a copy: the graph's output buffer is rewritten by its next replay)
                ids = self.graphs.run(ids, to_device(positions, torch.long, self.device), meta)[0].clone()
            else:
                ids = self.model.compute_logits(self._forward(ids, positions, meta)).argmax(-1)
            steps.append(ids)
        stacked = torch.stack(steps, dim=1)  # [n, K]
        batch = _DraftBatch(stacked)
        for i, req in enumerate(requests):
            self._written[req.request_id] = _Written(starts[i], all_slots[i], last[i], batch, i)
        if self.device_drafts:
            return [device_draft(stacked[i], last[i]) for i in range(n)]
        return [Draft(row) for row in batch.host()]

    def _hand_out(self, requests: list[Request], behind: dict[str, tuple[int, torch.Tensor]]) -> list[Draft]:
        """The drafts queued behind the last verify step for its requests (none for one whose acceptance the host
        did not follow there: its next commit writes its rows); the others draft now."""
        drafts: dict[int, Draft] = {}
        rest = []
        for req in requests:
            entry = behind.get(req.request_id)
            if entry is None:
                rest.append(req)
            else:
                draft = DraftsBehind.draft(entry, req, self.num_draft_tokens)
                drafts[id(req)] = draft if draft is not None else Draft([])
        for req, draft in zip(rest, self.propose(rest), strict=True):
            drafts[id(req)] = draft
        return [drafts[id(r)] for r in requests]

    # ------------------------------------------------------------------ right behind a verify step
    def can_draft_behind(self, step: VerifiedStep) -> bool:
        """Whether draft_after_verify queues the steps of every request of `step`: its graphs' buffers fit it and
        the engine reserved each request's pages through the next verify step's rows."""
        graphs = self.graphs
        return (graphs is not None and graphs.holds(len(step.request_ids), step.page_tables.shape[1])
                and step.pages_hold_next_step(self.block_size))

    @torch.inference_mode()
    def draft_after_verify(self, step: VerifiedStep) -> NextVerify | None:
        """The next drafts of every request of a verify step, queued behind it: the accepted count, the bonus token
        and the next verify step's positions and slots from the step's outputs on the device
        (kernels/draft_prologue.py); one step writes the last accepted token's row (a step of all K accepted ends
        with a draft no earlier step wrote), then K steps draft from the bonus token."""
        if not self.can_draft_behind(step):
            return None
        k, n, graphs = self.num_draft_tokens, len(step.request_ids), self.graphs
        q = k + 1
        nxt, accepted = verify_outcome(step, k, self.block_size)
        accepted = accepted[:, None]
        # Step 0: the last accepted row (its token, position and slot in the verify step); steps 1..K: the bonus token,
        # then each draft, at the next verify step's first K positions.
        ids = step.input_ids.view(n, q).gather(1, accepted)[:, 0]
        positions = torch.cat([step.positions.view(n, q).gather(1, accepted), nxt.positions.view(n, q)[:, :k]], 1)
        slots = torch.cat([step.slot_mapping.view(n, q).gather(1, accepted), nxt.slots.view(n, q)[:, :k]], 1)
        bound = [s + 2 * q for s in step.start]  # (the most a row's length can be)
        steps = []
        for j in range(q):
            out = run_rows_behind(graphs, nxt.bonus if j == 1 else ids, positions[:, j].contiguous(),
                                  slots[:, j].contiguous(), step.page_tables, bound)[0][:n].clone()
            if j:
                steps.append(out)
            ids = out
        drafts = torch.stack(steps, dim=1)
        self.blocks_behind += 1
        self.behind.record(step, drafts)
        return NextVerify(nxt.bonus[:, None], drafts, nxt.positions, nxt.slots, nxt.seq_lens, still_valid=lambda: True)
