"""Shared by the speculative-decoding tests: exact sequence distributions of a tiny-vocabulary model,
and the chi-square check that an engine's samples follow them."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import torch
from conftest import assert_pages_returned, build_checkpoint, hf_model

from atlas import SamplingParams

TINY_VOCAB = 5
TINY_PROMPT = [1, 3, 1, 3, 1]
CONTINUATION = 3  # tokens per sampled continuation


def exact_sequence_distribution(target, vocab: int, length: int) -> dict[tuple, float]:
    """Probability of every `length`-token sequence under target(prefix) -> next-token probabilities."""
    return {seq: math.prod(target(seq[:i])[seq[i]].item() for i in range(length))
            for seq in itertools.product(range(vocab), repeat=length)}


def tiny_vocab_target(root: Path) -> tuple[Path, dict[tuple, float]]:
    """A 5-token-vocabulary Qwen3 checkpoint, and the exact distribution of its 3-token continuations
    of TINY_PROMPT, computed from transformers' logits."""
    ckpt = build_checkpoint(root, "Qwen3ForCausalLM", None, seed=4, vocab_size=TINY_VOCAB, hidden_size=32,
                            intermediate_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    hf = hf_model(ckpt)

    @torch.no_grad()
    def target(prefix: tuple) -> torch.Tensor:
        return hf(torch.tensor([TINY_PROMPT + list(prefix)])).logits[0, -1].float().softmax(-1)

    return ckpt, exact_sequence_distribution(target, TINY_VOCAB, CONTINUATION)


def assert_samples_follow(llm, exact: dict[tuple, float], requests: int = 100, per_request: int = 100) -> None:
    """Sample requests x per_request continuations; Pearson's chi-square over all sequences stays
    within about 5 standard deviations of its mean; every page comes back."""
    torch.manual_seed(0)
    params = SamplingParams(n=per_request, max_tokens=CONTINUATION, temperature=1.0, ignore_eos=True)
    counts: dict[tuple, int] = {}
    for out in llm.generate([{"prompt_token_ids": TINY_PROMPT}] * requests, params):
        for c in out.outputs:
            counts[tuple(c.token_ids)] = counts.get(tuple(c.token_ids), 0) + 1
    draws = sum(counts.values())
    stat = sum((counts.get(s, 0) - draws * p) ** 2 / (draws * p) for s, p in exact.items())
    df = len(exact) - 1
    assert stat < df + 5 * math.sqrt(2 * df), stat
    assert_pages_returned(llm)
