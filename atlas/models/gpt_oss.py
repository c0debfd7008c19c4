"""gpt-oss (GptOssForCausalLM, model_type gpt_oss): OpenAI's open-weight mixture-of-experts models, 20B and 120B.

Facts from transformers' models/gpt_oss (modeling and configuration) and integrations/mxfp4.py:
- pre-norm decoder layers (RMSNorm whose weight scales in float32 before the one rounding: layers.norm
  .Float32ScaledRMSNorm; eps 1e-5 by default);
- GQA attention with q/k/v/o biases (attention_bias, true by default), scaled by head_dim ** -0.5, RoPE on the two
  halves of each head (YaRN in the published configs: factor 32 over 4096 positions, beta_fast 32, beta_slow 1,
  truncate false, theta 150000; layers/rotary.py), and **attention sinks**: a learned logit per query head
  (`self_attn.sinks`) that joins every row's softmax denominator (kernels/paged_attention*.py);
- alternating sliding-window (window `sliding_window`, 128) and full-attention layers by `layer_types` (by default
  even layers sliding, odd ones full). The full layers keep every KV page; the sliding ones keep theirs in a pool of
  their own whose pages below the window go back as the sequence advances (KV cache groups, as Gemma 3's:
  engine/kv_groups.py);
- every layer's MLP is a mixture of experts: a router (linear with bias, in the model dtype) whose top-k logits
  are softmaxed (over the chosen experts only), and experts with biases and a clamped SwiGLU: gate clamped above at
  swiglu_limit (7.0), up clamped to +-swiglu_limit, (up + 1) * gate * sigmoid(swiglu_alpha (1.702) * gate)
  (kernels/moe.clamped_swiglu);
- the experts are stacked in the checkpoint: `mlp.experts.gate_up_proj` [E, D, 2I] (x @ W: input dim first) with
  gate and up *interleaved* along the last dim (gate at even columns), `gate_up_proj_bias` [E, 2I] alike,
  `down_proj` [E, I, D], `down_proj_bias` [E, D]. The published checkpoints store gate_up_proj and down_proj in
  MXFP4 (quantization_config quant_method mxfp4): `*_blocks` uint8 [E, N, K / 32, 16] (two FP4 E2M1 values a byte,
  low nibble first) and `*_scales` uint8 [E, N, K / 32] (E8M0 exponents, 2^(s - 127)) in the [E, out, in] layout.
  The experts keep them (FusedExperts' MXFP4 form: the blocks viewed as uint8 [E, N, K / 2], the scales beside
  them; half a byte a weight) on CUDA with Triton, whose expert kernels dequantize each tile in registers
  (kernels/moe_triton.py), and on the CPU, where forward dequantizes them per call (dequantize_mxfp4's
  numbers: the logits of the dequantized checkpoint). Where the form cannot be used they are dequantized as
  they load, exactly, to the model dtype (kernels/mxfp4.dequantize_mxfp4), with a warning naming why
  (layers/moe.mxfp4_unusable: a hidden size or a rank's intermediate size that is not a multiple of 32, e.g.
  gpt-oss's 2880 over 4 or 8 tensor-parallel ranks, or CUDA without Triton): then memory and speed are those
  of the dequantized model (gpt-oss-20b in bf16: ~42 GB of weights; -120b: ~234 GB). A float16 model checks
  that every value fits float16 exactly either way. --load-format dummy draws MXFP4 codes too.

Numerics against the reference: in float32 the same function. In bf16 the router's logits and top-k softmax are
computed in the model dtype as transformers does (the choice of experts matches), the experts' weighted sum in
float32 (transformers adds expert by expert in bf16).

Tensor parallelism as the Llama family's: heads (and their sinks) and every expert's intermediate dimension (or
whole experts with --enable-expert-parallel) per rank; the biased o_proj reduces itself, the expert block
all-reduces once (its down bias added on one rank).
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Iterable

import torch
from torch import nn

from atlas.config import ModelConfig, RopeConfig
from atlas.errors import ModelLoadError
from atlas.kernels import gemv
from atlas.kernels.fused_ops import qk_norm_rope_kv_write
from atlas.layers.attention import AttentionMetadata, PagedAttention
from atlas.layers.embedding import LMHead, VocabEmbedding
from atlas.layers.linear import QKVParallelLinear, RowParallelLinear, loaded_shape, materialize, narrow_loaded
from atlas.layers.moe import (
    MXFP4_ASKED_OFF,
    FusedExperts,
    fused_routing,
    local_intermediate_size,
    mxfp4_unusable,
)
from atlas.layers.norm import Float32ScaledRMSNorm
from atlas.layers.parallel import current
from atlas.layers.rotary import RotaryEmbedding
from atlas.models.base import load_named_weights, make_layers, renamed_weights
from atlas.models.llama import LlamaForCausalLM
from atlas.models.quantization import check_mxfp4, dequantize_mxfp4, is_mxfp4
from atlas.models.sparse_moe import SparseMoeForCausalLM

logger = logging.getLogger(__name__)

SLIDING, FULL = "sliding_attention", "full_attention"
# transformers' GptOssConfig defaults, for fields a config.json may leave out.
DEFAULTS = dict(sliding_window=128, swiglu_alpha=1.702, swiglu_limit=7.0, attention_bias=True, rms_norm_eps=1e-5,
                head_dim=64, rope_theta=150000.0, max_position_embeddings=131072)
DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096}
_EXPERTS = re.compile(r"(.*\.mlp\.experts)\.(gate_up_proj|down_proj)(_bias|_blocks|_scales)?$")


def _where(cfg: ModelConfig) -> str:
    return str(cfg.path / "config.json")


def _number(cfg: ModelConfig, key: str) -> float:
    value = cfg.raw.get(key)
    if value is None:
        return float(DEFAULTS[key])
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
        raise ModelLoadError(f"malformed checkpoint: {_where(cfg)} field {key!r} must be a positive number, got "
                             f"{value!r}")
    return float(value)


def _count(cfg: ModelConfig, *keys: str) -> int:
    """The first of `keys` present in config.json, a positive integer."""
    for key in keys:
        value = cfg.raw.get(key)
        if value is not None:
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ModelLoadError(f"malformed checkpoint: {_where(cfg)} field {key!r} must be a positive integer, "
                                     f"got {value!r}")
            return value
    raise ModelLoadError(f"malformed checkpoint: {_where(cfg)} has no {keys[0]!r} field")


def gpt_oss_config(cfg: ModelConfig) -> ModelConfig:
    """cfg with gpt-oss's defaults where config.json leaves a field out (head_dim 64, rms_norm_eps 1e-5, untied
    LM head, 131072 positions, YaRN RoPE over theta 150000)."""
    raw = cfg.raw
    rope = cfg.rope
    if not (raw.get("rope_parameters") or raw.get("rope_scaling")):
        theta = raw.get("rope_theta", DEFAULTS["rope_theta"])
        rope = RopeConfig(theta=float(theta), rope_type="yarn", params=dict(DEFAULT_ROPE, rope_theta=theta))
    elif "rope_theta" not in raw and "rope_theta" not in (raw.get("rope_parameters") or {}):
        rope = dataclasses.replace(rope, theta=DEFAULTS["rope_theta"])
    return dataclasses.replace(
        cfg, rope=rope, head_dim=int(raw.get("head_dim") or DEFAULTS["head_dim"]),
        rms_norm_eps=_number(cfg, "rms_norm_eps"), tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        max_position_embeddings=int(raw.get("max_position_embeddings") or DEFAULTS["max_position_embeddings"]))


def gpt_oss_windows(cfg: ModelConfig) -> list[int | None]:
    """Each layer's sliding window (None: a full-attention layer), from layer_types (by default even layers
    sliding, odd ones full)."""
    n = cfg.num_hidden_layers
    types = cfg.raw.get("layer_types")
    if types is None:
        types = [SLIDING if (i + 1) % 2 else FULL for i in range(n)]
    if not isinstance(types, list) or len(types) != n or any(t not in (SLIDING, FULL) for t in types):
        raise ModelLoadError(f"malformed checkpoint: {_where(cfg)} layer_types must give {n} entries of "
                             f"{SLIDING!r} or {FULL!r}, got {types!r}")
    window = cfg.raw.get("sliding_window", DEFAULTS["sliding_window"])
    if SLIDING in types and (not isinstance(window, int) or isinstance(window, bool) or window <= 0):
        raise ModelLoadError(f"malformed checkpoint: {_where(cfg)} field 'sliding_window' must be a positive integer "
                             f"where layer_types has sliding layers, got {window!r}")
    return [window if t == SLIDING else None for t in types]


class GptOssAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, window: int | None, rotary: RotaryEmbedding):
        super().__init__()
        self.head_dim = cfg.head_dim
        bias = bool(cfg.raw.get("attention_bias", DEFAULTS["attention_bias"]))
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, self.head_dim, cfg.num_attention_heads,
                                          cfg.num_key_value_heads, bias=bias)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        # (a biased row-parallel projection reduces itself: the bias follows the sum)
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * self.head_dim, cfg.hidden_size, bias=bias)
        # This rank's heads' sink logits.
        mp = current()
        self.tp_rank, self.tp_size = mp.tp_rank, mp.tp_size
        self.sinks = nn.Parameter(torch.empty(self.num_heads))
        self.sinks.weight_loader = self._load_sinks
        self.rotary = rotary
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim, scale=self.head_dim ** -0.5,
                                   sliding_window=window)

    def _load_sinks(self, param: nn.Parameter, loaded) -> None:
        full = self.num_heads * self.tp_size
        if loaded_shape(loaded) != (full,):
            raise ValueError(f"shape mismatch: expected ({full},), got {loaded_shape(loaded)}")
        param.data.copy_(narrow_loaded(loaded, 0, self.tp_rank * self.num_heads, self.num_heads))

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        if meta.windowed is not None:  # (KV cache groups: a sliding layer reads and writes its group's pages)
            meta = meta.for_layer(self.attn.sliding_window)
        rotary = self.rotary
        q = qk_norm_rope_kv_write(self.qkv_proj(x), positions, rotary.cos_cache, rotary.sin_cache, self.num_heads,
                                  self.num_kv_heads, self.head_dim, None, None, 0.0, rotary.rotary_dim,
                                  rotary.is_neox_style, kv_cache, meta.slot_mapping)
        out = self.attn.attend(q, kv_cache, meta, sinks=self.sinks)
        return self.o_proj(out.view(-1, self.num_heads * self.head_dim))


class GptOssRouter(nn.Module):
    """`mlp.router.weight` [E, D] and `.bias` [E], in the model dtype as the reference computes them: top-k of the
    logits, softmax over the k chosen."""

    gemv_weight = True  # (a single row's logits through the small-M GEMV: layers/moe.py's TopKRouter says why)

    def __init__(self, hidden_size: int, num_experts: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.bias = nn.Parameter(torch.empty(num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, D] -> (weights [T, k] float32, expert ids [T, k])."""
        logits = gemv.linear(x, self.weight, self.bias)
        if fused_routing(logits):
            from atlas.kernels.moe_routing_triton import select_topk

            return select_topk(logits, self.top_k, "softmax_chosen")
        values, ids = logits.topk(self.top_k, dim=-1)
        return values.softmax(dim=-1).float(), ids


