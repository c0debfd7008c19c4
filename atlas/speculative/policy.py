"""When to speculate: each step, draft for the running requests only where it pays.

A verify step of n requests with K drafts each costs T_verify(n) (the target over K + 1 rows a request, the
drafter, the host work between steps) and gives every request 1 + a tokens, a being the drafts it
accepts; a plain step costs T_plain(n) and gives one token a request. So drafting pays when

    mean over the requests of (1 + a_r)  >  T_verify(n) / T_plain(n)   (with a small margin).

That is the right test while requests wait for a slot: a request that finishes early is replaced at once, so
the batch's tokens per second is what counts. When nothing waits, a request that finishes early frees a slot
nobody takes, and what counts is when the last request ends (a static batch's wall time, each user's latency):
drafting must shorten the longest expected remainder, so the gain is

    max over the requests of rem_r  /  max over the requests of rem_r / (1 + a_r)

(rem_r: tokens request r may still produce). With one request, or requests that accept alike, both tests are
the same; a request whose drafts are never accepted and that has as far to go as any other keeps the batch
plain, since every drafted step would lengthen its time by the cost ratio (n-gram on text where only some
requests repeat themselves).

The second test takes a maximum over the requests, so one request's noisy estimate decides it: n-gram and DFlash on
code accept 0 drafts in one step and 4 in the next, and the least of 16 short running means is far below any
request's real rate (on the built-in model's held-out code, 16 requests in a wave: the batch went plain after a few
steps and the probes, spaced for a batch that gains nothing, never came back: 0.87x plain decoding where drafting
every step gave 1.17x in session 31; benchmarks/s59/call2). So that test reads each request's mean over all its
verify steps shrunk towards the mean of all requests, as if it had begun with `shrink_steps` steps at that mean: a
request must accept less than the others over several steps before it holds the batch back.

A request that has accepted nothing yet is read otherwise there: it is worth the mean of all requests over the share
of its remaining steps expected after its first acceptance, that acceptance coming at the rate at which the recent
verify steps (`onset_window`, 32) of requests in the same state saw one. On code, requests that have not matched yet
mostly match soon, and that rate keeps them worth drafting for; on a random model's text with n-gram, some requests
fall into a repeat (every draft accepted) and the rest never match, and once the repeats have begun the rate falls to
nothing, so the requests that never matched keep the wave plain within a few drafted steps, where shrunk towards the
repeaters' mean they had looked worth drafting for over tens of steps (session 76's H100 row: 0.957x plain decoding at
64 streams). Replayed (tools/policy_replay.py, waves unless said; plain decoding's time over the policy's at a verify
cost of 1.2 / 1.5 / 2 plain steps; session 77): the synthetic mixed traces (benchmarks/s76/mixed_repeat_traces.py) at
64 streams from 0.95 / 0.93 / 0.93 to 0.97 / 0.97 / 0.96 (80 % repeating) and from 0.93 / 0.92 / 0.92 to 0.96 / 0.95 /
0.94 (95 %); the built-in model's code with n-gram 1.55 / 1.28 / 1.10 -> 1.55 / 1.28 / 1.08 in waves of 16, 1.21 / 1.01 /
0.85 -> 1.21 / 1.01 / 1.04 in waves of 48, 2.01 / 1.65 / 1.11 -> 2.00 / 1.65 / 1.06 in waves of 4, continuously at 16
2.10 / 1.71 / 1.27 -> 2.10 / 1.71 / 1.22; DFlash on code unchanged in all of them (its requests accept from the
start). A longer window follows the fall too slowly (128: 0.96 / 0.92 / 0.93 and 0.91 / 0.88 / 0.86 on the mixed
traces), a shorter one costs code (16: n-gram in waves of 16 1.47 / 1.18 / 1.08).

The first test, and the second with one request, read the short running means, which move with each step; a drafting
step whose gain dips below the margin is not a reason to stop, and each switch costs the overlap around it (the lone
probe's cost below). So the margin is asked of starting only: a drafting batch goes on while drafting pays at all.
And a lone request's step where the proposer has nothing (n-gram without a match) is a plain step that lost its
overlap, not a verify step that accepted nothing: it counts as falling short of a verify step by the margin
(`observe_empty`), so that the matches decide, and a proposer that never finds anything is still switched off.

Replaying the acceptances of 48 held-out prompts of the built-in model drafted at every step through this policy, a
verify step costing 1.2 / 1.5 / 2 plain ones and a switch 0.45 more (tools/policy_replay.py; plain decoding's time
over the policy's): in waves of 16, n-gram 1.55 / 1.28 / 1.10x (drafting every step 1.60 / 1.30 / 0.99x; the policy
before these three changes 1.18 / 1.07 / 1.01x) and DFlash 2.27 / 1.85 / 1.41x (every step 2.37 / 1.90 / 1.42x;
before 2.15 / 1.52 / 1.02x); one request at a time, n-gram 2.67 / 2.19 / 1.47x (every step 2.79 / 2.36 / 1.88x;
before 2.56 / 2.09 / 1.23x) and DFlash 3.25 / 2.60 / 1.92x (every step 3.25 / 2.60 / 1.95x; before 3.23 / 2.45 /
1.48x). On the H200 this policy ran n-gram alone at 2.61x where the one before ran 1.64x, and DFlash at 2.65x
against 2.28x (benchmarks/s59/call3, call5). What n-gram alone still loses at a costly verify step is its probes'
spacing: it is set by what a drafted probe costs, while an n-gram probe that finds no match costs a plain step.

Both sides are measured while serving, nothing is assumed:
- a_r: a running mean of the drafts request r accepted per verify step (per request: a request whose text suits the
  drafter keeps its own estimate; weight `acceptance_weight` 0.25 on the newest step, about the last seven steps). A
  request not measured yet counts as accepting the recent mean of all requests once that mean has followed
  `prior_steps` (32) observations, and before that half its drafts or the mean if more (so that the first requests
  are measured by their first steps instead of waiting for a probe). Counted at half its drafts whatever the recent
  requests accepted, each new wave of 256 requests among drafts never accepted looked nearly free to probe and
  drafted one step at a verify step's cost (0.953x plain decoding at 256 streams on an H200, session 90; replayed
  with tools/policy_replay.py on waves that accept nothing, a verify step at 5 plain steps: 0.975 -> 0.986x), while
  on code new requests are like the recent ones and draft from their first step as before;
- T_verify, T_plain: the measured time between successive step launches (the median of the recent ones), per
  kind and per batch-size bucket (a power of two), from steps that carry decodes only (a prefill chunk would
  make the step incomparable). A bucket not measured yet borrows the ratio of the nearest measured one; with none,
  the first step drafts (to measure it) and a plain step follows (to measure that).

Steps draft for every decoding request or for none: a verify step is one uniform CUDA graph of K + 1 rows a
request, so a request left out of it would cost the same rows. When drafting stops, the estimates stop
changing; a probe (one drafted step) refreshes them every P plain steps, P chosen so that the probes cost
at most `probe_budget` of plain decoding's speed: P = (what one probe loses against a plain step) / budget.
A lone probe costs more than a verify step among verify steps (the steps around it lose their overlap), so
its cost is measured apart, over the four launch periods around it (`_measure_probe`); on the H200 a DFlash
probe at batch 1 took about 2.3 plain steps against a verify step's 1.4 (benchmarks/s58/call4).

With a ladder of shorter draft lengths (`lengths`, --tuning draft_lengths) a drafting step may take one of them
instead of K: a request's mean accepted drafts at K is read as a per-draft rate p (each draft accepted with p
until the first rejection: E_k = p + ... + p^k), so that a step of k drafts gives 1 + E_k a request, against that
length's own measured cost ratio (else K's, scaled by the draft rows). The length with the most progress for its
cost wins, where it beats plain decoding by the margin; probes and measuring steps draft K. A step cut to k whose
k drafts were all accepted counts as a run that went on (k plus what p gives for the rest), so the mean stays K's.

While drafting is off and no request joined or left the batch, the engine repeats the last decision
(`decide_same_batch`: plain again, until a probe is due) for up to `reuse_steps` steps instead of reading every
request each step (the full decision costs about a third of a millisecond of host time a step at 256 requests on
one core). A request whose prefill ended in between is counted at the next full decision.

The policy holds no tensor and no torch import: the scheduler feeds it acceptances and requests, the
engine step times, and it answers `decide`.
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections import Counter, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field


def bucket_of(batch_size: int) -> int:
    """The cost table's key for a batch of this many requests: the power of two at or above it."""
    return 1 << max(0, batch_size - 1).bit_length()


