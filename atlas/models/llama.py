"""The Llama family: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM.

Pre-norm decoder blocks with GQA attention (RoPE, optional qkv bias, optional per-head q/k RMSNorm,
optional sliding window) and a SwiGLU MLP. The four architectures differ only in those switches.
Model math only: no scheduling, no sampling.

Tensor parallelism: each rank holds its query heads and KV heads (q|k|v column-parallel, o_proj
row-parallel) and its slice of the MLP (gate|up column-parallel, down_proj row-parallel), so a layer
all-reduces twice. Without biases both all-reduces are deferred to the norm that follows (the
post-attention norm, and the next layer's input norm or the final norm), which can run them in one
kernel with the residual add. Pipeline parallelism: a stage builds only its own decoder layers (`make_layers`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from atlas.config import ModelConfig, RopeConfig
from atlas.errors import ModelLoadError, UnsupportedModelError
from atlas.kernels.fused_ops import qk_norm_rope_kv_write
from atlas.layers.activation import gated_activation
from atlas.layers.attention import AttentionMetadata, PagedAttention
from atlas.layers.embedding import LMHead, VocabEmbedding
from atlas.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear, loaded_shape
from atlas.layers.norm import RMSNorm
from atlas.layers.parallel import current
from atlas.layers.rotary import RotaryEmbedding
from atlas.models.base import CausalLM, KVCacheSpec, language_model_weights, load_named_weights, make_layers


@dataclass
class LlamaVariant:
    """The switches that tell the four architectures apart."""

    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    sliding_windows: list[int | None]  # one entry per layer


def llama4_query_scaling(cfg: ModelConfig) -> tuple[float, int] | None:
    """Ministral 3's query temperature (its rope_parameters' llama_4_scaling_beta, as transformers' Ministral3 reads
    it): (beta, original_max_position_embeddings), each query scaled by 1 + beta * ln(1 + floor(p / original)) at
    position p; None without the key. Another model type whose config carries the key is refused: transformers'
    classes other than Ministral3's ignore it, vLLM applies it, so which is meant is unclear."""
    params = cfg.rope.params
    beta = params.get("llama_4_scaling_beta")
    if beta is None:
        return None
    where = cfg.path / "config.json"
    if cfg.model_type != "ministral3":
        raise UnsupportedModelError(f"llama_4_scaling_beta in {where} for model_type {cfg.model_type!r}: transformers "
                                    "applies it to Ministral 3 (model_type ministral3) only, vLLM to every Mistral, "
                                    "so which is meant is unclear")
    original = params.get("original_max_position_embeddings")
    if (not isinstance(beta, (int, float)) or isinstance(beta, bool)
            or not isinstance(original, int) or isinstance(original, bool) or original <= 0):
        raise ModelLoadError(f"malformed checkpoint: {where} llama_4_scaling_beta needs a number and a positive "
                             f"original_max_position_embeddings, got {beta!r} and {original!r}")
    return float(beta), original


def _positive_window(cfg: ModelConfig, value) -> int | None:
    """config.json's sliding_window: None (or 0, as some configs write "none"), else a positive integer."""
    if value is None or value == 0:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ModelLoadError(f"malformed checkpoint: {cfg.path / 'config.json'} field 'sliding_window' must be a "
                             f"positive integer or null, got {value!r}")
    return value


def _mistral_windows(cfg: ModelConfig) -> list[int | None]:
    """Mistral: `sliding_window` on every layer when set (transformers' MistralAttention; a `layer_types` list is
    not read there either)."""
    return [_positive_window(cfg, cfg.raw.get("sliding_window"))] * cfg.num_hidden_layers


