"""MTP drafting (`--speculative mtp`): the target's own multi-token-prediction module proposes K tokens.

The module (e.g. DeepSeek-V3's, at layer index num_hidden_layers) turns the target's final hidden state
h_i at position i and the token t_{i+1} that follows into u_i, whose logits predict t_{i+2}
(spec 3.2). It has its own decoder block and its own paged latent cache, addressed by the target's page
ids and slots.

`on_commit` runs the module over every committed position whose hidden state was captured (the
target's last-layer residual stream; the module applies the target's final norm), with the following
token as input. That fills its cache at those positions, and the last committed row of a request
(position n - 2 when n tokens are known) gives the first draft d1 = argmax, predicting t_n. `propose`
chains the same module K - 1 more times: step j feeds token d_j with the previous step's u as the
hidden state at position n - 2 + j, writing its cache there (lookahead slots; those entries are
overwritten with real ones once the target has verified the positions). Drafts are greedy, verified
by the target, so outputs never change; what the drafts cost is only acceptance.

A position whose hidden state was not captured (capture buffer full) keeps whatever its slot held, and
the last position of a page served from the prefix cache holds the row computed with the next token of
the request that first computed it: both only lower acceptance.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from atlas.errors import ConfigError
from atlas.host_copy import to_device
from atlas.layers.attention import AttentionMetadata
from atlas.models.loader import constructing, fill_dummy_weights, iterate_weights, safetensors_files
from atlas.models.quantization import dequantize_fp8, fp8_scheme
from atlas.runtime.cuda_graphs import uniform_graph_bytes
from atlas.speculative.proposer import (
    CommittedTokens,
    Draft,
    PagedDrafter,
    ProposerContext,
    place_drafts,
)
from atlas.speculative.token_map import MappedHead, load_token_map

if TYPE_CHECKING:
    from atlas.config import EngineConfig, ModelConfig
    from atlas.engine.request import Request
    from atlas.runtime.cuda_graphs import StepGraphs

logger = logging.getLogger(__name__)


class MTPProposer(PagedDrafter):
    reads_mtp_input = True  # (what the target captures for it is its model's MTP input: CausalLM.captured_width)
    uses_target_vocab = True  # (the target's embedding; its head is its own or, for some families, the target's)
    uses_target_head = False

    @classmethod
    def needs_target_head(cls, model: object) -> bool:
        return bool(getattr(model, "mtp_uses_target_head", False))

    def __init__(self, module: torch.nn.Module, num_draft_tokens: int, num_target_layers: int,
                 device: torch.device, dtype: torch.dtype, catch_up_graphs: bool = True,
                 max_context: int | None = None):
        self.module = module
        # --speculative-max-model-len: the module runs at positions below it only (rows past it are never handed
        # to it, and a request past it gets no drafts)
        self.max_context = max_context
        # (On an H200 the graphed catch-up pass took a small MTP model's bf16 batch-1 speed from 331 to 752 tok/s,
        #  greedy tokens equal to the eager pass's; --tuning mtp_catch_up_graphs=0 runs it eagerly.)
        self.catch_up_graphs = catch_up_graphs
        self.num_draft_tokens = num_draft_tokens
        self.lookahead_slots = num_draft_tokens - 1  # the chained steps' cache rows
        self.num_target_layers = num_target_layers
        self.device = device
        self.dtype = dtype
        self.kv_caches: list[torch.Tensor] = []
        self.block_size = 0
        # request id -> (last committed position, the module's u there [D], its draft d1 (0-dim tensor))
        self.state: dict[str, tuple[int, torch.Tensor, torch.Tensor]] = {}
        self.graphs: StepGraphs | None = None  # the chained one-token steps
        self._hidden: torch.Tensor | None = None  # their hidden-state input, a static buffer
        # The pass over committed rows of verify and decode steps (1..K+1 rows a request), padded to K + 1
        # rows a request: its graphs, their hidden-state input and the row of each request's last real row.
        self.catch_up: StepGraphs | None = None
        self._catch_hidden: torch.Tensor | None = None
        self._last_rows: torch.Tensor | None = None
        self._pad_slots: list[int] = []
        # --speculative-token-map: the ids drafts are drawn from, and the module's LM head rows for them
        self.token_map: MappedHead | None = None

    @classmethod
    def from_config(cls, config: EngineConfig, ctx: ProposerContext) -> MTPProposer:
        target = ctx.target_config
        if ctx.build_mtp is None and target.raw.get("num_nextn_predict_layers"):
            raise ConfigError(
                f"--speculative mtp: Atlas does not run the multi-token-prediction layers of {target.architecture} "
                f"checkpoints yet (num_nextn_predict_layers in {target.path / 'config.json'}). Use --speculative ngram "
                "or dflash")
        if ctx.build_mtp is None or not ctx.num_mtp_modules:
            raise ConfigError(
                f"--speculative mtp needs a model with multi-token-prediction heads; {target.architecture} has none "
                f"(no num_nextn_predict_layers in {target.path / 'config.json'}). Use --speculative ngram or dflash")
        if ctx.num_mtp_modules > 1:
            raise ConfigError(
                f"{target.path} has num_nextn_predict_layers = {ctx.num_mtp_modules}: --speculative mtp supports one "
                "MTP module (chained for K drafts); checkpoints with several are not supported yet")
        k = cls.draft_count(config, target)  # (as a worker's stand-in counts it)
        # Built whole (constructing takes no parallel view): on a tensor-parallel driver it runs alone, with no
        # collective the workers would have to join.
        with constructing(ctx.device, ctx.dtype):
            module = ctx.build_mtp(ctx.max_model_len + k + 1, ctx.whole_embedding, ctx.whole_lm_head)
        if config.dummy_weights:
            fill_dummy_weights(module)  # (its own parameters: the target's embedding and final norm are not among them)
        else:
            weights = iterate_weights(safetensors_files(target.path), desc="loading MTP", prefix=module.weight_prefix)
            scheme = fp8_scheme(target.raw, target.path)
            if scheme is not None:  # (an FP8 checkpoint's module: kept in the model dtype, dequantized as it loads)
                weights = dequantize_fp8(weights, scheme, ctx.dtype, target.path)
            with torch.no_grad():
                module.load_weights(weights)
        module.eval().requires_grad_(False)
        cap = config.speculative_max_model_len
        logger.info("MTP module %s* of %s: K=%d (chained), %.1f M parameters%s", module.weight_prefix, target.path, k,
                    sum(p.numel() for p in module.parameters()) / 1e6,
                    f", attending over positions below {cap} (--speculative-max-model-len)" if cap else "")
        proposer = cls(module, k, target.num_hidden_layers, ctx.device, ctx.dtype,
                       catch_up_graphs=config.tuning.mtp_catch_up_graphs, max_context=cap)
        if config.speculative_token_map is not None:
            proposer.use_token_map(load_token_map(config.speculative_token_map, target.vocab_size))
        return proposer

    @staticmethod
    def draft_count(config: EngineConfig, target: ModelConfig) -> int:
        """K for this target, from its config.json alone (a tensor-parallel worker's, which builds no module)."""
        return config.num_draft_tokens or int(target.raw.get("num_nextn_predict_layers") or 0)

    # ------------------------------------------------------------------ what the engine asks
    def capture_layers(self) -> tuple[int, ...]:
        return (self.num_target_layers - 1,)  # the last layer's residual stream (final-normed by the module)

    def cache_module(self) -> torch.nn.Module:
        return self.module

    def prefill_hidden_rows(self, max_rows: int) -> int:
        # Its attention sees every position below its cap: every captured row there is useful, none past it.
        return max_rows if self.max_context is None else min(max_rows, self.max_context)

    def weight_bytes(self) -> int:
        head = 0 if self.token_map is None else self.token_map.nbytes
        return sum(p.numel() * p.element_size() for p in self.module.parameters()) + head

    def use_token_map(self, token_ids: torch.Tensor) -> None:
        """Draft from these token ids only (--speculative-token-map): the module's LM head rows for them, copied
        once, score its outputs instead of the whole head (its bytes dominate a draft step over a large
        vocabulary)."""
        head = self.module.draft_head
        rows = head.weight_rows(token_ids) if hasattr(head, "weight_rows") else None
        self.token_map = MappedHead.make(rows, token_ids, self.device, self.dtype, "MTP module")

    def _draft_ids(self, u: torch.Tensor) -> torch.Tensor:
        """The module's output rows -> their greedy drafts: the argmax over the whole vocabulary, or over the token
        map's ids (as token ids)."""
        if self.token_map is None:
            return self.module.compute_logits(u).argmax(-1)
        return self.token_map.argmax(self.module.head_input(u))

    def graph_bytes(self, target: ModelConfig, max_num_seqs: int) -> int:
        # The chain graphs (one row a request) and the catch-up graphs (K + 1), each a pool of its own that keeps
        # every captured size's hidden states and drafts, and their hidden-state inputs (bind).
        total, hidden, size = 0, self.module.input_width, self.dtype.itemsize
        for q, made, logit_rows in ((1, self.num_draft_tokens > 1, 1),
                                    (self.num_draft_tokens + 1, self.catch_up_graphs, 1)):
            if made:
                total += max_num_seqs * q * hidden * size + uniform_graph_bytes(
                    max_num_seqs, q, hidden, target.intermediate_size, self.dtype, target.vocab_size,
                    hidden * size + 8, logit_rows_per_seq=logit_rows)
        return total

    def bind(self, ctx: ProposerContext) -> None:
        if ctx.graphs_enabled and self.num_draft_tokens > 1:
            self.capture_chain_graphs(ctx, use_graphs=True)
        if ctx.graphs_enabled and self.catch_up_graphs:
            self.capture_catch_up_graphs(ctx, use_graphs=True)

    def capture_catch_up_graphs(self, ctx: ProposerContext, use_graphs: bool) -> None:
        """The pass over a step's committed rows when every request committed 1..K+1 of them (decodes and
        verifies): K + 1 rows a request, the real ones first, the rest padding (token 0, cache writes into
        the scratch pages, outputs dropped), then the first draft of each request's last real row."""
        q = self.num_draft_tokens + 1
        rows = ctx.max_num_seqs * q
        self._catch_hidden = torch.zeros(rows, self.module.input_width, dtype=self.dtype, device=self.device)
        # Entry i always names a row of request i (i * q + j, j < q), so a smaller captured size never reads
        # past its rows.
        self._last_rows = torch.arange(ctx.max_num_seqs, device=self.device) * q
        width = -(-(ctx.max_model_len + self.num_draft_tokens + 1) // self.block_size)
        self.catch_up = ctx.make_graphs("mtp catch-up", self._graphed_catch_up, q,
                                        self.attention, width, use_graphs)
        self._pad_slots = self.catch_up.attn.pad_slots.tolist()
        self.catch_up.capture()

    def _graphed_catch_up(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata):
        rows = ids.shape[0]
        u = self.module(ids, self._catch_hidden[:rows], positions, self.kv_caches, meta)
        last = u[self._last_rows[: rows // self.catch_up.q]]
        return last, self._draft_ids(last)

    def capture_chain_graphs(self, ctx: ProposerContext, use_graphs: bool) -> None:
        """The chained draft step (one token a request: the module, its head, the argmax) as CUDA graphs;
        use_graphs=False runs the same static-buffer path eagerly (for CPU tests)."""
        self._hidden = torch.zeros(ctx.max_num_seqs, self.module.input_width, dtype=self.dtype, device=self.device)
        width = -(-(ctx.max_model_len + self.num_draft_tokens + 1) // self.block_size)
        self.graphs = ctx.make_graphs("mtp chain", self._graphed_step, 1, self.attention,
                                      width, use_graphs)
        self.graphs.capture()

    def _step(self, ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """One chained draft step: tokens d_j and hidden states u -> (the next u, the next drafts)."""
        u = self.module(ids, hidden, positions, self.kv_caches, meta)
        return u, self._draft_ids(u)

    def _graphed_step(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata):
        return self._step(ids, self._hidden[: ids.shape[0]], positions, meta)

    # ------------------------------------------------------------------ hooks
    def on_request_finish(self, req: Request) -> None:
        self.state.pop(req.request_id, None)

    def _inputs(self, tokens: list[int] | torch.Tensor, positions: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        dev = self.device
        if not isinstance(tokens, torch.Tensor):
            tokens = torch.tensor(tokens, dtype=torch.long, device=dev)
        return tokens, torch.tensor(positions, dtype=torch.long, device=dev)

    @torch.inference_mode()
    def on_commit(self, commits: list[CommittedTokens]) -> None:
        """Run the module over the committed rows with captured hidden states (row p reads token p + 1):
        requests with at most K + 1 such rows through the catch-up graphs when they are captured, the
        others (prompt chunks) eagerly."""
        rows_of: list[tuple[CommittedTokens, int, torch.Tensor]] = []  # (commit, first position, its rows)
        for c in commits:
            hidden = c.hidden
            if hidden is None or c.num_tokens <= 0:
                continue
            end = c.start_position + c.num_tokens  # one past the last committed position
            rows = min(hidden.shape[0], c.num_tokens)
            first = end - rows
            usable = min(end, len(c.request.all_token_ids) - 1)  # (a stop inside an accepted run appends fewer)
            if self.max_context is not None and end > self.max_context:
                usable = min(usable, self.max_context)  # (no row at or past the cap; no state to draft from)
                self.state.pop(c.request.request_id, None)
            if usable > first:
                skip = hidden.shape[0] - rows
                rows_of.append((c, first, hidden[skip: skip + usable - first]))
        if self.catch_up is not None:
            small = [r for r in rows_of if r[2].shape[0] <= self.catch_up.q]
            if 0 < len(small) <= self.catch_up.max_batch:
                self._catch_up_graphed(small)
                rows_of = [r for r in rows_of if r[2].shape[0] > self.catch_up.q]
        if rows_of:
            self._catch_up_eager(rows_of)

    def _catch_up_graphed(self, rows_of: list[tuple[CommittedTokens, int, torch.Tensor]]) -> None:
        q = self.catch_up.q
        rows, tokens, positions, slots, seq_lens, tables, last_rows = [], [], [], [], [], [], []
        for i, (c, first, hidden) in enumerate(rows_of):
            req = c.request
            n = hidden.shape[0]
            rows.extend(range(i * q, i * q + n))
            tokens.extend(req.all_token_ids[first + 1: first + n + 1] + [0] * (q - n))
            positions.extend(range(first, first + q))
            slots.extend(self.attention.slots(req.page_ids, first, n) + self._pad_slots[n:q])
            seq_lens.append(first + q)
            tables.append(req.page_ids)
            last_rows.append(i * q + n - 1)
        m = len(rows_of)
        hidden = self.module.target_hidden(torch.cat([h for _, _, h in rows_of]) if m > 1 else rows_of[0][2])
        self._catch_hidden.index_copy_(0, to_device(rows, torch.long, self.device), hidden)
        self._last_rows[:m].copy_(to_device(last_rows, torch.long, self.device))
        meta = self.attention.metadata_for_query_lens([q] * m, seq_lens, tables, slots, self.device)
        ids, pos = self._inputs(tokens, positions)
        last_u, drafts = self.catch_up.run(ids, pos, meta)
        last_u, drafts = last_u[:m].clone(), drafts[:m].clone()  # (the next replay overwrites the outputs)
        for i, (c, first, h) in enumerate(rows_of):
            end = c.start_position + c.num_tokens
            if first + h.shape[0] == end:
                self.state[c.request.request_id] = (end - 1, last_u[i], drafts[i])

    def _catch_up_eager(self, rows_of: list[tuple[CommittedTokens, int, torch.Tensor]]) -> None:
        feats: list[torch.Tensor] = []
        tokens: list[int] = []
        step = self.attention.rows()
        last: list[tuple[str, int, int]] = []  # (request id, last committed position, its flat row)
        for c, first, h in rows_of:
            req = c.request
            end = c.start_position + c.num_tokens
            n = h.shape[0]
            usable = first + n
            feats.append(h)
            tokens.extend(req.all_token_ids[first + 1: usable + 1])
            step.add(req.page_ids, first, n)
            if usable == end:
                last.append((req.request_id, end - 1, len(tokens) - 1))
        hidden = self.module.target_hidden(torch.cat(feats) if len(feats) > 1 else feats[0])
        meta = step.metadata(self.device)
        ids, pos = self._inputs(tokens, step.positions)
        u = self.module(ids, hidden, pos, self.kv_caches, meta)
        if not last:
            return
        last_rows = u[torch.tensor([row for _, _, row in last], dtype=torch.long, device=self.device)]
        drafts = self._draft_ids(last_rows)
        for j, (rid, pos, _) in enumerate(last):
            self.state[rid] = (pos, last_rows[j], drafts[j])

    @torch.inference_mode()
    def propose(self, requests: list[Request]) -> list[Draft]:
        ready = []
        for i, req in enumerate(requests):
            st = self.state.get(req.request_id)
            # (with a cap, the chain's last row, at st[0] + K - 1, must lie below it)
            if st is not None and st[0] == req.num_computed_tokens - 1 and (
                    self.max_context is None or st[0] + self.num_draft_tokens <= self.max_context):
                ready.append((i, req, st))
        drafts: list[Draft] = [Draft([]) for _ in requests]
        if not ready:
            return drafts
        u = torch.stack([st[1] for _, _, st in ready])
        d = torch.stack([st[2] for _, _, st in ready])
        steps = [d]
        for j in range(1, self.num_draft_tokens):
            positions = [st[0] + j for _, _, st in ready]
            meta = self.attention.decode_metadata([req.page_ids for _, req, _ in ready], positions, self.device)
            ids, pos = self._inputs(d, positions)
            if self.graphs is not None and self.graphs.can_run(meta):
                self._hidden[: len(ready)].copy_(u)
                u, d = self.graphs.run(ids, pos, meta)
                d = d.clone()  # (the graph's output buffer: the next replay overwrites it)
            else:
                u, d = self._step(ids, u, pos, meta)
            steps.append(d)
        place_drafts(drafts, [(i, req) for i, req, _ in ready], torch.stack(steps, dim=1), self.device_drafts)
        return drafts
