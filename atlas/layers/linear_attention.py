"""Gated DeltaNet, the linear-attention layer of the hybrid models (Qwen3-Next, Qwen3.5), and its state spec.

A linear-attention layer keeps no per-token cache: per sequence it keeps a fixed-size recurrent state (the
short convolution's last inputs and the delta-rule matrix of every value head; kernels/gated_delta_rule.py).
Its `RecurrentStateSpec` gives the memory plan the bytes of one sequence's state; the runner allocates one pool
of slots per layer (`allocate_state_pools`) and binds each layer to its pool (`bind_state`). The scheduler hands
each running request a slot number (a plain int) when it is admitted and takes it back when it finishes or is
preempted; the runner puts the step's slots in the attention metadata (`state_slots`). With prefix caching the
pools also hold snapshot slots after the running ones (ModelRunner.copy_states saves a slot into one at a prompt
page's end and loads one into a slot at a prefix hit; engine/kv_cache.py). The full-attention layers of the same
model keep the paged KV cache.

One layer, for the rows of one step:
    in_proj -> [q | k | v] (conv channels), z (output gate), b (write strength), a (decay)
    [q | k | v] -> depthwise causal conv1d (kernel K) with silu, continuing from the sequence's conv state
    beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias)
    o = gated delta rule(l2norm(q), l2norm(k), v, g, beta), continuing from the sequence's delta-rule state
    out_proj(RMSNorm(o) * silu(z))      (per value head)

Weights: the four input projections are one fused matrix here, rows [q | k | v | z | b | a] with q, k, v, z in
head order. Qwen3.5 checkpoints store them as in_proj_qkv, in_proj_z, in_proj_b, in_proj_a; Qwen3-Next ones as
in_proj_qkvz and in_proj_ba with the rows grouped by key head ([q_h | k_h | v_h.. | z_h..] per key head h), which
`split_grouped_qkvz` / `split_grouped_ba` put in head order as they load (`grouped_qkvz_of_rank` /
`grouped_ba_of_rank`: only a tensor-parallel rank's key-head groups, read alone).

Tensor parallelism: a rank holds num_k_heads / tp key heads and the num_v_heads / tp value heads that read them
(contiguous blocks of both), so its fused rows are [its q | its k | its v | its z | its b | its a] and its conv
channels its q, k and v channels (three row ranges of the checkpoint's [q | k | v]); out_proj is row-parallel (one
all-reduce), and the state spec, so the pools and the memory plan, counts only the rank's heads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from atlas.kernels.gated_delta_rule import (
    STATE_DTYPE,
    RecurrentRows,
    causal_conv1d_rows,
    causal_conv1d_uniform,
    causal_conv1d_varlen,
    gated_delta_rule_rows,
    gated_delta_rule_uniform,
    gated_delta_rule_varlen,
    gates,
    rms_norm_gated,
)
from atlas.layers.attention import AttentionMetadata
from atlas.layers.linear import (
    MergedLinear,
    RowParallelLinear,
    loaded_shape,
    narrow_loaded,
    plain_weight,
    sharded_loader,
    takes_slices,
)
from atlas.layers.parallel import current


@dataclass(frozen=True)
class RecurrentStateSpec:
    """What one recurrent layer keeps per sequence: the conv state [conv_dim, conv_kernel - 1] (model dtype) and
    the state matrices [num_heads, key_dim, value_dim] (float32): Gated DeltaNet's delta-rule state, Mamba-2's
    [state size, head dim] a head (layers/mamba2.py), Mamba's [state size, 1] a channel (layers/mamba1.py), none for
    LFM2's short convolution (layers/short_conv.py)."""

    conv_dim: int
    conv_kernel: int
    num_heads: int
    key_dim: int
    value_dim: int
    # (the per-head inputs a verify row saves besides the conv input: a and b; Mamba-2's dt; none where a replay
    #  recomputes everything from the conv input)
    gates_per_head: int = 2
    # Transient copies of a sequence's state matrices that a replay of the layer (speculative decoding) may allocate:
    # none for Gated DeltaNet's fused kernel, a few for the Mamba layers' PyTorch recurrences (the replay graphs'
    # memory; reserved whichever path runs).
    replay_state_copies: int = 0

    @property
    def verify_row_values(self) -> int:
        """Values of one row's saved inputs for a replay (runtime/state_slots.py): the conv input and the gates."""
        return self.conv_dim + self.gates_per_head * self.num_heads

    def conv_shape(self, num_slots: int) -> tuple[int, ...]:
        return (num_slots, self.conv_dim, self.conv_kernel - 1)

    def ssm_shape(self, num_slots: int) -> tuple[int, ...]:
        return (num_slots, self.num_heads, self.key_dim, self.value_dim)

    def bytes_per_sequence(self, dtype: torch.dtype) -> int:
        conv = self.conv_dim * (self.conv_kernel - 1) * torch.empty((), dtype=dtype).element_size()
        ssm = self.num_heads * self.key_dim * self.value_dim * torch.empty((), dtype=STATE_DTYPE).element_size()
        return conv + ssm


