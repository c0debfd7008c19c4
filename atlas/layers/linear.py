"""Linear layers whose weights may be stored in pieces in the checkpoint, and split across
tensor-parallel ranks.

A fused projection (q|k|v, or gate|up) is one matmul at run time but several tensors on disk; each
parameter carries a `weight_loader(param, tensor, shard_id)` that copies a piece into its rows.

Tensor parallelism (Megatron style): a column-parallel layer keeps a slice of the output rows (each
rank computes part of y, e.g. its own attention heads), a row-parallel one a slice of the input columns
(each rank computes a partial y from its slice of x, and the partials are summed by one all-reduce).
Column then row needs no communication in between, so an attention block and an MLP each cost one
all-reduce. Loaders of sharded parameters take either a tensor or a lazy safetensors slice
(`safe_open(...).get_slice(name)`) and read only this rank's rows or columns from it; they are marked
`takes_slices`, every other loader gets a whole tensor.

FP8 weights (`Fp8Scheme`): a layer constructed inside `quantizing(scheme)` holds its weight in float8_e4m3fn,
its float32 scales beside it (`weight_scale_inv` [ceil(N / bn), ceil(K / bk)] per block, or `weight_scale` [N]
per output row: a checkpoint's per-tensor scales are stored expanded per row, which computes the same and lets
fused q|k|v or gate|up keep each piece's own scale) and, for static activation schemes, the checkpoint's
`input_scale` (one number; the largest of a fused layer's pieces). The scales are narrowed with their weight
under tensor parallelism: a column-parallel layer's along the rows, a row-parallel layer's block scales along
the columns (its per-row scales whole); a layer whose split or fused piece would cut a scale block is a plain
layer of the model dtype instead, its FP8 pieces dequantized whole as they load (with a warning naming the sizes). The matmul is kernels/fp8_linear.py's (the dequantizing reference off CUDA). A layer whose
checkpoint weight comes in a plain floating-point dtype (a layer the quantizer left out) turns back into a
plain layer as it loads. `quantize_online` turns loaded plain layers into FP8 ones (--quantization fp8).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from atlas.errors import ModelLoadError
from atlas.kernels import gemv
from atlas.kernels.fp8_linear import (
    FP8,
    QuantizedRows,
    dequantize_block_fp8,
    fp8_linear,
    quantize_weight,
    takes_quantized_rows,
)
from atlas.kernels.fused_ops import act_and_mul
from atlas.layers.lora import LoraWeights
from atlas.layers.parallel import ModelParallel, current

logger = logging.getLogger(__name__)


def loaded_shape(loaded: Any) -> tuple[int, ...]:
    """Shape of a checkpoint tensor or of a lazy safetensors slice."""
    return tuple(loaded.shape) if isinstance(loaded, torch.Tensor) else tuple(loaded.get_shape())


def materialize(loaded: Any) -> torch.Tensor:
    """The whole checkpoint tensor (read now if it is a lazy slice)."""
    if isinstance(loaded, torch.Tensor):
        return loaded
    return loaded[:] if len(loaded.get_shape()) else loaded[()]  # (a 0-dim one, e.g. a per-tensor scale)


def narrow_loaded(loaded: Any, dim: int, start: int, size: int) -> torch.Tensor:
    """Elements start .. start + size - 1 along dim; of a lazy slice, only they are read."""
    if isinstance(loaded, torch.Tensor):
        return loaded.narrow(dim, start, size)
    return loaded[(slice(None),) * dim + (slice(start, start + size),)]


# safetensors' dtype codes (of a lazy slice) as torch names them
_CODES = {"F16": "float16", "BF16": "bfloat16", "F32": "float32", "F64": "float64", "F8_E4M3": "float8_e4m3fn",
          "F8_E5M2": "float8_e5m2", "F8_E8M0": "float8_e8m0fnu", "F4": "float4_e2m1fn_x2", "I8": "int8", "U8": "uint8",
          "I16": "int16", "U16": "uint16", "I32": "int32", "U32": "uint32", "I64": "int64", "U64": "uint64",
          "BOOL": "bool"}


def checkpoint_dtype(loaded: Any) -> str:
    """The dtype of a checkpoint tensor or lazy safetensors slice, as torch names it ('float8_e4m3fn')."""
    if isinstance(loaded, torch.Tensor):
        return str(loaded.dtype).removeprefix("torch.")
    get_dtype = getattr(loaded, "get_dtype", None)
    if get_dtype is None:  # (a slice-like object that offers only get_shape and indexing: read nothing of it)
        return checkpoint_dtype(loaded[(slice(0, 0),)] if len(loaded.get_shape()) else loaded[()])
    code = get_dtype()
    return _CODES.get(code, code.lower())


def takes_slices(loader):
    """Mark a weight loader that reads what it needs from a lazy safetensors slice."""
    loader.takes_slices = True
    return loader


def _check_shape(expected: tuple[int, ...], loaded: Any, what: str = "") -> None:
    got = loaded_shape(loaded)
    if got != tuple(expected):
        raise ValueError(f"shape mismatch{what}: expected {tuple(expected)}, got {got}")


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"shape mismatch: parameter {tuple(param.shape)} vs checkpoint {tuple(loaded.shape)}")
    param.data.copy_(loaded)


def sharded_loader(dim: int, rank: int, full_size: int):
    """Loader of a parameter that holds piece `rank` (of equal pieces) of the checkpoint tensor along dim,
    whose full length there is full_size."""
    @takes_slices
    def load(param: nn.Parameter, loaded: Any, shard_id: object = None) -> None:
        expected = list(param.shape)
        expected[dim] = full_size
        _check_shape(tuple(expected), loaded)
        size = param.shape[dim]
        param.data.copy_(narrow_loaded(loaded, dim, rank * size, size))

    return load


def _divide(total: int, parts: int, what: str) -> int:
    if total % parts:
        raise ValueError(f"{what} ({total}) is not divisible by the tensor-parallel size {parts}")
    return total // parts


@dataclass(frozen=True)
class Fp8Scheme:
    """How a checkpoint's linear layers are quantized to FP8 (models/quantization.fp8_scheme reads it).
    weights: "block" (scales per block x block tile), "channel" (per output row) or "tensor" (one per tensor,
    stored per row); activations: "dynamic" (computed as they come) or "static" (the checkpoint's input_scale);
    scale_name: the checkpoint's name of the weight scales (weight_scale_inv for blocks, else weight_scale);
    activation_scale_ub: a cap on dynamic activation scales (fbgemm_fp8); method: its name, for messages."""

    weights: str
    block: tuple[int, int] | None = None
    activations: str = "dynamic"
    scale_name: str = "weight_scale"
    activation_scale_ub: float | None = None
    method: str = "fp8"

    def __str__(self) -> str:
        layout = f"{self.block[0]}x{self.block[1]} blocks" if self.block else f"per-{self.weights} scales"
        return f"{self.method}: FP8 weights with {layout}, {self.activations} activation scales"


_quantizing: Fp8Scheme | None = None
_plain_weight = False  # (inside `plain_weight`)


@contextlib.contextmanager
def quantizing(scheme: Fp8Scheme | None) -> Iterator[None]:
    """Linear layers constructed inside hold FP8 weights of `scheme` (None: plain ones)."""
    global _quantizing
    previous = _quantizing
    _quantizing = scheme
    try:
        yield
    finally:
        _quantizing = previous


def current_scheme() -> Fp8Scheme | None:
    """The FP8 scheme layers constructed now take (`quantizing`; None: plain ones)."""
    return _quantizing


@contextlib.contextmanager
def plain_weight() -> Iterator[None]:
    """Linear layers constructed inside keep their weight in the model dtype whatever the checkpoint's FP8 scheme:
    for a weight read whole outside the layer's own matmul (MLA's kv_b_proj, which attention absorbs)."""
    global _quantizing, _plain_weight
    previous = _quantizing, _plain_weight
    _quantizing, _plain_weight = None, True
    try:
        yield
    finally:
        _quantizing, _plain_weight = previous


def _fp8_param(data: torch.Tensor, loader=None, fill: float | None = None) -> nn.Parameter:
    p = nn.Parameter(data, requires_grad=False)
    if loader is not None:
        p.weight_loader = loader
        p.fp8_scale = True  # (a checkpoint tensor the quantization refusals let through: models/base.py)
    if fill is not None:
        p.dummy_fill = fill  # (what --load-format dummy puts there: loader.fill_dummy_weights)
    return p


class Linear(nn.Module):
    """y = x W^T (+ b). A plain projection loaded from one checkpoint tensor (or an FP8 one: module docstring)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.fp8: Fp8Scheme | None = _quantizing
        self.plain_dtype = torch.get_default_dtype()
        weight = torch.empty(out_features, in_features, dtype=FP8 if self.fp8 is not None else None)
        self.weight = nn.Parameter(weight, requires_grad=self.fp8 is None)
        self.weight.weight_loader = default_weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features))
            self.bias.weight_loader = default_weight_loader
        else:
            self.register_parameter("bias", None)
        # (the scales are made by prepare_fp8, once a subclass has said how its rows and columns are split)
        self.loaded_scales: set = set()
        # Set by `plain_weight`: the layer's weight is also read whole outside its matmul, so it stays in the
        # model dtype (its FP8 checkpoint tensors are dequantized as they load; --quantization fp8 leaves it).
        self.keeps_model_dtype = _plain_weight
        self.fp8_pieces = 0  # FP8 weight pieces loaded
        # Set by _dequantize_as_loaded: the FP8 scheme a layer that cuts scale blocks was built with, and its pieces
        # waiting for their weight or scales.
        self.dequantized_from: Fp8Scheme | None = None
        self.pending_pieces: dict[object, dict[str, torch.Tensor]] = {}
        # LoRA adapter slots (layers/lora.py), attached by models/lora.attach_lora under --enable-lora; else None.
        self.lora: LoraWeights | None = None

    # ---- FP8 -----------------------------------------------------------------------------------------
    def row_map(self, shard_id: object = None) -> tuple[int, int, int, int]:
        """(first row here, rows, first row in the checkpoint tensor, its rows) of a checkpoint piece."""
        return 0, self.out_features, 0, self.out_features

    def col_map(self) -> tuple[int, int]:
        """(first column in the checkpoint tensor, its columns) of this layer's columns."""
        return 0, self.in_features

    def shard_ids(self) -> list[object]:
        return [None]

    @property
    def scale_name(self) -> str:
        """The scales' parameter name: the checkpoint's (weight_scale_inv for blocks, else weight_scale)."""
        scheme = self.fp8 or self.dequantized_from
        return scheme.scale_name if scheme is not None else "weight_scale"

    @property
    def scale(self) -> torch.Tensor | None:
        """An FP8 layer's weight scales (None before prepare_fp8, and for a plain layer)."""
        return self._parameters.get(self.scale_name) if self.fp8 is not None else None

    def prepare_fp8(self, name: str = "linear layer") -> None:
        """Make the scales of an FP8 layer (after construction), refusing a split or a fused piece that cuts a
        scale block."""
        scheme = self.fp8
        if scheme is None or self.scale is not None:
            return
        if scheme.block is not None:
            bn, bk = scheme.block
            for shard in self.shard_ids():
                here, rows, first, total = self.row_map(shard)
                cut = here % bn or first % bn or (rows % bn and not (first + rows == total
                                                                     and here + rows == self.out_features))
                if cut:
                    piece = f" piece {shard!r}" if shard is not None else ""
                    return self._dequantize_as_loaded(
                        name, f"rows {first}..{first + rows - 1} of{piece} its {total} (this rank's part under tensor "
                        f"parallelism, or a piece of a fused projection) cut the checkpoint's {bn}x{bk} scale blocks")
            first, total = self.col_map()
            if first % bk or (self.in_features % bk and first + self.in_features != total):
                return self._dequantize_as_loaded(
                    name, f"columns {first}..{first + self.in_features - 1} of its {total} (this rank's part under "
                    f"tensor parallelism) cut the checkpoint's {bn}x{bk} scale blocks")
            shape = (-(-self.out_features // bn), -(-self.in_features // bk))
        else:
            shape = (self.out_features,)
        device = self.weight.device
        self.register_parameter(self.scale_name, _fp8_param(torch.ones(shape, dtype=torch.float32, device=device),
                                                            self._load_scale, fill=1e-3 / 448))
        if scheme.activations == "static":
            self.register_parameter("input_scale", _fp8_param(torch.zeros(1, dtype=torch.float32, device=device),
                                                              self._load_input_scale, fill=1.0 / 448))
        weight_loader = self.weight.weight_loader

        def load_weight(param: nn.Parameter, loaded: Any, shard_id: object = None) -> None:
            self._check_weight_dtype(loaded, shard_id)
            if shard_id is None:
                weight_loader(param, loaded)
            else:
                weight_loader(param, loaded, shard_id)

        load_weight.takes_slices = getattr(weight_loader, "takes_slices", False)
        self.weight.weight_loader = load_weight

    def _dequantize_as_loaded(self, name: str, why: str) -> None:
        """A block-scaled layer whose rows or columns here cut the checkpoint's scale blocks (one scale grid cannot
        hold them): a plain layer of the model dtype whose FP8 pieces are dequantized, each whole with its own
        scales, before its loader narrows them. The same numbers as the dequantizing reference; the speed and
        memory of the model dtype for this layer."""
        scheme = self.fp8
        logger.warning("%s: %s; it is dequantized to %s as it loads (FP8 kernels need whole blocks; a "
                       "tensor-parallel size that divides it into whole blocks keeps it FP8)", name, why,
                       str(self.plain_dtype).removeprefix("torch."))
        self.unquantize()
        self.dropped_scales = False
        self.dequantized_from = scheme
        pending = self.pending_pieces  # shard id -> its FP8 weight and / or scales, until both came
        weight_loader = self.weight.weight_loader

        def finish(shard_id: object) -> None:
            pair = pending[shard_id]
            if len(pair) < 2:
                return
            del pending[shard_id]
            piece = f"{name}.weight" if shard_id is None else f"{name}[{shard_id}].weight"  # (its error's name)
            whole = dequantize_block_fp8(pair["weight"], pair["scale"], scheme.block, self.plain_dtype, piece)
            if shard_id is None:
                weight_loader(self.weight, whole)
            else:
                weight_loader(self.weight, whole, shard_id)

        def load_weight(param: nn.Parameter, loaded: Any, shard_id: object = None) -> None:
            dtype = checkpoint_dtype(loaded)
            plain = scheme.scale_name not in self._parameters  # (a plain piece came first)
            if dtype in ("float16", "bfloat16", "float32") and not self.fp8_pieces and not self.loaded_scales:
                self._parameters.pop(scheme.scale_name, None)  # (a layer the quantizer left out: no scales come)
                return weight_loader(param, loaded) if shard_id is None else weight_loader(param, loaded, shard_id)
            if dtype != "float8_e4m3fn" or plain:
                raise ModelLoadError(f"malformed FP8 checkpoint: a piece {shard_id!r} of {name} is {dtype}, another "
                                     "piece of the same layer is not: Atlas does not load a fused projection of mixed "
                                     "dtypes")
            self.fp8_pieces += 1
            pending.setdefault(shard_id, {})["weight"] = materialize(loaded)
            finish(shard_id)

        def load_scale(param: nn.Parameter, loaded: Any, shard_id: object = None) -> None:
            pending.setdefault(shard_id, {})["scale"] = materialize(loaded).to(torch.float32)
            self.loaded_scales.add(shard_id)
            finish(shard_id)

        self.weight.weight_loader = load_weight
        self.weight.takes_fp8 = True  # (load_named_weights: its float8 pieces are for it to dequantize)
        # (a stand-in parameter that takes the checkpoint's scales by their name; one number, never read)
        self.register_parameter(scheme.scale_name, _fp8_param(torch.zeros(1), load_scale, fill=0.0))

    def _check_weight_dtype(self, loaded: Any, shard_id: object) -> None:
        dtype = checkpoint_dtype(loaded)
        if self.fp8 is not None and dtype == "float8_e4m3fn":
            self.fp8_pieces += 1
            return
        if self.fp8 is not None and dtype in ("float16", "bfloat16", "float32") and not self.fp8_pieces:
            self.unquantize()  # (a layer the quantizer left out)
            return
        if self.fp8 is None and dtype in ("float16", "bfloat16", "float32"):
            return
        raise ModelLoadError(f"malformed FP8 checkpoint: a piece {shard_id!r} of a linear layer is {dtype}, another "
                             "piece of the same layer is not: Atlas does not load a fused projection of mixed dtypes")

    def unquantize(self) -> None:
        """Turn this FP8 layer (nothing loaded yet) into a plain one, of the model's dtype."""
        self.weight.data = torch.empty(self.weight.shape, dtype=self.plain_dtype, device=self.weight.device)
        for name in ("weight_scale", "weight_scale_inv", "input_scale"):
            self._parameters.pop(name, None)
        self.fp8 = None
        self.dropped_scales = True  # (load_named_weights: they are not missing)

    @takes_slices
    def _load_scale(self, param: nn.Parameter, loaded: Any, shard_id: object = None) -> None:
        if self.fp8 is None:  # (unquantized by a plain piece that came first)
            raise ModelLoadError(f"malformed FP8 checkpoint: a piece {shard_id!r} of a linear layer has FP8 scales, "
                                 "another piece of the same layer is not FP8: Atlas does not load a fused projection "
                                 "of mixed dtypes")
        here, rows, first, total = self.row_map(shard_id)
        shape = loaded_shape(loaded)
        block = self.fp8.block
        if block is None:
            if len(shape) == 0 or (len(shape) <= 2 and all(d == 1 for d in shape)):  # per tensor
                param.data.narrow(0, here, rows).fill_(float(materialize(loaded).reshape(-1)[0]))
            elif shape in ((total,), (total, 1)):
                values = narrow_loaded(loaded, 0, first, rows)
                param.data.narrow(0, here, rows).copy_(values.reshape(rows))
            else:
                raise ValueError(f"{self.scale_name} of shape {shape}: expected one number or one per each of the "
                                 f"{total} output rows")
        else:
            bn, bk = block
            col_first, col_total = self.col_map()
            expected = (-(-total // bn), -(-col_total // bk))
            if shape != expected:
                raise ValueError(f"{self.scale_name} of shape {shape}, but the weight's {total}x{col_total} in blocks "
                                 f"of {bn}x{bk} needs {expected}")
            n_blocks = -(-rows // bn)
            values = narrow_loaded(loaded, 0, first // bn, n_blocks)
            values = values[:, col_first // bk: col_first // bk + param.shape[1]]
            param.data.narrow(0, here // bn, n_blocks).copy_(values)
        self.loaded_scales.add(shard_id)

    def _load_input_scale(self, param: nn.Parameter, loaded: Any, shard_id: object = None) -> None:
        value = materialize(loaded).to(torch.float32).reshape(-1)
        if value.numel() != 1:
            raise ValueError(f"input_scale of shape {tuple(value.shape)}: expected one number (a per-tensor static "
                             "activation scale)")
        param.data.copy_(torch.maximum(param.data, value.to(param.device)))

    def missing_fp8_scales(self) -> list[object]:
        """Shard ids whose FP8 weight arrived without its scales."""
        if self.dequantized_from is not None:
            return [s for s, pair in self.pending_pieces.items() if "weight" in pair]
        if self.fp8 is None:
            return []
        return [s for s in self.shard_ids() if s not in self.loaded_scales]

    def quantize_online(self) -> None:
        """Quantize this loaded plain layer's weight to FP8 with a scale per output row (--quantization fp8;
        activations stay dynamic)."""
        if self.fp8 is not None:
            return
        q, scale = quantize_weight(self.weight.data)
        self.weight = _fp8_param(q)
        self.fp8 = Fp8Scheme("channel", method="--quantization fp8")
        self.register_parameter(self.scale_name, _fp8_param(scale))

    def _matmul(self, x: torch.Tensor | QuantizedRows, act: str | None = None, bias: torch.Tensor | None = None,
                push=None, quantize_act: bool = False) -> torch.Tensor | QuantizedRows:
        if self.fp8 is None:
            return gemv.linear(x, self.weight, bias, act, push=push)
        return fp8_linear(x, self.weight, self.scale, self.fp8.block, bias, self._parameters.get("input_scale"),
                          self.fp8.activation_scale_ub, act, quantize_act)

    def takes_quantized_rows(self, rows: int, dtype: torch.dtype, device: torch.device) -> bool:
        """Whether this layer's matmul of `rows` rows takes them as fp8_linear.QuantizedRows, quantized by the kernel
        that produces them (the fp8_fused_quant knob; kernels/fp8_linear.takes_quantized_rows)."""
        # (a layer with adapters reads its input whole: their shrink takes it in the model dtype)
        return self.fp8 is not None and self.lora is None and takes_quantized_rows(
            rows, self.weight, self.scale, self.fp8.block, dtype, device)

    def forward(self, x: torch.Tensor | QuantizedRows, act: str | None = None,
                quantize_for: Linear | None = None) -> torch.Tensor | QuantizedRows:
        """With `act` (an HF hidden_act name) this is a [gate | up] projection and the result act(gate) * up.
        F.linear, or on CUDA the small-M GEMV, the activation fused as its epilogue (kernels/gemv.py); FP8
        layers: kernels/fp8_linear.py. quantize_for (with act): the layer the result goes to, which may take it as
        QuantizedRows written by the activation's kernel."""
        if self.lora is not None:
            return self._forward_lora(x, act, self.bias)
        quantize_act = (act is not None and quantize_for is not None and self.fp8 is not None
                        and quantize_for.takes_quantized_rows(x.shape[0], x.dtype, x.device))
        return self._matmul(x, act, self.bias, quantize_act=quantize_act)

    def forward_onto(self, x: torch.Tensor | QuantizedRows, onto: torch.Tensor) -> torch.Tensor:
        """self(x) + onto. A single row of a plain layer (bf16 / fp16 / fp32, no adapter, no bias) takes `onto` as
        its matmul's bias: the sum rounds once, and a batch-1 decode step launches no add of its own."""
        if (isinstance(x, torch.Tensor) and x.dim() == 2 and x.shape[0] == 1 and self.fp8 is None and self.lora is None
                and self.bias is None and onto.dtype == x.dtype and onto.is_contiguous()):
            return self._matmul(x, None, onto.view(-1)).view_as(onto)
        return self(x) + onto

    def _forward_lora(self, x: torch.Tensor, act: str | None, bias: torch.Tensor | None) -> torch.Tensor:
        """The layer's output plus each row's adapter delta, the activation (of a gate|up layer) after the sum."""
        y = self.lora.add_delta(x, self._matmul(x, None, bias))
        return act_and_mul(y, act) if act is not None else y


class MergedLinear(Linear):
    """Several projections of the same input stacked along the output dimension.

    `shards` maps a shard id (e.g. "q", "k", "v" or 0, 1) to its number of output rows, in order.
    `sources` (tensor parallelism) maps a shard id to (first row, rows) of its checkpoint tensor: the
    parameter holds rows first .. first + shards[id] - 1 of it. Without an entry, the whole tensor.
    """

    def __init__(self, in_features: int, shards: dict[object, int], bias: bool = False,
                 sources: dict[object, tuple[int, int]] | None = None):
        super().__init__(in_features, sum(shards.values()), bias)
        self.shard_offsets: dict[object, tuple[int, int]] = {}
        offset = 0
        for shard_id, size in shards.items():
            self.shard_offsets[shard_id] = (offset, size)
            offset += size
        self.shard_sources = dict(sources or {})
        self.weight.weight_loader = self._load_shard
        if bias:
            self.bias.weight_loader = self._load_shard
        self.loaded_shards: dict[str, set] = {"weight": set(), "bias": set()}

    @takes_slices
    def _load_shard(self, param: nn.Parameter, loaded: Any, shard_id: object) -> None:
        if shard_id not in self.shard_offsets:
            raise ValueError(f"unknown shard {shard_id!r}")
        offset, size = self.shard_offsets[shard_id]
        target = param.data.narrow(0, offset, size)
        first, rows = self.shard_sources.get(shard_id, (0, size))
        _check_shape((rows, *target.shape[1:]), loaded, f" for shard {shard_id!r}")
        target.copy_(narrow_loaded(loaded, 0, first, size))
        self.loaded_shards["weight" if param is self.weight else "bias"].add(shard_id)

    def shard_ids(self) -> list[object]:
        return list(self.shard_offsets)

    def row_map(self, shard_id: object = None) -> tuple[int, int, int, int]:
        if shard_id not in self.shard_offsets:
            raise ValueError(f"unknown shard {shard_id!r}")
        offset, size = self.shard_offsets[shard_id]
        first, rows = self.shard_sources.get(shard_id, (0, size))
        return offset, size, first, rows

    def missing_shards(self) -> list[tuple[str, object]]:
        """(parameter kind, shard id) of every piece no checkpoint tensor filled."""
        kinds = ["weight"] + (["bias"] if self.bias is not None else [])
        return [(kind, s) for kind in kinds for s in self.shard_offsets if s not in self.loaded_shards[kind]]


class ColumnParallelLinear(Linear):
    """Output rows split over the tensor-parallel ranks: y_local = x W_local^T (+ b_local)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, mp: ModelParallel | None = None):
        mp = mp or current()
        super().__init__(in_features, _divide(out_features, mp.tp_size, "output features"), bias)
        self.full_out_features, self.tp_rank = out_features, mp.tp_rank
        if mp.tp_size > 1:
            self.weight.weight_loader = sharded_loader(0, mp.tp_rank, out_features)
            if bias:
                self.bias.weight_loader = sharded_loader(0, mp.tp_rank, out_features)

    def row_map(self, shard_id: object = None) -> tuple[int, int, int, int]:
        rows = self.out_features
        return 0, rows, self.tp_rank * rows, self.full_out_features


class RowParallelLinear(Linear):
    """Input columns split over the tensor-parallel ranks: y = all_reduce(x_local W_local^T) (+ b).
    With reduce=False the caller sums the partials (e.g. once for several branches); the bias is added
    once, after the sum. direct=True (with reduce=False) says the caller all-reduces the output as it is,
    next, through mp (e.g. in the following norm), so the projection may send it to the peers as it
    computes it (kernels/peer_all_reduce.py, push_args); it always may when it reduces itself."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, reduce: bool = True,
                 mp: ModelParallel | None = None, direct: bool = False):
        mp = mp or current()
        super().__init__(_divide(in_features, mp.tp_size, "input features"), out_features, bias)
        self.mp = mp
        self.reduce = reduce
        self.direct = reduce or direct
        self.full_in_features = in_features
        if mp.tp_size > 1:
            self.weight.weight_loader = sharded_loader(1, mp.tp_rank, in_features)
            if bias and not reduce:
                raise ValueError("a row-parallel layer with a bias must reduce its own output")

    def col_map(self) -> tuple[int, int]:
        return self.mp.tp_rank * self.in_features, self.full_in_features

    def forward_onto(self, x: torch.Tensor, onto: torch.Tensor) -> torch.Tensor:
        # (a rank's output is a partial sum, its bias added after the all-reduce: onto is added after too)
        return super().forward_onto(x, onto) if self.mp.tp_size == 1 else self(x) + onto

    def forward(self, x: torch.Tensor, act: str | None = None) -> torch.Tensor:
        if self.mp.tp_size == 1:
            return super().forward(x, act)
        assert act is None, "a row-parallel layer's output is a partial sum: no activation before the all-reduce"
        push = self.mp.fast if self.direct and hasattr(self.mp.fast, "push_args") else None
        # (an adapter's delta joins the partial sum before the all-reduce; the matmul then sends no rows itself)
        y = self._matmul(x, push=push) if self.lora is None else self._forward_lora(x, None, None)
        if self.reduce:
            y = self.mp.all_reduce(y)
            if self.bias is not None:
                y = y + self.bias
        return y


class MergedColumnParallelLinear(MergedLinear):
    """Column-parallel projections of one input stacked along the output (gate|up): each rank holds its
    slice of every shard."""

    def __init__(self, in_features: int, shards: dict[object, int], bias: bool = False,
                 mp: ModelParallel | None = None):
        mp = mp or current()
        local = {k: _divide(n, mp.tp_size, f"shard {k!r}") for k, n in shards.items()}
        sources = {k: (mp.tp_rank * local[k], n) for k, n in shards.items()} if mp.tp_size > 1 else None
        super().__init__(in_features, local, bias, sources)


def kv_heads_of_rank(num_kv_heads: int, mp: ModelParallel) -> tuple[int, int]:
    """(key/value heads, first of them) of this tensor-parallel rank: num_kv_heads / tp, or, when there are fewer
    KV heads than ranks, the one its query heads read (replicated on tp / num_kv_heads ranks)."""
    tp, rank = mp.tp_size, mp.tp_rank
    if num_kv_heads >= tp:
        kv_heads = _divide(num_kv_heads, tp, "key/value heads")
        return kv_heads, rank * kv_heads
    if tp % num_kv_heads:
        raise ValueError(f"the tensor-parallel size {tp} is neither a divisor nor a multiple of the "
                         f"{num_kv_heads} key/value heads")
    return 1, rank // (tp // num_kv_heads)


class QKVParallelLinear(MergedLinear):
    """The fused q|k|v projection over this rank's heads: num_heads / tp query heads, and its key/value
    heads: num_kv_heads / tp of them, or, when there are fewer KV heads than ranks, the one KV head its
    query heads read (replicated on tp / num_kv_heads ranks, as vLLM does)."""

    def __init__(self, in_features: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False,
                 mp: ModelParallel | None = None):
        mp = mp or current()
        tp, rank = mp.tp_size, mp.tp_rank
        heads = _divide(num_heads, tp, "attention heads")
        kv_heads, first_kv = kv_heads_of_rank(num_kv_heads, mp)
        self.num_heads, self.num_kv_heads = heads, kv_heads
        q, kv = heads * head_dim, kv_heads * head_dim
        sources = None
        if tp > 1:
            full_kv = num_kv_heads * head_dim
            sources = {"q": (rank * q, num_heads * head_dim), "k": (first_kv * head_dim, full_kv),
                       "v": (first_kv * head_dim, full_kv)}
        super().__init__(in_features, {"q": q, "k": kv, "v": kv}, bias, sources)
