"""Roofline arithmetic for decoder-only transformers (Llama / Qwen shapes), from config.json alone.

Conventions: a decode step reads every weight once (the input embedding only for the rows it looks up)
plus the K/V of every context token of every sequence, at the measured device-to-device copy bandwidth
(bytes read + written, as `copy_bandwidth` counts them). A prefill computes 2 FLOPs per non-embedding
parameter per token, plus attention (QK^T and PV over the causal triangle), plus the LM head for the
one row per sequence that is sampled, at the bf16 matmul peak measured in the same run. Each floor is
the larger of its compute time and its memory time.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch


@dataclass
class ModelShape:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool
    qk_norm: bool = False  # Qwen3: an RMSNorm over head_dim for q and for k

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> ModelShape:
        heads = cfg["num_attention_heads"]
        return cls(layers=cfg["num_hidden_layers"], hidden=cfg["hidden_size"], heads=heads,
                   kv_heads=cfg.get("num_key_value_heads") or heads,
                   head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
                   intermediate=cfg["intermediate_size"], vocab=cfg["vocab_size"],
                   tied=bool(cfg.get("tie_word_embeddings", False)),
                   qk_norm=cfg.get("model_type") == "qwen3")

    @property
    def layer_params(self) -> int:
        """Matmul weights and norms of one decoder layer (biases, if any, are negligible)."""
        q = self.heads * self.head_dim
        kv = self.kv_heads * self.head_dim
        norms = 2 * self.hidden + (2 * self.head_dim if self.qk_norm else 0)
        return self.hidden * (2 * q + 2 * kv) + 3 * self.hidden * self.intermediate + norms

    @property
    def non_embedding_params(self) -> int:
        """The decoder layers and the final norm: neither the embedding nor the LM head."""
        return self.layers * self.layer_params + self.hidden

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    def kv_elements_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim

    def attention_flops(self, context: int, queries: int = 1) -> float:
        """QK^T and PV of `queries` tokens over `context` keys each, all layers."""
        return 4.0 * self.layers * self.heads * self.head_dim * context * queries

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "non_embedding_params": self.non_embedding_params,
                "embedding_params": self.embedding_params}


def prefill_flops(shape: ModelShape, batch: int, input_len: int) -> float:
    """`batch` prompts of `input_len` tokens, causal, one sampled row per sequence."""
    causal_pairs = input_len * (input_len + 1) / 2
    per_seq = (2.0 * shape.non_embedding_params * input_len
               + 4.0 * shape.layers * shape.heads * shape.head_dim * causal_pairs
               + 2.0 * shape.embedding_params)  # the LM head on the last row
    return batch * per_seq


def decode_step_flops(shape: ModelShape, batch: int, context: float) -> float:
    return batch * (2.0 * (shape.non_embedding_params + shape.embedding_params)
                    + shape.attention_flops(int(round(context))))


def decode_step_bytes(weight_read_bytes: float, shape: ModelShape, kv_dtype_bytes: int, batch: int,
                      context: float) -> float:
    """Weights once, plus the K/V of `context` tokens for each of `batch` sequences."""
    return weight_read_bytes + batch * context * shape.kv_elements_per_token() * kv_dtype_bytes


def mean_decode_context(input_len: int, output_len: int) -> float:
    """Keys attended per sequence, averaged over the output_len - 1 decode steps after the prefill
    (step j: the token at position input_len + j - 1 attends to input_len + j keys)."""
    steps = max(output_len - 1, 1)
    return input_len + (steps + 1) / 2


def floor_seconds(flops: float, bytes_moved: float, peak_flops: float | None, bandwidth: float | None
                  ) -> dict[str, float | None]:
    compute = flops / peak_flops if peak_flops else None
    memory = bytes_moved / bandwidth if bandwidth else None
    known = [x for x in (compute, memory) if x is not None]
    return {"compute_s": compute, "memory_s": memory, "floor_s": max(known) if known else None}


def matmul_peak(device: torch.device, n: int = 8192, dtype: torch.dtype = torch.bfloat16, iters: int = 10,
                warmup: int = 3) -> float | None:
    """FLOP/s of an n x n x n matmul of random (never zero) `dtype` matrices: the median of `iters`
    timed after `warmup`. None when the device cannot be timed (a CPU: use small n in tests)."""
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=dtype, generator=g)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=g)
    out = torch.empty(n, n, device=device, dtype=dtype)
    for _ in range(warmup):
        torch.mm(a, b, out=out)
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            torch.mm(a, b, out=out)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1000)
        else:
            t0 = time.perf_counter()
            torch.mm(a, b, out=out)
            times.append(time.perf_counter() - t0)
    del a, b, out
    return 2.0 * n ** 3 / statistics.median(times)


def device_peak_flops(device: torch.device) -> float | None:
    """The bf16 matmul peak of a CUDA device (8192^3); None elsewhere."""
    return matmul_peak(device) if device.type == "cuda" else None
