"""A step's output, after its forward: the rows kept for hidden-state capture, prompt logprobs, sampling (under the
step's grammar masks), logprobs, the copies back to the host, and the host lists a StepHandle's result() reads them
into (the acceptance of drafts included)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import torch

from atlas.host_copy import to_device, to_device_tensor
from atlas.runtime.batch import ScheduledSeq, StepBatch, StepResult
from atlas.runtime.drafting import flat_device_drafts
from atlas.runtime.sampler import Sampler, SamplingRow, TokenLogprobs, bad_word_bans, gather_logprobs
from atlas.runtime.step_inputs import InputPreparer, StepInputs
from atlas.runtime.verify import accept_one_hot, accept_with_probs

if TYPE_CHECKING:
    from atlas.models.base import CausalLM
    from atlas.runtime.capture import HiddenCapture
    from atlas.runtime.parallel import ParallelState
    from atlas.runtime.parallel_protocol import StepInfo

# Rows of logits made at once for prompt logprobs (a [rows, vocab] float32 block each).
LOGITS_ROWS_PER_CHUNK = 256


class StepHandle:
    """A launched step. result() waits for the device (only then) and returns host lists. A step launched
    with `masks_deferred` is sampled when apply_masks gives its grammar masks (before result())."""

    def __init__(self, finish: Callable[[], StepResult], sample: Callable[[object], StepHandle] | None = None):
        self._finish = finish
        self._sample = sample
        self._result: StepResult | None = None

    @property
    def awaits_masks(self) -> bool:
        return self._sample is not None

    def apply_masks(self, masks) -> None:
        """Sample the step under `masks` (TokenMasks or None): queued on the device after its forward."""
        sample, self._sample = self._sample, None
        self._finish = sample(masks).result

    def result(self) -> StepResult:
        if self._sample is not None:
            raise RuntimeError("a step launched with deferred grammar masks is read back before apply_masks")
        if self._result is None:
            self._result = self._finish()
        return self._result


NO_RESULT = StepResult([], [], [])  # what a parallel worker's step handle returns (nobody reads it)


class PromptLogprobPlan(NamedTuple):
    """For sequences with prompt_logprobs, at each prompt position p computed in a step (and not before): the flat
    row, the prompt token p + 1 it scores, (sequence, p), and the top-k wanted. A parallel worker's plan has rows
    only (targets and where None, top_k 0): it makes their logits, an all-gather, with the driver."""

    rows: list[int]
    targets: list[int] | None
    where: list[tuple[int, int]] | None
    top_k: int


class PendingPromptLogprobs(NamedTuple):
    """A step's prompt logprobs queued on the device: (sequence, position) of each scored row, and the results
    (copies to the host) of each chunk of rows."""

    where: list[tuple[int, int]]
    chunks: list[TokenLogprobs]


def prompt_logprob_plan(batch: StepBatch) -> PromptLogprobPlan:
    """The step's PromptLogprobPlan (positions already scored are skipped)."""
    rows: list[int] = []
    targets: list[int] = []
    where: list[tuple[int, int]] = []
    first_row = 0
    for i, seq in enumerate(batch.seqs):
        start, n = batch.start[i], batch.num_scheduled[i]
        if seq.prompt_positions_scored is not None:
            first = max(start, seq.prompt_positions_scored)  # positions already scored are skipped
            prompt = seq.prompt_token_ids
            last = min(start + n, len(prompt) - 1)
            for p in range(first, last):
                rows.append(first_row + p - start)
                targets.append(prompt[p + 1])
                where.append((i, p))
        first_row += n
    top_k = max((batch.seqs[i].params.prompt_logprobs for i, _ in where), default=0)
    return PromptLogprobPlan(rows, targets, where, top_k)


