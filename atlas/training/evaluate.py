"""Evaluation: held-out negative log-likelihood of a causal LM and of a unigram baseline, greedy decoding.

Both are scored on exactly the same label tokens (`data.eval_windows` / `data.eval_labels`), in nats
per token; perplexity = exp(mean NLL).
"""

from __future__ import annotations

import contextlib
import inspect
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.nn.functional as F

from atlas.training.data import eval_labels, eval_windows


@dataclass
class NLL:
    total: float  # summed negative log-likelihood, nats
    tokens: int

    @property
    def mean(self) -> float:
        return self.total / max(1, self.tokens)

    @property
    def perplexity(self) -> float:
        return math.exp(min(self.mean, 700.0))

    def as_dict(self) -> dict:
        return {**asdict(self), "nll": self.mean, "perplexity": self.perplexity}


def autocast_for(device: torch.device, dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    """bf16 (or fp16) autocast on CUDA; nothing (fp32) elsewhere or when dtype is None."""
    if dtype is None or device.type != "cuda":
        return contextlib.nullcontext()
    return torch.autocast(device_type="cuda", dtype=dtype)


def _logits(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    out = model(input_ids=input_ids, use_cache=False)
    return out.logits if hasattr(out, "logits") else out


@torch.no_grad()
def lm_nll(model: torch.nn.Module, tokens: np.ndarray | torch.Tensor, seq_len: int, batch_size: int,
           device: torch.device | str, autocast_dtype: torch.dtype | None = None,
           max_tokens: int | None = None, logits_fn: Callable | None = None) -> NLL:
    """Summed next-token NLL of a causal LM over a held-out token stream (see `data.eval_windows`)."""
    device = torch.device(device)
    logits_fn = logits_fn or _logits
    was_training = model.training
    model.eval()
    full, rest = eval_windows(tokens, seq_len, max_tokens)
    total = torch.zeros((), dtype=torch.float64, device=device)
    count = 0
    batches = [full[i:i + batch_size] for i in range(0, len(full), batch_size)]
    if rest is not None:
        batches.append(rest[None])
    for rows in batches:
        rows = rows.to(device)
        with autocast_for(device, autocast_dtype):
            logits = logits_fn(model, rows[:, :-1])
        nll = F.cross_entropy(logits.float().flatten(0, 1), rows[:, 1:].flatten(), reduction="sum")
        total += nll.double()
        count += rows[:, 1:].numel()
    model.train(was_training)
    return NLL(float(total), count)


def unigram_counts(train_tokens: np.ndarray, vocab_size: int) -> np.ndarray:
    return np.bincount(np.asarray(train_tokens, dtype=np.int64), minlength=vocab_size)[:vocab_size]


def unigram_nll(counts: np.ndarray, tokens: np.ndarray, max_tokens: int | None = None) -> NLL:
    """A unigram model fitted on training counts with add-one smoothing, scored on eval_labels(tokens)."""
    labels = eval_labels(tokens, max_tokens).astype(np.int64)
    logp = np.log(counts.astype(np.float64) + 1.0) - math.log(float(counts.sum()) + len(counts))
    return NLL(float(-logp[labels].sum()), int(labels.size))


@torch.no_grad()
def greedy_decode(model: torch.nn.Module, prompt_ids: list[int], max_new_tokens: int,
                  stop_ids: tuple[int, ...] = ()) -> tuple[list[int], list[float]]:
    """Plain argmax continuation of a Hugging Face causal LM (its KV cache, no logits processors).

    Returns (new token ids, margin between the top two logits at each step): a margin near zero
    marks a step where tiny numerical differences could change the choice.
    """
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    new: list[int] = []
    margins: list[float] = []
    # transformers renamed `past_key_values` to `cache` (argument and output) during 5.x.
    cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    step_ids = torch.tensor([list(prompt_ids)], device=device)
    past = None
    for _ in range(max_new_tokens):
        out = model(input_ids=step_ids, use_cache=True, **({cache_arg: past} if past is not None else {}))
        past = out.get("cache") if out.get("cache") is not None else out.get("past_key_values")
        logits = out.logits[0, -1].float()
        top = torch.topk(logits, 2)
        token = int(torch.argmax(logits))
        margins.append(float(top.values[0] - top.values[1]))
        new.append(token)
        step_ids = torch.tensor([[token]], device=device)
        if token in stop_ids:
            break
    model.train(was_training)
    return new, margins