def state_bytes_per_sequence(specs: list[RecurrentStateSpec], dtype: torch.dtype) -> int:
    return sum(spec.bytes_per_sequence(dtype) for spec in specs)


def allocate_state_pools(specs: list[RecurrentStateSpec], num_slots: int, dtype: torch.dtype, device: torch.device
                         ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list[tuple[torch.Tensor, torch.Tensor]]]:
    """(conv state pool, delta-rule state pool) per layer, zeroed, num_slots slots each; the layers of one spec share
    one stacked tensor of each kind ([layers, slots, ...], each layer's pool a view of it), so that a copy between
    slots is one launch per kind for all of them. -> (per-layer pools, the stacks)."""
    groups: dict[RecurrentStateSpec, list[int]] = {}
    for i, spec in enumerate(specs):
        groups.setdefault(spec, []).append(i)
    pools: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(specs)
    stacks = []
    for spec, layers in groups.items():
        conv = torch.zeros(len(layers), *spec.conv_shape(num_slots), dtype=dtype, device=device)
        ssm = torch.zeros(len(layers), *spec.ssm_shape(num_slots), dtype=STATE_DTYPE, device=device)
        stacks.append((conv, ssm))
        for j, i in enumerate(layers):
            pools[i] = (conv[j], ssm[j])
    return pools, stacks


def _heads_of_rank(total: int, tp: int, what: str) -> int:
    if total % tp:
        raise ValueError(f"the tensor-parallel size {tp} does not divide the {total} {what}")
    return total // tp


class _ConvChannels:
    """Where this rank's [q | k | v] conv channels (its key heads' q and k, its value heads' v) lie in the
    checkpoint's [q | k | v] rows: (piece, first row here, first row in the checkpoint, rows)."""

    def __init__(self, key_dim: int, value_dim: int, tp: int, rank: int):
        full_key, full_value = key_dim * tp, value_dim * tp
        self.rows = 2 * full_key + full_value
        self.pieces = [("q", 0, rank * key_dim, key_dim), ("k", key_dim, full_key + rank * key_dim, key_dim),
                       ("v", 2 * key_dim, 2 * full_key + rank * value_dim, value_dim)]

    def copy(self, target: torch.Tensor, loaded, what: str) -> None:
        shape = loaded_shape(loaded)
        if not shape or shape[0] != self.rows or tuple(shape[1:]) != tuple(target.shape[1:]):
            raise ValueError(f"shape mismatch for {what}: expected ({self.rows}, {', '.join(map(str, target.shape[1:]))})"
                             f", got {shape}")
        for _, here, first, rows in self.pieces:
            target.narrow(0, here, rows).copy_(narrow_loaded(loaded, 0, first, rows))


