"""Mamba-2, the state-space token mixer of the Mamba-2 hybrid models (Granite 4.0-H, Bamba, Nemotron-H, Falcon-H1),
and its state spec.

Like a Gated DeltaNet layer (layers/linear_attention.py) it keeps no per-token cache: per sequence it keeps the
short convolution's last inputs and one state matrix per head, in a slot of the runner's state pools (the same
RecurrentStateSpec, pools, snapshots for prefix caching and verify-input buffer for speculative decoding).

One layer, for the rows of one step (I = num_heads * head_dim, G groups of state size N):
    in_proj -> z [I] (output gate), xBC [I + 2 G N] (conv channels), dt [num_heads]
    xBC -> depthwise causal conv1d (kernel K, with its bias) with silu, continuing from the sequence's conv state
    x [heads, P], B, C [G, N] (head h reads group h // (heads / G))
    y = SSD(x, softplus(dt + dt_bias) clamped to time_step_limit, A = -exp(A_log), B, C) + D * x   (kernels/mamba2.py)
    out_proj(RMSNorm_per_group(y * silu(z)) * weight)       (the norm over each group's I / G channels, float32)

The scan's decode and verify rows take one Triton launch on CUDA (kernels/mamba2_triton.py), as does the biased
convolution; prompts take the chunked form in PyTorch (kernels/mamba2.py). A uniform step of the CUDA graphs holds
them (no host value read), a mixed step does not (the model keeps its mixed steps eager:
CausalLM.recurrent_state_in_mixed_graphs).

Tensor parallelism: a rank holds num_heads / tp heads (a contiguous block: their z, x and dt rows of in_proj, their
conv channels, dt_bias, A_log, D and norm weights, a state of only those heads; out_proj row-parallel, one
all-reduce) and the B and C of the groups its heads read: its whole groups where tp divides n_groups, else the one
group it shares with tp / n_groups - 1 other ranks (Granite 4.0-H's single group: every rank reads it whole), whose
gated norm then sums its squares over those ranks (one all-reduce of [tokens, n_groups] floats).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from atlas.errors import UnsupportedModelError
from atlas.kernels.gated_delta_rule import causal_conv1d_uniform, causal_conv1d_varlen
from atlas.kernels.mamba2 import DEFAULT_CHUNK, ssd_uniform, ssd_varlen, time_steps
from atlas.layers.attention import AttentionMetadata
from atlas.layers.linear import (
    Linear,
    RowParallelLinear,
    loaded_shape,
    narrow_loaded,
    plain_weight,
    sharded_loader,
    takes_slices,
)
from atlas.layers.linear_attention import RecurrentStateSpec, save_verify_inputs
from atlas.layers.parallel import ModelParallel, current


def gated_group_rms_norm(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, groups: int, eps: float,
                         spread: tuple[ModelParallel, int, int] | None = None, before_gate: bool = False
                         ) -> torch.Tensor:
    """Mamba-2's output norm: y * silu(z) [T, I] in float32, RMS-normalised over each of `groups` equal groups of
    channels, times weight [I] (in the weight's dtype: the model's). before_gate (Falcon-H1's
    mamba_norm_before_gate): RMSNorm(y) times weight, in float32, then times silu(z). spread (mp, the whole model's
    groups, this rank's group): the rank holds part of one group, whose other parts other ranks hold; the group's
    sum of squares is the sum over its ranks (one all-reduce of [T, whole groups], each rank's partial in its group's
    column)."""
    h = y.float() if before_gate else y.float() * F.silu(z.float())
    g = h.view(h.shape[0], groups, -1)
    if spread is None:
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + eps)
    else:
        mp, whole, mine = spread
        sums = h.new_zeros(h.shape[0], whole)
        sums[:, mine] = g.pow(2).sum(-1)[:, 0]
        share = mp.tp_size // whole  # (ranks a group spans)
        g = g * torch.rsqrt(mp.all_reduce(sums)[:, mine, None, None] / (g.shape[-1] * share) + eps)
    if before_gate:
        return ((weight.float() * g.view(h.shape)) * F.silu(z.float())).to(weight.dtype)
    return weight * g.view(h.shape).to(weight.dtype)


class RowPieces:
    """Where this rank's rows of a fused checkpoint tensor lie: (first row here, first row there, rows) pieces of a
    tensor of `total` rows (the in_proj's z | x | B | C | dt, the convolution's x | B | C); `loader` makes the weight
    loader that copies them."""

    def __init__(self, total: int, pieces: list[tuple[int, int, int]]):
        self.total, self.pieces = total, pieces

    @property
    def rows(self) -> int:
        return sum(n for _, _, n in self.pieces)

    def loader(self, what: str):
        @takes_slices
        def load(param: nn.Parameter, loaded, shard_id: object = None) -> None:
            shape = loaded_shape(loaded)
            if not shape or shape[0] != self.total or tuple(shape[1:]) != tuple(param.shape[1:]):
                raise ValueError(f"shape mismatch for {what}: expected ({self.total}, "
                                 f"{', '.join(map(str, param.shape[1:]))}), got {shape}")
            for here, there, n in self.pieces:
                param.data.narrow(0, here, n).copy_(narrow_loaded(loaded, 0, there, n))
        return load


class Mamba2Mixer(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, state_size: int, n_groups: int,
                 conv_kernel: int, eps: float, conv_bias: bool = True, proj_bias: bool = False,
                 time_step_limit: tuple[float, float] = (0.0, float("inf")), chunk_size: int = DEFAULT_CHUNK,
                 act: str = "silu", norm: str = "gated", in_scale: float = 1.0,
                 section_scales: tuple[float, float, float, float, float] | None = None):
        """norm: the output's gated RMSNorm, "gated" (norm(y * silu(z)) * weight, Mamba-2's), "before_gate"
        (norm(y) * weight * silu(z)) or "none" (y * silu(z), no norm weight); in_scale: the input's multiplier;
        section_scales: multipliers of the in_proj output's z, x, B, C and dt rows (Falcon-H1's ssm_in_multiplier
        and ssm_multipliers)."""
        super().__init__()
        if norm not in ("gated", "before_gate", "none"):
            raise ValueError(f"unknown Mamba-2 output norm {norm!r}")
        if act not in ("silu", "swish"):
            raise UnsupportedModelError(f"a Mamba-2 layer with hidden_act {act!r}: Atlas implements silu")
        if num_heads % n_groups:
            raise ValueError(f"mamba_n_heads ({num_heads}) is not a multiple of mamba_n_groups ({n_groups})")
        mp = current()
        tp, rank = mp.tp_size, mp.tp_rank
        if num_heads % tp or (n_groups % tp and tp % n_groups):
            raise ValueError(f"the tensor-parallel size {tp} does not split the Mamba-2 layers' {num_heads} heads "
                             f"in {n_groups} groups (it must divide the heads, and divide or be a multiple of the "
                             "groups)")
        # This rank's heads (a contiguous block) and the groups they read: its whole groups where the ranks split
        # them, else part of one group (`spread`: its norm sums over the group's ranks).
        heads, groups = num_heads // tp, max(n_groups // tp, 1)
        first_group = rank * groups if n_groups >= tp else rank // (tp // n_groups)
        self.spread = (mp, n_groups, first_group) if n_groups < tp else None
        self.num_heads, self.head_dim, self.state_size, self.n_groups = heads, head_dim, state_size, groups
        self.intermediate = heads * head_dim
        self.conv_dim = self.intermediate + 2 * groups * state_size
        full_i, gn = num_heads * head_dim, n_groups * state_size
        mine_i, mine_g = rank * self.intermediate, first_group * state_size
        local_g = groups * state_size
        conv_rows = RowPieces(full_i + 2 * gn, [(0, mine_i, self.intermediate),
                                                 (self.intermediate, full_i + mine_g, local_g),
                                                 (self.intermediate + local_g, full_i + gn + mine_g, local_g)])
        in_rows = RowPieces(2 * full_i + 2 * gn + num_heads, [
            (0, mine_i, self.intermediate),
            *((self.intermediate + here, full_i + there, n) for here, there, n in conv_rows.pieces),
            (self.intermediate + self.conv_dim, 2 * full_i + 2 * gn + rank * heads, heads)])
        self.conv_kernel = conv_kernel
        self.eps = eps
        self.time_step_limit = (float(time_step_limit[0]), float(time_step_limit[1]))
        # (the chunk of the prompt scan: the checkpoint's (Granite's 256) where it is at most 64, whose intra-chunk
        #  products' memory grows with its square; the sums are the same recurrence in another order)
        self.chunk_size = min(chunk_size, DEFAULT_CHUNK)
        # (the model dtype whatever a checkpoint's quantization: the model families with these layers load none)
        with plain_weight():
            self.in_proj = Linear(hidden_size, in_rows.rows, bias=proj_bias)
            self.out_proj = RowParallelLinear(full_i, hidden_size, bias=proj_bias)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, conv_kernel, groups=self.conv_dim, bias=conv_bias)
        self.dt_bias = nn.Parameter(torch.empty(heads))
        self.A_log = nn.Parameter(torch.empty(heads))
        self.D = nn.Parameter(torch.empty(heads))
        self.norm_kind, self.in_scale = norm, float(in_scale)
        if norm != "none":
            self.norm = nn.Module()
            self.norm.weight = nn.Parameter(torch.empty(self.intermediate))
        # (each in_proj row's multiplier, in this rank's row order: z, x, B, C, dt)
        scales = None
        if section_scales is not None and any(v != 1.0 for v in section_scales):
            widths = [self.intermediate, self.intermediate, local_g, local_g, heads]
            scales = torch.cat([torch.full((w,), float(v)) for w, v in zip(widths, section_scales, strict=True)])
        self.register_buffer("section_scales", scales, persistent=False)
        if tp > 1:
            for param, pieces, what in ((self.in_proj.weight, in_rows, "in_proj.weight"),
                                        (self.in_proj.bias, in_rows, "in_proj.bias"),
                                        (self.conv1d.weight, conv_rows, "conv1d.weight"),
                                        (self.conv1d.bias, conv_rows, "conv1d.bias")):
                if param is not None:
                    param.weight_loader = pieces.loader(what)
            for param in (self.dt_bias, self.A_log, self.D):
                param.weight_loader = sharded_loader(0, rank, num_heads)
            if norm != "none":
                self.norm.weight.weight_loader = sharded_loader(0, rank, full_i)
        # This layer's state pools (conv, SSM), bound by the runner; None: no state is kept (a profiling forward).
        self.conv_state: torch.Tensor | None = None
        self.ssm_state: torch.Tensor | None = None
        # With speculative decoding: the inputs (conv input, dt) of the rows of each slot's last verify step.
        self.verify_inputs: torch.Tensor | None = None

    def state_spec(self) -> RecurrentStateSpec:
        # (the state of a head [state size, head dim]: y = S^T C as Gated DeltaNet's o = S^T q; replays allocate a
        #  few state-sized temporaries in PyTorch)
        return RecurrentStateSpec(self.conv_dim, self.conv_kernel, self.num_heads, self.state_size, self.head_dim,
                                  gates_per_head=1, replay_state_copies=4)

    def bind_state(self, conv_state: torch.Tensor | None, ssm_state: torch.Tensor | None,
                   verify_inputs: torch.Tensor | None = None) -> None:
        self.conv_state, self.ssm_state, self.verify_inputs = conv_state, ssm_state, verify_inputs

    def _scan_inputs(self, xbc: torch.Tensor, dt: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The convolution's output [T, conv_dim] and the raw dt [T, heads] -> x [T, heads, P], dt (time_steps),
        A [heads], B, C [T, groups, N] (views of the convolution's output)."""
        T = xbc.shape[0]
        x, B, C = xbc.split([self.intermediate, self.n_groups * self.state_size, self.n_groups * self.state_size],
                            dim=-1)
        return (x.view(T, self.num_heads, self.head_dim), time_steps(dt, self.dt_bias, self.time_step_limit),
                -self.A_log.float().exp(), B.view(T, self.n_groups, self.state_size),
                C.view(T, self.n_groups, self.state_size))

    def _advance(self, xbc: torch.Tensor, dt: torch.Tensor, slots: torch.Tensor, keep: torch.Tensor, q_len: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """A uniform step's state update (every sequence q_len rows; slots, keep on the device) -> (y [T, heads, P]
        float32 before the D skip, x)."""
        xbc = causal_conv1d_uniform(xbc, self.conv1d.weight[:, 0], self.conv_state, slots, keep, q_len,
                                    bias=self.conv1d.bias)
        x, dt, A, B, C = self._scan_inputs(xbc, dt)
        return ssd_uniform(x, dt, A, B, C, self.ssm_state, slots, keep, q_len), x

    def replay(self, slots: torch.Tensor, rows: int) -> None:
        """Advance the state at `slots` [n] by the first `rows` rows of each one's last verify step, from their saved
        inputs (the slots hold the state from before that step: runtime/state_slots.py restored their backups)."""
        saved = self.verify_inputs.index_select(0, slots)[:, :rows].reshape(slots.shape[0] * rows, -1)
        xbc, dt = saved.split([self.conv_dim, self.num_heads], dim=-1)
        self._advance(xbc, dt, slots, torch.ones_like(slots, dtype=torch.bool), rows)

    def forward(self, h: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """h [T, hidden] (the step's rows) -> [T, hidden]; each sequence's state advances by its rows."""
        T = h.shape[0]
        if self.in_scale != 1.0:
            h = h * self.in_scale
        proj = self.in_proj(h)
        if self.section_scales is not None:
            proj = proj * self.section_scales
        z, xbc, dt = proj.split([self.intermediate, self.conv_dim, self.num_heads], dim=-1)
        if meta.state_rows is not None and self.conv_state is not None:
            raise RuntimeError("a Mamba-2 layer in a mixed-step CUDA graph: its model keeps mixed steps eager")
        slots = meta.state_slots_cpu
        keep = slots is not None and self.conv_state is not None
        uniform = slots is None and meta.state_slots is not None and self.conv_state is not None
        q_len = T // meta.state_slots.shape[0] if uniform else None
        if self.verify_inputs is not None and (uniform or keep):
            save_verify_inputs(self.verify_inputs, torch.cat([xbc, dt], dim=-1), meta, q_len)
        if uniform:
            if meta.state_continues is None:  # (False: the sequence's first row is its position 0)
                meta.state_continues = meta.seq_lens > q_len
            y, x = self._advance(xbc, dt, meta.state_slots, meta.state_continues, q_len)
        else:
            qsl, lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
            splits = meta.state_splits if keep else ()
            xbc = causal_conv1d_varlen(xbc, self.conv1d.weight[:, 0], self.conv_state if keep else None, qsl, lens,
                                       slots, splits=splits, cache=meta.varlen_cache, bias=self.conv1d.bias)
            x, dt, A, B, C = self._scan_inputs(xbc, dt)
            y = ssd_varlen(x, dt, A, B, C, self.ssm_state if keep else None, qsl, lens, slots, self.chunk_size,
                           splits=splits, cache=meta.varlen_cache)
        y = y + self.D.float()[:, None] * x.float()
        y = y.view(T, self.intermediate)
        if self.norm_kind == "none":
            out = (y * F.silu(z.float())).to(z.dtype)
        else:
            out = gated_group_rms_norm(y, z, self.norm.weight, self.n_groups, self.eps, self.spread,
                                       before_gate=self.norm_kind == "before_gate")
        return self.out_proj(out)