def prompt_logprob_lists(batch: StepBatch, pending: PendingPromptLogprobs | None) -> list:
    """Each sequence's prompt logprobs of the step, read back: [(position, logprob, rank, top)], or None for a
    sequence that wants none."""
    out: list = [None] * batch.num_seqs
    if pending is None:
        return out
    where, chunks = pending
    for i, seq in enumerate(batch.seqs):
        if seq.prompt_positions_scored is not None:
            out[i] = []
    e = 0
    for lp in chunks:
        values, ranks = lp.logprobs.tolist(), lp.ranks.tolist()
        top_ids = lp.top_token_ids.tolist() if lp.top_token_ids is not None else None
        top_lp = lp.top_logprobs.tolist() if lp.top_logprobs is not None else None
        for c in range(len(values)):
            i, p = where[e]
            k = batch.seqs[i].params.prompt_logprobs
            top = list(zip(top_ids[c][:k], top_lp[c][:k], strict=True)) if k and top_ids else []
            out[i].append((p, values[c], ranks[c], top))
            e += 1
    return out


def sampling_row(seq: ScheduledSeq, offset: int, num_outputs: int, generator: torch.Generator | None,
                 outputs: list[int] | None) -> SamplingRow:
    """The sampler's view of row `offset` of a sequence that has num_outputs output tokens before it; `outputs`: the
    tokens before the row its penalties count (output tokens, then drafts), None for a sequence without penalties
    (the sampler reads its tokens only to multiply their counts by zero)."""
    p = seq.params
    banned = seq.stop_token_ids if num_outputs + offset < p.min_tokens else []
    if p.bad_words_token_ids and outputs is not None:
        banned = banned + bad_word_bans(p.bad_words_token_ids, outputs)
    return SamplingRow(
        temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, min_p=p.min_p,
        repetition_penalty=p.repetition_penalty, presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty, generator=generator, num_logprobs=p.logprobs,
        prompt_token_ids=seq.prompt_token_ids, output_token_ids=outputs if outputs is not None else [],
        banned_token_ids=banned, logit_bias=p.logit_bias, allowed_token_ids=p.allowed_token_ids)


def keep_captured_rows(cap: HiddenCapture, batch: StepBatch, inputs: StepInputs, device: torch.device
                       ) -> tuple[torch.Tensor | int, list[tuple[int, int]], list[int]]:
    """Which rows of this step go into the capture buffer: all rows of decodes and verifies, and as
    many of the last rows of each prefill chunk as the buffer (and the prefill switch) allow.
    -> (flat row ids, or how many of the first rows when they are all kept in order; per sequence (offset in
    buffer, count); the sequences in buffer order)."""
    space = cap.rows
    qsl = inputs.meta.query_start_loc_cpu
    is_prefill = [batch.num_sample_rows[i] != batch.num_scheduled[i] and not batch.num_draft_rows[i]
                  and batch.num_scheduled[i] > 1 for i in range(batch.num_seqs)]
    placed: list[tuple[int, int]] = [(0, 0)] * batch.num_seqs
    if not any(is_prefill) and qsl[-1] <= space:  # (decodes and verifies: every row, as they lie)
        return qsl[-1], [(qsl[i], qsl[i + 1] - qsl[i]) for i in range(batch.num_seqs)], list(range(batch.num_seqs))
    order = sorted(range(batch.num_seqs), key=lambda i: is_prefill[i])
    chunks: list[range] = []
    offset = 0
    for i in order:  # decode / verify sequences first: their rows always fit
        n = batch.num_scheduled[i]
        take = min(n, space - offset) if (not is_prefill[i] or cap.prefill_enabled) else 0
        if take > 0:
            chunks.append(range(qsl[i + 1] - take, qsl[i + 1]))
            placed[i] = (offset, take)
            offset += take
    rows = [r for c in chunks for r in c]
    return torch.tensor(rows, dtype=torch.long).to(device, non_blocking=True), placed, order