def _qwen_windows(cfg: ModelConfig) -> list[int | None]:
    """Qwen2 / Qwen3: a window only with use_sliding_window, on the layers `layer_types` marks sliding_attention,
    by default those from max_window_layers (28) on (transformers' Qwen2Config / Qwen3Config)."""
    raw = cfg.raw
    window = _positive_window(cfg, raw.get("sliding_window")) if raw.get("use_sliding_window") else None
    if window is None:
        return [None] * cfg.num_hidden_layers
    types = raw.get("layer_types")
    if types is None:
        first = raw.get("max_window_layers", 28)
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(cfg.num_hidden_layers)]
    if len(types) != cfg.num_hidden_layers:
        raise ModelLoadError(f"malformed checkpoint: {cfg.path / 'config.json'} has {len(types)} layer_types for "
                             f"{cfg.num_hidden_layers} layers")
    return [window if t == "sliding_attention" else None for t in types]


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, variant: LlamaVariant, layer_idx: int, rotary: RotaryEmbedding,
                 reduce: bool = True):
        """reduce=False: under tensor parallelism the output is this rank's partial sum."""
        super().__init__()
        self.head_dim = cfg.head_dim
        # This rank's heads (all of them on one device).
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, self.head_dim, cfg.num_attention_heads,
                                          cfg.num_key_value_heads, bias=variant.qkv_bias)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        # (unreduced, the output goes straight to the next norm's all-reduce: `direct`)
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * self.head_dim, cfg.hidden_size, bias=variant.o_bias,
                                        reduce=reduce, direct=True)
        if variant.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.rotary = rotary
        self.layer_idx = layer_idx
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim, scale=self.head_dim ** -0.5,
                                   sliding_window=variant.sliding_windows[layer_idx])
        self.split = [q_size, kv_size, kv_size]
        self.query_scaling = llama4_query_scaling(cfg)  # (Ministral 3's, else None)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        if meta.windowed is not None:  # (KV cache groups: a windowed layer reads and writes its group's pages)
            meta = meta.for_layer(self.attn.sliding_window)
        # One kernel between the projection and attention: q/k norm, RoPE, and the K/V cache write.
        rotary = self.rotary
        q = qk_norm_rope_kv_write(
            self.qkv_proj(x), positions, rotary.cos_cache, rotary.sin_cache, self.num_heads, self.num_kv_heads,
            self.head_dim, self.q_norm.weight if self.q_norm is not None else None,
            self.k_norm.weight if self.k_norm is not None else None,
            self.q_norm.eps if self.q_norm is not None else 0.0, rotary.rotary_dim, rotary.is_neox_style, kv_cache,
            meta.slot_mapping)
        if self.query_scaling is not None:
            beta, original = self.query_scaling
            scales = 1.0 + beta * torch.log1p(torch.floor(positions.float() / original))
            q = q * scales.to(q.dtype)[:, None, None]
        out = self.attn.attend(q, kv_cache, meta)
        return self.o_proj(out.view(-1, self.num_heads * self.head_dim))


class LlamaMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, act: str, bias: bool, reduce: bool = True,
                 direct: bool = False):
        """reduce=False: under tensor parallelism the output is this rank's partial sum (the caller
        all-reduces it, alone or together with other partials; direct=True: alone, next, through the layer's
        ModelParallel, so the projection may send it to the peers itself: RowParallelLinear)."""
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden, {0: intermediate, 1: intermediate}, bias=bias)
        self.act = gated_activation(act)  # (its HF name)
        self.down_proj = RowParallelLinear(intermediate, hidden, bias=bias, reduce=reduce, direct=direct)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The activation is gate|up's epilogue where the kernel fuses it (kernels/gemv.py), a kernel of its own
        # otherwise (which writes down's input in FP8 where down takes it so: the fp8_fused_quant knob).
        return self.down_proj(self.gate_up_proj(x, act=self.act, quantize_for=self.down_proj))

    def forward_onto(self, x: torch.Tensor, onto: torch.Tensor) -> torch.Tensor:
        """self(x) + onto (an MoE layer's shared experts onto its routed sum), the add in the down projection where
        it can take it (Linear.forward_onto: at one row, one rounding and no add kernel)."""
        return self.down_proj.forward_onto(self.gate_up_proj(x, act=self.act, quantize_for=self.down_proj), onto)


