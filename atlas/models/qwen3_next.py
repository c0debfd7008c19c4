"""The hybrid linear-attention family: Qwen3-Next (`qwen3_next`), Qwen3.5 (`qwen3_5`, dense) and Qwen3.5-MoE
(`qwen3_5_moe`).

Decoder blocks are pre-norm like Llama, with two kinds of token mixer, as `layer_types` says (or, without it,
every `full_attention_interval`-th layer full attention, the others linear):
- linear_attention: Gated DeltaNet (layers/linear_attention.py), which keeps a recurrent state per sequence
  (a slot of the runner's state pools) instead of KV pages;
- full_attention: GQA over the paged KV cache with an output gate (q_proj makes [query | gate] per head;
  the output is multiplied by sigmoid(gate) before o_proj), per-head q/k RMSNorm and partial RoPE (the first
  partial_rotary_factor of each head's dims).
Every RMSNorm of the model (not the Gated DeltaNet's output norm) scales by (1 + weight), in float32
(layers/norm.ZeroCenteredRMSNorm). The MLP is SwiGLU, or sparse MoE (softmax router, top-k, renormalised for
Qwen3.5-MoE and where Qwen3-Next's norm_topk_prob says so) plus one shared expert weighted by
sigmoid(shared_expert_gate(x)).

Qwen3.5 checkpoints are vision-language models (`Qwen3_5ForConditionalGeneration`, the language model's
config in text_config, its weights under model.language_model.): Atlas serves the language model on text;
the vision tower's weights are not loaded (the prompt holds tokens only). Its multimodal RoPE (mrope_section)
rotates text positions exactly as plain RoPE does (the three position components of a text token are equal).
Text-only checkpoints (`Qwen3_5ForCausalLM`, `Qwen3_5MoeForCausalLM`) load the same way.

Tensor parallelism: the Gated DeltaNet layers split their heads over the ranks (layers/linear_attention.py), the
gated attention its heads as QKVParallelLinear does (each head's [query | gate] rows together), the MLPs and the
experts as the other models do; each block all-reduces once. Pipeline parallelism: a stage builds its own layers
(make_layers) and starts from the previous stage's [x | residual].

Speculative decoding with every drafter (the engine backs the recurrent state up before a verify step and restores
it after a rejection), the model's own multi-token-prediction module (`mtp.*`, `HybridMTP`) among them for
--speculative mtp; plain serving skips its weights.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, replace

import torch
from torch import nn

from atlas.config import ModelConfig
from atlas.errors import ModelLoadError, UnsupportedModelError
from atlas.layers.attention import AttentionMetadata, KVCacheSpec, PagedAttention
from atlas.layers.embedding import LMHead, VocabEmbedding
from atlas.layers.linear import Linear, MergedLinear, RowParallelLinear, kv_heads_of_rank
from atlas.layers.linear_attention import (
    GatedDeltaNet,
    grouped_ba_of_rank,
    grouped_qkvz_of_rank,
)
from atlas.layers.moe import FusedExperts, RouterConfig, TopKRouter
from atlas.layers.norm import ZeroCenteredRMSNorm
from atlas.layers.parallel import current
from atlas.layers.rotary import RotaryEmbedding
from atlas.models.base import (
    MTPModule,
    language_model_weights,
    load_named_weights,
    make_layers,
    renamed_weights,
    whole_head,
)
from atlas.models.hybrid import HybridDecoderLayer, RecurrentHybridLM
from atlas.models.llama import LlamaForCausalLM, LlamaMLP
from atlas.models.sparse_moe import expert_mapper, experts_keep_fp8, split_fused_experts

logger = logging.getLogger(__name__)

LINEAR, FULL = "linear_attention", "full_attention"
_LINEAR_PIECES = {"in_proj_qkv": "qkv", "in_proj_z": "z", "in_proj_b": "b", "in_proj_a": "a"}
_STACKED = [
    ("q_proj", "qkv_proj", "q"),
    ("k_proj", "qkv_proj", "k"),
    ("v_proj", "qkv_proj", "v"),
    ("gate_proj", "gate_up_proj", 0),
    ("up_proj", "gate_up_proj", 1),
]


@dataclass
class HybridSettings:
    layer_types: list[str]
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int
    hidden_act: str
    attention_bias: bool
    moe_layers: list[bool]
    num_experts: int = 0
    top_k: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True


def layer_types(cfg: ModelConfig) -> list[str]:
    raw = cfg.raw
    n = cfg.num_hidden_layers
    types = raw.get("layer_types")
    if types is None:
        interval = raw.get("full_attention_interval", 4)
        types = [FULL if (i + 1) % interval == 0 else LINEAR for i in range(n)]
    types = list(types)[:n]
    unknown = sorted({t for t in types if t not in (LINEAR, FULL)})
    if unknown or len(types) != n:
        raise UnsupportedModelError(f"{cfg.path / 'config.json'}: layer_types must name {n} layers, each "
                                    f"{LINEAR!r} or {FULL!r}; got {unknown or types}")
    return types


def _settings(cfg: ModelConfig, moe_layers: list[bool]) -> HybridSettings:
    raw = cfg.raw
    if raw.get("attn_output_gate") is False:
        raise UnsupportedModelError(f"{cfg.path / 'config.json'} sets attn_output_gate false: Atlas implements the "
                                    "gated full attention of these models only")
    moe = any(moe_layers)
    return HybridSettings(
        layer_types=layer_types(cfg), num_k_heads=raw.get("linear_num_key_heads", 16),
        num_v_heads=raw.get("linear_num_value_heads", 32), head_k_dim=raw.get("linear_key_head_dim", 128),
        head_v_dim=raw.get("linear_value_head_dim", 128), conv_kernel=raw.get("linear_conv_kernel_dim", 4),
        hidden_act=raw.get("hidden_act", "silu"), attention_bias=bool(raw.get("attention_bias", False)),
        moe_layers=moe_layers, num_experts=raw.get("num_experts", 0) if moe else 0,
        top_k=raw.get("num_experts_per_tok", 0) if moe else 0,
        moe_intermediate_size=raw.get("moe_intermediate_size", 0) if moe else 0,
        shared_expert_intermediate_size=raw.get("shared_expert_intermediate_size", 0) if moe else 0,
        norm_topk_prob=bool(raw.get("norm_topk_prob", True)))


class GatedAttention(nn.Module):
    """Full attention with an output gate, q/k (1 + w) RMSNorm and partial RoPE, over the paged KV cache. Under tensor
    parallelism a rank holds its query heads (their [query | gate] rows) and key/value heads as QKVParallelLinear
    splits them, and o_proj's columns of its heads (row-parallel: one all-reduce)."""

    def __init__(self, cfg: ModelConfig, s: HybridSettings, rotary: RotaryEmbedding):
        super().__init__()
        mp = current()
        heads, kv_heads, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        if heads % mp.tp_size:
            raise ValueError(f"the tensor-parallel size {mp.tp_size} does not divide the {heads} attention heads")
        self.num_heads, self.head_dim = heads // mp.tp_size, d
        self.num_kv_heads, first_kv = kv_heads_of_rank(kv_heads, mp)
        q, kv = self.num_heads * d, self.num_kv_heads * d
        sources = None
        if mp.tp_size > 1:
            sources = {"q": (mp.tp_rank * 2 * q, 2 * heads * d), "k": (first_kv * d, kv_heads * d),
                       "v": (first_kv * d, kv_heads * d)}
        # q_proj rows: per head [query (head_dim) | gate (head_dim)]
        self.qkv_proj = MergedLinear(cfg.hidden_size, {"q": 2 * q, "k": kv, "v": kv}, bias=s.attention_bias,
                                     sources=sources)
        self.o_proj = RowParallelLinear(heads * d, cfg.hidden_size, bias=s.attention_bias)
        self.q_norm = ZeroCenteredRMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.rotary = rotary
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim, scale=self.head_dim ** -0.5)
        self.split = [2 * q, kv, kv]

    def cache_spec(self) -> KVCacheSpec:
        return KVCacheSpec(self.num_kv_heads, self.head_dim, self.num_heads)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        T = x.shape[0]
        H, D = self.num_heads, self.head_dim
        q_gate, k, v = self.qkv_proj(x).split(self.split, dim=-1)
        q, gate = q_gate.view(T, H, 2 * D).chunk(2, dim=-1)
        q = self.q_norm(q)
        k = self.k_norm(k.view(T, self.num_kv_heads, D))
        q, k = self.rotary(positions, q, k)
        out = self.attn(q.contiguous(), k.contiguous(), v.reshape(T, self.num_kv_heads, D), kv_cache, meta)
        out = out.reshape(T, H * D) * torch.sigmoid(gate.reshape(T, H * D))
        return self.o_proj(out)


