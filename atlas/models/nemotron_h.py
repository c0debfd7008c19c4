"""Nemotron-H (`nemotron_h`: Nemotron-H 8B / 47B / 56B, NVIDIA Nemotron Nano 2): a hybrid of Mamba-2, attention and
MLP blocks, one token mixer or MLP per block.

Each block is pre-norm with a residual add: x + mixer(RMSNorm(x)), its mixer as `layers_block_type` (or the
released configs' `hybrid_override_pattern`, one letter a block) says:
- linear_attention (M): a Mamba-2 mixer (layers/mamba2.py; its intermediate size mamba_num_heads * mamba_head_dim);
- full_attention (*): GQA over the paged KV cache without positional encoding (head_dim^-0.5 scores);
- mlp (-): up_proj, squared ReLU (mlp_hidden_act relu2), down_proj.
The routed-expert blocks (moe, E) of the MoE releases are refused by name: their experts are not gated (relu2 of up
alone), which Atlas's expert kernels do not compute.

Checkpoint names are the published ones (`backbone.embeddings`, `backbone.layers.N.norm` / `.mixer.*`,
`backbone.norm_f`, `lm_head`). Eager mixed steps; tensor parallelism as layers/mamba2.py says for the Mamba-2
layers, Llama's for the attention, the MLP column- then row-parallel; FP8 and LoRA refused.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from atlas.config import ModelConfig
from atlas.errors import ModelLoadError, UnsupportedModelError
from atlas.layers.attention import AttentionMetadata, KVCacheSpec
from atlas.layers.embedding import LMHead, VocabEmbedding
from atlas.layers.linear import ColumnParallelLinear, RowParallelLinear
from atlas.layers.linear_attention import RecurrentStateSpec
from atlas.layers.mamba2 import Mamba2Mixer
from atlas.layers.norm import RMSNorm
from atlas.layers.rotary import RotaryEmbedding
from atlas.models.base import CausalLM, load_named_weights, make_layers
from atlas.models.granite_hybrid import _time_step_limit
from atlas.models.llama import LlamaAttention, LlamaVariant

MAMBA, ATTENTION, MLP, MOE = "linear_attention", "full_attention", "mlp", "moe"
_LETTERS = {"M": MAMBA, "*": ATTENTION, "-": MLP, "E": MOE}
_STACKED = [("q_proj", "qkv_proj", "q"), ("k_proj", "qkv_proj", "k"), ("v_proj", "qkv_proj", "v")]


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
    if MOE in types:
        raise UnsupportedModelError(f"{where}: Nemotron-H's routed-expert (moe) blocks have non-gated relu2 experts, "
                                    "which Atlas's expert kernels do not compute; its dense releases (Nemotron-H, "
                                    "Nemotron Nano 2) are served")
    if ATTENTION not in types:
        raise UnsupportedModelError(f"{where}: a model without attention layers; Atlas serves the hybrids")
    return types


class SquaredReluMLP(nn.Module):
    """up_proj (column-parallel), relu(.)^2, down_proj (row-parallel: one all-reduce)."""

    def __init__(self, hidden: int, intermediate: int, bias: bool):
        super().__init__()
        self.up_proj = ColumnParallelLinear(hidden, intermediate, bias=bias)
        self.down_proj = RowParallelLinear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(torch.relu(self.up_proj(x)).square())


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
            self.mixer = SquaredReluMLP(cfg.hidden_size, cfg.intermediate_size, bool(raw.get("mlp_bias", False)))

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
        self.embeddings = VocabEmbedding(cfg.vocab_size, cfg.hidden_size)
        # (no positional encoding: the attention layers see the identity rotation)
        rotary = RotaryEmbedding(cfg.head_dim, cfg.rope, max_positions, cfg.max_position_embeddings).identity()
        self.layers = make_layers(cfg.num_hidden_layers, lambda i: NemotronHBlock(cfg, types[i], i, rotary))
        self.norm_f = RMSNorm(cfg.hidden_size, float(cfg.raw.get("layer_norm_epsilon", 1e-5)))


class NemotronHForCausalLM(CausalLM):
    keeps_recurrent_state = True
    recurrent_state_in_mixed_graphs = False  # (layers/mamba2.py)
    supports_fp8_linear = False
    lora_layers: tuple[str, ...] = ()

    @classmethod
    def tensor_parallel_divisors(cls, cfg: ModelConfig) -> dict[str, int]:
        return {"Mamba-2 heads (mamba_num_heads)": cfg.raw.get("mamba_num_heads", 128)}

    def __init__(self, cfg: ModelConfig, max_positions: int):
        super().__init__()
        self.config = cfg
        self.layer_types = nemotron_layer_types(cfg)
        self.model = NemotronHBackbone(cfg, self.layer_types, max_positions)
        tied = self.model.embeddings if cfg.tie_word_embeddings else None
        self.lm_head = LMHead(cfg.vocab_size, cfg.hidden_size, tied_to=tied)

    @property
    def num_layers(self) -> int:
        return len(self.model.layers)

    def kv_cache_specs(self) -> list[KVCacheSpec]:
        return [KVCacheSpec(b.mixer.num_kv_heads, b.mixer.head_dim, b.mixer.num_heads) for b in self.model.layers
                if b.kind == ATTENTION]

    def state_specs(self) -> list[RecurrentStateSpec]:
        return [m.state_spec() for m in self._mamba_layers()]

    def bind_state_caches(self, pools: list[tuple[torch.Tensor, torch.Tensor]] | None,
                          verify_inputs: list[torch.Tensor] | None = None) -> None:
        for i, layer in enumerate(self._mamba_layers()):
            layer.bind_state(*(pools[i] if pools is not None else (None, None)),
                             verify_inputs=verify_inputs[i] if verify_inputs is not None else None)

    def replay_states(self, slots: torch.Tensor, rows: int) -> None:
        for layer in self._mamba_layers():
            layer.replay(slots, rows)

    def _mamba_layers(self) -> list[Mamba2Mixer]:
        return [b.mixer for b in self.model.layers if b.kind == MAMBA]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embeddings(input_ids)

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return self.lm_head(hidden, out=out)

    def vocab_weight_names(self) -> tuple[str, str] | None:
        head = "backbone.embeddings.weight" if self.config.tie_word_embeddings else "lm_head.weight"
        return "backbone.embeddings.weight", head  # (checkpoint names)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: AttentionMetadata, capture_layers: tuple[int, ...] = (),
                intermediate: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """As Qwen3NextForCausalLM.forward: kv_caches one per attention block of this stage."""
        layers = self.model.layers
        if intermediate is None:
            x, residual = self.model.embeddings(input_ids), None
        else:
            x, residual = intermediate[0], intermediate[1]
        captured: dict[int, torch.Tensor] = {}
        c = 0
        for i, layer in enumerate(layers):
            cache = None
            if layer.kind == ATTENTION:
                cache, c = kv_caches[c], c + 1
            x, residual = layer(positions, x, residual, cache, meta)
            if layers.first + i in capture_layers:
                captured[layers.first + i] = x + residual
        aux = torch.cat([captured[i] for i in capture_layers if i in captured], dim=-1) if captured else None
        if not layers.is_last:
            return torch.stack([x, residual]), aux
        hidden, _ = self.model.norm_f(x, residual)
        return hidden, aux

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        tied = self.config.tie_word_embeddings
        # (the checkpoint's backbone. is this model's model., as the pipeline stages' loader reads it)
        renamed = (("model." + n[len("backbone."):] if n.startswith("backbone.") else n, t) for n, t in weights
                   if not (tied and n == "lm_head.weight"))
        load_named_weights(self, renamed, _STACKED, skip_suffixes=("rotary_emb.inv_freq",), strict=True)
