"""Mamba (version 1), the state-space token mixer of Jamba's Mamba layers, and its state spec.

One layer, for the rows of one step (D = mamba_expand x hidden channels, N the state size, R = dt_rank):
    in_proj -> x [D], z [D] (output gate)
    x -> depthwise causal conv1d (kernel K, with its bias) with silu, continuing from the sequence's conv state
    x_proj(x) -> dt [R], B [N], C [N], each RMS-normalised (Jamba's dt_layernorm, b_layernorm, c_layernorm)
    y = scan(x, softplus(dt_proj(dt)), A = -exp(A_log) [D, N], B, C) + D_skip * x     (kernels/mamba1.py)
    out_proj(y * silu(z))

Per sequence it keeps the convolution's last inputs and the scan's state [D, N] (float32), in the runner's state
slots as the other recurrent layers' (layers/linear_attention.RecurrentStateSpec with D "heads" of an [N, 1]
matrix): prefix-cache snapshots, speculative backups and replays (from the saved convolution inputs) included. On
CUDA the convolution and the scan are one Triton launch each, decode, verify and prompt rows alike; uniform steps
replay CUDA graphs, mixed steps run eagerly.

Tensor parallelism: a rank holds D / tp channels (their in_proj rows, conv channels, dt_proj rows, A_log, D and a
state of only those); x_proj is row-parallel (its dt, B and C all-reduced: every channel reads all of them) and
out_proj row-parallel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from atlas.kernels.gated_delta_rule import causal_conv1d_uniform, causal_conv1d_varlen
from atlas.kernels.mamba1 import scan_uniform, scan_varlen
from atlas.layers.attention import AttentionMetadata
from atlas.layers.linear import ColumnParallelLinear, Linear, RowParallelLinear, plain_weight, sharded_loader
from atlas.layers.linear_attention import RecurrentStateSpec, save_verify_inputs
from atlas.layers.mamba2 import RowPieces
from atlas.layers.norm import RMSNorm
from atlas.layers.parallel import current


class Mamba1Mixer(nn.Module):
    def __init__(self, hidden_size: int, channels: int, state_size: int, conv_kernel: int, dt_rank: int, eps: float,
                 conv_bias: bool = True, proj_bias: bool = False):
        super().__init__()
        mp = current()
        tp, rank = mp.tp_size, mp.tp_rank
        if channels % tp:
            raise ValueError(f"the tensor-parallel size {tp} does not divide the Mamba layers' {channels} channels")
        c = channels // tp
        self.channels, self.state_size, self.conv_kernel, self.dt_rank = c, state_size, conv_kernel, dt_rank
        with plain_weight():  # (the model dtype: the families with these layers load no quantized checkpoint)
            self.in_proj = Linear(hidden_size, 2 * c, bias=proj_bias)
            self.x_proj = RowParallelLinear(channels, dt_rank + 2 * state_size)
            self.dt_proj = ColumnParallelLinear(dt_rank, channels, bias=True)
            self.out_proj = RowParallelLinear(channels, hidden_size, bias=proj_bias)
        self.conv1d = nn.Conv1d(c, c, conv_kernel, groups=c, bias=conv_bias)
        self.A_log = nn.Parameter(torch.empty(c, state_size))
        self.D = nn.Parameter(torch.empty(c))
        self.dt_layernorm = RMSNorm(dt_rank, eps)
        self.b_layernorm = RMSNorm(state_size, eps)
        self.c_layernorm = RMSNorm(state_size, eps)
        if tp > 1:
            rows = RowPieces(2 * channels, [(0, rank * c, c), (c, channels + rank * c, c)])
            self.in_proj.weight.weight_loader = rows.loader("in_proj.weight")
            if proj_bias:
                self.in_proj.bias.weight_loader = rows.loader("in_proj.bias")
            for param in (self.conv1d.weight, self.conv1d.bias, self.A_log, self.D):
                if param is not None:
                    param.weight_loader = sharded_loader(0, rank, channels)
        # This layer's state pools (conv, scan), bound by the runner; None: no state is kept (a profiling forward).
        self.conv_state: torch.Tensor | None = None
        self.ssm_state: torch.Tensor | None = None
        # With speculative decoding: the convolution's inputs of the rows of each slot's last verify step.
        self.verify_inputs: torch.Tensor | None = None

    def state_spec(self) -> RecurrentStateSpec:
        # (the scan's state [D, N] as D "heads" of an [N, 1] matrix; a replay recomputes everything from the
        #  convolution's inputs, which are all a verify row saves)
        return RecurrentStateSpec(self.channels, self.conv_kernel, self.channels, self.state_size, 1,
                                  gates_per_head=0, replay_state_copies=4)

    def bind_state(self, conv_state: torch.Tensor | None, ssm_state: torch.Tensor | None,
                   verify_inputs: torch.Tensor | None = None) -> None:
        self.conv_state, self.verify_inputs = conv_state, verify_inputs
        self.ssm_state = None if ssm_state is None else ssm_state.view(*ssm_state.shape[:3])  # ([S, D, N, 1] -> [S, D, N])

    def _scan_inputs(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The convolution's output [T, D] -> dt [T, D] float32, A [D, N], B, C [T, N]."""
        dt, B, C = self.x_proj(x).split([self.dt_rank, self.state_size, self.state_size], dim=-1)
        dt = F.softplus(self.dt_proj(self.dt_layernorm(dt.contiguous())).float())
        return dt, -self.A_log.float().exp(), self.b_layernorm(B.contiguous()), self.c_layernorm(C.contiguous())

    def _advance(self, x: torch.Tensor, slots: torch.Tensor, keep: torch.Tensor, q_len: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """A uniform step's state update from the convolution's inputs (every sequence q_len rows; slots, keep on the
        device) -> (y [T, D] float32 before the D skip, the convolution's output)."""
        x = causal_conv1d_uniform(x, self.conv1d.weight[:, 0], self.conv_state, slots, keep, q_len,
                                  bias=self.conv1d.bias)
        dt, A, B, C = self._scan_inputs(x)
        return scan_uniform(x, dt, A, B, C, self.ssm_state, slots, keep, q_len), x

    def replay(self, slots: torch.Tensor, rows: int) -> None:
        """Advance the states at `slots` [n] by the first `rows` rows of each one's last verify step, from their saved
        convolution inputs (the slots hold the states from before that step: runtime/state_slots.py)."""
        saved = self.verify_inputs.index_select(0, slots)[:, :rows].reshape(slots.shape[0] * rows, -1)
        self._advance(saved, slots, torch.ones_like(slots, dtype=torch.bool), rows)

    def forward(self, h: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """h [T, hidden] (the step's rows) -> [T, hidden]; each sequence's state advances by its rows."""
        x, z = self.in_proj(h).split(self.channels, dim=-1)
        if meta.state_rows is not None and self.conv_state is not None:
            raise RuntimeError("a Mamba layer in a mixed-step CUDA graph: its model keeps mixed steps eager")
        T = h.shape[0]
        slots = meta.state_slots_cpu
        keep = slots is not None and self.conv_state is not None
        uniform = slots is None and meta.state_slots is not None and self.conv_state is not None
        q_len = T // meta.state_slots.shape[0] if uniform else None
        if self.verify_inputs is not None and (uniform or keep):
            save_verify_inputs(self.verify_inputs, x, meta, q_len)
        if uniform:
            if meta.state_continues is None:  # (False: the sequence's first row is its position 0)
                meta.state_continues = meta.seq_lens > q_len
            y, x = self._advance(x, meta.state_slots, meta.state_continues, q_len)
        else:
            qsl, lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
            splits = meta.state_splits if keep else ()
            x = causal_conv1d_varlen(x, self.conv1d.weight[:, 0], self.conv_state if keep else None, qsl, lens, slots,
                                     splits=splits, cache=meta.varlen_cache, bias=self.conv1d.bias)
            dt, A, B, C = self._scan_inputs(x)
            y = scan_varlen(x, dt, A, B, C, self.ssm_state if keep else None, qsl, lens, slots, splits=splits,
                            cache=meta.varlen_cache)
        y = (y + self.D.float() * x.float()) * F.silu(z.float())
        return self.out_proj(y.to(h.dtype))