class _Runs:
    """Accepted drafts of a step of k drafts, E_k(p) = p + p^2 + ... + p^k, for a request whose drafts are each
    accepted with probability p until the first rejection; p is read off the request's measured mean at K
    drafts, E_K(p) = a. Tabulated over p (65 points, linear between them): a per-request lookup is one bisection."""

    POINTS = 64

    def __init__(self, k_max: int, lengths: Iterable[int]):
        self.k_max = k_max
        ps = [i / self.POINTS for i in range(self.POINTS + 1)]
        self.at_max = [self.run(p, k_max) for p in ps]
        self.at = {k: [self.run(p, k) for p in ps] for k in lengths}

    @staticmethod
    def run(p: float, k: int) -> float:
        return sum(p ** i for i in range(1, k + 1))

    def rate(self, accepted: float) -> float:
        """p with E_K(p) = accepted."""
        table = self.at_max
        if accepted <= 0:
            return 0.0
        if accepted >= table[-1]:
            return 1.0
        i = bisect.bisect_left(table, accepted)
        lo, hi = table[i - 1], table[i]
        return (i - 1 + (accepted - lo) / (hi - lo)) / self.POINTS

    def at_length(self, accepted: float, k: int) -> float:
        """E_k for a request whose mean at K drafts is `accepted`."""
        if k == self.k_max:
            return accepted
        x = self.rate(accepted) * self.POINTS
        i = min(int(x), self.POINTS - 1)
        table = self.at[k]
        return table[i] + (x - i) * (table[i + 1] - table[i])


