"""Turning logits into tokens: logit bias, penalties, temperature, min-p / top-k / top-p, seeded sampling,
logprobs.

One call handles a whole batch of rows with mixed settings. Rows whose request has a seed draw their
randomness from the request's own generator, so their samples do not depend on the rest of the batch.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from dataclasses import dataclass

import torch

from atlas.host_copy import to_device, to_device_tensor
from atlas.kernels import settings as kernel_settings
from atlas.kernels import triton_available

logger = logging.getLogger(__name__)


@dataclass
class SamplingRow:
    """What the sampler needs to know about the request behind one logits row."""

    temperature: float
    top_k: int
    top_p: float
    min_p: float
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    generator: torch.Generator | None
    num_logprobs: int | None
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    banned_token_ids: list[int]  # e.g. EOS while fewer than min_tokens were generated
    logit_bias: dict[int, float] | None = None  # OpenAI's logit_bias: added to the raw logits first
    allowed_token_ids: list[int] | None = None  # vLLM's: the only tokens it may sample (the others -inf, first)


@dataclass
class TokenLogprobs:
    """Raw-distribution logprobs of chosen tokens, one row each."""

    logprobs: torch.Tensor  # [N]
    ranks: torch.Tensor  # [N] (1 = most likely)
    top_token_ids: torch.Tensor | None = None  # [N, k]
    top_logprobs: torch.Tensor | None = None  # [N, k]


def _padded(rows: list[list[int]], pad: int, device: torch.device) -> torch.Tensor:
    width = max((len(r) for r in rows), default=0)
    out = torch.full((len(rows), max(width, 1)), pad, dtype=torch.long)
    for i, r in enumerate(rows):
        if r:
            out[i, : len(r)] = torch.tensor(r, dtype=torch.long)
    return to_device_tensor(out, device)


def bad_word_bans(words: list[list[int]], history: list[int]) -> list[int]:
    """vLLM's bad words: the last token of each word whose other tokens end the output so far (a word of one token:
    always)."""
    bans = []
    for word in words:
        rest = len(word) - 1
        if rest == 0 or (len(history) >= rest and history[-rest:] == word[:-1]):
            bans.append(word[-1])
    return bans


def keep_allowed_tokens(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """A new tensor: logits [N, V] with every token outside a row's allowed_token_ids at -inf (rows without the
    list unchanged)."""
    vocab, device = logits.shape[1], logits.device
    restricted = [i for i, r in enumerate(rows) if r.allowed_token_ids is not None]
    row_ids: list[int] = []
    token_ids: list[int] = []
    for k, i in enumerate(restricted):  # (only the allowed ids travel to the device, not a [rows, vocab] mask)
        tokens = [t for t in rows[i].allowed_token_ids if t < vocab]
        row_ids.extend([k] * len(tokens))
        token_ids.extend(tokens)
    keep = torch.zeros(len(restricted), vocab, dtype=torch.bool, device=device)
    keep[to_device(row_ids, torch.long, device), to_device(token_ids, torch.long, device)] = True
    which = to_device(restricted, torch.long, device)
    out = logits.clone()
    out[which] = logits[which].masked_fill(~keep, float("-inf"))
    return out


def apply_logit_bias(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """A new tensor: logits [N, V] with each row's logit_bias added (ids past the logits' width are skipped;
    requests are checked against the vocabulary before they reach the engine)."""
    vocab = logits.shape[1]
    row_ids: list[int] = []
    token_ids: list[int] = []
    values: list[float] = []
    for i, r in enumerate(rows):
        if r.logit_bias:
            tokens = [t for t in r.logit_bias if t < vocab]
            row_ids.extend([i] * len(tokens))
            token_ids.extend(tokens)
            values.extend(r.logit_bias[t] for t in tokens)
    if not row_ids:
        return logits
    device = logits.device
    return logits.index_put((to_device(row_ids, torch.long, device), to_device(token_ids, torch.long, device)),
                            to_device(values, logits.dtype, device), accumulate=True)


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Repetition penalty over prompt + output tokens; presence and frequency over output tokens."""
    n, vocab = logits.shape
    device = logits.device
    out_counts = torch.zeros(n, vocab + 1, device=device)
    out_tokens = _padded([r.output_token_ids for r in rows], vocab, device)
    out_counts.scatter_add_(1, out_tokens, torch.ones_like(out_tokens, dtype=out_counts.dtype))
    out_counts = out_counts[:, :vocab]
    if any(r.repetition_penalty != 1.0 for r in rows):
        rep = to_device([r.repetition_penalty for r in rows], torch.float32, device)
        seen = torch.zeros(n, vocab + 1, dtype=torch.bool, device=device)
        seen.scatter_(1, _padded([r.prompt_token_ids for r in rows], vocab, device), True)
        seen = seen[:, :vocab] | (out_counts > 0)
        penalised = torch.where(logits > 0, logits / rep[:, None], logits * rep[:, None])
        logits = torch.where(seen, penalised, logits)
    freq = to_device([r.frequency_penalty for r in rows], torch.float32, device)
    pres = to_device([r.presence_penalty for r in rows], torch.float32, device)
    return logits - freq[:, None] * out_counts - pres[:, None] * (out_counts > 0).float()


