"""DeepSeek-V4 (DeepseekV4ForCausalLM, model_type deepseek_v4). Model math only; exact against transformers'
deepseek_v4 (modeling_deepseek_v4.py).

What V4 is, against V3.2:
- Attention (layers/dsv4_attention.py): no MLA. Shared-KV multi-query attention (one key head of head_dim 512 that
  is also the value), partial interleaved RoPE on the last rope dims, an unweighted per-head RMS on q, a learnable
  sink per head, a grouped low-rank output projection. Each layer has a sliding-window branch (sliding_window
  tokens); `layer_types` adds per layer a compressed branch: HCA (one pooled row per compress_rates[HCA] tokens,
  all visible ones attended) or CSA (overlapping windows of compress_rates[CSA], a lightning indexer over its own
  compressed keys choosing index_topk of them). RoPE theta differs: rope_theta on sliding-only layers,
  compress_rope_theta (with YaRN where configured) on compressed layers.
- Residual stream: manifold-constrained hyper-connections: hc_mult parallel streams [T, n, D]; around each
  sublayer a learned map collapses them into the sublayer's input (pre), spreads its output back (post) and mixes
  the streams (comb, projected by Sinkhorn-Knopp towards a doubly-stochastic matrix); a final head collapses them
  before the last norm.
- MoE in every layer: scores sqrt(softplus(logits)) (scoring_func sqrtsoftplus; sigmoid also served), no expert
  groups, top-k on scores + correction bias, weights renormalised then times routed_scaling_factor; the first
  layers (mlp_layer_types "hash_moe") pick their experts by a fixed token -> experts table (tid2eid) instead; the
  experts' and the shared expert's SwiGLU clamp gate (above) and up (both sides) at swiglu_limit.
- Norms are RMSNorms with float32 weights, as are the hyper-connection maps, sinks and the compressors' position
  biases (kept float32 here too).
- MTP (`mtp.0.*`, `--speculative mtp`): transformers does not build it; `DeepseekV4MTP` follows vLLM's and SGLang's
  DeepSeek-V4 MTP modules (see its docstring). Without --speculative mtp its tensors are not loaded (logged).

Checkpoint names are DeepSeek's (transformers writes them back on save): `layers.{i}.attn.*`, `.ffn.*`,
`attn_norm`, `ffn_norm`, `hc_attn_{fn,base,scale}`, `hc_ffn_*`, `hc_head_*`, `embed`, `head`, `norm`, with or without
a `model.` prefix (and transformers' `model.embed_tokens` / `model.hc_head.hc_*`).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from atlas.config import ModelConfig, _parse_rope
from atlas.errors import ModelLoadError, UnsupportedModelError
from atlas.layers.attention import AttentionMetadata
from atlas.layers.dsv4_attention import CSA, HCA, SLIDING, DSV4Attention, DSV4CacheSpec
from atlas.layers.embedding import LMHead, VocabEmbedding
from atlas.layers.linear import Linear
from atlas.layers.moe import FusedExperts
from atlas.layers.norm import Float32RMSNorm
from atlas.layers.parallel import current
from atlas.layers.rotary import RotaryEmbedding
from atlas.models.base import CausalLM, MTPModule, load_named_weights, make_layers
from atlas.models.quantization import refuse_quantized

logger = logging.getLogger(__name__)

_EXPERT = re.compile(r"((?:model\.layers\.\d+|block)\.ffn\.experts)\.(\d+)\.(w[123])\.weight$")
_KIND = {"w1": "gate", "w3": "up", "w2": "down"}
SCORING = {"sqrtsoftplus": lambda x: F.softplus(x).sqrt(), "sigmoid": torch.sigmoid}


def _fused_expert(name: str) -> tuple[str, object] | None:
    """A routed expert's w1 / w3 / w2 -> (the layer's fused w13 or w2, (expert, piece)); None for other names."""
    m = _EXPERT.match(name)
    if m is None:
        return None
    prefix, expert, w = m.groups()
    return f"{prefix}.{'w2' if w == 'w2' else 'w13'}", (int(expert), _KIND[w])


def _unweighted_rms32(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)


class HyperConnection(nn.Module):
    """The mHC map around one sublayer (transformers' DeepseekV4HyperConnection): from the n streams [T, n, D],
    (post [T, n], comb [T, n, n], the collapsed input [T, D]). Parameters `fn`, `base`, `scale` (checkpoint
    `hc_attn_fn` ... on the layer)."""

    def __init__(self, n: int, hidden_size: int, iters: int, hc_eps: float, norm_eps: float):
        super().__init__()
        self.n, self.iters, self.hc_eps, self.norm_eps = n, iters, hc_eps, norm_eps
        self.fn = nn.Parameter(torch.zeros((2 + n) * n, n * hidden_size, dtype=torch.float32))
        self.base = nn.Parameter(torch.zeros((2 + n) * n, dtype=torch.float32))
        self.scale = nn.Parameter(torch.ones(3, dtype=torch.float32))

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        t, n = streams.shape[0], self.n
        mix = F.linear(_unweighted_rms32(streams.reshape(t, -1).float(), self.norm_eps), self.fn.float())
        pre_w, post_w, comb_w = mix.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.float().split([n, n, n * n])
        s = self.scale.float()
        pre = torch.sigmoid(pre_w * s[0] + pre_b) + self.hc_eps
        post = 2 * torch.sigmoid(post_w * s[1] + post_b)
        comb = torch.softmax(comb_w.view(t, n, n) * s[2] + comb_b.view(n, n), dim=-1) + self.hc_eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        for _ in range(self.iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.hc_eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
        return post, comb, collapsed

    @staticmethod
    def expand(streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        """The streams after the sublayer: post * its output + comb^T @ streams."""
        dtype = streams.dtype
        return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2),
                                                                                streams)


class HyperHead(nn.Module):
    """The final collapse of the streams (transformers' DeepseekV4HyperHead; checkpoint `hc_head_{fn,base,scale}`)."""

    def __init__(self, n: int, hidden_size: int, hc_eps: float, norm_eps: float):
        super().__init__()
        self.hc_eps, self.norm_eps = hc_eps, norm_eps
        self.hc_fn = nn.Parameter(torch.zeros(n, n * hidden_size, dtype=torch.float32))
        self.hc_base = nn.Parameter(torch.zeros(n, dtype=torch.float32))
        self.hc_scale = nn.Parameter(torch.ones(1, dtype=torch.float32))

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        flat = _unweighted_rms32(streams.reshape(streams.shape[0], -1).float(), self.norm_eps)
        pre = torch.sigmoid(F.linear(flat, self.hc_fn.float()) * self.hc_scale.float() + self.hc_base.float())
        return ((pre + self.hc_eps).unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)


class SharedExpert(nn.Module):
    """w2(silu(w1 x clamped above) * (w3 x clamped both sides)) (transformers' DeepseekV4MLP)."""

    def __init__(self, hidden_size: int, intermediate_size: int, limit: float):
        super().__init__()
        self.limit = limit
        self.w1 = Linear(hidden_size, intermediate_size)
        self.w2 = Linear(intermediate_size, hidden_size)
        self.w3 = Linear(hidden_size, intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.w1(x).clamp(max=self.limit)
        return self.w2(F.silu(gate) * self.w3(x).clamp(min=-self.limit, max=self.limit))


class Gate(nn.Module):
    """Router (checkpoint `ffn.gate.weight`, `ffn.gate.bias` the correction bias, or `ffn.gate.tid2eid` for a hash
    layer); scores and weights in float32."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, scoring: str, scaling: float, hashed: bool,
                 vocab_size: int):
        super().__init__()
        self.top_k, self.score, self.scaling, self.hashed = top_k, SCORING[scoring], scaling, hashed
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        if hashed:
            self.tid2eid = nn.Parameter(torch.zeros(vocab_size, top_k, dtype=torch.long), requires_grad=False)
        else:
            self.bias = nn.Parameter(torch.zeros(num_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = self.score(F.linear(x.float(), self.weight.float()))
        if self.hashed:
            ids = self.tid2eid[input_ids].long()
        else:
            ids = torch.topk(scores + self.bias.float(), self.top_k, dim=-1).indices
        weights = scores.gather(1, ids)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scaling, ids


class MoE(nn.Module):
    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int, scoring: str,
                 scaling: float, limit: float, hashed: bool, vocab_size: int):
        super().__init__()
        self.gate = Gate(hidden_size, num_experts, top_k, scoring, scaling, hashed, vocab_size)
        self.experts = FusedExperts(num_experts, hidden_size, intermediate_size, "silu", silu_limit=limit)
        self.shared_experts = SharedExpert(hidden_size, intermediate_size, limit)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x, input_ids)
        return self.experts(x, weights, ids) + self.shared_experts(x)


class DeepseekV4DecoderLayer(nn.Module):
    def __init__(self, attn: DSV4Attention, ffn: MoE, hidden_size: int, hc: tuple[int, int, float], eps: float):
        super().__init__()
        n, iters, hc_eps = hc
        self.attn, self.ffn = attn, ffn
        self.attn_norm = Float32RMSNorm(hidden_size, eps)
        self.ffn_norm = Float32RMSNorm(hidden_size, eps)
        self.hc_attn = HyperConnection(n, hidden_size, iters, hc_eps, eps)
        self.hc_ffn = HyperConnection(n, hidden_size, iters, hc_eps, eps)

    def forward(self, positions: torch.Tensor, input_ids: torch.Tensor, streams: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        post, comb, x = self.hc_attn(streams)
        streams = HyperConnection.expand(streams, self.attn(positions, self.attn_norm(x), kv_cache, meta), post, comb)
        post, comb, x = self.hc_ffn(streams)
        return HyperConnection.expand(streams, self.ffn(self.ffn_norm(x), input_ids), post, comb)


def _refuse_unsupported(cfg: ModelConfig) -> None:
    raw, where = cfg.raw, cfg.path / "config.json"
    # (V4's published checkpoints are FP8 with FP4 experts: refused by name, never dequantized approximately)
    refuse_quantized(raw, cfg.path, f"{cfg.architecture} checkpoint")
    mp = current()
    if mp.tp_size > 1 or mp.pp_size > 1:
        raise UnsupportedModelError(f"{cfg.path}: DeepSeek-V4 is served on one device only (tensor and pipeline "
                                    "parallelism are not implemented for its attention and hyper-connections)")
    scoring = raw.get("scoring_func", "sqrtsoftplus")
    if scoring not in SCORING:
        raise UnsupportedModelError(f"{where}: DeepSeek-V4 router scoring_func={scoring!r} is not supported "
                                    f"(served: {', '.join(SCORING)})")
    if raw.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"{where}: DeepSeek-V4 with hidden_act={raw.get('hidden_act')!r} is not supported "
                                    "(silu only)")
    for key in ("attention_bias", "mlp_bias"):
        if raw.get(key):
            raise UnsupportedModelError(f"{where}: DeepSeek-V4 with {key}=true is not supported (transformers' "
                                        "deepseek_v4 has no such biases)")


class DeepseekV4ForCausalLM(CausalLM):
    # (FP8 / FP4 checkpoints are refused above)
    supports_fp8_linear = False
    cuda_graph_blocker = ("its attention runs the exact PyTorch reference, which reads the step's lengths on the "
                          "host")
    hidden_capture_blocker = ("DeepSeek-V4's residual stream is hc_mult hyper-connection streams, not one hidden "
                              "state a layer: what a drafter trained on other models reads is not defined for it")

    def capture_blocker(self, layers: tuple[int, ...], reads_mtp_input: bool) -> str:
        # (its own MTP module reads the last layer's streams, flattened: captured_width)
        if reads_mtp_input and tuple(layers) == (self.num_layers - 1,):
            return ""
        return self.hidden_capture_blocker

    def captured_width(self) -> int:
        return self.hc_mult * self.config.hidden_size

    def __init__(self, cfg: ModelConfig, max_positions: int):
        super().__init__()
        _refuse_unsupported(cfg)
        self.config = cfg
        where = cfg.path / "config.json"
        hf = _hf_config(cfg)
        n_layers, d = cfg.num_hidden_layers, cfg.hidden_size
        self.layer_types, self.mlp_layer_types = list(hf.layer_types), list(hf.mlp_layer_types)
        rates = dict(hf.compress_rates)
        head_dim, rope_dim = int(hf.head_dim), int(hf.qk_rope_head_dim)
        if rope_dim % 2 or not 0 < rope_dim <= head_dim or rope_dim > int(hf.index_head_dim):
            raise ModelLoadError(f"malformed checkpoint: {where} rope dims {rope_dim} must be even and fit head_dim "
                                 f"{head_dim} and index_head_dim {hf.index_head_dim}")
        if int(hf.num_key_value_heads) != 1:
            raise ModelLoadError(f"malformed checkpoint: {where} num_key_value_heads must be 1 (V4's shared-KV "
                                 f"attention), got {hf.num_key_value_heads}")
        for t in set(self.layer_types) - {SLIDING}:
            if not isinstance(rates.get(t), int) or rates[t] <= 0:
                raise ModelLoadError(f"malformed checkpoint: {where} compress_rates[{t!r}] must be a positive integer")
        ropes = _ropes(cfg, hf, max_positions)
        self._hf = hf
        eps = cfg.rms_norm_eps
        hashed = {i for i, t in enumerate(self.mlp_layer_types) if t == "hash_moe"}
        index = (int(hf.index_n_heads), int(hf.index_head_dim), int(hf.index_topk))

        def layer(i: int) -> DeepseekV4DecoderLayer:
            t = self.layer_types[i]
            return _decoder_layer(cfg, hf, t, rates.get(t, 0), ropes["main" if t == SLIDING else "compress"],
                                  index if t == CSA else None, i in hashed)

        self.hc_mult = int(hf.hc_mult)
        self.model = nn.Module()
        self.model.embed_tokens = VocabEmbedding(cfg.vocab_size, d)
        self.model.layers = make_layers(n_layers, layer)
        self.model.norm = Float32RMSNorm(d, eps)
        self.model.hc_head = HyperHead(self.hc_mult, d, float(hf.hc_eps), eps)
        tied = self.model.embed_tokens if cfg.tie_word_embeddings else None
        self.lm_head = LMHead(cfg.vocab_size, d, tied_to=tied)

    @property
    def num_layers(self) -> int:
        return len(self.model.layers)

    def kv_cache_specs(self) -> list[DSV4CacheSpec]:
        return [layer.attn.cache_spec() for layer in self.model.layers]

    def supports_cuda_graphs(self, dtype: torch.dtype, device: torch.device) -> bool:
        return False

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: AttentionMetadata, capture_layers: tuple[int, ...] = (),
                intermediate: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        if intermediate is not None or (capture_layers and self.capture_blocker(capture_layers, True)):
            # (the engine refuses such drafters at start-up)
            raise UnsupportedModelError(f"{self.config.path}: {self.hidden_capture_blocker}")
        x = self.model.embed_tokens(input_ids)
        streams = x.unsqueeze(1).expand(-1, self.hc_mult, -1).contiguous()
        for i, layer in enumerate(self.model.layers):
            streams = layer(positions, input_ids, streams, kv_caches[i], meta)
        # (the MTP module reads the last layer's streams before the head's collapse, [T, hc_mult * D])
        captured = streams.flatten(1) if capture_layers else None
        return self.model.norm(self.model.hc_head(streams)), captured

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return self.lm_head(hidden, out=out)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        cfg = self.config
        skipped_mtp = 0

        def named() -> Iterable[tuple[str, torch.Tensor]]:
            nonlocal skipped_mtp
            for name, tensor in weights:
                base = name.removeprefix("model.")
                if base.startswith("mtp."):
                    skipped_mtp += 1
                    continue
                base = {"embed.weight": "embed_tokens.weight", "head.weight": "lm_head.weight",
                        "hc_head_fn": "hc_head.hc_fn", "hc_head_base": "hc_head.hc_base",
                        "hc_head_scale": "hc_head.hc_scale"}.get(base, base)
                if base == "lm_head.weight":
                    if cfg.tie_word_embeddings:
                        continue
                    yield base, tensor
                    continue
                base = re.sub(r"\.hc_(attn|ffn)_(fn|base|scale)$", r".hc_\1.\2", base)
                yield f"model.{base}", tensor

        load_named_weights(self, named(), [], mapper=_fused_expert, strict=True)
        missing = [f"{name}.{piece}" for name, m in self.named_modules() if isinstance(m, FusedExperts)
                   for piece in m.missing_shards()]
        if missing:
            raise ModelLoadError(f"malformed checkpoint {cfg.path}: missing weight(s) {', '.join(missing[:5])}")
        for layer in self.model.layers:
            gate = layer.ffn.gate
            if gate.hashed and not (int(gate.tid2eid.min()) >= 0 and int(gate.tid2eid.max()) < gate.weight.shape[0]):
                raise ModelLoadError(f"malformed checkpoint {cfg.path}: a hash layer's tid2eid names an expert "
                                     f"outside the {gate.weight.shape[0]} routed experts")
        if skipped_mtp:
            logger.info("%s: not loading the %d tensors of its MTP module (mtp.*) into the model: --speculative mtp "
                        "loads them as its drafter", cfg.path, skipped_mtp)

    @property
    def num_mtp_modules(self) -> int:
        return int(self.config.raw.get("num_nextn_predict_layers") or 0)

    # (its MTP module's logits are the model's LM head: the published checkpoints carry no head of its own)
    mtp_uses_target_head = True

    def build_mtp(self, max_positions: int, embedding: VocabEmbedding | None = None,
                  lm_head: nn.Module | None = None) -> DeepseekV4MTP:
        """The MTP module (mtp.0.*), without weights (MTPProposer loads them); `embedding` and `lm_head`: whole
        copies of the target's in place of the model's."""
        return DeepseekV4MTP(self.config, self._hf, _ropes(self.config, self._hf, max_positions)["main"],
                             embedding if embedding is not None else self.model.embed_tokens,
                             lm_head if lm_head is not None else self.lm_head)  # (one device only: whole)


def _ropes(cfg: ModelConfig, hf: SimpleNamespace, max_positions: int) -> dict[str, RotaryEmbedding]:
    """The "main" (sliding-only layers) and "compress" RoPE of the config's rope_parameters."""
    ropes = {}
    for label, params in hf.rope_parameters.items():
        if isinstance(params, dict):
            rope = _parse_rope({"rope_parameters": {**params, "partial_rotary_factor": 1.0},
                                "max_position_embeddings": cfg.max_position_embeddings})
            ropes[label] = RotaryEmbedding(int(hf.qk_rope_head_dim), rope, max_positions, cfg.max_position_embeddings,
                                           is_neox_style=False)
    return ropes


def _decoder_layer(cfg: ModelConfig, hf: SimpleNamespace, layer_type: str, rate: int, rotary: RotaryEmbedding,
                   index: tuple[int, int, int] | None, hashed: bool) -> DeepseekV4DecoderLayer:
    d, eps = cfg.hidden_size, cfg.rms_norm_eps
    attn = DSV4Attention(d, cfg.num_attention_heads, int(hf.head_dim), int(hf.q_lora_rank), int(hf.o_groups),
                         int(hf.o_lora_rank), eps, layer_type, int(hf.sliding_window), rate, rotary, index)
    ffn = MoE(d, int(hf.n_routed_experts), int(hf.num_experts_per_tok), int(hf.moe_intermediate_size),
              str(hf.scoring_func), float(hf.routed_scaling_factor), float(hf.swiglu_limit), hashed, cfg.vocab_size)
    return DeepseekV4DecoderLayer(attn, ffn, d, (int(hf.hc_mult), int(hf.hc_sinkhorn_iters), float(hf.hc_eps)), eps)


class DeepseekV4MTP(MTPModule):
    """DeepSeek-V4's multi-token-prediction module (`mtp.0.*`). transformers does not build it; this follows the
    module as vLLM (deepseek_v4_mtp.py) and SGLang (deepseek_v4_nextn.py) run it, on which they agree: for row i,
    the target's last-layer hyper-connection streams H_i [hc_mult, D] (before the final head's collapse) and the
    token t_{i+1} after it ->

        S = h_proj(hnorm(H_i)) + e_proj(enorm(embed(t_{i+1})))      (e broadcast over the streams)
        U_i = block(S) at position i                               (one V4 decoder layer: sliding-window attention
                                                                    only (no compressed branch), a routed MoE with
                                                                    its correction bias, its own hyper-connections)

    whose logits are the target's LM head over norm(hc_head(U_i)) (its own hc_head and norm), predicting t_{i+2}.
    Chained drafting feeds U_i, flattened, back as the next row's streams. The embedding and the head are the
    target's (the published checkpoints carry none for the module; a copy they carry is used where it differs).
    Where the two references differ (vLLM zeroes the embedding of position 0's row, SGLang does not), this does
    as SGLang and Atlas's other MTP modules do: nothing."""

    weight_prefix = "mtp.0."
    _OWN = ("enorm.", "hnorm.", "e_proj.", "h_proj.", "norm.")

    def __init__(self, cfg: ModelConfig, hf: SimpleNamespace, rotary: RotaryEmbedding, target_embed: VocabEmbedding,
                 lm_head: nn.Module):
        super().__init__()
        self.config = cfg
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.hc_mult = int(hf.hc_mult)
        self.enorm = Float32RMSNorm(d, eps)
        self.hnorm = Float32RMSNorm(d, eps)
        self.e_proj = Linear(d, d)
        self.h_proj = Linear(d, d)
        self.block = _decoder_layer(cfg, hf, SLIDING, 0, rotary, None, hashed=False)
        self.hc_head = HyperHead(self.hc_mult, d, float(hf.hc_eps), eps)
        self.norm = Float32RMSNorm(d, eps)
        self.share_target(nn.Identity(), target_embed, lm_head=lm_head)

    @property
    def input_width(self) -> int:
        return self.hc_mult * self.config.hidden_size

    def kv_cache_specs(self) -> list[DSV4CacheSpec]:
        return [self.block.attn.cache_spec()]

    def target_hidden(self, captured: torch.Tensor) -> torch.Tensor:
        return captured  # (the streams as captured: the module normalises each one itself)

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        """Tokens t_{i+1} [T], streams H_i [T, hc_mult * D] (the target's, or a previous U) at positions i -> U
        [T, hc_mult * D]."""
        t, n, d = input_ids.shape[0], self.hc_mult, self.config.hidden_size
        e = self.e_proj(self.enorm(self.embed(input_ids)))
        h = self.h_proj(self.hnorm(hidden.to(e.dtype).reshape(t * n, d))).view(t, n, d)
        streams = self.block(positions, input_ids, h + e.unsqueeze(1), kv_caches[0], meta)
        return streams.reshape(t, n * d)

    def head_input(self, u: torch.Tensor) -> torch.Tensor:
        return self.norm(self.hc_head(u.view(u.shape[0], self.hc_mult, self.config.hidden_size)))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """DeepSeek's names under mtp.0.: its own norms and projections, hc_head_*, and the decoder layer's names
        as the model's layers have them (attn.*, ffn.*, attn_norm, ffn_norm, hc_attn_*, hc_ffn_*)."""
        def renamed(own: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
            for rest, tensor in own:
                if rest == "emb.tok_emb.weight":
                    self._adopt_embedding(tensor, rest)
                    continue
                if rest == "head.weight":
                    self._adopt_head(tensor)
                    continue
                m = re.fullmatch(r"hc_head_(fn|base|scale)", rest)
                if m:
                    yield f"hc_head.hc_{m.group(1)}", tensor
                    continue
                if rest.startswith(self._OWN):
                    yield rest, tensor
                    continue
                yield "block." + re.sub(r"^hc_(attn|ffn)_(fn|base|scale)$", r"hc_\1.\2", rest), tensor

        self.load_module(weights, lambda own: load_named_weights(self, renamed(own), [], mapper=_fused_expert, strict=True))
        missing = [f"block.ffn.experts.{piece}" for piece in self.block.ffn.experts.missing_shards()]
        if missing:
            raise ModelLoadError(f"malformed checkpoint {self.config.path}: missing MTP weight(s) "
                                 f"{', '.join(missing[:5])}")



# transformers' DeepseekV4Config defaults (configuration_deepseek_v4.py): a config.json that leaves a field out means
# these values.
_DEFAULTS = dict(head_dim=512, q_lora_rank=1024, num_key_value_heads=1, num_experts_per_tok=6, n_routed_experts=256,
                 n_shared_experts=1, scoring_func="sqrtsoftplus", routed_scaling_factor=1.5, moe_intermediate_size=2048,
                 rope_theta=10000.0, compress_rope_theta=160000.0, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6,
                 swiglu_limit=10.0, sliding_window=128, o_groups=8, o_lora_rank=1024, index_n_heads=64,
                 index_head_dim=128, index_topk=512)
_DEFAULT_RATES = {CSA: 4, HCA: 128}
_RATIO_TO_TYPE = {0: SLIDING, 4: CSA, 128: HCA}
_NUM_HASH_LAYERS = 3


def _hf_config(cfg: ModelConfig) -> SimpleNamespace:
    """V4's settings as transformers' DeepseekV4Config.__post_init__ resolves them: compress_rates (legacy
    compress_rate_csa / _hca folded in), layer_types (explicit, else legacy per-layer compress_ratios 0 / 4 / 128,
    else 2 HCA then CSA / HCA alternating), mlp_layer_types (num_hash_layers, default 3, hash_moe first), the rope
    dims (partial_rotary_factor, else legacy qk_rope_head_dim / head_dim, else 64 / 512) and the two RoPE settings
    ("main": rope_theta, plain; "compress": compress_rope_theta with the checkpoint's scaling, YaRN's
    attention_factor 1.0 unless given)."""
    raw, where, n = cfg.raw, cfg.path / "config.json", cfg.num_hidden_layers
    s = SimpleNamespace(**{k: raw.get(k, v) if raw.get(k) is not None else v for k, v in _DEFAULTS.items()})
    rates = dict(_DEFAULT_RATES)
    rates.update(raw.get("compress_rates") or {})
    if raw.get("compress_rate_csa") is not None:
        rates[CSA] = raw["compress_rate_csa"]
    if raw.get("compress_rate_hca") is not None:
        rates[HCA] = raw["compress_rate_hca"]
    s.compress_rates = rates
    types = raw.get("layer_types")
    if types is None and raw.get("compress_ratios") is not None:
        try:
            types = [_RATIO_TO_TYPE[r] for r in raw["compress_ratios"]]
        except (KeyError, TypeError) as exc:
            raise ModelLoadError(f"malformed checkpoint: {where} compress_ratios must hold 0, 4 or 128 per layer") from exc
    if types is None:
        types = [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
    mlp_types = raw.get("mlp_layer_types")
    if mlp_types is None:
        n_hash = raw.get("num_hash_layers", _NUM_HASH_LAYERS)
        mlp_types = ["hash_moe"] * min(n, n_hash) + ["moe"] * max(0, n - n_hash)
    s.layer_types, s.mlp_layer_types = list(types[:n]), list(mlp_types[:n])
    for name, got, allowed in (("layer_types", s.layer_types, (SLIDING, CSA, HCA)),
                               ("mlp_layer_types", s.mlp_layer_types, ("hash_moe", "moe"))):
        if len(got) != n or any(t not in allowed for t in got):
            raise ModelLoadError(f"malformed checkpoint: {where} {name} must give one of {allowed} for each of the {n} "
                                 f"layers, got {got}")
    partial = raw.get("partial_rotary_factor")
    if partial is None:
        partial = raw["qk_rope_head_dim"] / s.head_dim if raw.get("qk_rope_head_dim") is not None else 64 / 512
    s.qk_rope_head_dim = int(s.head_dim * partial)
    rp = {**(raw.get("rope_scaling") or {}), **(raw.get("rope_parameters") or {})}
    if isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
        s.rope_parameters = {"main": rp["main"], "compress": rp["compress"]}
    else:
        scaling = {k: v for k, v in rp.items() if k not in ("main", "compress", "rope_theta")}
        compress = {**scaling, "rope_theta": s.compress_rope_theta}
        compress["rope_type"] = compress.get("rope_type") or compress.pop("type", None) or "default"
        if compress["rope_type"] == "yarn":
            compress.setdefault("attention_factor", 1.0)
        s.rope_parameters = {"main": {"rope_type": "default", "rope_theta": s.rope_theta}, "compress": compress}
    return s
