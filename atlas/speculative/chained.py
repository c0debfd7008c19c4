"""Drafters that chain one row a step (MTP modules, EAGLE-3): what they share.

Such a drafter's row at position p reads a hidden state for p (from the target's captured streams, or its own
previous row) and the token at p + 1, writes its own K/V at p, and gives the draft for p + 2 and the hidden
state its next row reads. `on_commit` runs it over every committed position whose streams were captured, with
the following token as input: that fills its cache there, and the last committed row of a request (position
n - 1 when the target cache holds n tokens and token n is known) gives the first draft d1. `propose` chains it
K - 1 more times: step j feeds d_j with the previous row's hidden state at position n - 1 + j, writing its cache
there (lookahead slots, overwritten with real rows once the target has verified those positions). Drafts are
greedy and the target verifies them, so outputs never change; what the drafts cost is only acceptance.

On CUDA both passes replay graphs: the chain (one row a request) and the pass over a decode's or verify step's
committed rows (1..K + 1 a request, padded to K + 1 into the scratch pages); prompt chunks go eagerly.
Subclasses give the row forward (`_forward_rows`), the head (`_draft_ids`) and the captured streams' transform
(`_commit_hidden`)."""

from __future__ import annotations

from abc import abstractmethod
from typing import TYPE_CHECKING

import torch

from atlas.host_copy import to_device
from atlas.layers.attention import AttentionMetadata
from atlas.runtime.cuda_graphs import uniform_graph_bytes
from atlas.runtime.drafting import NextVerify, VerifiedStep
from atlas.speculative.proposer import (
    CommittedTokens,
    Draft,
    DraftsBehind,
    PagedDrafter,
    ProposerContext,
    place_drafts,
    run_rows_behind,
    verify_outcome,
)

if TYPE_CHECKING:
    from atlas.config import ModelConfig
    from atlas.engine.request import Request
    from atlas.runtime.cuda_graphs import StepGraphs

# (request, first position, the rows' hidden inputs before `_commit_hidden`)
_Rows = tuple[CommittedTokens, int, torch.Tensor]