def _filter(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """min-p, then top-k and top-p, on temperature-scaled logits (masked entries become -inf)."""
    device = logits.device
    if any(r.min_p > 0 for r in rows):
        min_p = to_device([r.min_p for r in rows], torch.float32, device)
        probs = logits.softmax(-1)
        threshold = probs.max(-1, keepdim=True).values * min_p[:, None]
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    vocab = logits.shape[-1]
    if any(0 < r.top_k < vocab or r.top_p < 1.0 for r in rows):
        top_k = to_device([r.top_k if 0 < r.top_k < vocab else vocab for r in rows], torch.long, device)
        top_p = to_device([r.top_p for r in rows], torch.float32, device)
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=device)[None, :]
        drop = ranks >= top_k[:, None]
        sorted_probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(-1)
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        drop |= mass_before >= top_p[:, None]
        drop[:, 0] = False  # the most likely token always survives, even a top_p that is 0 in float32
        logits = logits.scatter(1, order, sorted_logits.masked_fill(drop, float("-inf")))
    return logits


def sample_from_probs(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token per row by the exponential race (argmax p/q, q ~ Exp(1)), equivalent to sampling
    from p. Rows with a generator draw q from it."""
    q = exponential_noise(probs)
    for i, g in enumerate(generators):
        if g is not None:
            q[i] = exponential_noise(probs[i], g)
    return probs.div(q).argmax(dim=-1)


def exponential_noise(like: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Exp(1) draws shaped as `like`. On CUDA, exponential_ (one fused kernel). Elsewhere -log(1 - u) of uniform
    u, which on the CPU takes a sixth of exponential_'s time (256 rows of an 8k vocabulary: 6 against 37 ms on 2
    cores, most of a sampled step of the shipped model); a draw of exactly 0 (u = 0) is raised to the smallest
    normal float, so that a token of probability 0 still scores 0 rather than 0/0 = NaN, which argmax would pick."""
    if like.is_cuda:
        return torch.empty_like(like).exponential_(generator=generator)
    u = torch.rand(like.shape, dtype=like.dtype, device=like.device, generator=generator)
    return u.neg_().log1p_().neg_().clamp_min_(torch.finfo(like.dtype).tiny)


def unpack_bitmask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[R, words] int32 (bit t % 32 of word t // 32 allows token t) -> [R, vocab] bool. The words are read as
    little-endian bytes, 8 shifts per byte (fewer and narrower passes than 32 shifts per int32 word)."""
    if sys.byteorder == "little":
        as_bytes = bitmask.contiguous().view(torch.uint8)
        shifts = torch.arange(8, dtype=torch.uint8, device=bitmask.device)
        allowed = (as_bytes[:, :, None] >> shifts).bitwise_and_(1).view(torch.bool).reshape(bitmask.shape[0], 32 * bitmask.shape[1])
    else:  # pragma: no cover - no big-endian machine runs this
        bits = torch.arange(32, device=bitmask.device, dtype=torch.int32)
        allowed = ((bitmask[:, :, None] >> bits) & 1).bool().reshape(bitmask.shape[0], 32 * bitmask.shape[1])
    allowed = allowed[:, :vocab]
    if allowed.shape[1] < vocab:  # (a mask narrower than the logits: the rest is not allowed)
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
    return allowed


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None, *,
                        inplace: bool = False) -> torch.Tensor:
    """logits [N, V] with the bitmask rows [R, words] applied to rows `rows` [R] (None: R == N, in order);
    the other rows are untouched. Masked tokens become -inf. Where nothing the grammar allows is left (it
    allows only EOS while min_tokens bans it, say), the grammar wins: its tokens get equal logits, since a
    row of -inf has nothing to sample.

    On CUDA with triton (unless --tuning mask_kernel=0), float32 logits are masked by one kernel
    (kernels/token_mask_triton.py; bit-equal to the PyTorch path, a quarter of its time on an H200) in place:
    on a copy unless `inplace` says the caller owns `logits` (a step's logits are read again after the
    sampler: logprobs, draft verification). Elsewhere, and for good if the kernel ever fails, the
    PyTorch path below is used, which never writes to `logits`."""
    if _mask_kernel_usable(logits, bitmask, rows):
        try:
            from atlas.kernels.token_mask_triton import apply_token_bitmask_triton_

            return apply_token_bitmask_triton_(logits if inplace else logits.clone(), bitmask, rows)
        except Exception as exc:  # noqa: BLE001 - any failure (compile, launch) falls back for the process
            _mask_kernel_failed(exc)
    return _apply_token_bitmask_torch(logits, bitmask, rows)


_MASK_KERNEL_BROKEN = False


def _mask_kernel_usable(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None) -> bool:
    return (not _MASK_KERNEL_BROKEN and kernel_settings.tuning.mask_kernel and logits.is_cuda
            and logits.dtype == torch.float32 and logits.dim() == 2
            and logits.stride(1) == 1 and bitmask.dtype == torch.int32 and bitmask.device == logits.device
            and (rows is None or rows.device == logits.device) and triton_available())


def _mask_kernel_failed(exc: Exception) -> None:
    # The kernel is new to GPUs: a failure costs speed, not the request.
    global _MASK_KERNEL_BROKEN
    _MASK_KERNEL_BROKEN = True
    logger.warning("the Triton token-mask kernel failed (%s: %s); grammar masks use the PyTorch path from now on",
                   type(exc).__name__, exc)


def _apply_token_bitmask_torch(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None
                               ) -> torch.Tensor:
    """The reference: `apply_token_bitmask` in PyTorch ops, returning a new tensor."""
    allowed = unpack_bitmask(bitmask, logits.shape[1])
    selected = logits if rows is None else logits.index_select(0, rows)
    masked = torch.where(allowed, selected, float("-inf"))
    empty = masked.amax(dim=1, keepdim=True) == float("-inf")
    # (On CPU the check is free and the fix rare; on a GPU asking would wait for the device.)
    if logits.device.type != "cpu" or bool(empty.any()):
        fallback = torch.zeros_like(masked).masked_fill(~allowed, float("-inf"))
        masked = torch.where(empty, fallback, masked)
    if rows is None:
        return masked
    return logits.index_copy(0, rows, masked)


# Grammar bitmasks of a step on the device: (bitmask [R, words] int32, the logits row of each [R], or None
# when every row has one, in order).
DeviceMasks = tuple[torch.Tensor, torch.Tensor | None]


class Sampler:
    def processed_logits(self, logits: torch.Tensor, rows: list[SamplingRow],
                         masks: DeviceMasks | None = None) -> torch.Tensor:
        """Logits after logit bias, banned tokens, penalties and grammar masks (what greedy takes the argmax
        of). The bias comes first, as vLLM applies it: penalties scale the biased logits."""
        owned = False  # whether `logits` is a tensor made here (the caller reads its own again)
        if any(r.allowed_token_ids is not None for r in rows):
            logits = keep_allowed_tokens(logits, rows)
            owned = True
        if any(r.logit_bias for r in rows):
            logits = apply_logit_bias(logits, rows)
            owned = True
        banned = [(i, t) for i, r in enumerate(rows) for t in r.banned_token_ids if t < logits.shape[1]]
        if banned:
            logits = logits if owned else logits.clone()
            bi, bt = zip(*banned, strict=True)
            logits[to_device(list(bi), torch.long, logits.device), to_device(list(bt), torch.long, logits.device)] = (
                float("-inf"))
            owned = True
        if any(r.repetition_penalty != 1.0 or r.presence_penalty or r.frequency_penalty for r in rows):
            logits = apply_penalties(logits, rows)
            owned = True
        if masks is not None:
            logits = apply_token_bitmask(logits, *masks, inplace=owned)
        return logits

    def probabilities(self, logits: torch.Tensor, rows: list[SamplingRow],
                      masks: DeviceMasks | None = None) -> torch.Tensor:
        """The distribution each row samples from: after penalties, grammar masks, temperature and filters.
        A greedy row's distribution is one-hot on its argmax."""
        logits = self.processed_logits(logits, rows, masks)
        temps = to_device([max(r.temperature, 1e-5) for r in rows], torch.float32, logits.device)
        probs = _filter(logits / temps[:, None], rows).softmax(dim=-1)
        greedy_rows = [r.temperature < 1e-5 for r in rows]
        if any(greedy_rows):
            greedy = to_device(greedy_rows, torch.bool, logits.device)
            one_hot = torch.zeros_like(probs).scatter_(1, logits.argmax(-1, keepdim=True), 1.0)
            probs = torch.where(greedy[:, None], one_hot, probs)
        return probs

    def logprob_logits(self, logits: torch.Tensor, rows: list[SamplingRow],
                       masks: DeviceMasks | None = None) -> torch.Tensor:
        """The logits of the distribution each row's token was drawn from (--logprobs-mode processed_*, as vLLM's
        sampler returns them): processed_logits', then for a sampled row its temperature and min-p / top-k / top-p
        (the filtered tokens -inf); a greedy row's are processed_logits' alone (vLLM drops a greedy request's
        filters and takes no temperature)."""
        logits = self.processed_logits(logits, rows, masks)
        sampled = [r.temperature >= 1e-5 for r in rows]
        if not any(sampled):
            return logits
        temps = to_device([r.temperature if s else 1.0 for r, s in zip(rows, sampled, strict=True)], torch.float32,
                          logits.device)
        unfiltered = [r if s else dataclasses.replace(r, top_k=0, top_p=1.0, min_p=0.0)
                      for r, s in zip(rows, sampled, strict=True)]
        return _filter(logits / temps[:, None], unfiltered)

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow], masks: DeviceMasks | None = None
                 ) -> torch.Tensor:
        """logits [N, V] float32, one row per entry of `rows` -> one token id per row [N]. `masks`: grammar
        bitmasks for some rows (structured outputs); the other rows are untouched."""
        logits = self.processed_logits(logits, rows, masks)
        token_ids = logits.argmax(dim=-1)
        greedy_rows = [r.temperature < 1e-5 for r in rows]
        if not all(greedy_rows):
            greedy = to_device(greedy_rows, torch.bool, logits.device)
            temps = to_device([max(r.temperature, 1e-5) for r in rows], torch.float32, logits.device)
            probs = _filter(logits / temps[:, None], rows).softmax(dim=-1)
            sampled = sample_from_probs(probs, [r.generator for r in rows])
            token_ids = torch.where(greedy, token_ids, sampled)
        return token_ids


def gather_logprobs(raw_logits: torch.Tensor, token_ids: torch.Tensor, top_k: int,
                    normalize: bool = True) -> TokenLogprobs:
    """Logprobs of the chosen tokens under the distribution of `raw_logits` (the model's unprocessed one, unless
    --logprobs-mode says otherwise), their ranks, and the top_k most likely tokens of each row. normalize=False:
    the logits themselves in place of logprobs (--logprobs-mode *_logits; the same ranks)."""
    logprobs = raw_logits.float().log_softmax(dim=-1) if normalize else raw_logits.float()
    chosen = logprobs.gather(1, token_ids[:, None]).squeeze(1)
    out = TokenLogprobs(chosen, (logprobs > chosen[:, None]).sum(-1) + 1)
    if top_k > 0:
        out.top_logprobs, out.top_token_ids = logprobs.topk(top_k, dim=-1)
    return out
