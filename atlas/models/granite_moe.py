"""Granite 3.0 / 3.1 MoE (`granitemoe`) and GraniteMoeShared (`granitemoeshared`): Mixtral's block with Granite's
four constants, and the checkpoint layout the MoE Granites share (Granite 4.0-H's too: models/granite_hybrid.py).

Attention is Llama's (biases by attention_bias) with scores scaled by attention_multiplier; every layer's MLP is
routed experts (the router's top-k logits through a softmax: softmax routing, renormalized, logits in the model
dtype), plus, in GraniteMoeShared where shared_intermediate_size > 0, an always-on SwiGLU expert (`shared_mlp`).
The embedding is multiplied by embedding_multiplier, each block's output by residual_multiplier (folded into
o_proj's and the experts' down weights at load, as Granite's dense model folds it), the logits divided by
logits_scaling. FP8 checkpoints load dequantized to the model dtype; --quantization fp8 and LoRA adapters (whose
weights the folding would change) are refused.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path

import torch

from atlas.config import ModelConfig
from atlas.errors import ModelLoadError
from atlas.layers.linear import materialize
from atlas.models.base import renamed_weights
from atlas.models.llama import apply_granite_constants, fold_into_outputs
from atlas.models.sparse_moe import (
    MixtralForCausalLM,
    MoESettings,
    SparseMoeForCausalLM,
    _fields,
    fused_expert_pieces,
    load_moe_weights,
)


def granite_moe_names(name: str, tensor: torch.Tensor, where: Path, shared: str) -> Iterable[tuple[str, object]]:
    """A MoE Granite's checkpoint tensor under the names of Atlas's blocks: `block_sparse_moe.input_linear` [E, 2I, H]
    (gate rows first; `experts.gate_up_proj` as transformers 5 names it) and `output_linear` [E, H, I]
    (`experts.down_proj`) split per expert under `mlp.experts`, the router's `router.layer` (`router.weight`) as
    `mlp.gate`, the shared expert's fused `shared_mlp.input_linear` [2I, H] split into gate and up rows and its
    `output_linear` as down, under `mlp.<shared>`."""
    prefix, _, leaf = name.partition(".block_sparse_moe.")
    if leaf in ("input_linear.weight", "experts.gate_up_proj"):
        yield from fused_expert_pieces(f"{prefix}.mlp.experts.gate_up_proj", materialize(tensor))
    elif leaf in ("output_linear.weight", "experts.down_proj"):
        yield from fused_expert_pieces(f"{prefix}.mlp.experts.down_proj", materialize(tensor))
    elif leaf in ("router.layer.weight", "router.weight"):
        yield f"{prefix}.mlp.gate.weight", tensor
    elif ".shared_mlp.input_linear." in name:
        w = materialize(tensor)
        if w.dim() != 2 or w.shape[0] % 2:
            raise ModelLoadError(f"malformed checkpoint {where}: {name} of shape {tuple(w.shape)} is not "
                                 "[2 x intermediate, hidden]")
        gate, up = w.chunk(2, dim=0)
        base = name.replace(".shared_mlp.input_linear.weight", f".mlp.{shared}.")
        yield base + "gate_proj.weight", gate
        yield base + "up_proj.weight", up
    elif ".shared_mlp.output_linear." in name:
        yield name.replace(".shared_mlp.output_linear.", f".mlp.{shared}.down_proj."), tensor
    else:
        yield name, tensor


class GraniteMoeForCausalLM(SparseMoeForCausalLM):
    supports_fp8_linear = False
    lora_layers: tuple[str, ...] = ()

    @classmethod
    def read_settings(cls, cfg: ModelConfig, max_positions: int) -> MoESettings:
        s = MixtralForCausalLM.read_settings(cfg, max_positions)
        _, count = _fields(cfg)
        bias = bool(cfg.raw.get("attention_bias", False))
        return replace(s, attention=replace(s.attention, qkv_bias=bias, o_bias=bias),
                       shared_intermediate_size=count("shared_intermediate_size", 0))

    def __init__(self, cfg: ModelConfig, max_positions: int):
        super().__init__(cfg, max_positions)
        self.residual_multiplier, self.logits_scaling = apply_granite_constants(self, cfg)

    def vocab_weight_names(self) -> None:
        return None  # (the embedding is multiplied, so a drafter cannot share it as a plain lookup)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        where = self.config.path

        def renamed() -> Iterable[tuple[str, object]]:
            for name, tensor in renamed_weights(weights, tied_head=self.config.tie_word_embeddings):
                yield from granite_moe_names(name, tensor, where, "shared_experts")

        load_moe_weights(self, renamed(), where, self.stacked_params)
        shared = [layer.mlp.shared_experts.down_proj for layer in self.model.layers
                  if layer.mlp.shared_experts is not None]
        fold_into_outputs(self.residual_multiplier, [
            *(layer.self_attn.o_proj for layer in self.model.layers), *(layer.mlp.experts for layer in self.model.layers),
            *shared])

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return super().compute_logits(hidden, out=out).div_(self.logits_scaling)