class _InProj(MergedLinear):
    """q, k, v, z, b, a of this rank's heads stacked; the checkpoint's in_proj_qkv (shard "qkv") fills q, k and v."""

    def __init__(self, hidden: int, channels: _ConvChannels, shards: dict[str, int],
                 sources: dict[str, tuple[int, int]] | None):
        super().__init__(hidden, shards, sources=sources)
        self.channels = channels

    @takes_slices
    def _load_shard(self, param: nn.Parameter, loaded, shard_id: object) -> None:
        if shard_id != "qkv":
            return super()._load_shard(param, loaded, shard_id)
        offset = self.shard_offsets["q"][0]
        self.channels.copy(param.data.narrow(0, offset, sum(r for *_, r in self.channels.pieces)), loaded,
                           "shard 'qkv'")
        self.loaded_shards["weight"].update(("q", "k", "v"))


class GatedDeltaNet(nn.Module):
    """Under tensor parallelism a rank holds num_k_heads / tp key heads and num_v_heads / tp value heads (the value
    heads that read its key heads): its rows of every input projection and conv channel, its columns of out_proj
    (row-parallel: one all-reduce), and a state of only its heads."""

    def __init__(self, hidden_size: int, num_k_heads: int, num_v_heads: int, head_k_dim: int, head_v_dim: int,
                 conv_kernel: int, eps: float, act: str = "silu"):
        super().__init__()
        if num_v_heads % num_k_heads:
            raise ValueError(f"linear_num_value_heads ({num_v_heads}) is not a multiple of linear_num_key_heads "
                             f"({num_k_heads})")
        if act not in ("silu", "swish"):
            from atlas.errors import UnsupportedModelError

            raise UnsupportedModelError(f"a Gated DeltaNet layer with hidden_act {act!r}: Atlas implements silu")
        mp = current()
        tp, rank = mp.tp_size, mp.tp_rank
        # (contiguous blocks of heads: value head j reads key head j // (num_v_heads / num_k_heads) on every rank)
        self.num_k_heads = _heads_of_rank(num_k_heads, tp, "linear-attention key heads (linear_num_key_heads)")
        self.num_v_heads = _heads_of_rank(num_v_heads, tp, "linear-attention value heads (linear_num_value_heads)")
        self.head_k_dim, self.head_v_dim = head_k_dim, head_v_dim
        self.key_dim, self.value_dim = self.num_k_heads * head_k_dim, self.num_v_heads * head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv_kernel = conv_kernel
        channels = _ConvChannels(self.key_dim, self.value_dim, tp, rank)
        nv = self.num_v_heads
        shards = {"q": self.key_dim, "k": self.key_dim, "v": self.value_dim, "z": self.value_dim, "b": nv, "a": nv}
        sources = {"z": (rank * self.value_dim, tp * self.value_dim), "b": (rank * nv, tp * nv),
                   "a": (rank * nv, tp * nv)} if tp > 1 else None
        # (in the model dtype in an FP8 model too, its FP8 checkpoint tensors dequantized as they load: the scales of
        #  the checkpoint's [q | k | v] rows would have to be cut by head like the rows, and Qwen3-Next's grouped
        #  qkvz regrouped; out_proj, attention, MLPs and experts keep FP8)
        with plain_weight():
            self.in_proj = _InProj(hidden_size, channels, shards, sources)
        # [C, 1, K] as checkpoints store the depthwise conv1d weight
        self.conv1d = nn.Module()
        self.conv1d.weight = nn.Parameter(torch.empty(self.conv_dim, 1, conv_kernel))
        self.conv1d.weight.weight_loader = takes_slices(
            lambda param, loaded, shard=None: channels.copy(param.data, loaded, "conv1d.weight"))
        self.A_log = nn.Parameter(torch.empty(nv))
        self.dt_bias = nn.Parameter(torch.empty(nv))
        if tp > 1:
            self.A_log.weight_loader = sharded_loader(0, rank, num_v_heads)
            self.dt_bias.weight_loader = sharded_loader(0, rank, num_v_heads)
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.empty(head_v_dim))
        self.eps = eps
        self.out_proj = RowParallelLinear(num_v_heads * head_v_dim, hidden_size)
        # This layer's state pools (conv, delta rule), bound by the runner; None: no state is kept (every call
        # starts from zeros, as a profiling forward does).
        self.conv_state: torch.Tensor | None = None
        self.ssm_state: torch.Tensor | None = None
        # With speculative decoding: the inputs (conv input, a, b) of the rows of each slot's last verify step
        # [slots, rows, conv_dim + 2 * num_v_heads], for a replay after a rejection (runtime/state_slots.py).
        self.verify_inputs: torch.Tensor | None = None

    def state_spec(self) -> RecurrentStateSpec:
        return RecurrentStateSpec(self.conv_dim, self.conv_kernel, self.num_v_heads, self.head_k_dim,
                                  self.head_v_dim)

    def bind_state(self, conv_state: torch.Tensor | None, ssm_state: torch.Tensor | None,
                   verify_inputs: torch.Tensor | None = None) -> None:
        self.conv_state, self.ssm_state, self.verify_inputs = conv_state, ssm_state, verify_inputs

    def _save_verify_inputs(self, mixed: torch.Tensor, a: torch.Tensor, b: torch.Tensor, meta: AttentionMetadata | None,
                            q_len: int | None, save_index: torch.Tensor | None = None) -> None:
        save_verify_inputs(self.verify_inputs, torch.cat([mixed, a, b], dim=-1), meta, q_len, save_index)

    def _advance(self, mixed: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor,
                 starts: torch.Tensor, q_len: int) -> torch.Tensor:
        """A uniform step's state update of this layer (every sequence q_len rows; slots, starts on the device):
        the convolution and the delta rule -> o [rows, Hv, Dv] before the gated norm."""
        mixed = causal_conv1d_uniform(mixed, self.conv1d.weight[:, 0], self.conv_state, slots, starts, q_len)
        return gated_delta_rule_uniform(*self._heads(mixed), a, b, self.A_log, self.dt_bias, self.ssm_state, slots,
                                        starts, q_len)

    def _heads(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The convolution's output [T, conv_dim] as q, k [T, key heads, Dk] and v [T, value heads, Dv]."""
        T = mixed.shape[0]
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        return (q.reshape(T, self.num_k_heads, self.head_k_dim), k.reshape(T, self.num_k_heads, self.head_k_dim),
                v.reshape(T, self.num_v_heads, self.head_v_dim))

    def replay(self, slots: torch.Tensor, rows: int) -> None:
        """Advance the state at `slots` [n] by the first `rows` rows of each one's last verify step, from their saved
        inputs (the slots hold the state from before that step: runtime/state_slots.py restored their backups)."""
        saved = self.verify_inputs.index_select(0, slots)[:, :rows].reshape(slots.shape[0] * rows, -1)
        mixed, a, b = saved.split([self.conv_dim, self.num_v_heads, self.num_v_heads], dim=-1)
        self._advance(mixed, a, b, slots, torch.ones_like(slots, dtype=torch.bool), rows)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """x [T, hidden] (the step's rows) -> [T, hidden]; each sequence's state advances by its rows."""
        T = x.shape[0]
        proj = self.in_proj(x)
        mixed, z, b, a = proj.split([self.conv_dim, self.value_dim, self.num_v_heads, self.num_v_heads], dim=-1)
        if meta.state_rows is not None and self.conv_state is not None:
            o = self._advance_rows(mixed, a, b, meta.state_rows)
        else:
            o = self._advance_step(mixed, a, b, meta)
        o = rms_norm_gated(o.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim), self.norm.weight,
                           self.eps)
        return self.out_proj(o.reshape(T, self.value_dim))

    def _advance_rows(self, mixed: torch.Tensor, a: torch.Tensor, b: torch.Tensor, rows: RecurrentRows
                      ) -> torch.Tensor:
        """A mixed step of the CUDA graphs (runtime/mixed_graphs.py): sequences of any lengths, every number on the
        device -> o [rows, Hv, Dv] before the gated norm."""
        if self.verify_inputs is not None and rows.save_index is not None:
            self._save_verify_inputs(mixed, a, b, meta=None, q_len=None, save_index=rows.save_index)
        mixed = causal_conv1d_rows(mixed, self.conv1d.weight[:, 0], self.conv_state, rows)
        return gated_delta_rule_rows(*self._heads(mixed), a, b, self.A_log, self.dt_bias, self.ssm_state, rows)

    def _advance_step(self, mixed: torch.Tensor, a: torch.Tensor, b: torch.Tensor, meta: AttentionMetadata
                      ) -> torch.Tensor:
        """Any other step: a uniform one of the CUDA graphs, or an eager one (host lists) -> o before the gated
        norm."""
        T = mixed.shape[0]
        slots = meta.state_slots_cpu
        keep = slots is not None and self.conv_state is not None
        # A step of the CUDA graphs (runtime/cuda_graphs.py): every sequence q rows, its slot (padding sequences:
        # the scratch slot) and length only on the device, so the state is read and written from device tensors.
        uniform = slots is None and meta.state_slots is not None and self.conv_state is not None
        q_len = T // meta.state_slots.shape[0] if uniform else None
        if self.verify_inputs is not None and (uniform or keep):
            self._save_verify_inputs(mixed, a, b, meta, q_len)
        if uniform:
            if meta.state_continues is None:  # (False: the sequence's first row is its position 0)
                meta.state_continues = meta.seq_lens > q_len
            o = self._advance(mixed, a, b, meta.state_slots, meta.state_continues, q_len)
        else:
            qsl, lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
            splits = meta.state_splits if keep else ()
            mixed = causal_conv1d_varlen(mixed, self.conv1d.weight[:, 0], self.conv_state if keep else None, qsl,
                                         lens, slots, splits=splits, cache=meta.varlen_cache)
            g, beta = gates(a, b, self.A_log, self.dt_bias)
            o = gated_delta_rule_varlen(*self._heads(mixed), g, beta, self.ssm_state if keep else None, qsl, lens,
                                        slots, splits=splits, cache=meta.varlen_cache)
        return o