class LlamaDecoderLayer(nn.Module):
    # (a family whose attention differs in its norms alone subclasses both: same arguments and forward)
    attention_class: Callable[..., nn.Module] = LlamaAttention

    def __init__(self, cfg: ModelConfig, variant: LlamaVariant, layer_idx: int, rotary: RotaryEmbedding,
                 mlp: Callable[[bool], nn.Module] | None = None):
        """mlp(reduce): the layer's MLP in place of the dense SwiGLU one (a mixture of experts, models/sparse_moe.py);
        with reduce=False it must return this rank's partial sum, as LlamaMLP does."""
        super().__init__()
        mp = current()
        # Under tensor parallelism, the projections' partial sums go to the next norm unreduced (it
        # all-reduces them, fused with the add and norm where it can); a bias must follow the sum, so a
        # projection with one reduces itself.
        defer_attn = mp.tp_size > 1 and not variant.o_bias
        defer_mlp = mp.tp_size > 1 and not variant.mlp_bias
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = self.attention_class(cfg, variant, layer_idx, rotary, reduce=not defer_attn)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = (mlp(not defer_mlp) if mlp is not None else
                    LlamaMLP(cfg.hidden_size, cfg.intermediate_size, cfg.raw.get("hidden_act", "silu"),
                             variant.mlp_bias, reduce=not defer_mlp, direct=True))
        self.mp = mp
        self.attn_reduce = mp if defer_attn else None
        self.output_partial = defer_mlp  # forward's first output is a partial sum
        # (the layers each norm's output goes to: an FP8 one may take it quantized by the norm's kernel)
        self.attn_input = self.self_attn.qkv_proj
        self.mlp_input = self.mlp.gate_up_proj if isinstance(self.mlp, LlamaMLP) else None

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                kv_cache: torch.Tensor, meta: AttentionMetadata, x_partial: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, residual) -> (this layer's MLP output, the residual stream before it): the residual add
        is fused into the next norm, so the stream after the layer is their sum. x_partial: x is the
        previous layer's unreduced MLP output (and so is the output when self.output_partial)."""
        if residual is None:
            assert not x_partial, "the first layer's input is the (reduced) embedding"
            h, residual = self.input_layernorm(x, quantize_for=self.attn_input), x
        else:
            h, residual = self.input_layernorm(x, residual, reduce=self.mp if x_partial else None,
                                               quantize_for=self.attn_input)
        h, residual = self.post_attention_layernorm(self.self_attn(positions, h, kv_cache, meta), residual,
                                                    reduce=self.attn_reduce, quantize_for=self.mlp_input)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, variant: LlamaVariant, max_positions: int, rope: RopeConfig | None = None,
                 mlp: Callable[[int], Callable[[bool], nn.Module] | None] | None = None,
                 layer: Callable[..., nn.Module] | None = None, is_neox_style: bool = True):
        """rope: in place of cfg.rope; mlp(layer id): that layer's `mlp` builder (LlamaDecoderLayer), None for the
        dense SwiGLU MLP; layer: the decoder layer's class, if not LlamaDecoderLayer (the same arguments and
        forward); is_neox_style=False: RoPE on interleaved pairs (GLM's)."""
        super().__init__()
        self.windows = list(variant.sliding_windows)  # (every layer's, whichever stage holds it)
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size)
        # One rotary table shared by every layer (it is a buffer, not a weight).
        rotary = RotaryEmbedding(cfg.head_dim, rope or cfg.rope, max_positions, cfg.max_position_embeddings,
                                 is_neox_style=is_neox_style)
        layer = layer or LlamaDecoderLayer
        self.layers = make_layers(cfg.num_hidden_layers, lambda i: layer(
            cfg, variant, i, rotary, mlp(i) if mlp is not None else None))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mp = current()