class GptOssMoE(nn.Module):
    def __init__(self, cfg: ModelConfig, num_experts: int, top_k: int, swiglu: tuple[float, float],
                 mxfp4: bool):
        super().__init__()
        self.mp = current()
        self.router = GptOssRouter(cfg.hidden_size, num_experts, top_k)
        self.experts = FusedExperts(num_experts, cfg.hidden_size, cfg.intermediate_size, "silu", bias=True,
                                    swiglu=swiglu, mxfp4=mxfp4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.router(x)
        return self.mp.all_reduce(self.experts(x, weights, ids))


class GptOssDecoderLayer(nn.Module):
    # (LlamaForCausalLM.forward's protocol: the outputs are reduced, the stream after the layer is their sum)
    output_partial = False

    def __init__(self, cfg: ModelConfig, window: int | None, rotary: RotaryEmbedding, num_experts: int, top_k: int,
                 swiglu: tuple[float, float], mxfp4: bool):
        super().__init__()
        self.input_layernorm = Float32ScaledRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = GptOssAttention(cfg, window, rotary)
        self.post_attention_layernorm = Float32ScaledRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GptOssMoE(cfg, num_experts, top_k, swiglu, mxfp4)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                kv_cache: torch.Tensor, meta: AttentionMetadata, x_partial: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, residual) -> (this layer's MoE output, the stream before it); the stream after the layer is their
        sum (the first layer: residual None, x the embedding)."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm(x, residual)
        h, residual = self.post_attention_layernorm(self.self_attn(positions, h, kv_cache, meta), residual)
        return self.mlp(h), residual


class GptOssModel(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int, mxfp4: bool = False):
        super().__init__()
        self.windows = gpt_oss_windows(cfg)
        num_experts = _count(cfg, "num_local_experts", "num_experts")
        top_k = _count(cfg, "num_experts_per_tok", "experts_per_token")
        if top_k > num_experts:
            raise ModelLoadError(f"malformed checkpoint: num_experts_per_tok={top_k} is more than the {num_experts} "
                                 f"experts ({_where(cfg)})")
        swiglu = (_number(cfg, "swiglu_alpha"), _number(cfg, "swiglu_limit"))
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size)
        rotary = RotaryEmbedding(cfg.head_dim, cfg.rope, max_positions, cfg.max_position_embeddings)
        self.layers = make_layers(cfg.num_hidden_layers, lambda i: GptOssDecoderLayer(
            cfg, self.windows[i], rotary, num_experts, top_k, swiglu, mxfp4))
        self.norm = Float32ScaledRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mp = current()


