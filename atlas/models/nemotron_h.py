"""Nemotron-H (`nemotron_h`: Nemotron-H 8B / 47B / 56B, NVIDIA Nemotron Nano 2): a hybrid of Mamba-2, attention and
MLP blocks, one token mixer or MLP per block.

Each block is pre-norm with a residual add: x + mixer(RMSNorm(x)), its mixer as `layers_block_type` (or the
released configs' `hybrid_override_pattern`, one letter a block) says:
- linear_attention (M): a Mamba-2 mixer (layers/mamba2.py; its intermediate size mamba_num_heads * mamba_head_dim);
- full_attention (*): GQA over the paged KV cache without positional encoding (head_dim^-0.5 scores);
- mlp (-): up_proj, squared ReLU (mlp_hidden_act relu2), down_proj;
- moe (E, the MoE releases: Nemotron 3 Nano): routed experts chosen as DeepSeek-V3 chooses them (sigmoid scores plus
  a correction bias, n_group / topk_group, renormalized by norm_topk_prob, times routed_scaling_factor), each expert
  non-gated (up_proj, relu2, down_proj), plus a shared expert of the same kind; with moe_latent_size the experts work
  in a smaller width between fc1_latent_proj and fc2_latent_proj. The experts run through the gated expert kernels
  as relu(gate) * up with gate = up (the up rows loaded twice: relu(u) * u is relu(u)^2 exactly), which reads the
  up weights twice.
The multi-token-prediction module's tensors (num_nextn_predict_layers) are skipped with a log line.

Checkpoint names are the published ones (`backbone.embeddings`, `backbone.layers.N.norm` / `.mixer.*`,
`backbone.norm_f`, `lm_head`). Eager mixed steps; tensor parallelism as layers/mamba2.py says for the Mamba-2
layers, Llama's for the attention, the MLP column- then row-parallel; FP8 and LoRA refused.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable

import torch
from torch import nn

from atlas.config import ModelConfig
from atlas.errors import ModelLoadError, UnsupportedModelError
from atlas.layers.attention import AttentionMetadata
from atlas.layers.embedding import LMHead, VocabEmbedding
from atlas.layers.linear import ColumnParallelLinear, Linear, RowParallelLinear
from atlas.layers.mamba2 import Mamba2Mixer
from atlas.layers.moe import FusedExperts, TopKRouter
from atlas.layers.norm import RMSNorm
from atlas.layers.parallel import current
from atlas.layers.rotary import RotaryEmbedding
from atlas.models.base import load_named_weights, make_layers, renamed_weights
from atlas.models.granite_hybrid import _time_step_limit
from atlas.models.hybrid import RecurrentHybridLM
from atlas.models.llama import LlamaAttention, LlamaVariant
from atlas.models.qwen3_next import check_experts_complete
from atlas.models.sparse_moe import checked_router

logger = logging.getLogger(__name__)

MAMBA, ATTENTION, MLP, MOE = "linear_attention", "full_attention", "mlp", "moe"
_LETTERS = {"M": MAMBA, "*": ATTENTION, "-": MLP, "E": MOE}
_STACKED = [("q_proj", "qkv_proj", "q"), ("k_proj", "qkv_proj", "k"), ("v_proj", "qkv_proj", "v")]
_EXPERT = re.compile(r"(.*\.mixer\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")


def nemotron_layer_types(cfg: ModelConfig) -> list[str]:
    raw, where = cfg.raw, cfg.path / "config.json"
    types = raw.get("layers_block_type")
    if types is None and isinstance(raw.get("hybrid_override_pattern"), str):
        pattern = raw["hybrid_override_pattern"]
        if any(c not in _LETTERS for c in pattern):
            raise ModelLoadError(f"malformed checkpoint: {where} hybrid_override_pattern {pattern!r} has letters "
                                 f"other than {''.join(_LETTERS)}")
        types = [_LETTERS[c] for c in pattern]
    if not isinstance(types, list) or len(types) != cfg.num_hidden_layers or any(
            t not in _LETTERS.values() for t in types):
        raise ModelLoadError(f"malformed checkpoint: {where} must list {cfg.num_hidden_layers} layers_block_type (or "
                             f"a hybrid_override_pattern), each one of {sorted(_LETTERS.values())}; got {types!r}")
    if ATTENTION not in types:
        raise UnsupportedModelError(f"{where}: a model without attention layers; Atlas serves the hybrids")
    return types


class SquaredReluMLP(nn.Module):
    """up_proj (column-parallel), relu(.)^2, down_proj (row-parallel: one all-reduce; reduce=False: this rank's
    partial sum, the caller reduces)."""

    def __init__(self, hidden: int, intermediate: int, bias: bool, reduce: bool = True):
        super().__init__()
        self.up_proj = ColumnParallelLinear(hidden, intermediate, bias=bias)
        self.down_proj = RowParallelLinear(intermediate, hidden, bias=bias, reduce=reduce)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(torch.relu(self.up_proj(x)).square())


class NonGatedMoE(nn.Module):
    """The routed experts and the shared expert of a moe block (module docstring). Under tensor parallelism both are
    sharded by their intermediate rows and their partial sums all-reduced once (the latent projections, replicated,
    are linear: they map a partial sum to a partial sum)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        raw, where = cfg.raw, cfg.path / "config.json"
        if raw.get("mlp_bias"):
            raise UnsupportedModelError(f"{where}: Nemotron-H's moe blocks with mlp_bias are not supported (the "
                                        "released MoE models have none)")
        experts = raw.get("n_routed_experts", 8)
        n_group = raw.get("n_group") or 1
        router = checked_router(where, experts, raw.get("num_experts_per_tok", 2), "sigmoid", "noaux_tc", n_group,
                                raw.get("topk_group") or n_group, bool(raw.get("norm_topk_prob", True)),
                                float(raw.get("routed_scaling_factor", 1.0)))
        self.gate = TopKRouter(cfg.hidden_size, router, correction_bias=True)
        latent = raw.get("moe_latent_size")
        width = latent or cfg.hidden_size
        self.fc1_latent_proj = Linear(cfg.hidden_size, latent) if latent else None
        self.fc2_latent_proj = Linear(latent, cfg.hidden_size) if latent else None
        self.experts = FusedExperts(experts, width, raw.get("moe_intermediate_size", 7688), "relu")
        self.shared_experts = SquaredReluMLP(cfg.hidden_size, raw.get("moe_shared_expert_intermediate_size", 7688),
                                             bias=False, reduce=False)
        self.mp = current()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        h = x if self.fc1_latent_proj is None else self.fc1_latent_proj(x)
        y = self.experts(h, weights, ids)
        if self.fc2_latent_proj is not None:
            y = self.fc2_latent_proj(y)
        return self.mp.all_reduce(y + self.shared_experts(x))


class NemotronHBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, kind: str, layer_idx: int, rotary: RotaryEmbedding):
        super().__init__()
        raw = cfg.raw
        eps = float(raw.get("layer_norm_epsilon", 1e-5))
        self.kind = kind
        self.norm = RMSNorm(cfg.hidden_size, eps)
        if kind == MAMBA:
            act = raw.get("mamba_hidden_act", "silu")
            self.mixer = Mamba2Mixer(
                cfg.hidden_size, raw.get("mamba_num_heads", 128), raw.get("mamba_head_dim", 64),
                raw.get("ssm_state_size", 128), raw.get("n_groups", 8), raw.get("conv_kernel", 4), eps,
                conv_bias=bool(raw.get("use_conv_bias", True)), proj_bias=bool(raw.get("use_bias", False)),
                time_step_limit=_time_step_limit(cfg), chunk_size=raw.get("chunk_size", 128), act=act)
        elif kind == ATTENTION:
            variant = LlamaVariant(qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=False,
                                   sliding_windows=[None] * cfg.num_hidden_layers)
            self.mixer = LlamaAttention(cfg, variant, layer_idx, rotary)
        else:
            if raw.get("mlp_hidden_act", "relu2") != "relu2":
                raise UnsupportedModelError(f"{cfg.path / 'config.json'}: mlp_hidden_act "
                                            f"{raw.get('mlp_hidden_act')!r}; Atlas implements relu2 for Nemotron-H")
            self.mixer = (NonGatedMoE(cfg) if kind == MOE else
                          SquaredReluMLP(cfg.hidden_size, cfg.intermediate_size, bool(raw.get("mlp_bias", False))))

    @property
    def recurrent(self) -> Mamba2Mixer | None:
        return self.mixer if self.kind == MAMBA else None

    @property
    def attention(self) -> LlamaAttention | None:
        return self.mixer if self.kind == ATTENTION else None

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                kv_cache: torch.Tensor | None, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, residual) -> (this block's output, the residual stream before it)."""
        if residual is None:
            h, residual = self.norm(x), x
        else:
            h, residual = self.norm(x, residual)
        if self.kind == MAMBA:
            return self.mixer(h, meta), residual
        if self.kind == ATTENTION:
            return self.mixer(positions, h, kv_cache, meta), residual
        return self.mixer(h), residual


class NemotronHBackbone(nn.Module):
    def __init__(self, cfg: ModelConfig, types: list[str], max_positions: int):
        super().__init__()
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size)  # (the checkpoint's embeddings)
        # (no positional encoding: the attention layers see the identity rotation)
        rotary = RotaryEmbedding(cfg.head_dim, cfg.rope, max_positions, cfg.max_position_embeddings).identity()
        self.layers = make_layers(cfg.num_hidden_layers, lambda i: NemotronHBlock(cfg, types[i], i, rotary))
        self.norm_f = RMSNorm(cfg.hidden_size, float(cfg.raw.get("layer_norm_epsilon", 1e-5)))