class StepOutput:
    """What the runner does with a step after its forward (its greedy ids, logits, captured and hidden rows):
    captured rows into the capture buffer, prompt logprobs, sampling, the copies back, and the read-back."""

    def __init__(self, model: CausalLM, sampler: Sampler, device: torch.device, parallel: ParallelState | None,
                 logprobs_mode: str = "raw_logprobs"):
        self.model = model
        self.sampler = sampler
        self.device = device
        self.parallel = parallel
        self.logprobs_mode = logprobs_mode  # (--logprobs-mode: what a sampled token's logprobs are)

    def sample(self, batch: StepBatch, inputs: StepInputs, greedy: torch.Tensor | None, logits: torch.Tensor | None,
               captured: torch.Tensor | None, hidden: torch.Tensor | None, plan: PromptLogprobPlan | None,
               info: StepInfo | None, capture: HiddenCapture | None, preparer: InputPreparer | None) -> StepHandle:
        """After the forward: captured rows (into `capture`), prompt logprobs, sampling, copies back (the sampled
        ids stay with `preparer` for the next step's pending inputs). Sampling happens on the driver only; its
        tensor-parallel peers make the same logits (all-gathers) and, when the next step may read its input
        tokens on the device, receive the sampled ids."""
        par = self.parallel
        driver = par is None or par.is_driver
        hidden_views: list[torch.Tensor | None] = [None] * batch.num_seqs
        if captured is not None and capture is not None:
            keep, placed, order = keep_captured_rows(capture, batch, inputs, self.device)
            stored = capture.store(captured, keep)
            # (one split for every sequence's view: a slicing a sequence costs the host more)
            for i, view in zip(order, stored.split([placed[i][1] for i in order]), strict=True):
                if placed[i][1]:
                    hidden_views[i] = view
        prompt_lp = None
        if hidden is not None:
            prompt_lp = self.prompt_logprobs(hidden, plan if plan is not None else prompt_logprob_plan(batch))
        if batch.masks_deferred and driver and par is None:
            def sample(masks) -> StepHandle:
                batch.token_masks = masks
                return self.sample_tokens(batch, inputs, greedy, logits, hidden_views, prompt_lp, info, preparer)

            return StepHandle(lambda: NO_RESULT, sample)
        return self.sample_tokens(batch, inputs, greedy, logits, hidden_views, prompt_lp, info, preparer)

    def prompt_logprobs(self, hidden: torch.Tensor, plan: PromptLogprobPlan) -> PendingPromptLogprobs | None:
        """The plan's logprobs, queued on the device: logits are made a bounded number of rows at a time,
        since a prefill chunk can be thousands of rows. -> ((sequence, position) per row, device results
        per chunk), or None. (A parallel worker's plan has rows only: it makes their logits, an all-gather,
        with the driver.)"""
        rows, targets, where, top_k = plan
        if not rows:
            return None
        chunks = []
        for c in range(0, len(rows), LOGITS_ROWS_PER_CHUNK):
            index = to_device(rows[c: c + LOGITS_ROWS_PER_CHUNK], torch.long, self.device)
            logits = self.model.compute_logits(hidden[index])
            if targets is not None:
                tokens = to_device(targets[c: c + LOGITS_ROWS_PER_CHUNK], torch.long, self.device)
                chunks.append(to_host(gather_logprobs(logits, tokens, top_k)))
        return PendingPromptLogprobs(where, chunks) if targets is not None else None

    def sample_tokens(self, batch: StepBatch, inputs: StepInputs, greedy: torch.Tensor | None,
                      logits: torch.Tensor | None, hidden_views: list[torch.Tensor | None],
                      prompt_lp: PendingPromptLogprobs | None, info: StepInfo | None, preparer: InputPreparer | None
                      ) -> StepHandle:
        """Sampling (under the step's grammar masks), logprobs, the copies back."""
        par = self.parallel
        driver = par is None or par.is_driver
        seqs = batch.seqs
        owner, offset = inputs.sample_owner, inputs.sample_offset
        rows: list[SamplingRow] | None = None
        device_masks = None
        tokens = greedy
        target_probs = None
        logprobs = None
        scored = logits  # (the logits a sampled token's logprobs are taken from: --logprobs-mode)
        normalize = self.logprobs_mode.endswith("logprobs")
        draft_values: dict[int, list[int]] = {}  # (drafts left on the device, once read back: their values)
        if inputs.num_sample_rows and driver:
            masks = batch.token_masks
            constrained = masks.seqs if masks is not None else frozenset()
            plain = [p and i not in constrained for i, p in enumerate(batch.plain_greedy)]
            if not all(p for p, m in zip(plain, batch.num_sample_rows, strict=True) if m):  # (rows' owners)
                for i in batch.device_drafts:  # (penalties count the drafts before a row: their values)
                    if seqs[i].params.needs_output_history and i in batch.draft_tokens:
                        device, placeholders = batch.draft_tokens.pop(i), batch.drafts(i)
                        n = min(len(placeholders), device.shape[0])
                        draft_values[i] = device[:n].tolist() + placeholders[n:]
                gens, history = batch.generators, batch.output_tokens
                rows = []
                for i, j in zip(owner, offset, strict=True):
                    before = history.get(i)
                    if before is not None and j:  # (a verify row: its drafts before it count too)
                        before = before + (draft_values[i] if i in draft_values else batch.drafts(i))[:j]
                    rows.append(sampling_row(seqs[i], j, batch.num_output_tokens[i], gens[i] if gens else None,
                                             before))
                if masks is not None:  # grammar rows leave the argmax fast path for the masked logits
                    every_row = masks.rows == list(range(len(owner)))
                    device_masks = (to_device_tensor(masks.bitmask, self.device),
                                    None if every_row else to_device(masks.rows, torch.long, self.device))
                tokens = self.sampler(logits.float(), rows, device_masks)
                if any(batch.num_drafts[i] for i in batch.draft_probs):
                    target_probs = self.sampler.probabilities(logits.float(), rows, device_masks)
            wanted = [seqs[i].params.logprobs for i in owner]
            if any(k is not None for k in wanted):
                top_k = max(k for k in wanted if k is not None)
                if self.logprobs_mode.startswith("processed") and rows is not None:
                    # (rows None: every row plain greedy, whose processed logits are the raw ones)
                    scored = self.sampler.logprob_logits(logits.float(), rows, device_masks)
                logprobs = gather_logprobs(scored, tokens, top_k, normalize)
        if inputs.num_sample_rows and info is not None and info.share_samples:
            tokens = par.share_samples(tokens if driver else torch.empty(inputs.num_sample_rows, dtype=torch.long,
                                                                          device=self.device))
        if inputs.num_sample_rows and preparer is not None:
            preparer.remember_samples(batch, tokens, owner)
        if not driver:
            return StepHandle(lambda: NO_RESULT)
        tokens_host = tokens.to("cpu", non_blocking=True) if tokens is not None else None
        # Drafts left on the device come back with the results, for the acceptance on the host.
        on_device = [i for i in batch.device_drafts if i in batch.draft_tokens]  # (not read yet)
        drafts_host = None
        if on_device:
            drafts_host = flat_device_drafts([batch.draft_tokens[i] for i in on_device],
                                             [batch.num_drafts[i] for i in on_device]).to("cpu", non_blocking=True)
        logprobs_host = to_host(logprobs) if logprobs is not None else None
        done = None
        if self.device.type == "cuda":
            done = torch.cuda.Event()
            done.record()

        def finish() -> StepResult:
            if done is not None:
                if par is not None:
                    par.wait_event(done)  # (gives up if a worker fails meanwhile)
                else:
                    done.synchronize()
            if drafts_host is not None:
                draft_values.update(read_back(batch, on_device, drafts_host.tolist()))
            return step_result(batch, inputs, tokens_host, scored, rows, target_probs, logprobs_host,
                               hidden_views, prompt_lp, draft_values, normalize)

        handle = StepHandle(finish)
        return self.tracked(handle, info) if par is not None and par.pp == 1 else handle

    def tracked(self, handle: StepHandle, info: StepInfo) -> StepHandle:
        """The driver's handle of a parallel step: reading it back ends the step's clock (the watchdog's)."""
        par = self.parallel

        def finish() -> StepResult:
            result = handle.result()
            par.end_step(info)
            return result

        return StepHandle(finish)


