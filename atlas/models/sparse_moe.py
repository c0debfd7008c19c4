"""GQA decoders with sparse mixture-of-experts MLPs: Qwen3MoeForCausalLM, MixtralForCausalLM, Glm4MoeForCausalLM
(GLM-4.5 / 4.6) and Ernie4_5_MoeForCausalLM (ERNIE 4.5 MoE); MiniMax-M2 in models/minimax_m2.py. Model math only.

They are the Llama family's model (llama.py: GQA attention with optional qkv bias, per-head q/k RMSNorm and
partial RoPE; the decoder loop, final norm and LM head) with, on the layers the config names, `SparseMoE` in
place of the dense SwiGLU MLP: a router, the routed experts of layers/moe.py and optional always-on shared
experts (the DeepSeek family's MoE is the same module). The three architectures differ in config fields only:

| | Qwen3-MoE | Mixtral | GLM-4.5 / 4.6 | ERNIE 4.5 MoE |
|---|---|---|---|---|
| routing | softmax top-k, renormalized if norm_topk_prob | softmax top-k, renormalized | sigmoid; e_score_correction_bias for choosing only; grouped top-k (n_group, topk_group); renormalized if norm_topk_prob; times routed_scaling_factor | softmax in float32; moe_statics' correction bias for choosing only; renormalized |
| dense MLP layers | mlp_only_layers, and those off decoder_sparse_step | none | the first first_k_dense_replace | those off moe_layer_interval or outside moe_layer_start_index .. end_index |
| shared experts | none | none | n_shared_experts | moe_num_shared_experts |
| attention | QK-norm; q/k/v/o bias if attention_bias | plain | q/k/v bias if attention_bias; QK-norm if use_qk_norm; RoPE on partial_rotary_factor (0.5 when unset) of each head | plain, RoPE on interleaved pairs |

A sliding window that would bind within the context length (Mixtral's sliding_window; Qwen3-MoE's with
use_sliding_window) is refused, not approximated. GLM checkpoints' multi-token-prediction layers
(num_nextn_predict_layers, at layer index num_hidden_layers) and ERNIE's (its `mtp` tensors) are not loaded: Atlas
serves the target model without them (logged).

Tensor parallelism as the Llama and DeepSeek families: attention heads and dense MLPs sharded as in
llama.py, every expert sharded along its intermediate dimension (or whole experts per rank with
--enable-expert-parallel; layers/moe.py), one all-reduce of the experts' and shared experts' partial sums,
deferred to the norm that follows.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

import torch
from torch import nn

from atlas.config import ModelConfig, RopeConfig, config_fields
from atlas.errors import ModelLoadError, UnsupportedModelError
from atlas.layers.activation import gated_activation
from atlas.layers.linear import Linear, materialize
from atlas.layers.moe import FusedExperts, RouterConfig, TopKRouter
from atlas.layers.parallel import current
from atlas.models.base import language_model_weights, load_named_weights, renamed_weights
from atlas.models.llama import LANGUAGE_MODEL_RENAMES, LlamaForCausalLM, LlamaMLP, LlamaModel, LlamaVariant
from atlas.models.olmo2 import ProjectionNormDecoderLayer

logger = logging.getLogger(__name__)

_EXPERT = re.compile(r"(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight(_scale_inv|_scale)?$")
_LAYER = re.compile(r"model\.layers\.(\d+)\.")
# Checkpoint tensors that are safe to skip: rotary tables (recomputed).
SKIP = ("rotary_emb.inv_freq", "rotary_emb.original_inv_freq")


class SparseMoE(nn.Module):
    """Routed experts plus the always-on shared experts, if any (under tensor parallelism both are sharded and
    their partial sums are all-reduced once)."""

    def __init__(self, hidden_size: int, router: RouterConfig, correction_bias: bool, intermediate_size: int,
                 n_shared_experts: int, act: str, reduce: bool = True, shared_intermediate_size: int | None = None,
                 shared_gate: bool = False):
        """intermediate_size: of one expert (a shared expert's too, unless shared_intermediate_size gives the shared
        experts' whole width); shared_gate: the shared experts' output scaled by sigmoid(shared_expert_gate(x)), one
        value a token (Qwen2-MoE's; the same on every rank, so it may scale a partial sum); reduce=False: under
        tensor parallelism the output is this rank's partial sum."""
        super().__init__()
        self.mp = current()
        self.reduce = reduce
        self.gate = TopKRouter(hidden_size, router, correction_bias)
        self.experts = FusedExperts(router.num_experts, hidden_size, intermediate_size, act)
        width = shared_intermediate_size if shared_intermediate_size is not None else intermediate_size * n_shared_experts
        self.shared_experts = LlamaMLP(hidden_size, width, act, bias=False, reduce=False) if width else None
        self.shared_expert_gate = Linear(hidden_size, 1) if shared_gate and width else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.experts.forward_routed(x, self.gate)
        if self.shared_experts is not None and self.shared_expert_gate is None:
            out = self.shared_experts.forward_onto(x, out)
        elif self.shared_experts is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_experts(x)
        return self.mp.all_reduce(out) if self.reduce else out


def experts_keep_fp8(model: nn.Module) -> bool:
    """Whether the model's routed experts hold FP8 weights (FusedExperts built inside a block-scaled `quantizing`):
    then their checkpoint tensors load as they are, else dequantized (CausalLM.keeps_fp8)."""
    found = getattr(model, "_experts_keep_fp8", None)
    if found is None:
        found = any(m.fp8 is not None for m in model.modules() if isinstance(m, FusedExperts))
        model._experts_keep_fp8 = found
    return found


def checked_router(where: object, num_experts: int, top_k: int, scoring_func: str, topk_method: str, n_group: int,
                   topk_group: int, norm_topk_prob: bool, routed_scaling_factor: float,
                   model_dtype_logits: bool = False) -> RouterConfig:
    """A RouterConfig whose groups and top-k fit its experts, or a ModelLoadError naming the config fields."""
    if num_experts % n_group or not 1 <= topk_group <= n_group:
        raise ModelLoadError(f"malformed checkpoint: {num_experts} experts in n_group={n_group} groups with "
                             f"topk_group={topk_group} ({where})")
    if topk_method == "noaux_tc" and n_group > 1 and num_experts // n_group < 2:
        raise ModelLoadError(f"malformed checkpoint: noaux_tc routing scores groups by their two best experts, but "
                             f"{where} has {num_experts // n_group} expert(s) per group")
    router = RouterConfig(num_experts=num_experts, top_k=top_k, scoring_func=scoring_func, topk_method=topk_method,
                          n_group=n_group, topk_group=topk_group, norm_topk_prob=norm_topk_prob,
                          routed_scaling_factor=routed_scaling_factor, model_dtype_logits=model_dtype_logits)
    eligible = topk_group * (num_experts // n_group) if router.grouped else num_experts
    if top_k > eligible:
        raise ModelLoadError(f"malformed checkpoint: num_experts_per_tok={top_k} is more than the {eligible} experts a "
                             f"token can be routed to ({where})")
    return router


def expert_mapper(name: str) -> tuple[str, object] | None:
    """`...mlp.experts.{e}.{gate|up|down}_proj.weight` -> (the stacked FusedExperts parameter, (e, kind)); its FP8
    scales `....weight_scale_inv` (blocks) or `.weight_scale` (rows, tensor) -> the stacked scales (`w13_weight_scale_inv`
    / `w2_weight_scale_inv` ...)."""
    m = _EXPERT.match(name)
    if m is None:
        return None
    prefix, expert, kind, scale = m.groups()
    return f"{prefix}.{'w2' if kind == 'down' else 'w13'}{'_weight' + scale if scale else ''}", (int(expert), kind)


def fused_expert_pieces(name: str, w: torch.Tensor, transposed: bool = False) -> Iterable[tuple[str, torch.Tensor]]:
    """A checkpoint's fused experts tensor `<prefix>.gate_up_proj` ([E, 2I, H], gate rows first) or
    `<prefix>.down_proj` ([E, H, I]) -> the per-expert `<prefix>.{e}.{gate|up|down}_proj.weight` pieces (views);
    transposed: stored as [E, H, 2I] / [E, I, H] (Llama 4's, and some Qwen3-VL-MoE saves)."""
    prefix, _, kind = name.rpartition(".")
    for e in range(w.shape[0]):
        piece = w[e].t() if transposed else w[e]
        if kind == "down_proj":
            yield f"{prefix}.{e}.down_proj.weight", piece
        else:
            gate, up = piece.chunk(2, dim=0)
            yield f"{prefix}.{e}.gate_proj.weight", gate
            yield f"{prefix}.{e}.up_proj.weight", up


def split_fused_experts(name: str, tensor, where: object) -> Iterable[tuple[str, object]]:
    """`...mlp.experts.gate_up_proj` ([E, 2I, H], gate rows first) and `...mlp.experts.down_proj` ([E, H, I]), as
    transformers 5 may save them -> the per-expert pieces (fused_expert_pieces); other tensors as they are."""
    if not name.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")):
        yield name, tensor
        return
    w = materialize(tensor)
    if w.dim() != 3:
        raise ModelLoadError(f"malformed checkpoint {where}: {name} of shape {tuple(w.shape)} is not [experts, rows, "
                             "columns]")
    yield from fused_expert_pieces(name, w)


def load_moe_weights(module: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], where: object,
                     stacked: list[tuple[str, str, object]]) -> None:
    """Strict loading with per-expert checkpoint names: unknown tensors are refused, not ignored, and a missing
    expert is named."""
    load_named_weights(module, weights, stacked, skip_suffixes=SKIP, mapper=expert_mapper, strict=True)
    missing = [f"{name}.{piece}" for name, m in module.named_modules() if isinstance(m, FusedExperts)
               for piece in m.missing_shards()]
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ModelLoadError(f"malformed checkpoint {where}: missing weight(s) {shown}")


@dataclass(frozen=True)
class MoESettings:
    """A family's config.json fields, checked and typed."""

    attention: LlamaVariant
    rope: RopeConfig
    router: RouterConfig | None  # (None: no MoE layer)
    correction_bias: bool
    moe_intermediate_size: int
    n_shared_experts: int
    hidden_act: str
    moe_layers: frozenset[int]
    num_mtp_layers: int = 0  # layers past num_hidden_layers that the checkpoint may hold and Atlas does not load
    shared_intermediate_size: int | None = None  # (None: moe_intermediate_size x n_shared_experts)
    shared_expert_gate: bool = False  # (SparseMoE's shared_gate: Qwen2-MoE's)


def _refuse_sliding_window(cfg: ModelConfig, window: object, max_positions: int) -> None:
    """A window at least as long as the context never binds (exact); a shorter one is refused."""
    if window is None:
        return
    where = cfg.path / "config.json"
    if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
        raise ModelLoadError(f"malformed checkpoint: {where} field 'sliding_window' must be a positive integer or "
                             f"null, got {window!r}")
    if window < max_positions:
        raise UnsupportedModelError(
            f"{cfg.architecture}: sliding_window={window} in {where} is shorter than the context length "
            f"{max_positions}, and sliding-window attention is not supported for this architecture yet. Serve it with "
            f"--max-model-len {window} or less (the window then never binds)")


class SparseMoeForCausalLM(LlamaForCausalLM):
    """The shared model of the three families; subclasses read their config fields (`read_settings`)."""

    # --enable-lora: adapters on the attention projections (the experts take none)
    lora_layers: tuple[str, ...] = ("qkv_proj", "o_proj")
    # the decoder layer's class (None: LlamaDecoderLayer; one of its subclasses for another attention)
    decoder_layer: Callable[..., nn.Module] | None = None

    # FP8 checkpoints keep the attention projections, dense MLPs and shared experts in FP8 (layers/linear.py), and
    # the routed experts too (layers/moe.py: FusedExperts keeps FP8 weights and their block or row scales); the router,
    # and experts that cannot stay FP8 (static activation scales, a split that cuts scale blocks), are dequantized as
    # they load (keeps_fp8).
    supports_fp8_linear = True
    supports_pooling = False

    def keeps_fp8(self, name: str) -> bool:
        name = self.checkpoint_name(name)
        if ".mlp.experts." in name:
            return experts_keep_fp8(self)
        return ".mlp.gate." not in name

    @classmethod
    def read_settings(cls, cfg: ModelConfig, max_positions: int) -> MoESettings:
        raise NotImplementedError

    def decoder(self, cfg: ModelConfig, max_positions: int) -> nn.Module:
        s = self.moe_settings = self.read_settings(cfg, max_positions)
        gated_activation(s.hidden_act)

        def mlp(i: int) -> Callable[[bool], nn.Module] | None:
            if i not in s.moe_layers:
                return None
            return lambda reduce: SparseMoE(cfg.hidden_size, s.router, s.correction_bias, s.moe_intermediate_size,
                                            s.n_shared_experts, s.hidden_act, reduce=reduce,
                                            shared_intermediate_size=s.shared_intermediate_size,
                                            shared_gate=s.shared_expert_gate)

        return LlamaModel(cfg, s.attention, max_positions, rope=s.rope, mlp=mlp, layer=self.decoder_layer,
                          is_neox_style=self.neox_rope)

    @classmethod
    def checkpoint_name(cls, name: str) -> str:
        """A checkpoint tensor's name as the model's parameters name it (Mixtral renames its MoE's)."""
        return name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        cfg, where = self.config, self.config.path
        n, mtp = cfg.num_hidden_layers, self.moe_settings.num_mtp_layers
        skipped = 0

        def main_model() -> Iterable[tuple[str, torch.Tensor]]:
            nonlocal skipped
            for name, tensor in renamed_weights(weights, tied_head=cfg.tie_word_embeddings):
                m = _LAYER.match(name)
                if m is not None and n <= int(m.group(1)) < n + mtp:
                    skipped += 1  # (not loaded: nothing of it, quantized or not, reaches the model)
                    continue
                yield self.checkpoint_name(name), tensor

        load_moe_weights(self, main_model(), where, self.stacked_params)
        if skipped:
            logger.info("%s: not loading the %d tensors of its multi-token-prediction layer(s) (%d, from layer %d):"
                        " Atlas runs %s without them (speculative decoding: --speculative ngram or dflash)",
                        where, skipped, mtp, n, cfg.architecture)

    cuda_graph_blocker = "its MoE experts need torch.nn.functional.grouped_mm, which takes bf16 on sm90+"

    def supports_cuda_graphs(self, dtype: torch.dtype, device: torch.device) -> bool:
        return all(m.graph_safe() for m in self.modules() if isinstance(m, FusedExperts))


def _fields(cfg: ModelConfig) -> tuple[Callable[[str], int], Callable[[str, int, int], int]]:
    """Readers of integer config fields: need(key), a positive integer; count(key, default, least=0), an integer
    of at least `least`, `default` (the reference's) if absent or null. A key may be "a|b": two names of one field
    (the reference's attribute_map), the first present is read."""
    where = cfg.path / "config.json"
    _, need_one = config_fields(cfg.raw, where, "checkpoint")

    def named(key: str) -> str:
        names = key.split("|")
        return next((k for k in names if cfg.raw.get(k) is not None), names[0])

    def need(key: str) -> int:
        return need_one(named(key))

    def count(key: str, default: int, least: int = 0) -> int:
        key = named(key)
        value = cfg.raw.get(key)
        if value is None:
            return default
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise ModelLoadError(f"malformed checkpoint: {where} field '{key}' must be an integer of at least {least}, "
                                 f"got {value!r}")
        return value

    return need, count


def _full_rope(cfg: ModelConfig) -> RopeConfig:
    """The rope of a family whose reference rotates every head dim: a partial_rotary_factor is refused, not
    ignored."""
    if cfg.rope.partial_rotary_factor != 1.0:
        raise UnsupportedModelError(f"{cfg.architecture}: partial_rotary_factor={cfg.rope.partial_rotary_factor} in "
                                    f"{cfg.path / 'config.json'} is not supported: this architecture rotates every "
                                    "dim of each head")
    return cfg.rope


class Qwen3MoeForCausalLM(SparseMoeForCausalLM):
    @classmethod
    def read_settings(cls, cfg: ModelConfig, max_positions: int) -> MoESettings:
        raw, where = cfg.raw, cfg.path / "config.json"
        need, count = _fields(cfg)
        _refuse_sliding_window(cfg, raw.get("sliding_window") if raw.get("use_sliding_window") else None,
                               max_positions)
        num_experts, step = count("num_experts|num_local_experts", 128), count("decoder_sparse_step", 1, 1)
        dense = raw.get("mlp_only_layers") or []
        if not isinstance(dense, list) or not all(isinstance(i, int) for i in dense):
            raise ModelLoadError(f"malformed checkpoint: {where} field 'mlp_only_layers' must be a list of layer ids, "
                                 f"got {dense!r}")
        moe = frozenset(i for i in range(cfg.num_hidden_layers)
                        if num_experts and i not in dense and (i + 1) % step == 0)
        router = (checked_router(where, num_experts, need("num_experts_per_tok"), "softmax", "greedy", 1, 1,
                                 bool(raw.get("norm_topk_prob", False)), 1.0, model_dtype_logits=True)
                  if moe else None)
        bias = bool(raw.get("attention_bias", False))
        return MoESettings(
            attention=LlamaVariant(qkv_bias=bias, o_bias=bias, mlp_bias=False, qk_norm=True,
                                   sliding_windows=[None] * cfg.num_hidden_layers),
            rope=_full_rope(cfg), router=router, correction_bias=False,
            moe_intermediate_size=need("moe_intermediate_size") if moe else 0, n_shared_experts=0,
            hidden_act=str(raw.get("hidden_act", "silu")), moe_layers=moe)


class Qwen3VLMoeForConditionalGeneration(Qwen3MoeForCausalLM):
    """Qwen3-VL MoE (Qwen3-VL-30B-A3B, -235B-A22B) served on text: its Qwen3-MoE language model (the vision tower not
    loaded; a text token's interleaved multimodal RoPE is plain RoPE). Its experts are stored fused, gate|up as one
    [experts, ...] tensor and down as another, in either orientation transformers has saved ([E, 2I, H] / [E, H, I],
    or the transposes [E, H, 2I] / [E, I, H]): split here per expert, each piece read by its shape (a shape that
    fits both orientations, hidden_size equal to 2 x moe_intermediate_size for gate|up or to it for down, is
    refused)."""

    lora_layers: tuple[str, ...] = ()
    _TOWERS = ("visual.", "model.visual.")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        text = language_model_weights(weights, self._TOWERS, self.config.path, "the vision tower's",
                                      LANGUAGE_MODEL_RENAMES)
        super().load_weights(self._per_expert(text))

    def _per_expert(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
        hidden, inter = self.config.hidden_size, self.moe_settings.moe_intermediate_size
        for name, tensor in weights:
            if not name.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")):
                yield name, tensor
                continue
            w = materialize(tensor)
            down = name.endswith("down_proj")
            rows = hidden if down else 2 * inter  # (each expert's piece as the layer holds it: [rows, cols])
            cols = inter if down else hidden
            if rows == cols or tuple(w.shape[1:]) not in ((rows, cols), (cols, rows)):
                raise ModelLoadError(f"malformed checkpoint {self.config.path}: {name} has shape {tuple(w.shape)}, "
                                     f"which is not [experts, {rows}, {cols}] nor its transpose in an orientation "
                                     "its shape tells apart")
            yield from fused_expert_pieces(name, w, transposed=tuple(w.shape[1:]) != (rows, cols))


class MixtralForCausalLM(SparseMoeForCausalLM):
    _NAMES = re.compile(r"\.block_sparse_moe\.(?:experts\.(\d+)\.(w1|w2|w3)\.weight(_scale_inv|_scale)?$)?")
    _KINDS = {"w1": "gate", "w3": "up", "w2": "down"}

    @classmethod
    def read_settings(cls, cfg: ModelConfig, max_positions: int) -> MoESettings:
        raw, where = cfg.raw, cfg.path / "config.json"
        need, _ = _fields(cfg)
        _refuse_sliding_window(cfg, raw.get("sliding_window"), max_positions)
        router = checked_router(where, need("num_local_experts"), need("num_experts_per_tok"), "softmax", "greedy",
                                1, 1, True, 1.0, model_dtype_logits=True)
        return MoESettings(
            attention=LlamaVariant(qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=False,
                                   sliding_windows=[None] * cfg.num_hidden_layers),
            rope=_full_rope(cfg), router=router, correction_bias=False, moe_intermediate_size=cfg.intermediate_size,
            n_shared_experts=0, hidden_act=str(raw.get("hidden_act", "silu")),
            moe_layers=frozenset(range(cfg.num_hidden_layers)))

    @classmethod
    def checkpoint_name(cls, name: str) -> str:
        """`block_sparse_moe.gate` -> `mlp.gate`; `block_sparse_moe.experts.{e}.w1|w3|w2` -> `mlp.experts.{e}.
        gate_proj|up_proj|down_proj` (their weight and FP8 weight_scale_inv)."""
        def rename(m: re.Match) -> str:
            if m.group(1) is None:
                return ".mlp."
            return f".mlp.experts.{m.group(1)}.{cls._KINDS[m.group(2)]}_proj.weight{m.group(3) or ''}"

        return cls._NAMES.sub(rename, name, count=1)


class Glm4MoeForCausalLM(SparseMoeForCausalLM):
    @classmethod
    def read_settings(cls, cfg: ModelConfig, max_positions: int) -> MoESettings:
        raw, where = cfg.raw, cfg.path / "config.json"
        need, count = _fields(cfg)
        # (the reference's default when the config names no partial_rotary_factor)
        params = {**(raw.get("rope_scaling") or {}), **(raw.get("rope_parameters") or {})}
        partial = params.get("partial_rotary_factor", raw.get("partial_rotary_factor"))
        partial = 0.5 if partial is None else partial
        rope = replace(cfg.rope, partial_rotary_factor=float(partial))
        rotary_dim = int(cfg.head_dim * rope.partial_rotary_factor)
        if not 0 < rotary_dim <= cfg.head_dim or rotary_dim % 2:
            raise ModelLoadError(f"malformed checkpoint: partial_rotary_factor={partial} of head_dim {cfg.head_dim} "
                                 f"in {where} rotates {rotary_dim} dims (must be even, 2 .. head_dim)")
        first_dense = count("first_k_dense_replace", 1)
        n_group, topk_group = count("n_group", 1, 1), count("topk_group", 1, 1)
        router = checked_router(where, need("n_routed_experts|num_local_experts"), need("num_experts_per_tok"), "sigmoid", "noaux_tc",
                                n_group, topk_group, bool(raw.get("norm_topk_prob", True)),
                                float(raw.get("routed_scaling_factor", 1.0)))
        bias = bool(raw.get("attention_bias", False))
        return MoESettings(
            attention=LlamaVariant(qkv_bias=bias, o_bias=False, mlp_bias=False, qk_norm=bool(raw.get("use_qk_norm")),
                                   sliding_windows=[None] * cfg.num_hidden_layers),
            rope=rope, router=router, correction_bias=True, moe_intermediate_size=need("moe_intermediate_size"),
            n_shared_experts=count("n_shared_experts", 1), hidden_act=str(raw.get("hidden_act", "silu")),
            moe_layers=frozenset(range(first_dense, cfg.num_hidden_layers)),
            num_mtp_layers=count("num_nextn_predict_layers|num_mtp_layers", 1))


class SolarOpenForCausalLM(SparseMoeForCausalLM):
    """Solar Open (upstage/Solar-Open-100B; model_type solar_open), as transformers' SolarOpenForCausalLM computes it:
    GLM-4.5's experts (sigmoid scores chosen with the correction bias, grouped top-k, renormalized, shared experts) in
    every layer, under Llama's attention (RoPE over the whole head unless rope_parameters say otherwise, no q / k
    norms, q / k / v biases by attention_bias, no o bias). Its config has no dense first layers and no MTP layers: a
    config that names first_k_dense_replace, use_qk_norm or MTP layers is refused (transformers' class reads none)."""

    @classmethod
    def read_settings(cls, cfg: ModelConfig, max_positions: int) -> MoESettings:
        raw, where = cfg.raw, cfg.path / "config.json"
        need, count = _fields(cfg)
        for key in ("first_k_dense_replace", "use_qk_norm", "num_nextn_predict_layers", "num_mtp_layers"):
            if raw.get(key):
                raise UnsupportedModelError(f"{cfg.architecture}: {key} = {raw[key]!r} in {where}; transformers' "
                                            "Solar Open reads no such field (every layer MoE, no q / k norms, no MTP)")
        router = checked_router(where, need("n_routed_experts|num_local_experts"), need("num_experts_per_tok"),
                                "sigmoid", "noaux_tc", count("n_group", 1, 1), count("topk_group", 1, 1),
                                bool(raw.get("norm_topk_prob", True)), float(raw.get("routed_scaling_factor", 1.0)))
        return MoESettings(
            attention=LlamaVariant(qkv_bias=bool(raw.get("attention_bias", False)), o_bias=False, mlp_bias=False,
                                   qk_norm=False, sliding_windows=[None] * cfg.num_hidden_layers),
            rope=cfg.rope, router=router, correction_bias=True, moe_intermediate_size=need("moe_intermediate_size"),
            n_shared_experts=count("n_shared_experts", 1), hidden_act=str(raw.get("hidden_act", "silu")),
            moe_layers=frozenset(range(cfg.num_hidden_layers)), num_mtp_layers=0)


class Ernie4_5_MoeForCausalLM(SparseMoeForCausalLM):
    """ERNIE 4.5 MoE (ERNIE-4.5-21B-A3B, -300B-A47B; model_type ernie4_5_moe), as transformers' Ernie4_5_MoeForCausalLM
    computes it (the table above). Its correction bias is stored as `mlp.moe_statics.e_score_correction_bias`
    [1, experts]; its MTP tensors (`mtp` in their names) are not loaded. use_bias (biases on every projection and on
    the LM head, which the released checkpoints leave off) is refused."""

    neox_rope = False
    _STATICS = re.compile(r"\.mlp\.moe_statics\.e_score_correction_bias$")

    @classmethod
    def read_settings(cls, cfg: ModelConfig, max_positions: int) -> MoESettings:
        raw, where = cfg.raw, cfg.path / "config.json"
        need, count = _fields(cfg)
        if raw.get("use_bias"):
            raise UnsupportedModelError(f"{cfg.architecture}: use_bias in {where} (biases on every projection and "
                                        "on the LM head) is not supported for the MoE model")
        n = cfg.num_hidden_layers
        start, interval = count("moe_layer_start_index", 1), count("moe_layer_interval", 1, 1)
        end = raw.get("moe_layer_end_index", -1)
        if not isinstance(end, int) or isinstance(end, bool) or end < -1:
            raise ModelLoadError(f"malformed checkpoint: {where} field 'moe_layer_end_index' must be an integer (-1: "
                                 f"the last layer), got {end!r}")
        end = n - 1 if end == -1 else end
        moe = frozenset(i for i in range(n) if (i + 1) % interval == 0 and start <= i <= end)
        router = (checked_router(where, need("moe_num_experts|num_experts"), need("moe_k|num_experts_per_tok"),
                                 "softmax", "noaux_tc", 1, 1, True, 1.0) if moe else None)
        floor = raw.get("moe_norm_min", 1e-12)  # (the least sum of the chosen weights it divides by)
        if not isinstance(floor, (int, float)) or isinstance(floor, bool) or floor < 0:
            raise ModelLoadError(f"malformed checkpoint: {where} field 'moe_norm_min' must be a number >= 0, got "
                                 f"{floor!r}")
        if router is not None:
            router = replace(router, norm_floor=float(floor))
        return MoESettings(
            attention=LlamaVariant(qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=False,
                                   sliding_windows=[None] * n),
            rope=cfg.rope, router=router, correction_bias=True,
            moe_intermediate_size=need("moe_intermediate_size") if moe else 0,
            n_shared_experts=count("moe_num_shared_experts", 2), hidden_act=str(raw.get("hidden_act", "silu")),
            moe_layers=moe)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        skipped = 0

        def renamed() -> Iterable[tuple[str, torch.Tensor]]:
            nonlocal skipped
            for name, tensor in weights:
                if any(part.startswith("mtp") for part in name.split(".")):  # (mtp_block, mtp_emb_norm, ...)
                    skipped += 1
                    continue
                if self._STATICS.search(name):
                    yield self._STATICS.sub(".mlp.gate.e_score_correction_bias", name), materialize(tensor).reshape(-1)
                    continue
                yield name, tensor

        super().load_weights(renamed())
        if skipped:
            logger.info("%s: not loading the %d tensors of its multi-token-prediction block: Atlas runs %s without "
                        "them", self.config.path, skipped, self.config.architecture)


class Dots1ForCausalLM(SparseMoeForCausalLM):
    """dots.llm1 (model_type dots1): Qwen3's attention (per-head q / k norms, biases by attention_bias) and DeepSeek-V3's
    MoE (sigmoid scores chosen with the correction bias in grouped top-k, renormalized when norm_topk_prob, off by
    default, times routed_scaling_factor; shared experts; the first first_k_dense_replace layers dense), as
    transformers' Dots1ForCausalLM computes it. Its windows (sliding_window on the layers from max_window_layers on,
    as transformers reads them) are refused where they would bind, as Qwen3-MoE's."""

    @classmethod
    def read_settings(cls, cfg: ModelConfig, max_positions: int) -> MoESettings:
        raw, where = cfg.raw, cfg.path / "config.json"
        need, count = _fields(cfg)
        window, first_windowed = raw.get("sliding_window"), count("max_window_layers", cfg.num_hidden_layers)
        types = raw.get("layer_types") or ["sliding_attention" if window is not None and i >= first_windowed
                                           else "full_attention" for i in range(cfg.num_hidden_layers)]
        _refuse_sliding_window(cfg, window if "sliding_attention" in types else None, max_positions)
        n_group, topk_group = count("n_group", 1, 1), count("topk_group", 1, 1)
        router = checked_router(where, need("n_routed_experts|num_local_experts"), need("num_experts_per_tok"),
                                "sigmoid", "noaux_tc", n_group, topk_group, bool(raw.get("norm_topk_prob", False)),
                                float(raw.get("routed_scaling_factor", 1.0)))
        bias = bool(raw.get("attention_bias", False))
        return MoESettings(
            attention=LlamaVariant(qkv_bias=bias, o_bias=bias, mlp_bias=False, qk_norm=True,
                                   sliding_windows=[None] * cfg.num_hidden_layers),
            rope=_full_rope(cfg), router=router, correction_bias=True,
            moe_intermediate_size=need("moe_intermediate_size"), n_shared_experts=count("n_shared_experts", 0),
            hidden_act=str(raw.get("hidden_act", "silu")),
            moe_layers=frozenset(range(count("first_k_dense_replace", 0), cfg.num_hidden_layers)))


class Qwen2MoeForCausalLM(SparseMoeForCausalLM):
    """Qwen1.5-MoE / Qwen2-MoE (model_type qwen2_moe): Qwen2's attention (q / k / v biases by qkv_bias), softmax routing in the
    model dtype (renormalized when norm_topk_prob, off by default), one shared expert of shared_expert_intermediate_size
    gated by sigmoid(shared_expert_gate(x)), dense layers by mlp_only_layers and decoder_sparse_step; a window that
    would bind (use_sliding_window) is refused, as Qwen3-MoE's."""

    _SHARED = re.compile(r"\.mlp\.shared_expert\.")

    @classmethod
    def read_settings(cls, cfg: ModelConfig, max_positions: int) -> MoESettings:
        s = Qwen3MoeForCausalLM.read_settings(cfg, max_positions)
        raw = cfg.raw
        router = (None if s.router is None else
                  replace(s.router, norm_topk_prob=bool(raw.get("norm_topk_prob", False))))
        _, count = _fields(cfg)
        return replace(s, attention=replace(s.attention, qkv_bias=bool(raw.get("qkv_bias", True)), o_bias=False,
                                            qk_norm=False), router=router,
                       shared_intermediate_size=count("shared_expert_intermediate_size", 0),
                       shared_expert_gate=True)

    @classmethod
    def checkpoint_name(cls, name: str) -> str:
        """`mlp.shared_expert.` (one shared expert) -> the block's `mlp.shared_experts.`."""
        return cls._SHARED.sub(".mlp.shared_experts.", name)


class OlmoeForCausalLM(SparseMoeForCausalLM):
    """OLMoE (model_type olmoe): Llama's pre-norm block with q / k RMSNorms over the whole projections (as
    MiniMax-M2's: models/olmo2.ProjectionNormAttention), softmax routing in the model dtype (renormalized when
    norm_topk_prob, off by default), every layer MoE. clip_qkv (a clamp of q, k and v that the released checkpoints
    leave off) is refused."""

    decoder_layer = ProjectionNormDecoderLayer
    lora_layers: tuple[str, ...] = ()  # (no test covers adapters on the whole-projection norms)

    @classmethod
    def read_settings(cls, cfg: ModelConfig, max_positions: int) -> MoESettings:
        raw, where = cfg.raw, cfg.path / "config.json"
        if raw.get("clip_qkv") is not None:
            raise UnsupportedModelError(f"{cfg.architecture}: clip_qkv = {raw['clip_qkv']} in {where} (a clamp of q, "
                                        "k and v) is not supported")
        need, _ = _fields(cfg)
        router = checked_router(where, need("num_experts|num_local_experts"), need("num_experts_per_tok"), "softmax",
                                "greedy", 1, 1, bool(raw.get("norm_topk_prob", False)), 1.0, model_dtype_logits=True)
        bias = bool(raw.get("attention_bias", False))
        return MoESettings(
            attention=LlamaVariant(qkv_bias=bias, o_bias=bias, mlp_bias=False, qk_norm=False,
                                   sliding_windows=[None] * cfg.num_hidden_layers),
            rope=_full_rope(cfg), router=router, correction_bias=False, moe_intermediate_size=cfg.intermediate_size,
            n_shared_experts=0, hidden_act=str(raw.get("hidden_act", "silu")),
            moe_layers=frozenset(range(cfg.num_hidden_layers)))