class SharedExpertMoE(nn.Module):
    """Routed experts (softmax scores, top-k) plus one shared expert gated by sigmoid(shared_expert_gate(x)). Under
    tensor parallelism both are sharded (layers/moe.py) and their partial sums all-reduced once (the gate is the
    same on every rank, so it may scale a partial sum)."""

    def __init__(self, hidden: int, s: HybridSettings):
        super().__init__()
        self.mp = current()
        self.gate = TopKRouter(hidden, RouterConfig(s.num_experts, s.top_k, scoring_func="softmax",
                                                    topk_method="greedy", norm_topk_prob=s.norm_topk_prob,
                                                    model_dtype_logits=True),
                               correction_bias=False)
        self.experts = FusedExperts(s.num_experts, hidden, s.moe_intermediate_size, s.hidden_act)
        self.shared_expert = None
        if s.shared_expert_intermediate_size:
            self.shared_expert = LlamaMLP(hidden, s.shared_expert_intermediate_size, s.hidden_act, bias=False,
                                          reduce=False)
            self.shared_expert_gate = Linear(hidden, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.experts.forward_routed(x, self.gate)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return self.mp.all_reduce(out)


class Qwen3NextDecoderLayer(HybridDecoderLayer):
    recurrent_name = "linear_attn"

    def __init__(self, cfg: ModelConfig, s: HybridSettings, layer_idx: int, rotary: RotaryEmbedding):
        super().__init__()
        self.is_recurrent = s.layer_types[layer_idx] == LINEAR
        if self.is_recurrent:
            self.linear_attn = GatedDeltaNet(cfg.hidden_size, s.num_k_heads, s.num_v_heads, s.head_k_dim,
                                             s.head_v_dim, s.conv_kernel, cfg.rms_norm_eps, s.hidden_act)
        else:
            self.self_attn = GatedAttention(cfg, s, rotary)
        self.input_layernorm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = (SharedExpertMoE(cfg.hidden_size, s) if s.moe_layers[layer_idx]
                    else LlamaMLP(cfg.hidden_size, cfg.intermediate_size, s.hidden_act, bias=False))


class HybridModel(nn.Module):
    def __init__(self, cfg: ModelConfig, s: HybridSettings, max_positions: int):
        super().__init__()
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size)
        rotary = RotaryEmbedding(cfg.head_dim, cfg.rope, max_positions, cfg.max_position_embeddings)
        self.layers = make_layers(cfg.num_hidden_layers, lambda i: Qwen3NextDecoderLayer(cfg, s, i, rotary))
        self.norm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mp = current()