class LlamaForCausalLM(CausalLM):
    # --runner pooling: loads without its LM head (lm_head None), also from a bare base-model checkpoint.
    supports_pooling = True
    # FP8 checkpoints (and --quantization fp8) keep q|k|v, o, gate|up and down in FP8 (layers/linear.py); the
    # embedding and LM head stay as the checkpoint has them.
    supports_fp8_linear = True
    neox_rope = True  # (False: RoPE on interleaved pairs, GLM's and ERNIE's)
    supports_kv_cache_groups = True  # (LlamaAttention: meta.for_layer)
    # --enable-lora: the layers that take adapter slots (models/lora.py), by their last name
    lora_layers: tuple[str, ...] = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
    # Checkpoint name piece -> (our fused parameter piece, shard id).
    stacked_params = [
        ("q_proj", "qkv_proj", "q"),
        ("k_proj", "qkv_proj", "k"),
        ("v_proj", "qkv_proj", "v"),
        ("gate_proj", "gate_up_proj", 0),
        ("up_proj", "gate_up_proj", 1),
    ]

    @classmethod
    def variant(cls, cfg: ModelConfig) -> LlamaVariant:
        bias = bool(cfg.raw.get("attention_bias", False))
        # (transformers' Llama has no sliding window: a sliding_window field in its config is not read)
        return LlamaVariant(qkv_bias=bias, o_bias=bias, mlp_bias=bool(cfg.raw.get("mlp_bias", False)),
                            qk_norm=False, sliding_windows=[None] * cfg.num_hidden_layers)

    def __init__(self, cfg: ModelConfig, max_positions: int):
        super().__init__()
        self.config = cfg
        self.model = self.decoder(cfg, max_positions)
        tied = self.model.embed_tokens if cfg.tie_word_embeddings else None
        self.lm_head = LMHead(cfg.vocab_size, cfg.hidden_size, tied_to=tied)
        # A *ForSequenceClassification checkpoint: class logits of the last token's final-normed hidden state
        # (--runner pooling applies it to the pooled row; the LM head is dropped there)
        labels = cfg.classifier_labels
        self.score = nn.Linear(cfg.hidden_size, len(labels), bias=False) if labels else None

    def decoder(self, cfg: ModelConfig, max_positions: int) -> nn.Module:
        """The embedding, decoder layers and final norm (`model.` in the checkpoint)."""
        return LlamaModel(cfg, self.variant(cfg), max_positions, is_neox_style=self.neox_rope)

    def kv_cache_specs(self) -> list[KVCacheSpec]:
        """(This rank's heads, this stage's layers.)"""
        return [KVCacheSpec(layer.self_attn.num_kv_heads, layer.self_attn.head_dim, layer.self_attn.num_heads,
                            layer.self_attn.attn.reach)
                for layer in self.model.layers]

    def attention_windows(self) -> list[int | None]:
        return list(self.model.windows)

    @property
    def num_layers(self) -> int:
        return len(self.model.layers)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: AttentionMetadata, capture_layers: tuple[int, ...] = (),
                intermediate: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """-> (final-normed hidden [T, H], captured residual streams [T, n * H] or None).

        A captured layer id i is the residual stream after decoder layer i (HF hidden_states[i + 1]); the n
        captured are those of capture_layers in this pipeline stage, in capture_layers' order (all of them
        without pipeline parallelism).
        Pipeline stages: a later stage starts from `intermediate` ([2, T, H]: the previous stage's x and
        residual) instead of the embedding; a stage before the last returns that pair for the next one
        in place of the normed hidden. kv_caches are this stage's layers' caches.
        """
        layers = self.model.layers
        if intermediate is None:
            x, residual = self.model.embed_tokens(input_ids), None
        else:
            x, residual = intermediate[0], intermediate[1]
        mp = self.model.mp
        captured: dict[int, torch.Tensor] = {}
        partial = False  # x is a layer's unreduced MLP output (see LlamaDecoderLayer)
        for i, layer in enumerate(layers):
            x, residual = layer(positions, x, residual, kv_caches[i], meta, partial)
            partial = layer.output_partial
            if layers.first + i in capture_layers:
                if partial:
                    x, partial = mp.all_reduce(x), False
                captured[layers.first + i] = x + residual
        aux = torch.cat([captured[i] for i in capture_layers if i in captured], dim=-1) if captured else None
        if not layers.is_last:
            if partial:
                x = mp.all_reduce(x)
            return torch.stack([x, residual]), aux
        hidden, _ = self.model.norm(x, residual, reduce=mp if partial else None)
        return hidden, aux

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Vocabulary logits in the model's dtype (consumers that do arithmetic on them cast to float32),
        written into `out` when given."""
        return self.lm_head(hidden, out=out)

    def vocab_weight_names(self) -> tuple[str, str]:
        embedding = "model.embed_tokens.weight"
        return embedding, embedding if self.config.tie_word_embeddings else "lm_head.weight"

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        skip = ("rotary_emb.inv_freq",)
        if self.config.tie_word_embeddings or self.lm_head is None:  # (None: --runner pooling)
            skip = (*skip, "lm_head.weight")
        weights = _with_model_prefix(weights)
        if self.config.classifier_token_ids is not None:
            weights = self._score_from_token_rows(weights)
        try:
            load_named_weights(self, weights, self.stacked_params, skip_suffixes=skip)
        except ModelLoadError as exc:
            if "lm_head.weight" not in str(exc):
                raise
            raise ModelLoadError(f"{exc}. A checkpoint without an LM head (a bare base model, such as an embedding "
                                 "model) generates nothing: serve it with --runner pooling") from exc


    def _score_from_token_rows(self, weights: Iterable[tuple[str, torch.Tensor]]
                               ) -> Iterator[tuple[str, torch.Tensor]]:
        """A causal LM read as a sequence classifier (ModelConfig.classifier_from_tokens): the checkpoint's tensors,
        then a score head made of its tokens' LM-head rows (the embedding's when tied), in float32 as vLLM makes
        it: for a 2-way softmax the second token's row minus the first's (its logit is the log-odds of the
        second), else the rows themselves."""
        source = "model.embed_tokens.weight" if self.config.tie_word_embeddings else "lm_head.weight"
        ids = list(self.config.classifier_token_ids)
        rows = None
        for name, tensor in weights:
            if name == source:
                rows = tensor[ids].to(torch.float32)
            yield name, tensor
        if rows is None:
            raise ModelLoadError(f"malformed checkpoint: {self.config.path} has no {source}, whose rows "
                                 "classifier_from_token reads")
        two_way = self.config.classifier_from_tokens[0] == "from_2_way_softmax"
        yield "score.weight", rows[1:] - rows[:1] if two_way else rows


def _with_model_prefix(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
    """A bare base-model checkpoint (LlamaModel, Qwen3Model, ... as embedding models ship them: `layers.0...`,
    `embed_tokens.weight`, `norm.weight`) under the `model.` names of the *ForCausalLM one."""
    for name, tensor in weights:
        if name.startswith(("embed_tokens.", "layers.", "norm.")):
            name = "model." + name
        yield name, tensor


class MistralForCausalLM(LlamaForCausalLM):
    @classmethod
    def variant(cls, cfg: ModelConfig) -> LlamaVariant:
        v = super().variant(cfg)
        v.sliding_windows = _mistral_windows(cfg)
        return v


class Qwen2ForCausalLM(LlamaForCausalLM):
    @classmethod
    def variant(cls, cfg: ModelConfig) -> LlamaVariant:
        return LlamaVariant(qkv_bias=True, o_bias=False, mlp_bias=False, qk_norm=False,
                            sliding_windows=_qwen_windows(cfg))


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3 and Phi-4: Llama's layers, q|k|v and gate|up fused in the checkpoint (split here into the pieces the
    loader shards by), `sliding_window` on every layer when config.json sets it (transformers' Phi3Attention reads
    it). LoRA adapters (PEFT names Phi's fused modules) and FP8 checkpoints (whose scales are fused too) are not
    read for this family and are refused."""

    supports_fp8_linear = False
    lora_layers: tuple[str, ...] = ()

    @classmethod
    def variant(cls, cfg: ModelConfig) -> LlamaVariant:
        return LlamaVariant(qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=False,
                            sliding_windows=_mistral_windows(cfg))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(self._unfused(weights))

    def _unfused(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        cfg = self.config
        q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        for name, tensor in weights:
            # (a lazy safetensors slice under tensor parallelism: each piece is read whole, then narrowed)
            if name.endswith("self_attn.qkv_proj.weight"):
                rows = loaded_shape(tensor)[0]
                if rows != q + 2 * kv:
                    raise ModelLoadError(f"malformed checkpoint: {name} has {rows} rows, not q|k|v's {q + 2 * kv}")
                base = name.removesuffix("qkv_proj.weight")
                yield base + "q_proj.weight", tensor[:q]
                yield base + "k_proj.weight", tensor[q:q + kv]
                yield base + "v_proj.weight", tensor[q + kv:]
            elif name.endswith("mlp.gate_up_proj.weight"):
                half = loaded_shape(tensor)[0] // 2
                base = name.removesuffix("gate_up_proj.weight")
                yield base + "gate_proj.weight", tensor[:half]
                yield base + "up_proj.weight", tensor[half:]
            else:
                yield name, tensor


class _MultipliedEmbedding(VocabEmbedding):
    """The token embedding times a constant (Granite's embedding_multiplier, as transformers multiplies it)."""

    def __init__(self, vocab_size: int, hidden_size: int, multiplier: float):
        super().__init__(vocab_size, hidden_size)
        self.multiplier = multiplier

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().forward(input_ids) * self.multiplier


class GraniteForCausalLM(LlamaForCausalLM):
    """Granite 3 (dense): Llama's layers with four constants of config.json: the embedding times
    embedding_multiplier, attention scores scaled by attention_multiplier (in place of head_dim^-0.5), each
    block's output times residual_multiplier before the residual add (folded into o_proj's and down_proj's weights
    at load: the same product, rounded once in the weight), logits divided by logits_scaling (apply_granite_constants).
    FP8 checkpoints load dequantized; LoRA adapters and --quantization fp8 (whose weights the folding would change)
    are refused for this family."""

    supports_fp8_linear = False
    lora_layers: tuple[str, ...] = ()

    def __init__(self, cfg: ModelConfig, max_positions: int):
        super().__init__(cfg, max_positions)
        self.residual_multiplier, self.logits_scaling = apply_granite_constants(self, cfg)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(weights)
        fold_into_outputs(self.residual_multiplier, [p for layer in self.model.layers
                                                     for p in (layer.self_attn.o_proj, layer.mlp.down_proj)])

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return super().compute_logits(hidden, out=out).div_(self.logits_scaling)

    def vocab_weight_names(self) -> None:
        return None  # (the embedding is multiplied and the logits scaled: neither is the plain lookup or product)


def apply_granite_constants(model: LlamaForCausalLM, cfg: ModelConfig) -> tuple[float, float]:
    """Granite's config constants on a model of Llama's layers: the embedding times embedding_multiplier, attention
    scores scaled by attention_multiplier; -> (residual_multiplier, logits_scaling), for the model to apply (each
    positive, 1 if absent, as transformers' Granite configs default them)."""
    values = {}
    for key in ("embedding_multiplier", "attention_multiplier", "residual_multiplier", "logits_scaling"):
        value = cfg.raw.get(key, 1.0)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
            raise ModelLoadError(f"malformed checkpoint: {cfg.path / 'config.json'} field {key!r} must be a "
                                 f"positive number, got {value!r}")
        values[key] = float(value)
    embedding = _MultipliedEmbedding(cfg.vocab_size, cfg.hidden_size, values["embedding_multiplier"])
    embedding.weight = model.model.embed_tokens.weight  # (the parameter a tied LM head holds too)
    model.model.embed_tokens = embedding
    for layer in model.model.layers:
        layer.self_attn.attn.scale = values["attention_multiplier"]
    return values["residual_multiplier"], values["logits_scaling"]


def fold_into_outputs(multiplier: float, modules: Iterable[nn.Module]) -> None:
    """A block output's constant factor (Granite's residual_multiplier) folded into the weights (and biases) of the
    modules that write it: the same product, rounded once in the weight."""
    with torch.no_grad():
        for module in modules:
            tensors = [t for name in ("weight", "bias", "w2", "b2")  # (Linear; FusedExperts' down projections)
                       if isinstance(t := getattr(module, name, None), torch.Tensor)]
            if not tensors:
                raise TypeError(f"{type(module).__name__} holds no output weight to fold a multiplier into")
            for tensor in tensors:
                tensor.mul_(multiplier)


class SmolLM3ForCausalLM(LlamaForCausalLM):
    """SmolLM3: Llama's layers, of which those `no_rope_layers` marks 0 (every fourth, by default) take no RoPE: their
    rotation tables are the identity (cos 1, sin 0: the same bits in and out, through the same fused prologue).
    Windows as Qwen's (use_sliding_window, layer_types)."""

    @classmethod
    def variant(cls, cfg: ModelConfig) -> LlamaVariant:
        bias = bool(cfg.raw.get("attention_bias", False))
        return LlamaVariant(qkv_bias=bias, o_bias=bias, mlp_bias=bool(cfg.raw.get("mlp_bias", False)),
                            qk_norm=False, sliding_windows=_qwen_windows(cfg))

    def __init__(self, cfg: ModelConfig, max_positions: int):
        super().__init__(cfg, max_positions)
        uses = cfg.raw.get("no_rope_layers")
        if uses is None:
            interval = cfg.raw.get("no_rope_layer_interval", 4)
            uses = [int((i + 1) % interval != 0) for i in range(cfg.num_hidden_layers)]
        if len(uses) != cfg.num_hidden_layers:
            raise ModelLoadError(f"malformed checkpoint: {cfg.path / 'config.json'} has {len(uses)} no_rope_layers "
                                 f"for {cfg.num_hidden_layers} layers")
        identity = None
        for layer in self.model.layers:
            if uses[layer.self_attn.layer_idx]:
                continue
            if identity is None:
                identity = layer.self_attn.rotary.identity()
            layer.self_attn.rotary = identity


class SeedOssForCausalLM(LlamaForCausalLM):
    """Seed-OSS: Llama's layers with q / k / v biases (attention_bias) and an o bias of its own (attention_out_bias)."""

    @classmethod
    def variant(cls, cfg: ModelConfig) -> LlamaVariant:
        return LlamaVariant(qkv_bias=bool(cfg.raw.get("attention_bias", True)),
                            o_bias=bool(cfg.raw.get("attention_out_bias", False)),
                            mlp_bias=bool(cfg.raw.get("mlp_bias", False)), qk_norm=False,
                            sliding_windows=[None] * cfg.num_hidden_layers)


class Ernie4_5ForCausalLM(LlamaForCausalLM):
    """ERNIE 4.5 (dense): Llama's layers, every projection's bias by use_bias, RoPE on interleaved pairs (GLM's
    style)."""

    neox_rope = False

    @classmethod
    def variant(cls, cfg: ModelConfig) -> LlamaVariant:
        bias = bool(cfg.raw.get("use_bias", False))
        return LlamaVariant(qkv_bias=bias, o_bias=bias, mlp_bias=bias, qk_norm=False,
                            sliding_windows=[None] * cfg.num_hidden_layers)


class HeliumForCausalLM(LlamaForCausalLM):
    """Helium (kyutai/helium-1-2b; model_type helium): Llama's layers, q / k / v biases by attention_bias and none on
    o, RoPE on interleaved pairs (as transformers' Helium rotates)."""

    neox_rope = False

    @classmethod
    def variant(cls, cfg: ModelConfig) -> LlamaVariant:
        return LlamaVariant(qkv_bias=bool(cfg.raw.get("attention_bias", False)), o_bias=False,
                            mlp_bias=bool(cfg.raw.get("mlp_bias", False)), qk_norm=False,
                            sliding_windows=[None] * cfg.num_hidden_layers)


class Qwen3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def variant(cls, cfg: ModelConfig) -> LlamaVariant:
        bias = bool(cfg.raw.get("attention_bias", False))
        return LlamaVariant(qkv_bias=bias, o_bias=bias, mlp_bias=False, qk_norm=True,
                            sliding_windows=_qwen_windows(cfg))


# ---------------------------------------------------------------------------------- image-text checkpoints
# Their language model served on text (the prompt holds tokens only: image inputs are refused before they reach the
# engine); the vision tower's and projector's tensors are not loaded. A text token's multimodal RoPE (Qwen2-VL's and
# Qwen3-VL's mrope sections) rotates it as plain RoPE does: its three position components are equal.
LANGUAGE_MODEL_RENAMES = (("model.language_model.", "model."), ("language_model.model.", "model."),
                           ("language_model.lm_head.", "lm_head."))


class _ImageTextLanguageModel:
    """An image-text checkpoint's language model (a LlamaForCausalLM family's layers under the model's names)."""

    towers: tuple[str, ...] = ()  # (the vision tower's and projector's prefixes)
    lora_layers: tuple[str, ...] = ()  # (PEFT adapters of these checkpoints name the language model otherwise)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(language_model_weights(weights, self.towers, self.config.path,  # type: ignore[misc]
                                                    "the vision tower's and projector's", LANGUAGE_MODEL_RENAMES))


class Qwen2VLForConditionalGeneration(_ImageTextLanguageModel, Qwen2ForCausalLM):
    """Qwen2-VL and Qwen2.5-VL: a Qwen2 language model."""

    towers = ("visual.", "model.visual.")


class Qwen3VLForConditionalGeneration(_ImageTextLanguageModel, Qwen3ForCausalLM):
    """Qwen3-VL (dense): a Qwen3 language model (its deepstack features join only image tokens' rows)."""

    towers = ("visual.", "model.visual.")


class Mistral3ForConditionalGeneration(_ImageTextLanguageModel, MistralForCausalLM):
    """Mistral Small 3.1 / 3.2, Magistral Small: a Mistral language model; Ministral 3 (text_config model_type
    ministral3): the same with its query temperature (LlamaAttention.query_scaling)."""

    towers = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")

