"""The model runner's host tables of the running requests, keyed by request id (vLLM's persistent input batch is the
model): each one's page table, a row of one array, and for the requests whose sampling penalizes repeats, their
output tokens.

The scheduler owns the truth; the runner's copies change by the deltas each step brings (StepBatch): every record
(ScheduledSeq) carries its table's change since the runner last saw the request and, for a penalized request, its
new output tokens; requests that ended or were preempted are forgotten (a preempted one comes back with its whole
table and all its output tokens). A step binds what it reads at its launch (`bind`). Every rank of a parallel engine
keeps its own copy from the same deltas.

One array row a request, rather than a list: a step's page tables are then one gather of its rows (numpy), where
copying each sequence's list into the step's table took about a microsecond a sequence.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from atlas.layers.attention import table_width
from atlas.runtime.batch import ScheduledSeq, StepBatch, window
from atlas.sampling_params import SamplingParams


class StepPageTables(NamedTuple):
    """A step's page tables, as bound at its launch: rows of the runner's page-table array, read at launch (later
    steps change the array)."""

    array: np.ndarray  # [rows, width] int32: row r holds a request's page ids, then zeros
    rows: list[int]  # each sequence's row
    counts: list[int]  # each sequence's number of pages

    def fill(self, out: np.ndarray) -> None:
        """out [B, width] (width up to the array's): row i = sequence i's page ids, then zeros."""
        rows = self.rows
        if len(rows) == 1:  # (a gather costs a few microseconds more for one row)
            out[0] = self.array[rows[0], : out.shape[1]]
        else:  # (rows are the array's, so "clip" never clips; numpy buffers `out` under the default "raise")
            np.take(self.array[:, : out.shape[1]], rows, axis=0, out=out, mode="clip")

    def lists(self) -> list[list[int]]:
        """Each sequence's page ids."""
        return [self.array[r, :n].tolist() for r, n in zip(self.rows, self.counts, strict=True)]


class RequestTables:
    def __init__(self, rows: int = 16, width: int = 64):
        self.pages = np.zeros((rows, table_width(width)), dtype=np.int32)
        self.num_pages = [0] * rows  # (by row)
        self.row_of: dict[str, int] = {}
        self.free_rows = list(range(rows - 1, -1, -1))
        self.output_tokens: dict[str, list[int]] = {}  # (requests with penalties only)

    def __len__(self) -> int:
        return len(self.row_of)

    def page_table(self, request_id: str) -> list[int]:
        row = self.row_of[request_id]
        return self.pages[row, : self.num_pages[row]].tolist()

    def forget(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.output_tokens.pop(rid, None)
            row = self.row_of.pop(rid, None)
            if row is not None:
                self.pages[row, : self.num_pages[row]] = 0
                self.num_pages[row] = 0
                self.free_rows.append(row)

    def bind(self, batch: StepBatch) -> None:
        """At a step's launch: forget the requests that ended or were preempted, apply the step's records, and give
        the step its sequences' page tables (and the output tokens of those with penalties)."""
        if batch.finished_request_ids:
            self.forget(batch.finished_request_ids)
        if batch.preempted_request_ids:
            self.forget(batch.preempted_request_ids)
        seqs = batch.seqs
        for i, seq in enumerate(seqs):
            if seq.pages is not None:
                self._change(seq.request_id, *seq.pages)
            if seq.new_output_tokens is not None:
                batch.output_tokens[i] = self._outputs(seq.request_id, seq.new_output_tokens)
        row_of, num_pages = self.row_of, self.num_pages
        rows = [row_of[seq.request_id] for seq in seqs]
        batch.page_tables = StepPageTables(self.pages, rows, [num_pages[r] for r in rows])

    def bind_window_group(self, batch: StepBatch) -> None:
        """As `bind` for a model's window group (engine/kv_groups.py; a RequestTables of its own): the records'
        window-group table changes, bound to the step as its window_page_tables."""
        if batch.finished_request_ids:
            self.forget(batch.finished_request_ids)
        if batch.preempted_request_ids:
            self.forget(batch.preempted_request_ids)
        for seq in batch.seqs:
            if seq.window_pages is not None:
                self._change(seq.request_id, *seq.window_pages)
        row_of, num_pages = self.row_of, self.num_pages
        rows = [row_of[seq.request_id] for seq in batch.seqs]
        batch.window_page_tables = StepPageTables(self.pages, rows, [num_pages[r] for r in rows])

    def _change(self, request_id: str, first: int, pages: list[int]) -> None:
        """The request's table becomes table[:first] + pages (a request without one gets a row: first is 0)."""
        row = self.row_of.get(request_id)
        if row is None:
            if not self.free_rows:
                self._grow(rows=2 * len(self.num_pages))
            row = self.row_of[request_id] = self.free_rows.pop()
        end, held = first + len(pages), self.num_pages[row]
        if end > self.pages.shape[1]:
            self._grow(width=2 * end)
        self.pages[row, first:end] = pages
        if held > end:
            self.pages[row, end:held] = 0
        self.num_pages[row] = end

    def _grow(self, rows: int = 0, width: int = 0) -> None:
        """A larger array (a step bound earlier keeps the one it read)."""
        old = self.pages
        rows, width = max(rows, old.shape[0]), max(table_width(width), old.shape[1])
        self.pages = np.zeros((rows, width), dtype=np.int32)
        self.pages[: old.shape[0], : old.shape[1]] = old
        self.free_rows[:0] = range(rows - 1, len(self.num_pages) - 1, -1)
        self.num_pages += [0] * (rows - len(self.num_pages))

    def _outputs(self, request_id: str, new: list[int]) -> list[int]:
        outputs = self.output_tokens.get(request_id)
        if outputs is None:
            outputs = self.output_tokens[request_id] = list(new)
        else:
            outputs.extend(new)
        return outputs


def snapshot_batch(requests: list, num_scheduled: list[int], **fields) -> StepBatch:
    """A StepBatch over request-like objects (all_token_ids, page_ids, optionally spec_token_ids, params, ...), as
    tests and tools build one: each record carries its request's whole page table, bound to tables of its own as a
    runner binds a step to its tables (the scheduler's records carry page-table changes only:
    Scheduler._make_output).
    `fields`: StepBatch's other fields; `start` defaults to each request's num_computed_tokens, the sample rows to
    those of a plain step over known tokens (or a verify of num_drafts)."""
    n = len(requests)
    start = fields.pop("start", None) or [getattr(r, "num_computed_tokens", 0) for r in requests]
    num_drafts = fields.get("num_drafts") or [0] * n
    pending = fields.get("pending_input") or [False] * n
    seqs = []
    for r, first, count, on_device in zip(requests, start, num_scheduled, pending, strict=True):
        if on_device:  # (a pending input: its token is the device's)
            first, count = first + 1, count - 1
        params = getattr(r, "params", None) or SamplingParams()
        scored = getattr(r, "prompt_logprobs", None)
        seqs.append(ScheduledSeq(
            r.request_id, window(r.all_token_ids, getattr(r, "spec_token_ids", []), first, count),
            (0, list(r.page_ids)), params, list(getattr(r, "stop_token_ids", ())),
            list(getattr(r, "prompt_token_ids", ())),
            list(r.output_token_ids) if params.needs_output_history else None,
            len(scored) - 1 if scored is not None else None))
    fields.setdefault("num_output_tokens", [len(getattr(r, "output_token_ids", ())) for r in requests])
    fields.setdefault("num_sample_rows", [
        max(0, s + k - len(r.all_token_ids) + 1) if not d else 1 + d
        for r, s, k, d in zip(requests, start, num_scheduled, num_drafts, strict=True)])
    if "state_slots" not in fields and any(getattr(r, "state_slot", None) is not None for r in requests):
        fields["state_slots"] = [r.state_slot for r in requests]
    batch = StepBatch(seqs, num_scheduled, start=start, **fields)
    RequestTables().bind(batch)
    return batch
