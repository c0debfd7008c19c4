"""Roofline arithmetic for decoder-only transformers (Llama / Qwen / DeepSeek shapes), from config.json.

`ModelShape.from_config` builds the engine's own model for the config on the meta device (no memory,
no weights) and reads from it what the cache and the weights really are: the cache values per token
come from the layers' cache specs (K and V planes for GQA, one latent row of kv_lora_rank +
qk_rope_head_dim for MLA), the parameters from its modules (MLA projections, dense MLPs, shared and
routed experts).

Conventions: a decode step reads every weight it uses once (the input embedding only for the rows it
looks up; of the routed experts, only those its tokens are routed to) plus the cache of every context
token of every sequence, and reads and writes the recurrent state of every sequence (hybrid models' linear-
attention layers: `recurrent_state_bytes`), at the measured device-to-device copy bandwidth (bytes read +
written, as `copy_bandwidth` counts them). A prefill computes 2 FLOPs per active non-embedding parameter per token,
plus attention (QK^T and PV over the causal triangle), plus the LM head for the one row per sequence
that is sampled, at the bf16 matmul peak measured in the same run. Each floor is the larger of its
compute time and its memory time.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from atlas.errors import AtlasError

if TYPE_CHECKING:
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
    # Read from the engine's model by from_config; None / 0: the dense GQA formulas of the fields above.
    attention: str = "gqa"  # "mla": one latent row per token, absorbed attention
    kv_values_per_token: int | None = None  # cache values per token, all layers (the layers' cache specs)
    attention_pair_flops: int | None = None  # QK^T + PV FLOPs of one query against one key, all layers
    base_params: int | None = None  # non-embedding parameters every token goes through (all but routed experts)
    expert_params: int = 0  # matrices of one routed expert
    moe_layers: int = 0
    num_experts: int = 0  # routed experts per MoE layer
    experts_per_token: int = 0  # top-k
    # Recurrent state per sequence, all linear-attention layers (hybrid models): the conv state's values (model
    # dtype) and the delta-rule state's (float32).
    conv_state_values: int = 0
    delta_state_values: int = 0

    @classmethod
    def from_config(cls, cfg: dict[str, Any], path: Path | None = None) -> ModelShape:
        if isinstance(cfg.get("text_config"), dict) and "hidden_size" not in cfg:
            # (a vision-language checkpoint, e.g. Qwen3.5's: the language model's fields, as the engine reads them)
            from atlas.config import ModelConfig

            cfg = ModelConfig.from_dict(cfg, path or Path(".")).raw
        heads = cfg["num_attention_heads"]
        # (the aliases ModelConfig reads too: num_layers, ffn_hidden_size)
        shape = cls(layers=cfg.get("num_hidden_layers") or cfg["num_layers"], hidden=cfg["hidden_size"], heads=heads,
                    kv_heads=cfg.get("num_key_value_heads") or heads,
                    head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
                    intermediate=cfg.get("intermediate_size") or cfg.get("ffn_hidden_size") or 0, vocab=cfg["vocab_size"],
                    tied=bool(cfg.get("tie_word_embeddings", False)),
                    qk_norm=cfg.get("model_type") == "qwen3")
        try:
            engine = engine_figures(cfg, path)
        except AtlasError:
            if is_mla_or_moe(cfg):  # the GQA formulas would be wrong, not just approximate
                raise
            return shape  # an architecture Atlas does not build: the dense formulas
        for key, value in engine.items():
            setattr(shape, key, value)
        return shape

    @property
    def layer_params(self) -> int:
        """Matmul weights and norms of one decoder layer (biases, if any, are negligible)."""
        q = self.heads * self.head_dim
        kv = self.kv_heads * self.head_dim
        norms = 2 * self.hidden + (2 * self.head_dim if self.qk_norm else 0)
        return self.hidden * (2 * q + 2 * kv) + 3 * self.hidden * self.intermediate + norms

    @property
    def non_embedding_params(self) -> int:
        """The decoder layers and the final norm, every expert included: neither the embedding nor the LM head."""
        if self.base_params is None:
            return self.layers * self.layer_params + self.hidden
        return self.base_params + self.moe_layers * self.num_experts * self.expert_params

    @property
    def active_non_embedding_params(self) -> int:
        """What one token goes through: the routed experts only top-k of each MoE layer."""
        idle = self.moe_layers * (self.num_experts - self.experts_per_token) * self.expert_params
        return self.non_embedding_params - idle

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    def experts_read(self, tokens: int) -> float:
        """Routed experts of one MoE layer that `tokens` tokens reach: top-k for one token; for more, the
        expectation under uniform independent routing, n (1 - (1 - k/n)^tokens)."""
        if not self.num_experts:
            return 0.0
        n, k = self.num_experts, self.experts_per_token
        return n * (1.0 - (1.0 - k / n) ** max(tokens, 1))

    def weight_read_params(self, tokens: int = 1) -> float:
        """Parameters one forward of `tokens` tokens reads: everything but the input embedding (which is
        only looked up, unless it is the LM head too), and of the routed experts only those reached. A
        decode step at batch 1 reads the top-k routed experts + the shared experts of each MoE layer."""
        base = self.non_embedding_params - self.moe_layers * self.num_experts * self.expert_params
        return base + self.moe_layers * self.experts_read(tokens) * self.expert_params + self.embedding_params

    def kv_elements_per_token(self) -> int:
        """Cache values one token takes, all layers (MLA: one latent row per layer, not K and V per head)."""
        if self.kv_values_per_token is not None:
            return self.kv_values_per_token
        return 2 * self.layers * self.kv_heads * self.head_dim

    def attention_flops(self, context: int, queries: int = 1) -> float:
        """QK^T and PV of `queries` tokens over `context` keys each, all layers."""
        pair = self.attention_pair_flops
        if pair is None:
            pair = 4 * self.layers * self.heads * self.head_dim
        return float(pair) * context * queries

    def recurrent_state_bytes(self, dtype_bytes: int) -> int:
        """Bytes of one sequence's recurrent state, every linear-attention layer (0 for other models)."""
        return self.conv_state_values * dtype_bytes + self.delta_state_values * 4

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "non_embedding_params": self.non_embedding_params,
                "active_non_embedding_params": self.active_non_embedding_params,
                "embedding_params": self.embedding_params, "kv_elements_per_token": self.kv_elements_per_token()}


