"""LongCat-Flash (LongcatFlashForCausalLM, model_type longcat_flash). Model math only.

As transformers' longcat_flash computes it, each of the `num_layers` decoder layers holds two MLA attention
sublayers (their own latent caches: cache 2i and 2i + 1 of layer i), two dense SwiGLU MLPs and one
"shortcut-connected" mixture of experts that reads the first MLP's input and joins the stream at the layer's end:
    a = x + attn0(ln_in0(x)); n = ln_post0(a); b = a + mlp0(n)
    c = b + attn1(ln_in1(b)); out = c + mlp1(ln_post1(c)) + moe(n)
The MoE router takes the softmax of n_routed_experts + zero_expert_num logits (float32), picks top-k by
softmax + e_score_correction_bias, weighs each pick by its softmax probability times routed_scaling_factor (no
renormalisation); picks at index >= n_routed_experts are zero-computation experts: their output is the input
times the weight. There are no shared experts. The MLA is DeepSeek's with LongCat's scaling: q (nope and rope
parts) times sqrt(hidden / q_lora_rank) and the normed latent times sqrt(hidden / kv_lora_rank), applied here
to q_a_layernorm's and kv_a_layernorm's weights once they are loaded (so the cache holds the scaled latent, k_pe
unscaled); the latent norms at eps 1e-6 whatever rms_norm_eps is; the RoPE interleaved over `head_dim` dims.
Its MTP module (`model.mtp.*`, `LongcatMTP`) drafts for --speculative mtp. LongCat-Flash-Lite (LongcatFlashNgramForCausalLM) is the
same model with the n-gram input embedding of layers/ngram_embedding.py. Spec:
../shared/specs/mla-mtp-dsa-longcat.md section 5.

Atlas's layer i is LongCat's decoder layer i (capture layer ids and pipeline stages count those; transformers'
num_hidden_layers property is twice that: attention sublayers).
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Iterable

import torch
from torch import nn

from atlas.config import ModelConfig
from atlas.errors import ModelLoadError, UnsupportedModelError
from atlas.layers.attention import AttentionMetadata
from atlas.layers.embedding import LMHead, VocabEmbedding
from atlas.layers.linear import Linear
from atlas.layers.mla import MLAAttention, MLACacheSpec, MLAConfig, mla_softmax_scale
from atlas.layers.moe import FusedExperts, RouterConfig, TopKRouter
from atlas.layers.ngram_embedding import NgramConfig, NgramEmbedding, TokenHistorySpec
from atlas.layers.norm import RMSNorm
from atlas.layers.parallel import current
from atlas.layers.rotary import RotaryEmbedding
from atlas.models.base import CausalLM, MTPModule, make_layers, renamed_weights, whole_head
from atlas.models.deepseek import _STACKED_MLP, LATENT_NORM_EPS, stacked_attention
from atlas.models.llama import LlamaForCausalLM, LlamaMLP
from atlas.models.quantization import declared_method, refuse_quantized, refuse_quantized_tensor
from atlas.models.sparse_moe import SparseMoeForCausalLM, load_moe_weights

logger = logging.getLogger(__name__)

_EXPERT = re.compile(r"model\.layers\.\d+\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")


class LongcatMoE(nn.Module):
    """The shortcut MoE: `router` (checkpoint `mlp.router.classifier.weight`, `mlp.router.e_score_correction_bias`)
    over the routed and zero experts, `experts` the routed ones only (zero experts have no weights)."""

    def __init__(self, hidden_size: int, router: RouterConfig, num_routed: int, intermediate_size: int, act: str):
        super().__init__()
        self.mp = current()
        self.num_routed = num_routed
        self.router = TopKRouter(hidden_size, router, correction_bias=True)
        self.experts = FusedExperts(num_routed, hidden_size, intermediate_size, act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.router(x)
        zero = ids >= self.num_routed
        # Zero-expert picks run through expert 0 at weight 0 (fixed shapes, no host sync) and are added below as
        # weight * x: the identity, once, after the routed experts' partial sums are reduced.
        routed = self.experts(x, torch.where(zero, 0.0, weights), torch.where(zero, 0, ids))
        identity = (weights * zero).sum(dim=-1, keepdim=True)
        return (self.mp.all_reduce(routed).float() + identity * x.float()).to(x.dtype)


class LongcatDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, mla: MLAConfig, router: RouterConfig, num_routed: int,
                 expert_intermediate: int, act: str, rotary: RotaryEmbedding, scale: float):
        super().__init__()
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.self_attn = nn.ModuleList([MLAAttention(mla, rotary, scale) for _ in range(2)])
        self.mlps = nn.ModuleList([LlamaMLP(d, cfg.intermediate_size, act, bias=False) for _ in range(2)])
        self.input_layernorm = nn.ModuleList([RMSNorm(d, eps) for _ in range(2)])
        self.post_attention_layernorm = nn.ModuleList([RMSNorm(d, eps) for _ in range(2)])
        self.mlp = LongcatMoE(d, router, num_routed, expert_intermediate, act)
        self.output_partial = False  # (every projection reduces itself)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                kv_caches: list[torch.Tensor], meta: AttentionMetadata, x_partial: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, residual) -> (mlp1 output + the shortcut MoE output, the residual stream before them), as
        LlamaDecoderLayer; kv_caches: the two attention sublayers' caches."""
        if residual is None:
            h, residual = self.input_layernorm[0](x), x
        else:
            h, residual = self.input_layernorm[0](x, residual)
        h, residual = self.post_attention_layernorm[0](self.self_attn[0](positions, h, kv_caches[0], meta), residual)
        shortcut = self.mlp(h)
        h, residual = self.input_layernorm[1](self.mlps[0](h), residual)
        h, residual = self.post_attention_layernorm[1](self.self_attn[1](positions, h, kv_caches[1], meta), residual)
        return self.mlps[1](h) + shortcut, residual