def step_result(batch: StepBatch, inputs: StepInputs, tokens_host: torch.Tensor | None, logits: torch.Tensor | None,
                rows: list[SamplingRow] | None, target_probs: torch.Tensor | None,
                logprobs_host: TokenLogprobs | None, hidden_views: list[torch.Tensor | None],
                prompt_lp: PendingPromptLogprobs | None, draft_values: dict[int, list[int]],
                normalize: bool = True) -> StepResult:
    """A finished step's host lists: each sequence's emitted tokens (its drafts accepted or not), their logprobs,
    its captured rows and its prompt logprobs. `logits`: those the logprobs are taken from (--logprobs-mode;
    normalize=False: the logits themselves)."""
    n_seqs = batch.num_seqs
    result = StepResult([[] for _ in range(n_seqs)], [None] * n_seqs, hidden_views,
                        prompt_logprob_lists(batch, prompt_lp))
    if tokens_host is None:
        return result
    tokens = tokens_host.tolist()
    owner = inputs.sample_owner
    first_row: dict[int, int] = {}
    for r, i in enumerate(owner):
        first_row.setdefault(i, r)
    emitted_rows: list[int] = []
    emitted_tokens: list[int] = []
    for i, r0 in first_row.items():
        m = batch.num_sample_rows[i]
        drafts = (draft_values[i] if i in draft_values else batch.drafts(i))[: batch.num_drafts[i]]
        probs = batch.draft_probs.get(i)
        if not drafts:
            emitted = [tokens[r0]]
        elif probs is None:
            emitted = accept_one_hot(drafts, tokens[r0: r0 + m])
        else:
            emitted = accept_with_probs(drafts, target_probs[r0: r0 + m], probs[: m - 1], tokens[r0 + m - 1],
                                        batch.generators[i] if batch.generators else None)
        result.sampled_token_ids[i] = emitted
        emitted_rows.extend(range(r0, r0 + len(emitted)))
        emitted_tokens.extend(emitted)
    if logprobs_host is None:
        return result
    if emitted_tokens != [tokens[r] for r in emitted_rows]:
        # Rejection sampling emitted tokens other than the target's samples: score those (rare).
        index = to_device(emitted_rows, torch.long, logits.device)
        top_k = logprobs_host.top_token_ids.shape[1] if logprobs_host.top_token_ids is not None else 0
        chosen = to_device(emitted_tokens, torch.long, logits.device)
        full = to_host(gather_logprobs(logits[index], chosen, top_k, normalize))
        picks = list(range(len(emitted_rows)))
    else:
        full, picks = logprobs_host, emitted_rows
    values, ranks = full.logprobs.tolist(), full.ranks.tolist()
    top_ids = full.top_token_ids.tolist() if full.top_token_ids is not None else None
    top_lp = full.top_logprobs.tolist() if full.top_logprobs is not None else None
    for e, r in enumerate(emitted_rows):
        i = owner[r]
        k = batch.seqs[i].params.logprobs
        if k is None:
            continue
        c = picks[e]
        top = list(zip(top_ids[c][:k], top_lp[c][:k], strict=True)) if k and top_ids else []
        if result.logprobs[i] is None:
            result.logprobs[i] = []
        result.logprobs[i].append((values[c], ranks[c], top))
    return result


def read_back(batch: StepBatch, on_device: list[int], values: list[int]) -> dict[int, list[int]]:
    """The drafts of sequences on_device, read back (flat, num_drafts each): each one's drafts with the values in
    place of their placeholders."""
    out, o = {}, 0
    for i in on_device:
        k = batch.num_drafts[i]
        out[i] = values[o: o + k] + batch.drafts(i)[k:]
        o += k
    return out


def to_host(lp: TokenLogprobs) -> TokenLogprobs:
    """Queue the copy of logprob results to the host (read once the step's event has passed)."""
    def host(t):
        return t.to("cpu", non_blocking=True) if t is not None else None

    return TokenLogprobs(host(lp.logprobs), host(lp.ranks), host(lp.top_token_ids), host(lp.top_logprobs))