class GptOssForCausalLM(LlamaForCausalLM):
    """Llama's forward loop, cache specs and vocabulary over gpt-oss's layers (module docstring)."""

    supports_pooling = False
    # --enable-lora: adapters on the attention projections (the MXFP4 experts take none)
    lora_layers: tuple[str, ...] = ("qkv_proj", "o_proj")
    supports_fp8_linear = False
    # models/quantization.refuse_quantized lets this class's MXFP4 checkpoints through: the experts keep them
    # (mxfp4_experts) or load_weights dequantizes them.
    loads_mxfp4_experts = True
    stacked_params = [("q_proj", "qkv_proj", "q"), ("k_proj", "qkv_proj", "k"), ("v_proj", "qkv_proj", "v")]
    cuda_graph_blocker = SparseMoeForCausalLM.cuda_graph_blocker
    supports_cuda_graphs = SparseMoeForCausalLM.supports_cuda_graphs

    def __init__(self, cfg: ModelConfig, max_positions: int):
        nn.Module.__init__(self)
        cfg = gpt_oss_config(cfg)
        self.config = cfg
        mxfp4, self.mxfp4_fallback = self._mxfp4_form(cfg)
        self.model = GptOssModel(cfg, max_positions, mxfp4)
        self.lm_head = LMHead(cfg.vocab_size, cfg.hidden_size,
                              tied_to=self.model.embed_tokens if cfg.tie_word_embeddings else None)

    @property
    def mxfp4_experts(self) -> bool:
        """Whether the routed experts hold MXFP4 codes (chosen at construction; turned plain by a checkpoint
        whose expert tensors are floating point although its config says mxfp4)."""
        return any(m.mxfp4 for m in self.modules() if isinstance(m, FusedExperts))

    @staticmethod
    def _mxfp4_form(cfg: ModelConfig) -> tuple[bool, str | None]:
        """(whether the routed experts keep the checkpoint's MXFP4 codes, why not where an MXFP4 checkpoint's
        are dequantized as they load). Kept where layers/moe.mxfp4_unusable finds nothing against it on the
        device the model is built on (CUDA with Triton: the kernels; the CPU: dequantized per call, the same
        numbers)."""
        if not is_mxfp4(cfg.raw):
            return False, None
        device = torch.get_default_device()  # (constructing's device)
        reason = mxfp4_unusable(cfg.hidden_size, local_intermediate_size(cfg.intermediate_size), device)
        if reason is not None and device.type != "meta":
            (logger.info if reason == MXFP4_ASKED_OFF else logger.warning)("%s: the MXFP4 experts are dequantized to %s as they load: %s (their memory and "
                           "speed are those of the dequantized model)", cfg.path,
                           str(torch.get_default_dtype()).removeprefix("torch."), reason)
        return reason is None, reason

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        cfg = self.config
        mxfp4 = is_mxfp4(cfg.raw)
        # (from a stacked expert module: every pipeline stage holds some, the embedding only the first)
        stacks = {name: m for name, m in self.named_modules() if isinstance(m, FusedExperts)}
        anchor = next(iter(stacks.values()))
        device, dtype = anchor.w13.device, anchor.plain_dtype
        pending: dict[str, dict[str, torch.Tensor]] = {}

        def experts(name: str, tensor) -> Iterable[tuple[str, torch.Tensor]]:
            """A stacked expert tensor under the FusedExperts parameter that takes it, in its [E, out, in] layout;
            MXFP4 pairs dequantized once both halves are in (they may come in either order)."""
            m = _EXPERTS.match(name)
            prefix, proj, suffix = m.groups()
            target = f"{prefix}.{'w13' if proj == 'gate_up_proj' else 'w2'}"
            if suffix == "_bias":
                yield f"{prefix}.{'b13' if proj == 'gate_up_proj' else 'b2'}", tensor
            elif suffix is None:  # (unquantized: x @ W, the input dim first)
                yield target, materialize(tensor).transpose(-1, -2)
            else:
                pair = pending.setdefault(f"{prefix}.{proj}", {})
                pair[suffix] = materialize(tensor)
                if len(pair) == 2:
                    del pending[f"{prefix}.{proj}"]
                    if prefix in stacks and stacks[prefix].mxfp4:
                        yield from kept_mxfp4(target, pair["_blocks"], pair["_scales"], f"{prefix}.{proj}")
                    else:
                        yield target, dequantize_mxfp4(pair["_blocks"], pair["_scales"], dtype, device,
                                                       f"{prefix}.{proj}")

        def kept_mxfp4(target: str, blocks: torch.Tensor, scales: torch.Tensor, name: str):
            """The codes as the kernels read them (uint8 [E, N, K / 2]: the checkpoint's [E, N, K / 32, 16]
            viewed whole) and their scales, checked as dequantize_mxfp4 checks them: the E8M0 NaN code is
            refused, and in a dtype narrower than float32's range (float16) every value must fit exactly, as
            the kernels round each weight to the activations' dtype."""
            check_mxfp4(blocks, scales, name)
            if bool((scales == 255).any()):
                raise ModelLoadError(f"malformed MXFP4 checkpoint: {name}_scales holds the E8M0 NaN code 255")
            if dtype not in (torch.bfloat16, torch.float32):
                for e in range(blocks.shape[0]):  # (raises where a value does not fit; one expert at a time)
                    dequantize_mxfp4(blocks[e: e + 1], scales[e: e + 1], dtype, device, name)
            e, n, groups, half = blocks.shape
            yield target, blocks.reshape(e, n, groups * half)
            yield f"{target}_scales", scales

        def stream() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in renamed_weights(weights, tied_head=cfg.tie_word_embeddings):
                m = _EXPERTS.match(name)
                # (MXFP4 tensors of a checkpoint whose config.json does not say so go on, to be refused by name)
                if m is not None and (m.group(3) not in ("_blocks", "_scales") or mxfp4):
                    yield from experts(name, tensor)
                else:
                    yield name, tensor
            if pending:
                stem, pair = next(iter(pending.items()))
                have, lack = next(iter(pair)), ({"_blocks", "_scales"} - set(pair)).pop()
                raise ModelLoadError(f"malformed MXFP4 checkpoint {cfg.path}: {stem}{have} has no {stem}{lack} "
                                     f"({len(pending)} such tensor(s))")

        def mapper(name: str) -> tuple[str, object] | None:
            return (name, "interleaved") if name.endswith((".experts.w13", ".experts.b13", ".experts.w2",
                                                          ".experts.b2", ".experts.w13_scales",
                                                          ".experts.w2_scales")) else None

        load_named_weights(self, stream(), self.stacked_params, skip_suffixes=("rotary_emb.inv_freq",),
                           mapper=mapper, strict=True)
        missing = [f"{name}.{piece}" for name, m in self.named_modules() if isinstance(m, FusedExperts)
                   for piece in m.missing_shards()]
        if missing:
            raise ModelLoadError(f"malformed checkpoint {cfg.path}: missing expert weight(s), e.g. {missing[0]}")
