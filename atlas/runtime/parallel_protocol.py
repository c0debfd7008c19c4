"""The messages between the driver (rank 0) and the workers of a parallel engine.

On the control channel (a gloo broadcast from the driver) travel STEP messages (one step's host-side description:
the StepBatch numbers, the token ids to compute, the page-table changes workers have not seen, the rows whose
prompt logprobs are wanted), FINISH (a pipeline step's end, for the first stage's tensor-parallel peers), STOP
and HOST_REPORT. Each message is pickled and framed: its first CHUNK bytes travel in one broadcast of a fixed
size (workers know what to receive), the rest, if any, in a second.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from atlas.runtime.batch import StepBatch
from atlas.runtime.step_inputs import scheduled_tokens

STEP, FINISH, STOP, HOST_REPORT = 0, 1, 2, 3
CHUNK = 16 << 10  # bytes of a message that travel in its first broadcast (the rest, if any, in a second)


def frame(data: bytes) -> tuple[bytearray, bytes]:
    """A pickled message as its fixed-size head (length, then the first bytes) and the rest (maybe empty)."""
    first = min(len(data), CHUNK - 8)
    # (framed in a bytearray, then wrapped: a tenth of the host time of filling a tensor piece by piece)
    head = bytearray(CHUNK)
    head[:8] = len(data).to_bytes(8, "little")
    head[8: 8 + first] = data[:first]
    return head, data[first:]


def unframe(head: bytes) -> tuple[bytes, int]:
    """A received head -> (the message bytes it holds, how many bytes follow in a second broadcast)."""
    size = int.from_bytes(head[:8], "little")
    first = min(size, CHUNK - 8)
    return bytes(head[8: 8 + first]), size - first


@dataclass
class StepInfo:
    """What every rank knows about a step beyond its StepBatch."""

    number: int
    prompt_rows: list[int] = field(default_factory=list)  # flat rows whose prompt logprobs the driver wants
    share_samples: bool = False  # the driver broadcasts the sampled ids to its tensor-parallel peers


class RemoteSeq:
    """A worker's view of a scheduled sequence: its id, its page table, and the tokens it computes this
    step (`window`: the known tokens, then drafts, from the first row that is not a pending input)."""

    __slots__ = ("request_id", "page_ids", "window")

    def __init__(self, request_id: str, page_ids: list[int], window: list[int]):
        self.request_id = request_id
        self.page_ids = page_ids
        self.window = window


class StepEncoder:
    """Driver side: a step as a compact tuple, with only the page-table changes workers have not seen.

    It keeps a copy of every table it sent: a table that still starts with that copy sends only its new
    pages; any other change (pages trimmed or replaced, a new request under an old id) sends it whole."""

    _PRUNE_EVERY = 16

    def __init__(self) -> None:
        self.sent: dict[str, tuple[object, list[int]]] = {}  # request id -> (sequence, its table as sent)

    def encode(self, batch: StepBatch, info: StepInfo) -> tuple:
        ids, tokens, pages = [], [], []
        sent = self.sent
        for i, seq in enumerate(batch.seqs):
            rid, table = seq.request_id, seq.page_ids
            s, k = batch.start[i], batch.num_scheduled[i]
            if batch.pending_input[i]:
                s, k = s + 1, k - 1
            ids.append(rid)
            tokens.append(scheduled_tokens(seq, s, k))
            known = sent.get(rid)
            n = len(known[1]) if known is not None else 0
            if known is not None and known[0] is seq and len(table) >= n and table[:n] == known[1]:
                pages.append((n, table[n:]) if len(table) > n else None)
            else:
                pages.append((0, list(table)))
            sent[rid] = (seq, list(table))
        forget = []
        if info.number % self._PRUNE_EVERY == 0:
            forget = [rid for rid, (seq, _) in sent.items() if getattr(seq, "is_finished", False)]
            for rid in forget:
                del sent[rid]
        return (STEP, info.number, ids, tokens, pages, forget, batch.num_scheduled, batch.start,
                batch.num_sample_rows, batch.num_drafts, batch.pending_input, batch.num_output_tokens,
                batch.num_draft_rows, info.prompt_rows, info.share_samples,
                # (a hybrid model's state slots and copies; none for the others)
                (batch.state_slots, batch.state_loads, batch.state_saves, batch.state_backups, batch.state_restores)
                if batch.state_slots else None)


class StepDecoder:
    """Worker side: the page tables of the running requests, and each step message as a StepBatch."""

    def __init__(self) -> None:
        self.tables: dict[str, list[int]] = {}

    def decode(self, msg: tuple) -> tuple[StepBatch, StepInfo]:
        (_, number, ids, tokens, pages, forget, num_scheduled, start, num_sample_rows, num_drafts, pending,
         num_outputs, num_draft_rows, prompt_rows, share_samples, states) = msg
        tables = self.tables
        for rid, change in zip(ids, pages, strict=True):
            if change is None:
                continue
            first, new = change
            if first == 0:
                tables[rid] = list(new)
            else:
                table = tables[rid]
                del table[first:]
                table.extend(new)
        seqs = [RemoteSeq(rid, tables[rid], window) for rid, window in zip(ids, tokens, strict=True)]
        for rid in forget:
            tables.pop(rid, None)
        slots, loads, saves, backups, restores = states if states is not None else ([], [], [], [], [])
        batch = StepBatch(seqs, num_scheduled, start=start, num_sample_rows=num_sample_rows, num_drafts=num_drafts,
                          pending_input=pending, num_output_tokens=num_outputs, num_draft_rows=num_draft_rows,
                          state_slots=slots, state_loads=loads, state_saves=saves, state_backups=backups,
                          state_restores=restores)
        return batch, StepInfo(number, prompt_rows, share_samples)
