"""The messages between the driver (rank 0) and the workers of a parallel engine.

On the control channel (a gloo broadcast from the driver) travel STEP messages (one step's host-side description:
the StepBatch numbers, the token ids to compute, the page-table changes and the requests to forget, which every
rank applies to its own tables, the rows whose prompt logprobs are wanted), FINISH (a pipeline step's end, for the
first stage's tensor-parallel peers), STOP, HOST_REPORT and LORA_LOAD (--enable-lora: an adapter written into a
slot between two steps, as on the driver; each worker reads its share from the adapter's folder). Each message is pickled and framed: its first CHUNK
bytes travel in one broadcast of a fixed size (workers know what to receive), the rest, if any, in a second.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from atlas.runtime.batch import ScheduledSeq, StepBatch

STEP, FINISH, STOP, HOST_REPORT, LORA_LOAD = 0, 1, 2, 3, 4
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


def encode_step(batch: StepBatch, info: StepInfo) -> tuple:
    """Driver side: a step as a compact tuple. Each sequence's record travels as its id, its tokens and its page-table
    change (the scheduler's, made for every rank's copy of the tables: RequestTables), with the requests the ranks
    forget (ended, preempted); a worker samples nothing, so nothing of the sampling travels."""
    seqs = batch.seqs
    return (STEP, info.number, [s.request_id for s in seqs], [s.tokens for s in seqs], [s.pages for s in seqs],
            batch.finished_request_ids, batch.preempted_request_ids, batch.num_scheduled, batch.start,
            batch.num_sample_rows, batch.num_drafts, batch.pending_input, batch.num_output_tokens,
            batch.num_draft_rows, info.prompt_rows, info.share_samples,
            # (a hybrid model's state slots and copies; none for the others)
            (batch.state_slots, batch.state_loads, batch.state_saves, batch.state_backups, batch.state_replays)
            if batch.state_slots else None,
            # (models with KV cache groups: the window-group table changes; None for the others)
            [s.window_pages for s in seqs] if batch.window_page_tables is not None else None,
            batch.lora_slots)  # (--enable-lora: each sequence's adapter slot)


def decode_step(msg: tuple) -> tuple[StepBatch, StepInfo]:
    """Worker side: a step message as a StepBatch (its records without sampling fields) and its StepInfo."""
    (_, number, ids, tokens, pages, finished, preempted, num_scheduled, start, num_sample_rows, num_drafts, pending,
     num_outputs, num_draft_rows, prompt_rows, share_samples, states, window_pages, lora_slots) = msg
    window_pages = window_pages or [None] * len(ids)
    seqs = [ScheduledSeq(rid, window, change, None, [], [], None, None, window_change)
            for rid, window, change, window_change in zip(ids, tokens, pages, window_pages, strict=True)]
    slots, loads, saves, backups, replays = states if states is not None else ([], [], [], [], [])
    batch = StepBatch(seqs, num_scheduled, start=start, num_sample_rows=num_sample_rows, num_drafts=num_drafts,
                      pending_input=pending, num_output_tokens=num_outputs, num_draft_rows=num_draft_rows,
                      state_slots=slots, state_loads=loads, state_saves=saves, state_backups=backups,
                      state_replays=replays, finished_request_ids=finished, preempted_request_ids=preempted,
                      lora_slots=lora_slots)
    return batch, StepInfo(number, prompt_rows, share_samples)