class ChainedDrafter(PagedDrafter):
    """The shared state, passes and graphs of a drafter that chains one row a step (this module's note)."""

    #: its graphs' names
    name: str
    #: the row forward's hidden-state input width (after `_commit_hidden`; the chain's rows feed theirs back)
    hidden_width: int
    #: the pass over committed rows replays graphs where graphs are on (--tuning mtp_catch_up_graphs=0: eagerly)
    catch_up_graphs: bool = True
    #: positions the drafter attends over lie below this (None: no cap)
    max_context: int | None = None
    can_draft_after_verify = True

    @property
    def lookahead_slots(self) -> int:
        """Cache rows past a step's rows: the chain's K - 1; drafting right behind a verify step, the next verify
        step's rows too, which reach K + 1 past it."""
        return self.num_draft_tokens + 1 if self.drafts_after_verify else self.num_draft_tokens - 1

    def _init_chain(self) -> None:
        # request id -> (last committed position, the hidden state its next row reads [D], its draft d1 (0-dim))
        self.state: dict[str, tuple[int, torch.Tensor, torch.Tensor]] = {}
        self.graphs: StepGraphs | None = None  # the chained one-row steps
        self._hidden: torch.Tensor | None = None  # their hidden-state input, a static buffer
        # The pass over committed rows of verify and decode steps (1..K+1 rows a request), padded to K + 1
        # rows a request: its graphs, their hidden-state input and the row of each request's last real row.
        self.catch_up: StepGraphs | None = None
        self._catch_hidden: torch.Tensor | None = None
        self._last_rows: torch.Tensor | None = None
        self._pad_slots: list[int] = []
        self.behind = DraftsBehind()  # (chains queued right behind verify steps)
        self.blocks_behind = 0  # (verify steps drafted behind: tests read it)

    # ------------------------------------------------------------------ what a subclass gives
    @abstractmethod
    def _commit_hidden(self, captured: torch.Tensor) -> torch.Tensor:
        """Captured target rows -> the row forward's hidden inputs [n, hidden_width]."""

    @abstractmethod
    def _forward_rows(self, ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                      meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows (token at p + 1, hidden state for p) -> (the hidden state the next row reads, the head's input)."""

    @abstractmethod
    def _draft_ids(self, head_input: torch.Tensor) -> torch.Tensor:
        """The head's input rows -> their greedy drafts, as target token ids."""

    @abstractmethod
    def _graph_dims(self, target: ModelConfig) -> tuple[int, int]:
        """(intermediate width, head rows) of the drafter, for its graphs' memory."""

    # ------------------------------------------------------------------ graphs
    def graph_bytes(self, target: ModelConfig, max_num_seqs: int) -> int:
        # The chain graphs (one row a request) and the catch-up graphs (K + 1), each a pool of its own that keeps
        # every captured size's hidden states and drafts, and their hidden-state inputs (bind).
        total, hidden, size = 0, self.hidden_width, self.dtype.itemsize
        intermediate, vocab = self._graph_dims(target)
        for q, made in ((1, self.num_draft_tokens > 1), (self.num_draft_tokens + 1, self.catch_up_graphs)):
            if made:
                total += max_num_seqs * q * hidden * size + uniform_graph_bytes(
                    max_num_seqs, q, hidden, intermediate, self.dtype, vocab, hidden * size + 8,
                    logit_rows_per_seq=1)
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
        self._catch_hidden = torch.zeros(rows, self.hidden_width, dtype=self.dtype, device=self.device)
        # Entry i always names a row of request i (i * q + j, j < q), so a smaller captured size never reads
        # past its rows.
        self._last_rows = torch.arange(ctx.max_num_seqs, device=self.device) * q
        self.catch_up = ctx.make_graphs(f"{self.name} catch-up", self._graphed_catch_up, q, self.attention,
                                        self._graph_width(ctx), use_graphs)
        self._pad_slots = self.catch_up.attn.pad_slots.tolist()
        self.catch_up.capture()

    def _graphed_catch_up(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata):
        rows = ids.shape[0]
        nxt, head = self._forward_rows(ids, self._catch_hidden[:rows], positions, meta)
        last = self._last_rows[: rows // self.catch_up.q]
        return nxt[last], self._draft_ids(head[last])

    def capture_chain_graphs(self, ctx: ProposerContext, use_graphs: bool) -> None:
        """The chained draft step (one row a request: the drafter, its head, the argmax) as CUDA graphs;
        use_graphs=False runs the same static-buffer path eagerly (for CPU tests)."""
        self._hidden = torch.zeros(ctx.max_num_seqs, self.hidden_width, dtype=self.dtype, device=self.device)
        self.graphs = ctx.make_graphs(f"{self.name} chain", self._graphed_step, 1, self.attention,
                                      self._graph_width(ctx), use_graphs)
        self.graphs.capture()

    def _step(self, ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """One chained draft step: tokens d_j and hidden states -> (the next hidden states, the next drafts)."""
        nxt, head = self._forward_rows(ids, hidden, positions, meta)
        return nxt, self._draft_ids(head)

    def _graphed_step(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata):
        return self._step(ids, self._hidden[: ids.shape[0]], positions, meta)

    # ------------------------------------------------------------------ hooks
    def on_request_finish(self, req: Request) -> None:
        self.state.pop(req.request_id, None)
        self.behind.forget(req.request_id)

    # (preempted, its pages go back: its rows are run again as it recomputes them)
    on_request_preempt = on_request_finish

    def _inputs(self, tokens: list[int] | torch.Tensor, positions: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        if isinstance(tokens, torch.Tensor):
            return tokens, to_device(positions, torch.long, self.device)
        both = to_device(tokens + positions, torch.long, self.device)
        return both[: len(tokens)], both[len(tokens):]

    @torch.inference_mode()
    def on_commit(self, commits: list[CommittedTokens]) -> None:
        """Run the drafter over the committed rows with captured streams (row p reads token p + 1): requests
        with at most K + 1 such rows through the catch-up graphs when they are captured, the others (prompt
        chunks) eagerly. A request drafted right behind its verify step had those rows run there."""
        self.behind.read_back()
        rows_of: list[_Rows] = []
        for c in commits:
            hidden = c.hidden
            if hidden is None or c.num_tokens <= 0 or c.request.request_id in self.behind.ready:
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

    def _catch_up_graphed(self, rows_of: list[_Rows]) -> None:
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
        hidden = self._commit_hidden(torch.cat([h for _, _, h in rows_of]) if m > 1 else rows_of[0][2])
        index = to_device(rows + last_rows, torch.long, self.device)
        self._catch_hidden.index_copy_(0, index[: len(rows)], hidden)
        self._last_rows[:m].copy_(index[len(rows):])
        meta = self.attention.metadata_for_query_lens([q] * m, seq_lens, tables, slots, self.device)
        ids, pos = self._inputs(tokens, positions)
        last_u, drafts = self.catch_up.run(ids, pos, meta)
        last_u, drafts = last_u[:m].clone(), drafts[:m].clone()  # (the next replay overwrites the outputs)
        for i, (c, first, h) in enumerate(rows_of):
            end = c.start_position + c.num_tokens
            if first + h.shape[0] == end:
                self.state[c.request.request_id] = (end - 1, last_u[i], drafts[i])

    def _catch_up_eager(self, rows_of: list[_Rows]) -> None:
        feats: list[torch.Tensor] = []
        tokens: list[int] = []
        step = self.attention.rows()
        last: list[tuple[str, int, int]] = []  # (request id, last committed position, its flat row)
        for c, first, h in rows_of:
            req = c.request
            end = c.start_position + c.num_tokens
            n = h.shape[0]
            feats.append(h)
            tokens.extend(req.all_token_ids[first + 1: first + n + 1])
            step.add(req.page_ids, first, n)
            if first + n == end:
                last.append((req.request_id, end - 1, len(tokens) - 1))
        hidden = self._commit_hidden(torch.cat(feats) if len(feats) > 1 else feats[0])
        meta = step.metadata(self.device)
        ids, pos = self._inputs(tokens, step.positions)
        nxt, head = self._forward_rows(ids, hidden, pos, meta)
        if not last:
            return
        rows_at = to_device([row for _, _, row in last], torch.long, self.device)
        drafts = self._draft_ids(head[rows_at])
        nxt = nxt[rows_at]
        for j, (rid, pos, _) in enumerate(last):
            self.state[rid] = (pos, nxt[j], drafts[j])

    @torch.inference_mode()
    def propose(self, requests: list[Request]) -> list[Draft]:
        behind = self.behind.take()
        drafts: list[Draft] = [Draft([]) for _ in requests]
        ready = []
        for i, req in enumerate(requests):
            entry = behind.get(req.request_id)
            if entry is not None:
                # (None where the host's acceptance is not where the chain ran: no drafts this step; its state is
                #  the device's, and its next commit runs it)
                draft = DraftsBehind.draft(entry, req, self.num_draft_tokens)
                if draft is not None:
                    drafts[i] = draft
                continue
            st = self.state.get(req.request_id)
            # (with a cap, the chain's last row, at st[0] + K - 1, must lie below it)
            if st is not None and st[0] == req.num_computed_tokens - 1 and (
                    self.max_context is None or st[0] + self.num_draft_tokens <= self.max_context):
                ready.append((i, req, st))
        if not ready:
            return drafts
        u = torch.stack([st[1] for _, _, st in ready])
        d = torch.stack([st[2] for _, _, st in ready])
        steps = [d]
        tables = [req.page_ids for _, req, _ in ready]
        for j in range(1, self.num_draft_tokens):
            positions = [st[0] + j for _, _, st in ready]
            meta = self.attention.decode_metadata(tables, positions, self.device)
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

    # ------------------------------------------------------------------ right behind a verify step
    def can_draft_behind(self, step: VerifiedStep) -> bool:
        """Whether draft_after_verify queues the chain of every request of `step`: the graphs' buffers fit it, the
        engine reserved each request's pages through the next verify step's rows, and they lie below the cap."""
        catch_up, chain, k = self.catch_up, self.graphs, self.num_draft_tokens
        n, width, reach = len(step.request_ids), step.page_tables.shape[1], 2 * (k + 1)
        return (catch_up is not None and step.captured is not None and catch_up.holds(n, width)
                and (k == 1 or (chain is not None and chain.holds(n, width)))
                and step.pages_hold_next_step(self.block_size)
                and (self.max_context is None or all(s + reach <= self.max_context for s in step.start)))

    def takes_captured_rows(self, step: VerifiedStep) -> bool:
        return self.can_draft_behind(step)

    @torch.inference_mode()
    def draft_after_verify(self, step: VerifiedStep) -> NextVerify | None:
        """The next drafts of every request of a verify step, queued behind it: which drafts the target accepted,
        the bonus token and the next verify step's positions and slots come from the step's outputs on the device
        (kernels/draft_prologue.py); the pass over the step's rows runs with each row's next token (the bonus after
        the accepted ones; rows past them lie where the chain and the next verify step write again), the first
        draft from the last accepted row, then the chain at the next verify step's first K - 1 positions."""
        if not self.can_draft_behind(step):
            return None
        k, dev, n = self.num_draft_tokens, self.device, len(step.request_ids)
        q = k + 1
        rows = n * q
        nxt, accepted = verify_outcome(step, k, self.block_size)
        first = step.positions.view(n, q)[:, 0]
        ids = step.input_ids.view(n, q).roll(-1, 1).scatter(1, accepted[:, None], nxt.bonus[:, None])
        catch_up = self.catch_up
        self._catch_hidden[:rows].copy_(self._commit_hidden(step.captured[:rows]))
        self._last_rows[:n].copy_(torch.arange(n, device=dev) * q + accepted)
        meta = catch_up.attn.device_step_meta((first + q).to(torch.int32), step.page_tables, step.slot_mapping,
                                              [s + q for s in step.start])
        u, d = catch_up.run(ids.flatten(), step.positions, meta)
        steps = [d[:n].clone()]  # (the next replay overwrites the outputs)
        if k > 1:
            chain = self.graphs
            positions, slots = nxt.positions.view(n, q), nxt.slots.view(n, q)
            bound = [s + 2 * q for s in step.start]  # (the most a chain row's length can be)
            for j in range(1, k):
                self._hidden[:n].copy_(u[:n])
                u, d = run_rows_behind(chain, steps[-1], positions[:, j - 1].contiguous(),
                                       slots[:, j - 1].contiguous(), step.page_tables, bound)
                steps.append(d[:n].clone())
        drafts = torch.stack(steps, dim=1)
        self.blocks_behind += 1
        self.behind.record(step, drafts)
        for rid in step.request_ids:
            self.state.pop(rid, None)
        return NextVerify(nxt.bonus[:, None], drafts, nxt.positions, nxt.slots, nxt.seq_lens, still_valid=lambda: True)
