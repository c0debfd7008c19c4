"""Beam search over the engine (vLLM's LLM.beam_search and the server's use_beam_search), on the host.

Each step, every live beam of every prompt is one ordinary request of one token whose logprobs (the best
2 x beam_width) are the step's candidates: its prompt is the beam so far, so the prefix cache gives back every full
page the beam shares with the steps before, and a step of many beams is one batched engine step. The search itself
is transformers' with early_stopping=True (no sampling): from all candidates of a prompt, ranked by summed logprob,
an end token among the best beam_width ends a beam (kept among the beam_width best finished ones, by score), the best
beam_width others go on; the search ends when beam_width beams have ended, or at max_tokens, where the live ones
finish too. A finished beam's score is its summed logprob /
(generated tokens ** length_penalty), the end token not counted.
"""

from __future__ import annotations

from dataclasses import dataclass

from atlas.outputs import BeamSearchOutput, BeamSearchSequence, Logprob
from atlas.sampling_params import BeamSearchParams, SamplingParams


def step_work(searches: list[BeamSearch]) -> list[tuple[BeamSearch, list[int]]]:
    """The beams every unfinished search scores next: (its search, its tokens), one request each."""
    return [(search, beam) for search in searches for beam in search.pending()]


def advance_all(searches: list[BeamSearch], work: list[tuple[BeamSearch, list[int]]], outs: list) -> None:
    """Each search advanced by its beams' one-token outputs (`outs`, the RequestOutputs of `work`, in order)."""
    entries: dict[int, list] = {}
    for (search, _), out in zip(work, outs, strict=True):
        entries.setdefault(id(search), []).append(out.outputs[0].logprobs[0])
    for search in searches:
        if id(search) in entries:
            search.advance(entries[id(search)])


def step_params(params: BeamSearchParams) -> SamplingParams:
    """The one-token request that scores a beam's next tokens."""
    return SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, logprobs=2 * params.beam_width,
                          detokenize=False, skip_special_tokens=False)


@dataclass
class _Beam:
    tokens: list[int]
    logprobs: list[dict[int, Logprob]]
    cum_logprob: float


class BeamSearch:
    """One prompt's search: `pending()` are the beams to score next (empty once it is over), `advance(entries)`
    takes each one's logprob entries, `output(decode)` the result."""

    def __init__(self, prompt_ids: list[int], params: BeamSearchParams, eos_token_ids: list[int]):
        self.params = params
        self.num_prompt_tokens = len(prompt_ids)
        self.eos = frozenset(() if params.ignore_eos else eos_token_ids)
        self.alive = [_Beam(list(prompt_ids), [], 0.0)]
        self.finished: list[tuple[float, _Beam, str]] = []  # (score, beam, finish reason), best first
        self.steps = 0

    def pending(self) -> list[list[int]]:
        return [] if self.done else [b.tokens for b in self.alive]

    @property
    def last_prompt_length(self) -> int:
        """The longest prompt a step of this search sends (the beams before their last token): it must fit."""
        return self.num_prompt_tokens + self.params.max_tokens - 1

    @property
    def done(self) -> bool:
        # (at max_tokens `advance` has finished every live beam)
        return not self.alive or self._cannot_improve()

    def _cannot_improve(self) -> bool:
        """(transformers' early_stopping=True: beam_width beams have ended; nothing live can then replace one)"""
        return len(self.finished) >= self.params.beam_width

    def _score(self, beam: _Beam, ended: bool) -> float:
        generated = len(beam.tokens) - self.num_prompt_tokens - (1 if ended else 0)
        return beam.cum_logprob / (max(generated, 1) ** self.params.length_penalty)

    def _finish(self, beam: _Beam, reason: str) -> None:
        self.finished.append((self._score(beam, reason == "stop"), beam, reason))
        self.finished.sort(key=lambda f: -f[0])
        del self.finished[self.params.beam_width:]

    def advance(self, entries: list[dict[int, Logprob]]) -> None:
        """entries[i]: the logprob entries of live beam i's next token."""
        width = self.params.beam_width
        candidates = []
        for index, (beam, top) in enumerate(zip(self.alive, entries, strict=True)):
            for token, lp in top.items():
                candidates.append((beam.cum_logprob + lp.logprob, index, token, top))
        # (best first; ties by beam, then token id: the same order every run)
        candidates.sort(key=lambda c: (-c[0], c[1], c[2]))
        alive = []
        for rank, (cum, index, token, top) in enumerate(candidates):
            beam = self.alive[index]
            grown = _Beam(beam.tokens + [token], beam.logprobs + [top], cum)
            if token in self.eos:
                if rank < width:  # (an end token outside the best beam_width is not a better hypothesis)
                    self._finish(grown, "stop")
                continue
            alive.append(grown)
            if len(alive) == width:
                break
        self.alive = alive
        self.steps += 1
        if self.steps >= self.params.max_tokens:
            for beam in self.alive:
                self._finish(beam, "length")
            self.alive = []

    def output(self, decode) -> BeamSearchOutput:
        """The best beam_width beams, best first; decode(ids) -> the generated tokens' text (None: no text)."""
        if self.alive:  # (stopped early: the live beams compete with the finished ones)
            for beam in self.alive:
                self._finish(beam, "length")
            self.alive = []
        sequences = []
        for _, beam, reason in self.finished:
            generated = beam.tokens[self.num_prompt_tokens:]
            shown = generated[:-1] if reason == "stop" and not self.params.include_stop_str_in_output else generated
            sequences.append(BeamSearchSequence(beam.tokens, beam.logprobs, beam.cum_logprob,
                                                decode(shown) if decode is not None else None, reason,
                                                self.num_prompt_tokens))
        return BeamSearchOutput(sequences)
