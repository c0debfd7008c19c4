"""Verification of draft tokens: which drafts to keep, and the target's own next token.

The target scores [last token, d_1 .. d_K] in one forward; row j is the target's distribution p_j for
the position after d_j (row 0: after the last committed token). Every rule here leaves the output
distribution exactly the target's:

* One-hot drafts (n-gram lookup, argmax drafters), any temperature: g_j is a sample from p_j (the
  argmax for greedy rows); d_{j+1} is accepted while it equals g_j, and the first g_j that differs
  is emitted in its place. Each emitted token is then a sample from the target given the committed
  prefix. This is rejection sampling with a one-hot proposal: accept d with probability p(d),
  otherwise sample p with d removed.
* Drafts with probabilities q_j (sampled drafts): accept d_j with probability min(1, p_j(d_j) / q_j(d_j));
  at the first rejection emit a sample of norm(max(0, p_j - q_j)); if all are accepted, a sample of p_K.
"""

from __future__ import annotations

import torch


def accept_one_hot(drafts: list[int], target_tokens: list[int]) -> list[int]:
    """Tokens to emit for one request: the accepted drafts, then the target's token after them.

    target_tokens[j] is the target's token (sample or argmax) at row j, len = len(drafts) + 1.
    """
    emitted = []
    for j, draft in enumerate(drafts):
        if draft != target_tokens[j]:
            break
        emitted.append(draft)
    emitted.append(target_tokens[len(emitted)])
    return emitted


def accept_with_probs(drafts: list[int], target_probs: torch.Tensor, draft_probs: torch.Tensor,
                      bonus_token: int, generator: torch.Generator | None) -> list[int]:
    """Rejection sampling for drafts drawn from draft_probs.

    target_probs [K + 1, V]: the target's distributions at the K + 1 rows; draft_probs [K, V]: the
    drafter's distribution each draft was drawn from; bonus_token: a sample of target_probs[K].
    """
    k = len(drafts)
    if k == 0:
        return [bonus_token]
    device = target_probs.device
    idx = torch.arange(k, device=device)
    d = torch.tensor(drafts, device=device)
    p_d = target_probs[idx, d]
    q_d = draft_probs[idx, d]
    u = torch.rand(k, device=device, generator=generator)
    accepted = u * q_d <= p_d  # u < p/q without dividing by a zero q
    rejected = (~accepted).nonzero()
    if rejected.numel() == 0:
        return drafts + [bonus_token]
    j = int(rejected[0])
    residual = (target_probs[j] - draft_probs[j]).clamp_min(0)
    total = residual.sum()
    if float(total) <= 0:  # p == q exactly: any sample of p is right
        residual, total = target_probs[j], target_probs[j].sum()
    q = torch.empty_like(residual).exponential_(generator=generator)
    token = int((residual / total / q).argmax())
    return drafts[:j] + [token]