class Qwen3NextForCausalLM(RecurrentHybridLM):
    """Qwen3-Next: MoE where (i + 1) % decoder_sparse_step == 0 and i is not in mlp_only_layers."""
    # FP8 checkpoints (the Qwen -FP8 block layout, per-channel and per-tensor ones) and --quantization fp8: the
    # attention, out_proj, MLP, shared-expert and expert projections keep FP8 weights; the linear-attention layers'
    # input projection and the router stay in the model dtype (keeps_fp8)
    supports_fp8_linear = True

    def keeps_fp8(self, name: str) -> bool:
        if ".mlp.experts." in name:
            return experts_keep_fp8(self)
        return ".linear_attn.in_proj" not in name and ".mlp.gate." not in name

    @classmethod
    def moe_layers(cls, cfg: ModelConfig) -> list[bool]:
        raw = cfg.raw
        step = raw.get("decoder_sparse_step", 1) or 1
        dense = set(raw.get("mlp_only_layers") or [])
        experts = raw.get("num_experts", 0) or 0
        return [experts > 0 and i not in dense and (i + 1) % step == 0 for i in range(cfg.num_hidden_layers)]

    @classmethod
    def tensor_parallel_divisors(cls, cfg: ModelConfig) -> dict[str, int]:
        """The linear-attention layers' heads split over the ranks like attention heads (whole heads, and each
        rank's value heads are those that read its key heads), and the shared expert like an MLP."""
        s = _settings(cfg, cls.moe_layers(cfg))
        out = {"linear-attention key heads (linear_num_key_heads)": s.num_k_heads,
               "linear-attention value heads (linear_num_value_heads)": s.num_v_heads}
        if s.shared_expert_intermediate_size:
            out["shared_expert_intermediate_size"] = s.shared_expert_intermediate_size
        return out

    def __init__(self, cfg: ModelConfig, max_positions: int):
        super().__init__()
        self.config = cfg
        self.settings = _settings(cfg, self.moe_layers(cfg))
        self.model = HybridModel(cfg, self.settings, max_positions)
        tied = self.model.embed_tokens if cfg.tie_word_embeddings else None
        self.lm_head = LMHead(cfg.vocab_size, cfg.hidden_size, tied_to=tied)

    compute_logits = LlamaForCausalLM.compute_logits
    vocab_weight_names = LlamaForCausalLM.vocab_weight_names

    # ------------------------------------------------------------------ weights
    def _checkpoint_names(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, object]]:
        """Checkpoint tensors under this model's names: a VLM's language model under model., the vision tower
        and the MTP module skipped (one log line each), Qwen3-Next's grouped linear-attention projections and
        fused expert tensors split into their pieces (of the grouped ones, only this tensor-parallel rank's key-head
        groups are read)."""
        s, mp = self.settings, self.model.mp
        skipped_mtp = 0
        for name, tensor in renamed_weights(language_model_weights(weights, ("model.visual.", "visual."),
                                                                   self.config.path, "the vision tower's"),
                                            tied_head=self.config.tie_word_embeddings):
            if name.startswith(("mtp.", "model.mtp.")):
                skipped_mtp += 1
                continue
            if name.endswith(".linear_attn.in_proj_qkvz.weight"):
                qkv, z = grouped_qkvz_of_rank(tensor, s.num_k_heads, s.num_v_heads, s.head_k_dim, s.head_v_dim,
                                              mp.tp_size, mp.tp_rank)
                prefix = name[: -len("in_proj_qkvz.weight")]
                yield prefix + "in_proj_qkv.weight", qkv
                yield prefix + "in_proj_z.weight", z
                continue
            if name.endswith(".linear_attn.in_proj_ba.weight"):
                b, a = grouped_ba_of_rank(tensor, s.num_k_heads, s.num_v_heads, mp.tp_size, mp.tp_rank)
                prefix = name[: -len("in_proj_ba.weight")]
                yield prefix + "in_proj_b.weight", b
                yield prefix + "in_proj_a.weight", a
                continue
            yield from split_fused_experts(name, tensor, self.config.path)
        if skipped_mtp:
            logger.info("%s: the multi-token-prediction module's %d tensors (mtp.*) are loaded only as the drafter of "
                        "--speculative mtp", self.config.path, skipped_mtp)

    @staticmethod
    def _mapper(name: str) -> tuple[str, object] | None:
        expert = expert_mapper(name)  # (a routed expert's piece, or its FP8 scales)
        if expert is not None:
            return expert
        parent, _, leaf = name.rpartition(".linear_attn.")
        piece = leaf.removesuffix(".weight")
        if parent and piece in _LINEAR_PIECES and leaf.endswith(".weight"):
            return f"{parent}.linear_attn.in_proj.weight", _LINEAR_PIECES[piece]
        return None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_named_weights(self, self._checkpoint_names(weights), _STACKED, skip_suffixes=("rotary_emb.inv_freq",),
                           mapper=self._mapper, strict=True)
        check_experts_complete(self, self.config.path)

    # ------------------------------------------------------------------ multi-token prediction
    @property
    def num_mtp_modules(self) -> int:
        # (Qwen3.5 says mtp_num_hidden_layers; Qwen3-Next's config may not say: one, as vLLM reads it)
        raw = self.config.raw
        return int(raw.get("num_nextn_predict_layers") or raw.get("mtp_num_hidden_layers") or 1)

    # (its MTP module's logits are the model's LM head: a tensor-parallel driver holds a whole copy for it)
    mtp_uses_target_head = True

    def build_mtp(self, max_positions: int, embedding: VocabEmbedding | None = None,
                  lm_head: LMHead | None = None) -> HybridMTP:
        """The MTP module (mtp.*), without weights (MTPProposer loads them); `embedding` and `lm_head`: whole copies
        of the target's in place of the model's (a tensor-parallel driver's, which drafts alone with the module
        built whole)."""
        return HybridMTP(self.config, self.settings, self.moe_layers(self.config)[0], max_positions, self.model.norm,
                         embedding if embedding is not None else self.model.embed_tokens,
                         whole_head(self, lm_head, self.lm_head))