def _refuse_unsupported(cfg: ModelConfig, ngram: bool = False) -> None:
    """Config values whose computation transformers' longcat_flash does not have (it hard-codes them) or Atlas does
    not implement: refused by name."""
    raw, where = cfg.raw, cfg.path / "config.json"
    refuse_quantized(raw, cfg.path, f"{cfg.architecture} checkpoint", dequantizes=True)
    if raw.get("ngram_vocab_size_ratio") is not None and not ngram:
        raise UnsupportedModelError(
            f"{where}: {cfg.architecture} with ngram_vocab_size_ratio set: LongCat's n-gram input embedding is served "
            "as LongcatFlashNgramForCausalLM (architectures in config.json)")
    fixed = {"zero_expert_type": ("identity",), "mla_scale_q_lora": (True,), "mla_scale_kv_lora": (True,),
             "attention_method": ("MLA",), "router_bias": (False,)}
    for key, allowed in fixed.items():
        if raw.get(key) is not None and raw[key] not in allowed:
            raise UnsupportedModelError(f"{where}: LongCat-Flash with {key}={raw[key]!r} is not supported (the "
                                        f"reference computes {allowed[0]!r} only)")


@torch.no_grad()
def fold_latent_scaling(attn: MLAAttention, hidden_size: int, mla: MLAConfig) -> None:
    """LongCat's MLA scaling (module docstring), folded into a loaded layer's latent norms' weights."""
    attn.q_a_layernorm.weight.mul_(math.sqrt(hidden_size / mla.q_lora_rank))
    attn.kv_a_layernorm.weight.mul_(math.sqrt(hidden_size / mla.kv_lora_rank))