@dataclass
class _Cost:
    """One kind of step's period at one bucket: the median of its recent samples. (A running mean trusted its
    first sample: the first plain step after a verify step is launched before the device is busy again, so its
    period is the host's alone, and the real periods after it, several times longer, were then rejected as
    idle gaps: plain decoding looked cheap and drafting stayed off. The median follows either way.)"""

    recent: deque = field(default_factory=lambda: deque(maxlen=15))

    @property
    def samples(self) -> int:
        return len(self.recent)

    @property
    def seconds(self) -> float:
        return statistics.median(self.recent) if self.recent else 0.0

    def add(self, seconds: float) -> None:
        if len(self.recent) >= 3 and seconds > 4 * self.seconds:
            return  # (a pause of the host or an idle loop between two steps: not the step's cost)
        self.recent.append(seconds)


@dataclass
class SpeculationPolicy:
    num_draft_tokens: int
    always: bool = False  # --speculative-policy always: every step drafts (the policy only measures)
    margin: float = 0.05  # drafting must beat plain decoding by this share
    probe_budget: float = 0.01  # share of plain decoding's speed the probes may cost while drafting is off
    min_probe_interval: int = 8
    max_probe_interval: int = 2048
    acceptance_weight: float = 0.25  # of the newest verify step in a request's running mean
    min_cost_samples: int = 2  # periods a bucket needs before its mean is trusted
    unmeasured_ratio: float = 1.5  # a verify step's cost in plain steps before one is measured (probe spacing)
    reuse_steps: int = 16  # steps a "plain" decision may be repeated for an unchanged batch (decide_same_batch)
    shrink_steps: float = 8.0  # verify steps at the mean of all requests each request's whole-life mean begins with
    onset_window: int = 32  # recent verify steps of requests that had accepted nothing, read for their onset rate
    # observations after which a request not measured yet is taken at the prior alone (0: never; _unknown)
    prior_steps: int = 32
    # Draft lengths below num_draft_tokens that a drafting step may take instead (a ladder: each has verify-step
    # CUDA graphs of its own); empty: K only.
    lengths: tuple[int, ...] = ()
    # State
    prior: float | None = None  # recent mean of accepted drafts per verify step, over all requests
    acceptance: dict[str, float] = field(default_factory=dict)  # request id -> running mean
    # request id -> [accepted drafts, verify steps] over its life (the shrunk mean of the wall-time test)
    totals: dict[str, list] = field(default_factory=dict)
    costs: dict[tuple[bool, int], _Cost] = field(default_factory=dict)  # (drafted, bucket) -> period
    # bucket -> a lone probe's cost in plain steps (a _Cost's median, of ratios here, not seconds)
    probe_costs: dict[int, _Cost] = field(default_factory=dict)
    _recent: deque = field(default_factory=lambda: deque(maxlen=4))  # (drafted, bucket, seconds) of the last periods
    drafting: bool = True  # the last decision
    plain_run: int = 0  # plain steps since drafting stopped or the last probe
    decisions: int = 0
    probes: int = 0
    switches: int = 0
    repeats: int = 0  # decisions that repeated the last one for an unchanged batch (decide_same_batch)
    length: int = 0  # drafts a request of the last drafting decision (num_draft_tokens, or one of `lengths`)
    lengths_chosen: Counter = field(default_factory=Counter)  # drafting decisions by length
    # (k < K, bucket) -> the period of a verify step of k drafts a request
    length_costs: dict[tuple[int, int], _Cost] = field(default_factory=dict)
    _off_interval: int | None = None  # the probe spacing of the last decision, when it kept the batch plain by cost
    _reused: int = 0  # times the last full decision has been repeated
    _started: set = field(default_factory=set)  # requests that have accepted a draft
    _prior_count: int = 0  # observations the prior has followed

    def __post_init__(self) -> None:
        k = self.num_draft_tokens
        self.lengths = tuple(sorted({n for n in self.lengths if 0 < n < k}))
        self.length = k
        self._runs = _Runs(k, self.lengths) if self.lengths else None
        # whether each recent verify step of a request that had accepted nothing before it accepted something
        self._onsets: deque = deque(maxlen=max(1, self.onset_window))

    # ------------------------------------------------------------------ what it is told
    def observe_verify(self, request_id: str, accepted: int, cut: int | None = None) -> None:
        """A request's verify step accepted this many of its drafts; `cut`: the step's drafts were cut to that
        length by this policy (a ladder length), so that every one accepted says the run went on: it counts as
        `cut` plus what the request's rate gives for the K - cut drafts it did not have (the mean is kept at K)."""
        self._observe(request_id, accepted, cut, drafted=True)

    def _observe(self, request_id: str, accepted: float, cut: int | None, drafted: bool) -> None:
        """observe_verify's update; `drafted`: the request had drafts this step (observe_empty's value, for a step
        where it had none, is no acceptance: it does not start the request for the onset rate)."""
        if request_id not in self._started:
            onset = drafted and accepted > 0
            self._onsets.append(onset)
            if onset:
                self._started.add(request_id)
        w = self.acceptance_weight
        old = self.acceptance.get(request_id)
        base = old if old is not None else (self.prior if self.prior is not None else accepted)
        if cut is not None and self._runs is not None and 0 < cut < self.num_draft_tokens and accepted >= cut:
            accepted = cut + _Runs.run(self._runs.rate(base), self.num_draft_tokens - cut)
        self.acceptance[request_id] = base + w * (accepted - base)
        total = self.totals.setdefault(request_id, [0.0, 0])
        total[0] += accepted
        total[1] += 1
        # (the prior follows every observation, more slowly: it seeds the requests that arrive next)
        self.prior = accepted if self.prior is None else self.prior + 0.1 * (accepted - self.prior)
        self._prior_count += 1

    def observe_empty(self, request_id: str, batch_size: int) -> None:
        """The proposer had no draft for this request this step (n-gram without a match), in a batch of
        `batch_size` decoding requests. Among others, the step still verifies their drafts at a verify step's
        cost and this request gains nothing from it: it counts as accepting nothing (or a few requests whose
        drafts hit would keep every step of a large batch drafting). Alone, its step is a plain one, one row,
        that lost its overlap with the next: it counts as a verify step that falls short of paying by the margin
        (ratio / (1 + margin) - 1 drafts), so that the matches decide and a proposer that never finds anything
        is still turned off."""
        ratio = self.cost_ratio(1) if batch_size == 1 else None
        self._observe(request_id, 0 if ratio is None else max(0.0, ratio / (1.0 + self.margin) - 1.0), None,
                      drafted=False)

    def forget(self, request_id: str) -> None:
        self.acceptance.pop(request_id, None)
        self.totals.pop(request_id, None)
        self._started.discard(request_id)

    def _shrunk(self, request_id: str, unknown: float) -> float:
        """A request's mean accepted drafts over its life, as if it had begun with `shrink_steps` verify steps at
        the mean of all requests (the wall-time test's estimate; the module's note)."""
        total = self.totals.get(request_id)
        if total is None or self.prior is None:
            return unknown
        return (total[0] + self.shrink_steps * self.prior) / (total[1] + self.shrink_steps)

    def _onset_rate(self) -> float | None:
        """The share of the recent verify steps of requests that had accepted nothing in which they accepted something
        (None: onset_window off, or fewer than half its steps seen)."""
        if not self.onset_window or len(self._onsets) < self._onsets.maxlen // 2:
            return None
        return sum(self._onsets) / len(self._onsets)

    def _wall_estimate(self, request_id: str, unknown: float, remaining: int, h: float | None) -> float:
        """The wall-time test's estimate of a request's accepted drafts a step: its shrunk mean, but for a request that
        has accepted nothing yet, the mean of all requests over the share of its remaining steps expected after its
        first acceptance, at the onset rate h (_onset_rate; the module's note)."""
        if h is None or request_id in self._started or request_id not in self.totals or self.prior is None:
            return self._shrunk(request_id, unknown)
        if h <= 0.0:
            return 0.0
        steps = remaining / (1.0 + self.prior)  # (its steps if it accepted as the others do)
        after = 1.0 - (1.0 - (1.0 - h) ** steps) / (steps * h)  # (expected share of them after a geometric onset)
        return self.prior * max(0.0, after)

    def observe_step(self, drafted: bool, batch_size: int, seconds: float, length: int | None = None) -> None:
        """The period of one step that carried decodes only (batch_size requests), drafted (`length` drafts a
        request: K if None) or plain; successive calls are successive steps unless observe_gap came between them."""
        if batch_size <= 0 or seconds <= 0:
            self.observe_gap()
            return
        b = bucket_of(batch_size)
        if drafted and length is not None and length < self.num_draft_tokens:
            self.length_costs.setdefault((length, b), _Cost()).add(seconds)
        else:
            self.costs.setdefault((drafted, b), _Cost()).add(seconds)
        self._recent.append((drafted, b, seconds))
        self._measure_probe()

    def observe_gap(self) -> None:
        """A step that is not one of decodes only (a prompt chunk among them), or an idle engine, came between."""
        self._recent.clear()

    def _measure_probe(self) -> None:
        """A lone probe costs more than a verify step among verify steps: the plain step before it is read back
        before the probe is drafted (no overlap), and the plain step after it waits for its accepted count. So
        the four periods plain, probe, plain, plain (launch to launch: from the launch of the step before the probe
        to that of the third after it) are measured together, and what they took beyond three plain periods is
        the probe's cost, in plain steps."""
        recent = self._recent
        if len(recent) < 4 or [d for d, _, _ in recent] != [False, True, False, False]:
            return
        b = recent[0][1]
        plain = self.costs.get((False, b))
        if any(bucket != b for _, bucket, _ in recent) or not self._trusted(plain):
            return
        span = sum(seconds for _, _, seconds in recent)
        self.probe_costs.setdefault(b, _Cost()).add(max(1.0, span / plain.seconds - 3))

    def _trusted(self, cost: _Cost | None) -> bool:
        """Whether a step kind's period at a bucket has the samples its median needs to be used."""
        return cost is not None and cost.samples >= self.min_cost_samples

    def probe_ratio(self, batch_size: int, ratio: float) -> float:
        """What a lone probe costs in plain steps at this batch size: the measured lone probes' median at its
        bucket, at least the verify steps' ratio (which is what a probe costs before any lone one is measured)."""
        probes = self.probe_costs.get(bucket_of(batch_size))
        return max(ratio, probes.seconds) if self._trusted(probes) else ratio

    # ------------------------------------------------------------------ what it answers
    def expected_tokens(self, request_ids: Iterable[str], remaining: Sequence[int] | None = None,
                        length: int | None = None) -> float:
        """How many plain steps' worth of progress one verify step (of `length` drafts a request; K if None) gives
        these requests: the mean of each one's 1 + expected accepted drafts; with `remaining` (tokens each may still
        produce, nothing waiting for a slot), the shortening of the longest expected remainder instead (the
        module's note)."""
        ids = list(request_ids)
        if not ids:
            return 1.0
        unknown = self._unknown()
        if remaining is not None and len(ids) > 1:
            # (a maximum over requests: the steady estimates)
            onset = self._onset_rate()
            accepts = [self._wall_estimate(r, unknown, max(1, n), onset) for r, n in zip(ids, remaining, strict=True)]
        else:
            accepts = [self.acceptance.get(r, unknown) for r in ids]
        if length is None or length == self.num_draft_tokens or self._runs is None:
            per_request = [1.0 + a for a in accepts]
        else:
            per_request = [1.0 + self._runs.at_length(a, length) for a in accepts]
        if remaining is None:
            return sum(per_request) / len(ids)
        rem = [max(1, n) for n in remaining]
        return max(rem) / max(n / t for n, t in zip(rem, per_request, strict=True))

    def _unknown(self) -> float:
        """What a request not measured yet is taken to accept a verify step: the recent mean of all requests once
        `prior_steps` observations made it (new requests are mostly like the recent ones; the module's note), else
        half its drafts or that mean if more."""
        if self.prior is not None and self.prior_steps and self._prior_count >= self.prior_steps:
            return self.prior
        return max(self.num_draft_tokens / 2, self.prior or 0.0)

    def cost_ratio(self, batch_size: int) -> float | None:
        """T_verify / T_plain at this batch size, from the nearest bucket where both are measured; None if none."""
        want = bucket_of(batch_size)
        best: tuple[float, float] | None = None
        for (drafted, b), cost in self.costs.items():
            plain = self.costs.get((False, b))
            if not drafted or not self._trusted(cost) or not self._trusted(plain) or plain.seconds <= 0:
                continue
            distance = abs(math.log2(b) - math.log2(want))
            if best is None or distance < best[0]:
                best = (distance, cost.seconds / plain.seconds)
        # (at least 1: a verify step is a plain step plus draft rows, so a measured ratio below 1 is noise of the
        #  host, and with it drafts that are never accepted would look worth drafting)
        return None if best is None else max(1.0, best[1])

    def length_ratio(self, batch_size: int, length: int, ratio: float) -> float:
        """T_verify / T_plain of a step of `length` drafts a request: measured at this bucket, else the K-draft
        ratio scaled by the draft rows (a verify step's cost beyond a plain one grows with its rows)."""
        b = bucket_of(batch_size)
        cost, plain = self.length_costs.get((length, b)), self.costs.get((False, b))
        if self._trusted(cost) and self._trusted(plain) and plain.seconds > 0:
            return max(1.0, cost.seconds / plain.seconds)
        return 1.0 + (ratio - 1.0) * length / self.num_draft_tokens

    def _best_length(self, request_ids: list[str], remaining: Sequence[int] | None, gain: float,
                     ratio: float) -> tuple[int, float]:
        """The draft length of the ladder whose verify step gives the most progress for its cost: (length,
        expected progress / cost ratio)."""
        n, k = len(request_ids), self.num_draft_tokens
        best = (k, gain / ratio)
        for length in self.lengths:
            value = (self.expected_tokens(request_ids, remaining, length)
                     / self.length_ratio(n, length, ratio))
            if value > best[1]:
                best = (length, value)
        return best

    def decide(self, request_ids: list[str], remaining: Sequence[int] | None = None) -> bool:
        """Whether the next step drafts for these decoding requests. `remaining`: the tokens each may still
        produce when no request waits for a slot (None while some wait: the batch's throughput counts)."""
        self.decisions += 1
        self._off_interval, self._reused = None, 0
        self.length = self.num_draft_tokens  # (probes and measuring steps draft K; _decide may choose shorter)
        drafting = self._decide(request_ids, remaining)
        if drafting:
            self.lengths_chosen[self.length] += 1
        if drafting != self.drafting:
            self.switches += 1
        self.drafting = drafting
        self.plain_run = 0 if drafting else self.plain_run + 1
        return drafting

    def _decide(self, request_ids: list[str], remaining: Sequence[int] | None) -> bool:
        if self.always or not request_ids:
            return True
        n = len(request_ids)
        b = bucket_of(n)
        gain = self.expected_tokens(request_ids, remaining)
        verify, plain = self.costs.get((True, b)), self.costs.get((False, b))
        ratio = self.cost_ratio(n)
        if ratio is None:
            # Nothing to compare yet: measure a drafted step first, then a plain one. While no drafted step can be
            # measured (every proposal empty), probe as if a verify step cost `unmeasured_ratio` plain ones.
            if self._trusted(verify):
                return False
            if gain > 1.0 + self.margin:
                return True
            ratio = self.unmeasured_ratio
        elif not self._trusted(plain):
            return False  # (a plain step here is never a loss: measure this bucket's own)
        elif gain > ratio * (1.0 + self._margin(n, remaining)):
            if self.lengths:
                self.length = self._best_length(request_ids, remaining, gain, ratio)[0]
            return True
        elif self.lengths:
            length, value = self._best_length(request_ids, remaining, gain, ratio)
            if value > 1.0 + self.margin:
                self.length = length
                return True
        # Off: probe now and then, so that a request whose text turns predictable is found again.
        loss = max(0.0, self.probe_ratio(n, ratio) - gain)  # plain steps one probe costs more than it gives
        interval = min(self.max_probe_interval, max(self.min_probe_interval, math.ceil(loss / self.probe_budget)))
        self._off_interval = interval
        if self.plain_run + 1 >= interval:
            self.probes += 1
            return True
        return False

    def _margin(self, n: int, remaining: Sequence[int] | None) -> float:
        """What drafting must beat plain decoding by: `margin` to start; nothing to go on where the gain comes from
        the short running means (a lone request, or requests waiting), whose noise would otherwise turn drafting
        off and on, each switch losing the overlap around it. (The wall-time test's shrunk means are steady.)"""
        return 0.0 if self.drafting and (remaining is None or n == 1) else self.margin

    def decide_same_batch(self) -> bool | None:
        """The last decision again, for the batch it was made for (the caller knows no request joined or left it),
        without reading every request: False (plain) while no probe is due. None: decide in full, because the last
        decision drafted (each verify step moves the estimates), kept the batch plain only to measure a step's
        cost, or has been repeated `reuse_steps` times (the remainders and step costs drift slowly), or a probe
        is due. (A full decision reads each request: about a third of a millisecond a step at 256 requests on one
        core.)"""
        if self.drafting or self._off_interval is None or self._reused >= self.reuse_steps:
            return None
        if self.plain_run + 1 >= self._off_interval:
            return None
        self._reused += 1
        self.repeats += 1
        self.decisions += 1
        self.plain_run += 1
        return False

    @property
    def draft_length(self) -> int:
        """Drafts per request of the last decision (0: plain steps)."""
        return self.length if self.drafting else 0
