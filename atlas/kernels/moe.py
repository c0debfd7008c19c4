"""The PyTorch reference of the routed-expert matmuls in kernels/moe_triton.py: y[m] = W[experts[m]] @
x[rows[m]], in float32. Both of the kernel's modes are this function with a different (experts, rows)
map: "pairs" (expert ids.flatten(), rows p // topk) and "grouped" (rows in order, experts from the
offsets); the helpers below build the maps, with host syncs (tests only).

Also gpt-oss's expert activation, `clamped_swiglu` (plain PyTorch ops, on every device: layers/moe.py applies it
between the two expert matmuls, with the experts' biases, whichever path computed them)."""

from __future__ import annotations

import torch


def moe_matmul_ref(x: torch.Tensor, w: torch.Tensor, experts: torch.Tensor,
                   rows: torch.Tensor) -> torch.Tensor:
    """x [R, K], w [E, N, K], experts [M] and rows [M] (indices) -> y [M, N] float32, y[m] =
    w[experts[m]] @ x[rows[m]]. One matmul per expert used (no [M, N, K] gather of W)."""
    y = torch.zeros(experts.shape[0], w.shape[1], dtype=torch.float32, device=x.device)
    for e in experts.unique().tolist():
        sel = (experts == e).nonzero().squeeze(1)
        y[sel] = x[rows[sel]].float() @ w[e].float().T
    return y


def pairs_ref(x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor, topk: int) -> torch.Tensor:
    """moe_pairs_matmul's function: one row per (token, choice) pair p, expert ids.flatten()[p], x row
    p // topk."""
    experts = ids.reshape(-1)
    return moe_matmul_ref(x, w, experts, torch.arange(experts.shape[0], device=x.device) // topk)


def moe_combine_ref(y: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """moe_triton.moe_combine's function: y [T * k, D] in (token, choice) order times weights [T, k] in float32,
    the products added in the choices' order from the first, in dtype."""
    t, k = weights.shape
    products = y.view(t, k, -1).float() * weights.float().unsqueeze(-1)
    total = products[:, 0]
    for j in range(1, k):
        total = total + products[:, j]
    return total.to(dtype)


def grouped_ref(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """moe_grouped_matmul's function: rows offsets[e] .. offsets[e + 1] of x (sorted by expert) through
    w[e]."""
    counts = offsets[1:] - offsets[:-1]
    experts = torch.repeat_interleave(torch.arange(w.shape[0], device=x.device), counts,
                                      output_size=x.shape[0])
    return moe_matmul_ref(x, w, experts, torch.arange(x.shape[0], device=x.device))


def clamped_swiglu(h: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's expert activation of h [..., 2I] = [gate | up] -> [..., I]: the gate clamped from above at `limit`,
    up clamped to [-limit, limit], then (up + 1) * gate * sigmoid(alpha * gate). transformers' GptOssExperts in the
    same operations and order (so in any dtype it rounds as the reference does); its checkpoints interleave gate and
    up columns, which the loader separates into the halves taken here."""
    gate, up = h.chunk(2, dim=-1)
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def limited_silu_and_mul(h: torch.Tensor, limit: float) -> torch.Tensor:
    """DeepSeek-V4's expert activation of h [..., 2I] = [gate | up] -> [..., I]: silu(gate clamped from above at
    `limit`) * (up clamped to [-limit, limit]) (transformers' DeepseekV4Experts._apply_gate, same operations)."""
    gate, up = h.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)
