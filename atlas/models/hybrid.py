"""What the hybrid models share: layers that keep a recurrent state per sequence (Gated DeltaNet, Mamba-2, LFM2's
short convolution) beside attention layers that keep paged KV.

A hybrid model's `model` holds `embed_tokens` and its stage's `layers`; each decoder layer (most of them a
HybridDecoderLayer) says which of its modules
keeps a recurrent state (`recurrent`, None for none) and which attends over a paged KV cache (`attention`, None for
none; Falcon-H1's blocks have both) and is called as layer(positions, x, residual, kv_cache or None, meta) ->
(its output, the residual stream before it), the residual add fused into the next norm. The model class names its
final norm (`final_norm`). The runtime binds the recurrent layers' state pools in layer order (allocate_state_pools)
and replays their last verify step's kept rows after a rejection (runtime/state_slots.py).
"""

from __future__ import annotations

import torch
from torch import nn

from atlas.layers.attention import AttentionMetadata, KVCacheSpec
from atlas.layers.linear_attention import RecurrentStateSpec
from atlas.models.base import CausalLM


class HybridDecoderLayer(nn.Module):
    """The pre-norm block most hybrids share: input_layernorm, one token mixer (the recurrent module named
    `recurrent_name` where `is_recurrent`, else the attention `self_attn`), post_attention_layernorm, `mlp`; the
    mixer's and the MLP's outputs times residual_multiplier (Granite's; 1 elsewhere) before their residual adds.
    Subclasses build the modules and set is_recurrent."""

    recurrent_name = ""
    residual_multiplier = 1.0
    is_recurrent: bool

    @property
    def recurrent(self) -> nn.Module | None:
        return getattr(self, self.recurrent_name) if self.is_recurrent else None

    @property
    def attention(self) -> nn.Module | None:
        return None if self.is_recurrent else self.self_attn

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                kv_cache: torch.Tensor | None, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, residual) -> (this layer's MLP output, the residual stream before it)."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.recurrent(h, meta) if self.is_recurrent else self.self_attn(positions, h, kv_cache, meta)
        m = self.residual_multiplier
        h, residual = self.post_attention_layernorm(h * m if m != 1.0 else h, residual)
        out = self.mlp(h)
        return (out * m if m != 1.0 else out), residual


class RecurrentHybridLM(CausalLM):
    keeps_recurrent_state = True

    def final_norm(self) -> nn.Module:
        return self.model.norm

    @property
    def num_layers(self) -> int:
        return len(self.model.layers)

    def _recurrent(self) -> list[nn.Module]:
        return [layer.recurrent for layer in self.model.layers if layer.recurrent is not None]

    def kv_cache_specs(self) -> list[KVCacheSpec]:
        """The attention layers' paged caches, in layer order (the recurrent layers keep none)."""
        return [KVCacheSpec(a.num_kv_heads, a.head_dim, a.num_heads)
                for a in (layer.attention for layer in self.model.layers) if a is not None]

    def state_specs(self) -> list[RecurrentStateSpec]:
        """The recurrent layers' per-sequence states, in layer order."""
        return [m.state_spec() for m in self._recurrent()]

    def bind_state_caches(self, pools: list[tuple[torch.Tensor, torch.Tensor]] | None,
                          verify_inputs: list[torch.Tensor] | None = None) -> None:
        """Give each recurrent layer its (conv, state-matrix) pool (None: keep no state) and, with speculative
        decoding, its buffer of the rows of each slot's last verify step (runtime/state_slots.py)."""
        for i, layer in enumerate(self._recurrent()):
            layer.bind_state(*(pools[i] if pools is not None else (None, None)),
                             verify_inputs=verify_inputs[i] if verify_inputs is not None else None)

    def replay_states(self, slots: torch.Tensor, rows: int) -> None:
        """Advance the state at `slots` [n] of every recurrent layer by the first `rows` rows of each slot's last
        verify step, from their saved inputs."""
        for layer in self._recurrent():
            layer.replay(slots, rows)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: AttentionMetadata, capture_layers: tuple[int, ...] = (),
                intermediate: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """-> (final-normed hidden [T, H], captured residual streams or None). kv_caches: one per attention layer of
        this stage (kv_cache_specs' order); the recurrent layers read and write their bound state pools at the slots
        of the step's metadata (none kept where it has none). Pipeline stages as LlamaForCausalLM.forward: a later
        stage starts from `intermediate` ([2, T, H]), a stage before the last returns that pair."""
        layers = self.model.layers
        if intermediate is None:
            x, residual = self.model.embed_tokens(input_ids), None
        else:  # (a later pipeline stage: the previous stage's x and residual)
            x, residual = intermediate[0], intermediate[1]
        captured: dict[int, torch.Tensor] = {}
        c = 0
        for i, layer in enumerate(layers):
            cache = None
            if layer.attention is not None:
                cache, c = kv_caches[c], c + 1
            x, residual = layer(positions, x, residual, cache, meta)
            if layers.first + i in capture_layers:
                captured[layers.first + i] = x + residual
        aux = torch.cat([captured[i] for i in capture_layers if i in captured], dim=-1) if captured else None
        if not layers.is_last:
            return torch.stack([x, residual]), aux
        hidden, _ = self.final_norm()(x, residual)
        return hidden, aux
