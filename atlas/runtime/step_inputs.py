"""From a StepBatch (host numbers) to the device tensors of one forward pass, without holding the host.

The numbers are computed with numpy into pinned staging buffers and copied to persistent device
buffers with non-blocking copies: the host never waits for the device here. Two staging sets
alternate, so the set a step fills was last used two steps ago, whose copies the device has long
done (an event makes sure). Input tokens that are still on the device (the previous step's samples,
under asynchronous scheduling) are gathered there.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from atlas.kernels.paged_attention import ProgramMap
from atlas.layers.attention import AttentionMetadata, aligned_count, table_width
from atlas.layers.attention_backend import AttentionBackend
from atlas.runtime.batch import StepBatch
from atlas.runtime.drafting import NextVerify, flat_device_drafts


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # [R] flat row of every row that needs a next token
    num_sample_rows: int
    sample_owner: list[int]  # batch index of the sequence each sample row belongs to
    sample_offset: list[int]  # 0 for the row after the last known token, j for the j-th draft
    all_rows_sampled: bool  # every row is a sample row, in order (decode, unpadded verify)


PACK_SLACK = 8 * 4  # (room for the 16-byte alignment of up to 8 slices: layers.attention.aligned_count)


class _Staging:
    """One set of host buffers (pinned on CUDA) for a step's numbers."""

    def __init__(self, max_tokens: int, max_seqs: int, max_table: int, pin: bool, groups: int = 1):
        """groups: KV cache groups (2: the windowed layers' pages too, with slots and page tables of their own)."""
        def buf(n: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(n, dtype=dtype, pin_memory=pin)

        # int64: ids, positions, slots, sample rows, pending rows, pending sources, rows of drafts on the device
        # (then the window group's slots)
        self.i64 = buf((4 + groups) * max_tokens + 2 * max_seqs + PACK_SLACK, torch.int64)
        # int32: query_start_loc, seq_lens, page table, program map (request, first query) (then the window group's
        # page table)
        self.i32 = buf(2 * (max_seqs + 1) + groups * max_table + 2 * max_tokens + PACK_SLACK, torch.int32)
        self.np64 = self.i64.numpy()
        self.np32 = self.i32.numpy()
        self.done: torch.cuda.Event | None = None


class InputPreparer:
    def __init__(self, max_tokens: int, max_seqs: int, max_pages: int, attention: AttentionBackend,
                 device: torch.device, kv_groups: int = 1):
        """kv_groups: 2 where the windowed layers keep a page pool of their own (engine/kv_groups.py): each step
        then carries their page tables and slots too (AttentionMetadata.windowed)."""
        self.kv_groups = kv_groups
        self.max_tokens = max_tokens
        self.max_seqs = max_seqs
        self.attention = attention  # (slots and the program map: its formulas)
        self.block_size = attention.block_size
        self.device = device
        self.max_table = max_seqs * table_width(max_pages)
        pin = device.type == "cuda"
        self.staging = [_Staging(max_tokens, max_seqs, self.max_table, pin, kv_groups) for _ in range(2 if pin else 1)]
        self.turn = 0
        self.dev64 = torch.zeros_like(self.staging[0].i64, device=device)
        self.dev32 = torch.zeros_like(self.staging[0].i32, device=device)
        # The previous step's sampled tokens on the device, and each request's row in them.
        self.prev_tokens: torch.Tensor | None = None
        self._prev_rows: tuple[list, list[int]] = ([], [])  # (the step's sequences, the owner of each sample row)
        self._prev_row: dict[str, int] | None = {}
        self.decode_shortcut = True  # (off: every step the general way; the tests compare the two)
        self._uniform_cache: dict[tuple[int, int], tuple[list[int], list[int]]] = {}
        self._arange: torch.Tensor | None = None

    def _grow(self, tokens: int, seqs: int, table: int) -> None:
        """A step larger than planned (tests, tools): bigger buffers, allocated once."""
        if tokens <= self.max_tokens and seqs <= self.max_seqs and table <= self.max_table:
            return
        self.max_tokens = max(self.max_tokens, tokens)
        self.max_seqs = max(self.max_seqs, seqs)
        self.max_table = max(self.max_table, table)
        pin = self.device.type == "cuda"
        self.staging = [_Staging(self.max_tokens, self.max_seqs, self.max_table, pin, self.kv_groups)
                        for _ in self.staging]
        self.dev64 = torch.zeros_like(self.staging[0].i64, device=self.device)
        self.dev32 = torch.zeros_like(self.staging[0].i32, device=self.device)

    @torch.inference_mode()
    def prepare(self, batch: StepBatch) -> StepInputs:
        bs = self.block_size
        seqs = batch.seqs
        B = len(seqs)
        T, R = sum(batch.num_scheduled), sum(batch.num_sample_rows)
        # A uniform step, every sequence q rows and every row sampled (a plain decode step, q = 1, or a verify
        # step of K whole drafts, q = K + 1), takes the short way through the arithmetic below: the same
        # numbers with a third of the numpy calls (host time a step at small batches).
        q = batch.num_scheduled[0] if B else 0
        uniform = self.decode_shortcut and B > 0 and B * q == T and R == T and batch.num_scheduled.count(q) == B
        n = np.asarray(batch.num_scheduled, dtype=np.int64)
        start = np.asarray(batch.start, dtype=np.int64)
        rows = np.arange(max(T, B) + 1, dtype=np.int64)
        if uniform:
            qsl = rows[: B + 1] * q if q > 1 else rows[: B + 1]
        else:
            qsl = np.zeros(B + 1, dtype=np.int64)
            np.cumsum(n, out=qsl[1:])
        width = table_width(max(batch.page_tables.counts, default=1))
        m = np.asarray(batch.num_sample_rows, dtype=np.int64)
        attn = self.attention
        block_q = attn.block_q(max(batch.num_scheduled) if B else 1)
        per_seq = -(-q // block_q)  # (attention programs a sequence of a uniform step)
        num_programs = B * per_seq if uniform else attn.num_programs(n, block_q)
        self._grow(T, B, B * width)

        st = self._take_staging()
        i64, i32 = st.np64, st.np32
        # Packed back to back (each slice 16-byte aligned), so that one small copy per dtype moves what this
        # step uses.
        o_pos = aligned_count(T, 8)
        o_slot = o_pos + aligned_count(T, 8)
        o_sample = o_slot + aligned_count(T, 8)
        o_pend = o_sample + aligned_count(R, 8)
        o_src = o_pend + aligned_count(B, 8)
        o_draft = o_src + aligned_count(B, 8)
        ids, positions, slots = i64[:T], i64[o_pos: o_pos + T], i64[o_slot: o_slot + T]
        sample_rows = i64[o_sample: o_sample + R]
        pend_rows, pend_src = i64[o_pend: o_pend + B], i64[o_src: o_src + B]
        # A verify step of a drafter block's whole drafts (every sequence: its last token, then q - 1 drafts left
        # on the device): the drafts go into rows 1.. of each sequence on the device, without a row index.
        drafts_behind = (uniform and q > 1 and len(batch.device_drafts) == B and not any(batch.pending_input)
                         and batch.num_drafts.count(q - 1) == B)
        num_device_drafts = 0 if drafts_behind else self._device_draft_rows(batch, qsl, i64[o_draft: o_draft + T])
        used64 = o_draft + num_device_drafts
        windows = batch.window_page_tables  # (KV cache groups: the windowed layers' own pages)
        if windows is not None:
            o_wslot = o_draft + aligned_count(num_device_drafts, 8)
            used64 = o_wslot + T
        o_lens = aligned_count(B + 1, 4)
        o_table = o_lens + aligned_count(B, 4)
        o_prog = o_table + B * width  # (width: a multiple of 16)
        o_q0 = o_prog + aligned_count(num_programs, 4)
        qsl32, seq_lens = i32[: B + 1], i32[o_lens: o_lens + B]
        table = i32[o_table: o_prog].reshape(B, width)
        prog_req, prog_q0 = i32[o_prog: o_prog + num_programs], i32[o_q0: o_q0 + num_programs]
        used32 = o_q0 + num_programs
        if windows is not None:  # (as wide as the full group's: both cover the same positions)
            o_wtable = o_q0 + aligned_count(num_programs, 4)
            used32 = o_wtable + B * width

        qsl32[:] = qsl
        lens = start + n
        seq_lens[:] = lens
        batch.page_tables.fill(table)
        num_pending = 0
        qsl_list = qsl.tolist()
        if drafts_behind:  # (row 0 of each sequence: its last token; the drafts' rows are filled on the device)
            ids.reshape(B, q)[:, 0] = [seq.tokens[0] for seq in seqs]
        else:
            for i, (seq, k) in enumerate(zip(seqs, batch.num_scheduled, strict=True)):
                a = qsl_list[i]
                if batch.pending_input[i]:
                    pend_rows[num_pending] = a
                    pend_src[num_pending] = self.prev_row[seq.request_id]
                    num_pending += 1
                    ids[a] = 0
                    a, k = a + 1, k - 1
                    if not k:
                        continue
                ids[a: a + k] = seq.tokens
        if uniform:  # (row r is row r % q of sequence r // q, at position start + r % q, sampled)
            if q == 1:
                seq_of_row = rows[:B]
                positions[:] = start
            else:
                seq_of_row = rows[:T] // q
                positions.reshape(B, q)[:] = start[:, None] + rows[:q]
            owner, offset = self._uniform_rows(B, q)
            sample_rows[:] = rows[:T]
            attn.fill_programs(prog_req, prog_q0, n, block_q, rows, uniform_q=q)
        else:
            seq_of_row = np.repeat(rows[:B], n)
            positions[:] = rows[:T] + np.repeat(start - qsl[:-1], n)
            # The rows that get a next token: the last known token's row, then one per draft.
            first = qsl[1:] - np.asarray(batch.num_draft_rows, dtype=np.int64) - 1
            owner_rows = np.repeat(rows[:B], m)
            offset_rows = rows[:R] - np.repeat(np.cumsum(m) - m, m)
            sample_rows[:] = first[owner_rows] + offset_rows
            owner, offset = owner_rows.tolist(), offset_rows.tolist()
            attn.fill_programs(prog_req, prog_q0, n, block_q, rows)
        attn.step_slots(table, seq_of_row, positions, slots)
        if windows is not None:
            window_table = i32[o_wtable: used32].reshape(B, width)
            windows.fill(window_table)
            attn.step_slots(window_table, seq_of_row, positions, i64[o_wslot: used64])

        d64, d32 = self._upload(st, used64, used32)
        input_ids = d64[:T]
        if num_pending:
            input_ids.index_copy_(0, d64[o_pend: o_pend + num_pending],
                                  self.prev_tokens.index_select(0, d64[o_src: o_src + num_pending]))
        if drafts_behind:
            input_ids.view(B, q)[:, 1:].copy_(flat_device_drafts(
                [batch.draft_tokens[i] for i in range(B)], batch.num_drafts).view(B, q - 1))
        elif num_device_drafts:  # (the drafts of sequences whose drafter left them on the device)
            on_device = batch.device_drafts
            input_ids.index_copy_(0, d64[o_draft: o_draft + num_device_drafts], flat_device_drafts(
                [batch.draft_tokens[i] for i in on_device], [batch.num_drafts[i] for i in on_device]))
        lens_list = lens.tolist()
        meta = AttentionMetadata(
            query_start_loc=d32[: B + 1], seq_lens=d32[o_lens: o_lens + B],
            page_tables=d32[o_table: o_prog].view(B, width), slot_mapping=d64[o_slot: o_slot + T],
            query_start_loc_cpu=qsl_list, seq_lens_cpu=lens_list,
            max_query_len=max(batch.num_scheduled) if B else 0, max_seq_len=max(lens_list) if B else 0, block_size=bs,
            programs=ProgramMap(block_q, d32[o_prog: o_prog + num_programs], d32[o_q0: o_q0 + num_programs]))
        if windows is not None:
            meta.windowed = dataclasses.replace(meta, page_tables=d32[o_wtable: used32].view(B, width),
                                                slot_mapping=d64[o_wslot: used64])
        all_rows = uniform or (R == T and bool((m == n).all()))
        return StepInputs(input_ids=input_ids, positions=d64[o_pos: o_pos + T], meta=meta,
                          sample_rows=d64[o_sample: o_sample + R], num_sample_rows=R, sample_owner=owner,
                          sample_offset=offset, all_rows_sampled=all_rows)

    @torch.inference_mode()
    def prepare_behind(self, batch: StepBatch, following: NextVerify, request_ids: list[str]) -> StepInputs | None:
        """A verify step of exactly the requests `request_ids`, each verifying the whole drafts of the block a drafter
        queued behind the last step (`following`): its ids, positions, slots and lengths are that block's, already on
        the device, so only the page tables (the scheduler may have added pages), the program map and the host lists
        are made here. None when the step is any other (then `prepare`)."""
        seqs = batch.seqs
        B, k = len(seqs), following.drafts.shape[1]
        q = k + 1
        if (len(request_ids) != B or not self.decode_shortcut or batch.num_scheduled.count(q) != B
                or batch.num_drafts.count(k) != B or batch.num_draft_rows.count(k) != B
                or len(batch.device_drafts) != B or any(batch.pending_input)
                or (following.still_valid is None or not following.still_valid())):
            return None
        row0, row_bytes = following.drafts.data_ptr(), following.drafts.stride(0) * following.drafts.element_size()
        for i, (seq, rid) in enumerate(zip(seqs, request_ids, strict=True)):
            drafts = batch.draft_tokens.get(i)
            if seq.request_id != rid or drafts is None or drafts.data_ptr() != row0 + i * row_bytes:
                return None
        T, bs = B * q, self.block_size
        width = table_width(max(batch.page_tables.counts))
        block_q = self.attention.block_q(q)
        num_programs = B * -(-q // block_q)
        self._grow(T, B, B * width)
        st = self._take_staging()
        i32 = st.np32
        o_table = aligned_count(B + 1, 4)
        o_prog = o_table + B * width
        o_q0 = o_prog + aligned_count(num_programs, 4)
        used32 = o_q0 + num_programs
        rows = np.arange(max(T, num_programs) + 1, dtype=np.int64)
        qsl = rows[: B + 1] * q
        i32[: B + 1] = qsl
        batch.page_tables.fill(i32[o_table: o_prog].reshape(B, width))
        self.attention.fill_programs(i32[o_prog: o_prog + num_programs], i32[o_q0: o_q0 + num_programs], None,
                                    block_q, rows, uniform_q=q)
        windows, used64 = batch.window_page_tables, 0
        if windows is not None:  # (KV cache groups: the block's slots are the full group's; the window group's here)
            o_wtable = o_q0 + aligned_count(num_programs, 4)
            used32 = o_wtable + B * width
            window_table = i32[o_wtable: used32].reshape(B, width)
            windows.fill(window_table)
            positions = (np.asarray(batch.start, dtype=np.int64)[:, None] + rows[:q]).reshape(T)
            used64 = T
            self.attention.step_slots(window_table, rows[:T] // q, positions, st.np64[:T])
        d64, d32 = self._upload(st, used64, used32)
        lens_list = [s + q for s in batch.start]
        meta = AttentionMetadata(
            query_start_loc=d32[: B + 1], seq_lens=following.seq_lens, page_tables=d32[o_table: o_prog].view(B, width),
            slot_mapping=following.slot_mapping, query_start_loc_cpu=qsl.tolist(), seq_lens_cpu=lens_list,
            max_query_len=q, max_seq_len=max(lens_list), block_size=bs,
            programs=ProgramMap(block_q, d32[o_prog: o_prog + num_programs], d32[o_q0: o_q0 + num_programs]))
        if windows is not None:
            meta.windowed = dataclasses.replace(meta, page_tables=d32[o_wtable: used32].view(B, width),
                                                slot_mapping=d64[:T])
        owner, offset = self._uniform_rows(B, q)
        return StepInputs(input_ids=following.input_ids, positions=following.positions, meta=meta,
                          sample_rows=self._rows_on_device(T), num_sample_rows=T, sample_owner=owner,
                          sample_offset=offset, all_rows_sampled=True)

    def _take_staging(self) -> _Staging:
        """The next set of host buffers, once the device has copied what it held (two steps ago: normally long done)."""
        st = self.staging[self.turn]
        self.turn = (self.turn + 1) % len(self.staging)
        if st.done is not None:
            st.done.synchronize()
        return st

    def _upload(self, st: _Staging, used64: int, used32: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy the first used64 / used32 values of the staging buffers to the device buffers (non-blocking; an event
        marks when `st` may be filled again); -> the device buffers."""
        d64, d32 = self.dev64, self.dev32
        if used64:
            d64[:used64].copy_(st.i64[:used64], non_blocking=True)
        d32[:used32].copy_(st.i32[:used32], non_blocking=True)
        if self.device.type == "cuda":
            st.done = torch.cuda.Event()
            st.done.record()
        return d64, d32

    def _uniform_rows(self, B: int, q: int) -> tuple[list[int], list[int]]:
        """(owner, offset) of every row of a uniform step of B sequences of q rows, all sampled (made once)."""
        key = (B, q)
        if key not in self._uniform_cache:
            self._uniform_cache[key] = ([r // q for r in range(B * q)], [r % q for r in range(B * q)])
        return self._uniform_cache[key]

    def _rows_on_device(self, n: int) -> torch.Tensor:
        """0 .. n - 1 on the device (a view of one buffer, made once)."""
        if self._arange is None or self._arange.shape[0] < n:
            self._arange = torch.arange(max(n, self.max_tokens), device=self.device)
        return self._arange[:n]

    @staticmethod
    def _device_draft_rows(batch: StepBatch, qsl: np.ndarray, out: np.ndarray) -> int:
        """The rows of drafts left on the device (Draft.device_tokens; the host packed placeholders there)
        into out; -> how many."""
        count = 0
        for i in batch.device_drafts:
            k = batch.num_drafts[i]
            first = int(qsl[i + 1]) - batch.num_draft_rows[i]  # (known tokens, then the drafts)
            out[count: count + k] = np.arange(first, first + k)
            count += k
        return count

    def remember_samples(self, batch: StepBatch, tokens: torch.Tensor, owner: list[int]) -> None:
        """The step's sampled tokens stay on the device for the next step's pending inputs (each request's row
        in them is worked out when a pending input asks: steps without any, speculative ones, never pay)."""
        self.prev_tokens = tokens
        self._prev_rows = (batch.seqs, owner)
        self._prev_row = None

    @property
    def prev_row(self) -> dict[str, int]:
        """Each request's first row among the previous step's sampled tokens."""
        if self._prev_row is None:
            seqs, owner = self._prev_rows
            self._prev_row = {}
            for r, i in enumerate(owner):
                self._prev_row.setdefault(seqs[i].request_id, r)
        return self._prev_row
