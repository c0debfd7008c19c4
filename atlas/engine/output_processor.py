"""Output processing: from a step's RequestUpdates to RequestOutputs.

It detokenizes the new tokens (batched into few calls of the Rust tokenizer), applies stop strings
(cutting an accepted run of speculative tokens exactly where plain decoding would stop, and finishing
the request through the scheduler), builds the logprob entries and the cumulative outputs. The engine
runs it while the device computes the next step, so none of it sits between two GPU steps.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from atlas.engine.request import Request, RequestStatus
from atlas.engine.tokenizer import Tokenizer, detokenize_runs, find_stop_string
from atlas.outputs import Logprob, RequestOutput

_ENDED = frozenset((RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH))
_FINISHED = frozenset(s for s in RequestStatus if s.is_finished)

if TYPE_CHECKING:
    from atlas.engine.scheduler import RequestUpdate, Scheduler


@dataclass
class ParentRequest:
    """A user request; n > 1 fans out into n sibling sequences."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[Request]


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None, scheduler: Scheduler, parents: dict[str, ParentRequest]):
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self.parents = parents
        # What process() makes of each touched parent: a cumulative RequestOutput by default; the engine process
        # sets its own (a delta for the front end, made from the sequences' state without copying it).
        self.emit: Callable[[ParentRequest, bool], Any] = self.make_output
        # Each token's text as logprob entries show it (decode([t]) with special tokens; fixed per id), so that the
        # 21 entries of each of 256 sequences a step are dictionary reads, the new ids of a step decoded in one call.
        self.token_texts: dict[int, str] = {}

    def process(self, updates: list[RequestUpdate], final_only: bool = False) -> list[RequestOutput]:
        """-> the outputs of the parents these updates touched (only finished ones with final_only)."""
        self._learn_token_texts(updates)
        for u in updates:
            if u.prompt_logprobs:
                self._add_prompt_logprobs(u.request, u.prompt_logprobs)
        self._add_tokens([u for u in updates if u.new_token_ids])
        touched: dict[str, ParentRequest] = {}
        for u in updates:
            req = u.request
            if final_only and req.status not in _FINISHED:
                continue  # (its parent cannot be finished)
            parent = self.parents.get(req.parent_id)
            if parent is not None and (u.new_token_ids or req.status in _FINISHED):
                touched[parent.request_id] = parent
        outputs = []
        emit = self.emit
        for parent in touched.values():
            finished = all(c.status in _FINISHED for c in parent.children)
            if finished or not final_only:
                out = emit(parent, finished)
                if out is not None:
                    outputs.append(out)
        return outputs

    # ------------------------------------------------------------------ tokens and text
    def _add_tokens(self, updates: list[RequestUpdate]) -> None:
        """The updates' tokens, detokenized in batched calls: the runs of requests without stop strings (whose
        only early end is a stop token, the run's last) in one call for all their tokens; the others token k of
        every update in round k, since a stop string found at token k leaves the later ones undecoded."""
        # (update, output index of its first token, index of a final stop token or -1)
        active, runs = [], []
        for u in updates:
            req = u.request
            n = len(u.new_token_ids)
            stop_token = req.status is RequestStatus.FINISHED_STOPPED and not isinstance(req.stop_reason, str)
            entry = (u, len(req.output_token_ids) - n, n - 1 if stop_token else -1)
            (active if req.params.stop_strings else runs).append(entry)
        if runs:
            for (u, first, stop_at), texts in zip(runs, self._detokenize_runs(runs), strict=True):
                if u.logprobs is None:  # (no stop strings, no logprobs: the run's text at once; a stop token's is "")
                    req = u.request
                    req.output_text += "".join(texts)
                    if req.status in _ENDED:
                        self._flush(req)
                    continue
                for k in range(len(u.new_token_ids)):
                    self._add_token(u, first + k, k, texts[k], k == stop_at)
        k = 0
        while active:
            texts = self._detokenize(active, k)
            still = []
            for entry, text in zip(active, texts, strict=True):
                u, first, stop_at = entry
                if self._add_token(u, first + k, k, text, k == stop_at) and k + 1 < len(u.new_token_ids):
                    still.append(entry)
            active = still
            k += 1

    def _detokenize_runs(self, runs: list) -> list[list[str]]:
        """Each run's token texts ("" for a stop token and without a detokenizer)."""
        texts = [[""] * len(u.new_token_ids) for u, _, _ in runs]
        idx = [i for i, (u, _, _) in enumerate(runs) if u.request.detokenizer is not None]
        if idx:
            tokens = []
            for i in idx:
                u, _, stop_at = runs[i]
                tokens.append(u.new_token_ids[:stop_at] if stop_at >= 0 else u.new_token_ids)
            decoded = detokenize_runs(self.tokenizer, [runs[i][0].request.detokenizer for i in idx], tokens)
            for i, run_texts in zip(idx, decoded, strict=True):
                texts[i][:len(run_texts)] = run_texts
        return texts

    def _detokenize(self, active: list, k: int) -> list[str]:
        """Token k of each update (a run of one token each)."""
        texts = [""] * len(active)
        idx = [i for i, (u, _, stop_at) in enumerate(active) if u.request.detokenizer is not None and k != stop_at]
        if idx:
            decoded = detokenize_runs(self.tokenizer, [active[i][0].request.detokenizer for i in idx],
                                      [[active[i][0].new_token_ids[k]] for i in idx])
            for i, (text,) in zip(idx, decoded, strict=True):
                texts[i] = text
        return texts

    def _add_token(self, u: RequestUpdate, index: int, k: int, new_text: str, is_stop_token: bool) -> bool:
        """Token k of the update (output index `index`): logprobs, text, stop strings.
        -> False when the request stops with it."""
        req = u.request
        if u.logprobs is not None:
            entry = u.logprobs[k]
            req.logprobs.append(self.logprob_entry(u.new_token_ids[k], entry))
            req.cumulative_logprob += entry[0]
        if is_stop_token:
            self._flush(req)
            return False
        req.output_text += new_text
        params = req.params
        if new_text and params.stop_strings and index + 1 >= params.min_tokens:
            hit = find_stop_string(req.output_text, len(new_text), params.stop_strings)
            if hit is not None:
                pos, stop = hit
                req.output_text = req.output_text[: pos + len(stop) if params.include_stop_str_in_output else pos]
                self._stop_at(req, index, stop)
                return False
        if k == len(u.new_token_ids) - 1 and req.status in _ENDED:
            self._flush(req)
        return True

    def _flush(self, req: Request) -> None:
        """At the end: the text held back for a partial character."""
        if req.detokenizer is not None and req.status is not RequestStatus.FINISHED_ABORTED:
            req.output_text += req.detokenizer.flush()

    def _stop_at(self, req: Request, index: int, stop: str) -> None:
        """A stop string ends the request at output token `index`: later tokens of the step go."""
        extra = len(req.output_token_ids) - (index + 1)
        if extra:
            del req.output_token_ids[index + 1:]
            del req.all_token_ids[len(req.prompt_token_ids) + index + 1:]
            self.scheduler.stats.num_generation_tokens -= extra
        req.stop_reason = stop
        if req.is_finished:  # it reached a length limit on the same step: the stop string decides
            stats = self.scheduler.stats
            stats.finished_reasons[req.status.value] -= 1
            stats.finished_reasons["stop"] = stats.finished_reasons.get("stop", 0) + 1
            req.status = RequestStatus.FINISHED_STOPPED
        else:
            self.scheduler.finish(req, RequestStatus.FINISHED_STOPPED)

    # ------------------------------------------------------------------ logprobs
    def _learn_token_texts(self, updates: list[RequestUpdate]) -> None:
        """The texts of the step's logprob tokens not seen before, decoded in one batched call."""
        if self.tokenizer is None:
            return
        known = self.token_texts
        new: set[int] = set()
        for u in updates:
            rows = []
            if u.logprobs is not None:
                rows.append(zip(u.new_token_ids, u.logprobs, strict=False))
            if u.prompt_logprobs:
                ids = u.request.prompt_token_ids
                rows.append(((ids[pos + 1] if pos + 1 < len(ids) else None, (lp, rank, top))
                             for pos, lp, rank, top in u.prompt_logprobs))
            for row in rows:
                for token, (_, _, top) in row:
                    if token is not None and token not in known:
                        new.add(token)
                    new.update(t for t, _ in top if t not in known)
        if new:
            ids = sorted(new)
            known.update(zip(ids, self.tokenizer.decode_batch([[t] for t in ids], skip_special_tokens=False),
                             strict=True))

    def _token_text(self, token: int) -> str | None:
        if self.tokenizer is None:
            return None
        text = self.token_texts.get(token)
        if text is None:
            text = self.token_texts[token] = self.tokenizer.decode([token], skip_special_tokens=False)
        return text

    def logprob_entry(self, token: int, entry: tuple) -> dict[int, Logprob]:
        """{token: Logprob} for a chosen token, then the top ones in rank order."""
        logprob, rank, top = entry
        text = self._token_text
        entries = {token: Logprob(logprob, rank, text(token))}
        for r, (t, lp) in enumerate(top, start=1):
            if t not in entries:
                entries[t] = Logprob(lp, r, text(t))
        return entries

    def _add_prompt_logprobs(self, req: Request, rows: list) -> None:
        for position, logprob, rank, top in rows:
            if position + 1 == len(req.prompt_logprobs):  # (a recompute after preemption repeats some)
                req.prompt_logprobs.append(self.logprob_entry(req.prompt_token_ids[position + 1], (logprob, rank, top)))

    # ------------------------------------------------------------------ outputs
    @staticmethod
    def visible_length(req: Request) -> int:
        """While running, the characters that could still be the start of a stop string are held back."""
        hold = req.params.max_stop_string_len - 1
        if req.is_finished or hold <= 0:
            return len(req.output_text)
        return max(0, len(req.output_text) - hold)

    @classmethod
    def _visible_text(cls, req: Request) -> str:
        return req.output_text[: cls.visible_length(req)]

    def make_output(self, parent: ParentRequest, finished: bool) -> RequestOutput:
        if finished:
            self.parents.pop(parent.request_id, None)
        first = parent.children[0]
        return RequestOutput(
            request_id=parent.request_id,
            prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            outputs=[c.completion_output(self._visible_text(c)) for c in parent.children],
            finished=finished,
            num_cached_tokens=first.num_cached_tokens,
            metrics=first.metrics,
            prompt_logprobs=list(first.prompt_logprobs) if first.prompt_logprobs is not None else None,
            embedding=first.embedding,
        )