class NemotronHForCausalLM(RecurrentHybridLM):
    recurrent_state_in_mixed_graphs = False  # (layers/mamba2.py)
    supports_fp8_linear = False
    lora_layers: tuple[str, ...] = ()

    @classmethod
    def tensor_parallel_divisors(cls, cfg: ModelConfig) -> dict[str, int]:
        out = {"Mamba-2 heads (mamba_num_heads)": cfg.raw.get("mamba_num_heads", 128)}
        if MOE in nemotron_layer_types(cfg):
            out["moe_shared_expert_intermediate_size"] = cfg.raw.get("moe_shared_expert_intermediate_size", 7688)
        return out

    def __init__(self, cfg: ModelConfig, max_positions: int):
        super().__init__()
        self.config = cfg
        self.layer_types = nemotron_layer_types(cfg)
        self.model = NemotronHBackbone(cfg, self.layer_types, max_positions)
        tied = self.model.embed_tokens if cfg.tie_word_embeddings else None
        self.lm_head = LMHead(cfg.vocab_size, cfg.hidden_size, tied_to=tied)

    def final_norm(self) -> nn.Module:
        return self.model.norm_f

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return self.lm_head(hidden, out=out)

    def vocab_weight_names(self) -> tuple[str, str] | None:
        head = "backbone.embeddings.weight" if self.config.tie_word_embeddings else "lm_head.weight"
        return "backbone.embeddings.weight", head  # (checkpoint names)

    def _checkpoint_names(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, object]]:
        """The checkpoint's backbone. as this model's model. (as the pipeline stages' loader reads it); each
        routed expert's up_proj twice, as the gate and the up rows (module docstring); the MTP module skipped."""
        skipped = 0
        for name, tensor in renamed_weights(weights, tied_head=self.config.tie_word_embeddings):
            if name.startswith(("mtp.", "backbone.mtp.", "model.mtp.")):
                skipped += 1
                continue
            if name.startswith("backbone."):
                name = "model." + name[len("backbone."):]
            if name == "model.embeddings.weight":
                name = "model.embed_tokens.weight"
            if name.endswith("_proj.weight") and ".mixer.experts." in name and ".up_proj." in name:
                yield name.replace(".up_proj.", ".gate_proj."), tensor
            yield name, tensor
        if skipped:
            logger.info("%s: not loading the %d tensors of its multi-token-prediction module", self.config.path,
                        skipped)

    @staticmethod
    def _mapper(name: str) -> tuple[str, object] | None:
        m = _EXPERT.match(name)
        if m is None:
            return None
        prefix, expert, kind = m.groups()
        return f"{prefix}.{'w2' if kind == 'down' else 'w13'}", (int(expert), kind)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_named_weights(self, self._checkpoint_names(weights), _STACKED, skip_suffixes=("rotary_emb.inv_freq",),
                           mapper=self._mapper, strict=True)
        check_experts_complete(self, self.config.path)