class LongcatFlashForCausalLM(CausalLM):
    # (FP8 checkpoints are dequantized as they load, as the other MoE families)
    supports_fp8_linear = False

    NGRAM = False

    def __init__(self, cfg: ModelConfig, max_positions: int):
        super().__init__()
        _refuse_unsupported(cfg, self.NGRAM)
        raw, where = cfg.raw, cfg.path / "config.json"

        def need(key: str, default: int | None = None) -> int:
            value = raw.get(key, default)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ModelLoadError(f"malformed checkpoint: {where} field '{key}' must be a positive integer, got "
                                     f"{value!r}")
            return value

        if raw.get("num_layers") != cfg.num_hidden_layers:
            raise ModelLoadError(f"malformed checkpoint: {where} must give num_layers (LongCat's decoder layers), got "
                                 f"num_layers={raw.get('num_layers')!r}, num_hidden_layers={raw.get('num_hidden_layers')!r}")
        self.config = cfg
        self.mla = MLAConfig(hidden_size=cfg.hidden_size, num_heads=cfg.num_attention_heads,
                             q_lora_rank=need("q_lora_rank"), kv_lora_rank=need("kv_lora_rank"),
                             qk_nope_head_dim=need("qk_nope_head_dim"), qk_rope_head_dim=need("qk_rope_head_dim"),
                             v_head_dim=need("v_head_dim"), rms_norm_eps=LATENT_NORM_EPS,
                             attention_bias=bool(raw.get("attention_bias", False)), rope_interleave=True)
        rope_dim = self.mla.qk_rope_head_dim
        # transformers sizes its RoPE tables by head_dim (its default 64): other than the rope dims, it cannot run.
        if raw.get("head_dim", 64) != rope_dim or rope_dim % 2:
            raise ModelLoadError(f"malformed checkpoint: {where} has head_dim {raw.get('head_dim', 64)!r} (the RoPE "
                                 f"dims) and qk_rope_head_dim {rope_dim}: they must be equal and even")
        num_routed, zero = need("n_routed_experts"), int(raw.get("zero_expert_num") or 0)
        top_k = need("moe_topk") if raw.get("moe_topk") is not None else need("num_experts_per_tok")
        if top_k > num_routed + zero:
            raise ModelLoadError(f"malformed checkpoint: {where} routes to {top_k} of {num_routed + zero} experts")
        self.router = RouterConfig(num_experts=num_routed + zero, top_k=top_k, scoring_func="softmax",
                                   topk_method="noaux_tc", norm_topk_prob=False,
                                   routed_scaling_factor=float(raw.get("routed_scaling_factor", 6.0)))
        self.num_routed, self.zero_experts = num_routed, zero
        expert_intermediate = (need("expert_ffn_hidden_size") if raw.get("expert_ffn_hidden_size") is not None
                               else need("moe_intermediate_size"))
        act = str(raw.get("hidden_act", "silu"))
        rotary = RotaryEmbedding(rope_dim, cfg.rope, max_positions, cfg.max_position_embeddings, is_neox_style=False)
        scale = mla_softmax_scale(self.mla, cfg.rope)
        self.model = nn.Module()
        self.model.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.model.layers = make_layers(cfg.num_hidden_layers, lambda i: LongcatDecoderLayer(
            cfg, self.mla, self.router, num_routed, expert_intermediate, act, rotary, scale))
        self.model.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.model.mp = current()
        tied = self.model.embed_tokens if cfg.tie_word_embeddings else None
        self.lm_head = LMHead(cfg.vocab_size, cfg.hidden_size, tied_to=tied)

    @property
    def num_layers(self) -> int:
        return len(self.model.layers)

    def kv_cache_specs(self) -> list[MLACacheSpec]:
        return [attn.cache_spec() for layer in self.model.layers for attn in layer.self_attn]

    embed = LlamaForCausalLM.embed
    compute_logits = LlamaForCausalLM.compute_logits
    vocab_weight_names = LlamaForCausalLM.vocab_weight_names

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: AttentionMetadata, capture_layers: tuple[int, ...] = (),
                intermediate: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """As LlamaForCausalLM.forward, each layer taking its two sublayers' caches."""
        pairs = [kv_caches[2 * i: 2 * i + 2] for i in range(len(self.model.layers))]
        return LlamaForCausalLM.forward(self, input_ids, positions, pairs, meta, capture_layers, intermediate)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        cfg, where = self.config, self.config.path
        skipped_mtp = 0

        def named() -> Iterable[tuple[str, torch.Tensor]]:
            nonlocal skipped_mtp
            for name, tensor in renamed_weights(weights, tied_head=cfg.tie_word_embeddings):
                refuse_quantized_tensor(name, where, declared=declared_method(cfg.raw))
                if name.startswith("model.mtp."):
                    skipped_mtp += 1
                    continue
                m = _EXPERT.match(name)
                # Zero experts compute nothing; transformers' LongcatFlashExperts still allocates gate|up rows for
                # them, which its saves carry: only those are known (anything else is refused below).
                if (m is not None and self.num_routed <= int(m.group(1)) < self.num_routed + self.zero_experts
                        and m.group(2) != "down"):
                    continue
                yield name.replace(".mlp.router.classifier.", ".mlp.router."), tensor

        load_moe_weights(self, named(), where, _STACKED_MLP + stacked_attention(self.mla))
        for layer in self.model.layers:
            for attn in layer.self_attn:
                fold_latent_scaling(attn, cfg.hidden_size, self.mla)
        if skipped_mtp:
            logger.info("%s: the %d tensors of its MTP module (model.mtp.*) are loaded only as the drafter of "
                        "--speculative mtp", where, skipped_mtp)

    cuda_graph_blocker = SparseMoeForCausalLM.cuda_graph_blocker
    supports_cuda_graphs = SparseMoeForCausalLM.supports_cuda_graphs

    @property
    def num_mtp_modules(self) -> int:
        # (LongCat-Flash ships one, model.mtp.*; its config may not say so)
        return int(self.config.raw.get("num_nextn_predict_layers") or 1)

    # (its MTP module's logits are the model's LM head: a tensor-parallel driver holds a whole copy for it)
    mtp_uses_target_head = True

    def build_mtp(self, max_positions: int, embedding: VocabEmbedding | None = None,
                  lm_head: LMHead | None = None) -> LongcatMTP:
        """The MTP module (model.mtp.*), without weights (MTPProposer loads them); `embedding` and `lm_head`: whole
        copies of the target's in place of the model's (a tensor-parallel driver's, which drafts alone)."""
        rotary = RotaryEmbedding(self.mla.qk_rope_head_dim, self.config.rope, max_positions,
                                 self.config.max_position_embeddings, is_neox_style=False)
        return LongcatMTP(self.config, self.mla, rotary, mla_softmax_scale(self.mla, self.config.rope),
                          self.model.norm, embedding if embedding is not None else self.model.embed_tokens,
                          whole_head(self, lm_head, self.lm_head))