def check_experts_complete(module: nn.Module, where) -> None:
    """Every expert shard of the module's FusedExperts was in the checkpoint (ModelLoadError naming the first)."""
    missing = [f"{name}.{piece}" for name, m in module.named_modules() if isinstance(m, FusedExperts)
               for piece in m.missing_shards()]
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ModelLoadError(f"malformed checkpoint {where}: missing weight(s) {shown}")


class HybridMTP(MTPModule):
    """The multi-token-prediction module of these models (`mtp.*`; vLLM's qwen3_next_mtp reads it the same way): for
    row i, the target's final (normed) hidden state h_i and the token t_{i+1} after it ->
    u_i = norm(layer(fc([pre_fc_norm_embedding(embed(t_{i+1})) | pre_fc_norm_hidden(h_i)]))) at position i, one
    gated full-attention decoder layer (its own paged KV cache; sparse MoE where the model's first layer is, else
    SwiGLU) and the (1 + w) norms; its logits are the model's LM head over u_i. Chained drafting feeds u (after
    `norm`, as vLLM does for this family) back as the next row's hidden state. No recurrent state: the module has no
    linear-attention layer."""

    weight_prefix = "mtp."

    def __init__(self, cfg: ModelConfig, s: HybridSettings, moe: bool, max_positions: int, final_norm: nn.Module,
                 target_embed: VocabEmbedding, lm_head: LMHead):
        super().__init__()
        self.config = cfg
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.pre_fc_norm_embedding = ZeroCenteredRMSNorm(d, eps)
        self.pre_fc_norm_hidden = ZeroCenteredRMSNorm(d, eps)
        self.fc = Linear(2 * d, d)
        rotary = RotaryEmbedding(cfg.head_dim, cfg.rope, max_positions, cfg.max_position_embeddings)
        one = replace(s, layer_types=[FULL], moe_layers=[moe])
        self.layer = Qwen3NextDecoderLayer(cfg, one, 0, rotary)
        self.norm = ZeroCenteredRMSNorm(d, eps)
        self.share_target(final_norm, target_embed, lm_head=lm_head)

    def kv_cache_specs(self) -> list[KVCacheSpec]:
        return [self.layer.self_attn.cache_spec()]

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        """Tokens t_{i+1} [T], hidden states h_i [T, D] (target-normed, or a previous u) at positions i -> u [T, D]."""
        e = self.pre_fc_norm_embedding(self.embed(input_ids))
        z = self.fc(torch.cat([e, self.pre_fc_norm_hidden(hidden.to(e.dtype))], dim=-1))
        x, residual = self.layer(positions, z, None, kv_caches[0], meta)
        u, _ = self.norm(x, residual)
        return u

    def head_input(self, u: torch.Tensor) -> torch.Tensor:
        return u  # (already through the module's final norm)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Checkpoint tensors under mtp.: fc, the two pre-fc norms, layers.0.*, norm."""
        def renamed(own: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, object]]:
            for rest, tensor in own:
                if rest.startswith("layers.0."):
                    rest = "layer." + rest[len("layers.0."):]
                elif rest.startswith("layers."):
                    raise ModelLoadError(f"{self.config.path}: mtp.{rest}: Atlas drives one MTP layer (mtp.layers.0)")
                yield from split_fused_experts(rest, tensor, self.config.path)

        self.load_module(weights, lambda own: load_named_weights(
            self, renamed(own), _STACKED, skip_suffixes=("rotary_emb.inv_freq",), mapper=Qwen3NextForCausalLM._mapper,
            strict=True))
        check_experts_complete(self, self.config.path)


class Qwen3_5ForCausalLM(Qwen3NextForCausalLM):
    """Qwen3.5 (dense): SwiGLU MLP in every layer; separate in_proj_qkv / z / b / a."""

    @classmethod
    def moe_layers(cls, cfg: ModelConfig) -> list[bool]:
        return [False] * cfg.num_hidden_layers


class Qwen3_5MoeForCausalLM(Qwen3NextForCausalLM):
    """Qwen3.5-MoE: sparse MoE with a shared expert in every layer, top-k renormalised."""

    @classmethod
    def moe_layers(cls, cfg: ModelConfig) -> list[bool]:
        return [True] * cfg.num_hidden_layers

    def __init__(self, cfg: ModelConfig, max_positions: int):
        if cfg.raw.get("norm_topk_prob") is False:
            raise UnsupportedModelError(f"{cfg.path / 'config.json'}: Qwen3.5-MoE always renormalises its top-k "
                                        "routing weights; norm_topk_prob false is not that model")
        super().__init__(cfg, max_positions)