def save_verify_inputs(buffer: torch.Tensor, rows: torch.Tensor, meta: AttentionMetadata | None, q_len: int | None,
                       save_index: torch.Tensor | None = None) -> None:
    """Keep a recurrent layer's inputs `rows` [T, values] of this step's sequences that may verify drafts (1 < rows
    <= the buffer's) in its verify-input buffer [slots, rows, values]: a uniform step's all at once (device slots: a
    CUDA graph holds it), a mixed step of the CUDA graphs' by its row index into the buffer
    (RecurrentRows.save_index), an eager step's one sequence at a time."""
    if save_index is not None:
        buffer.view(-1, buffer.shape[-1]).index_copy_(0, save_index, rows)
        return
    if q_len is not None:
        if 1 < q_len <= buffer.shape[1]:
            n = meta.state_slots.shape[0]
            buffer.narrow(1, 0, q_len).index_copy_(0, meta.state_slots, rows.view(n, q_len, -1))
        return
    qsl = meta.query_start_loc_cpu
    for i, slot in enumerate(meta.state_slots_cpu):
        first, last = qsl[i], qsl[i + 1]
        if 1 < last - first <= buffer.shape[1]:
            buffer[slot, : last - first] = rows[first:last]


def split_grouped_qkvz(w: torch.Tensor, num_k_heads: int, num_v_heads: int, head_k_dim: int, head_v_dim: int
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3-Next's in_proj_qkvz [key heads x (q | k | v.. | z..), hidden] -> ([q | k | v] in head order, z)."""
    r = num_v_heads // num_k_heads
    per_head = 2 * head_k_dim + 2 * r * head_v_dim
    if w.dim() != 2 or w.shape[0] != num_k_heads * per_head:
        raise ValueError(f"shape mismatch: expected ({num_k_heads * per_head}, hidden), got {tuple(w.shape)}")
    q, k, v, z = w.view(num_k_heads, per_head, -1).split([head_k_dim, head_k_dim, r * head_v_dim, r * head_v_dim],
                                                         dim=1)
    hidden = w.shape[-1]
    return torch.cat([t.reshape(-1, hidden) for t in (q, k, v)]), z.reshape(-1, hidden)


def split_grouped_ba(w: torch.Tensor, num_k_heads: int, num_v_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3-Next's in_proj_ba [key heads x (b.. | a..), hidden] -> (b, a) in value-head order."""
    r = num_v_heads // num_k_heads
    if w.dim() != 2 or w.shape[0] != 2 * num_v_heads:
        raise ValueError(f"shape mismatch: expected ({2 * num_v_heads}, hidden), got {tuple(w.shape)}")
    b, a = w.view(num_k_heads, 2 * r, -1).split([r, r], dim=1)
    return b.reshape(-1, w.shape[-1]), a.reshape(-1, w.shape[-1])


class RankRows:
    """A checkpoint tensor of `shape` of which only this tensor-parallel rank's row ranges were read: it serves them to
    the loaders, which read row slices of it (layers.linear.narrow_loaded) as of a lazy safetensors slice."""

    def __init__(self, shape: tuple[int, ...], pieces: list[tuple[int, torch.Tensor]]):
        self.shape, self.pieces = tuple(shape), pieces  # (first row in the whole tensor, its rows)

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def get_dtype(self) -> str:
        return _SAFETENSORS_CODES[self.pieces[0][1].dtype]

    def __getitem__(self, index) -> torch.Tensor:
        rows, rest = (index[0], index[1:]) if isinstance(index, tuple) else (index, ())
        start, stop, step = rows.indices(self.shape[0])
        for first, t in self.pieces:
            if step == 1 and first <= start and stop <= first + t.shape[0]:
                return t[(slice(start - first, stop - first), *rest)]
        raise ValueError(f"rows {start}..{stop - 1} of a tensor of shape {self.shape} belong to another "
                         "tensor-parallel rank")


_SAFETENSORS_CODES = {torch.float16: "F16", torch.bfloat16: "BF16", torch.float32: "F32", torch.float64: "F64"}


def grouped_qkvz_of_rank(loaded, num_k_heads: int, num_v_heads: int, head_k_dim: int, head_v_dim: int, tp: int,
                         rank: int):
    """This rank's rows of Qwen3-Next's in_proj_qkvz (its key heads' groups, contiguous: only they are read), as the
    ([q | k | v] in head order, z) that split_grouped_qkvz makes of the whole (RankRows under tensor parallelism)."""
    r = num_v_heads // num_k_heads
    per_head = 2 * head_k_dim + 2 * r * head_v_dim
    shape = loaded_shape(loaded)
    if len(shape) != 2 or shape[0] != num_k_heads * per_head:
        raise ValueError(f"shape mismatch: expected ({num_k_heads * per_head}, hidden), got {shape}")
    nk, nv = num_k_heads // tp, num_v_heads // tp
    qkv, z = split_grouped_qkvz(narrow_loaded(loaded, 0, rank * nk * per_head, nk * per_head), nk, nv, head_k_dim,
                                head_v_dim)
    if tp == 1:
        return qkv, z
    key, value, full_key = nk * head_k_dim, nv * head_v_dim, num_k_heads * head_k_dim
    q, k, v = qkv.split([key, key, value])
    return (RankRows((2 * full_key + num_v_heads * head_v_dim, shape[1]),
                     [(rank * key, q), (full_key + rank * key, k), (2 * full_key + rank * value, v)]),
            RankRows((num_v_heads * head_v_dim, shape[1]), [(rank * value, z)]))


def grouped_ba_of_rank(loaded, num_k_heads: int, num_v_heads: int, tp: int, rank: int):
    """This rank's rows of Qwen3-Next's in_proj_ba, as the (b, a) that split_grouped_ba makes of the whole."""
    shape = loaded_shape(loaded)
    if len(shape) != 2 or shape[0] != 2 * num_v_heads:
        raise ValueError(f"shape mismatch: expected ({2 * num_v_heads}, hidden), got {shape}")
    nk, nv = num_k_heads // tp, num_v_heads // tp
    b, a = split_grouped_ba(narrow_loaded(loaded, 0, rank * 2 * nv, 2 * nv), nk, nv)
    if tp == 1:
        return b, a
    return (RankRows((num_v_heads, shape[1]), [(rank * nv, b)]), RankRows((num_v_heads, shape[1]), [(rank * nv, a)]))