def is_mla_or_moe(cfg: dict[str, Any]) -> bool:
    return bool(cfg.get("kv_lora_rank") or cfg.get("n_routed_experts") or cfg.get("num_experts")
                or cfg.get("num_local_experts"))


def engine_figures(cfg: dict[str, Any], path: Path | None = None) -> dict[str, Any]:
    """ModelShape fields read from the engine's model for this config, built on the meta device (the
    cache specs the memory plan uses, the parameters the loader fills). Raises AtlasError for a config
    the engine does not build."""
    import torch

    from atlas.config import ModelConfig
    from atlas.layers.attention import KVCacheSpec
    from atlas.layers.embedding import VocabEmbedding
    from atlas.layers.mla import MLACacheSpec
    from atlas.layers.moe import FusedExperts
    from atlas.layers.parallel import building_with
    from atlas.models.registry import model_class

    mc = ModelConfig.from_dict(cfg, path or Path("."))
    with torch.device("meta"), building_with(None):
        model = model_class(mc)(mc, 1)
    specs = model.kv_cache_specs()
    pair = 0
    for spec in specs:
        if isinstance(spec, MLACacheSpec):  # absorbed: q.k over the latent + rope dims, p.v over the latent
            pair += 2 * spec.num_heads * (2 * spec.kv_lora_rank + spec.rope_dim)
        elif isinstance(spec, KVCacheSpec):
            pair += 2 * (spec.num_heads or spec.num_kv_heads) * 2 * spec.head_dim
        else:
            raise TypeError(f"no attention FLOP count for cache spec {spec!r}")
    embeddings = ("model.embed_tokens.", "lm_head.")
    # (other lookup tables, such as Gemma 4's per-layer embeddings: a token reads one row of them, not the table)
    lookups = {id(p) for m in model.modules() if isinstance(m, VocabEmbedding) for p in m.parameters()}
    non_embedding = sum(p.numel() for name, p in model.named_parameters()
                        if not name.startswith(embeddings) and id(p) not in lookups)
    experts = [m for m in model.modules() if isinstance(m, FusedExperts)]
    # (every router says its top-k: TopKRouter, gpt-oss's GptOssRouter)
    routers = [m.top_k for m in model.modules() if isinstance(getattr(m, "top_k", None), int)]
    expert_total = sum(p.numel() for m in experts for p in m.parameters())
    num_experts = experts[0].num_experts if experts else 0
    states = model.state_specs()
    return {
        "conv_state_values": sum(s.conv_dim * (s.conv_kernel - 1) for s in states),
        "delta_state_values": sum(s.num_heads * s.key_dim * s.value_dim for s in states),
        "attention": "mla" if any(isinstance(s, MLACacheSpec) for s in specs) else "gqa",
        "kv_values_per_token": sum(spec.values_per_token() for spec in specs),
        "attention_pair_flops": pair,
        "base_params": non_embedding - expert_total,
        "expert_params": expert_total // (len(experts) * num_experts) if experts else 0,
        "moe_layers": len(experts),
        "num_experts": num_experts,
        "experts_per_token": routers[0] if routers else 0,
    }


def prefill_flops(shape: ModelShape, batch: int, input_len: int) -> float:
    """`batch` prompts of `input_len` tokens, causal, one sampled row per sequence."""
    causal_pairs = input_len * (input_len + 1) / 2
    per_seq = (2.0 * shape.active_non_embedding_params * input_len
               + shape.attention_flops(1) * causal_pairs
               + 2.0 * shape.embedding_params)  # the LM head on the last row
    return batch * per_seq


def decode_step_flops(shape: ModelShape, batch: int, context: float) -> float:
    return batch * (2.0 * (shape.active_non_embedding_params + shape.embedding_params)
                    + shape.attention_flops(int(round(context))))


def decode_step_bytes(weight_read_bytes: float, shape: ModelShape, kv_dtype_bytes: int, batch: int,
                      context: float, state_bytes: float = 0) -> float:
    """The weights the step reads (ModelShape.weight_read_params(batch) in bytes), plus the cache of
    `context` tokens for each of `batch` sequences, plus each sequence's recurrent state (`state_bytes`: hybrid
    models) read and written."""
    return weight_read_bytes + batch * (context * shape.kv_elements_per_token() * kv_dtype_bytes + 2 * state_bytes)


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


def matmul_peak(device: torch.device, n: int = 8192, dtype: torch.dtype | None = None, iters: int = 10,
                warmup: int = 3) -> float | None:
    """FLOP/s of an n x n x n matmul of random (never zero) `dtype` (default bfloat16) matrices: the median of
    `iters` timed after `warmup`. None when the device cannot be timed (a CPU: use small n in tests)."""
    import torch

    dtype = torch.bfloat16 if dtype is None else dtype
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