class LongcatMTP(MTPModule):
    """LongCat-Flash's multi-token-prediction module (`model.mtp.*`), as DeepSeek's (spec 3.2) with LongCat's names
    and block: for row i, the target's final (normed) hidden state h_i and the token t_{i+1} after it ->
    u_i = block(eh_proj([enorm(embed(t_{i+1})) | hnorm(h_i)])) at position i, one MLA sublayer (LongCat's scaling,
    its own latent cache) and one dense SwiGLU MLP, pre-norm; its logits are the target's LM head over mtp.norm(u_i).
    Chained drafting feeds u back as the next row's hidden state (as speculative/mtp.py does for DeepSeek's)."""

    weight_prefix = "model.mtp."
    _RENAMES = {"layers.0.enorm.m.weight": "enorm.weight", "layers.0.hnorm.m.weight": "hnorm.weight",
                "layers.0.eh_proj.weight": "eh_proj.weight", "norm.weight": "final_norm.weight"}

    def __init__(self, cfg: ModelConfig, mla: MLAConfig, rotary: RotaryEmbedding, scale: float, final_norm: RMSNorm,
                 target_embed: VocabEmbedding, lm_head: LMHead):
        super().__init__()
        self.config = cfg
        self.mla = mla
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.enorm = RMSNorm(d, eps)
        self.hnorm = RMSNorm(d, eps)
        self.eh_proj = Linear(2 * d, d)
        self.input_layernorm = RMSNorm(d, eps)
        self.self_attn = MLAAttention(mla, rotary, scale)
        self.post_attention_layernorm = RMSNorm(d, eps)
        self.mlp = LlamaMLP(d, cfg.intermediate_size, str(cfg.raw.get("hidden_act", "silu")), bias=False)
        self.final_norm = RMSNorm(d, eps)
        self.share_target(final_norm, target_embed, lm_head=lm_head)

    def kv_cache_specs(self) -> list[MLACacheSpec]:
        return [self.self_attn.cache_spec()]

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        """Tokens t_{i+1} [T], hidden states h_i [T, D] (target-normed, or a previous u) at positions i -> u [T, D]
        (before mtp.norm)."""
        e = self.enorm(self.embed(input_ids))
        z = self.eh_proj(torch.cat([e, self.hnorm(hidden.to(e.dtype))], dim=-1))
        h, residual = self.post_attention_layernorm(
            self.self_attn(positions, self.input_layernorm(z), kv_caches[0], meta), z)
        return self.mlp(h) + residual

    def head_input(self, u: torch.Tensor) -> torch.Tensor:
        return self.final_norm(u)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Checkpoint tensors under model.mtp. (SGLang's and the published checkpoints' names); LongCat's MLA
        scaling folded into the latent norms afterwards, as for the model's own layers."""
        def renamed(own: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
            for rest, tensor in own:
                if rest == "embed_tokens.weight":
                    self._adopt_embedding(tensor)
                    continue
                rest = self._RENAMES.get(rest, rest)
                if rest.startswith("layers.0."):
                    rest = rest[len("layers.0."):].replace("transformer_layer.mlp.", "mlp.")
                yield rest, tensor

        self.load_module(weights, lambda own: load_moe_weights(self, renamed(own), self.config.path,
                                                               _STACKED_MLP + stacked_attention(self.mla)))
        fold_latent_scaling(self.self_attn, self.config.hidden_size, self.mla)


class LongcatFlashNgramForCausalLM(LongcatFlashForCausalLM):
    """LongCat-Flash-Lite: LongCat-Flash whose input embedding is the n-gram embedding (layers/ngram_embedding.py),
    its token history kept in one more paged cache (the last of kv_caches)."""

    NGRAM = True
    cuda_graph_blocker = "its n-gram input embedding reads each row's look-back tokens on the PyTorch path"

    def __init__(self, cfg: ModelConfig, max_positions: int):
        super().__init__(cfg, max_positions)
        # (under tensor parallelism every rank holds the whole hashed tables and computes the same embedding; under
        # pipeline parallelism the first stage embeds, and every stage keeps the small token history)
        self.model.ngram_embeddings = NgramEmbedding(ngram_config(cfg), self.model.embed_tokens)

    def kv_cache_specs(self) -> list:
        specs = super().kv_cache_specs()
        return [*specs, TokenHistorySpec(pack=specs[0].program_heads)]

    def supports_cuda_graphs(self, dtype: torch.dtype, device: torch.device) -> bool:
        return False

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: AttentionMetadata, capture_layers: tuple[int, ...] = (),
                intermediate: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        if intermediate is None:  # (the first pipeline stage, or the only one)
            x = self.model.ngram_embeddings(input_ids, positions, kv_caches[-1], meta)
            # (the decoder starts from this embedding; a zero residual adds nothing to it)
            intermediate = torch.stack([x, torch.zeros_like(x)])
        return super().forward(input_ids, positions, kv_caches[:-1], meta, capture_layers, intermediate)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        word = "model.embed_tokens.weight"
        seen: dict[str, torch.Tensor] = {}

        def named() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                # (the remote code's alias of the shared word table)
                if name == "model.ngram_embeddings.word_embeddings.weight":
                    name = word
                if name == word:
                    if word in seen:
                        if not torch.equal(seen[word], tensor):
                            raise ModelLoadError(f"malformed checkpoint {self.config.path}: model.embed_tokens.weight "
                                                 "and model.ngram_embeddings.word_embeddings.weight differ")
                        continue
                    seen[word] = tensor
                yield name, tensor

        super().load_weights(named())


def ngram_config(cfg: ModelConfig) -> NgramConfig:
    """The n-gram embedding's fields of config.json, checked."""
    raw, where = cfg.raw, cfg.path / "config.json"
    ratio, order, splits = raw.get("ngram_vocab_size_ratio"), raw.get("emb_neighbor_num"), raw.get("emb_split_num")
    if not isinstance(ratio, (int, float)) or isinstance(ratio, bool) or ratio <= 0:
        raise ModelLoadError(f"malformed checkpoint: {where} field 'ngram_vocab_size_ratio' must be a positive number, "
                             f"got {ratio!r}")
    for key, value, least in (("emb_neighbor_num", order, 2), ("emb_split_num", splits, 1)):
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise ModelLoadError(f"malformed checkpoint: {where} field '{key}' must be an integer >= {least}, got "
                                 f"{value!r}")
    eos = raw.get("eos_token_id")
    if isinstance(eos, list) and len(eos) == 1:
        eos = eos[0]
    if not isinstance(eos, int) or isinstance(eos, bool):
        raise UnsupportedModelError(f"{where}: LongCat's n-gram embedding resets its look-back after the end-of-sequence "
                                    f"token, so it needs one eos_token_id; got {raw.get('eos_token_id')!r}")
    tables = splits * (order - 1)
    if cfg.hidden_size % tables:
        raise ModelLoadError(f"malformed checkpoint: {where} hidden_size {cfg.hidden_size} is not a multiple of the "
                             f"n-gram tables' count, emb_split_num x (emb_neighbor_num - 1) = {tables}")
    return NgramConfig(cfg.vocab_size, cfg.hidden_size, float(ratio), order, splits, eos)
