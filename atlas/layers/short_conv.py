"""LFM2's gated short convolution, the token mixer of its non-attention layers, and its state spec.

One layer, for the rows of one step:
    in_proj -> B, C, x (hidden each)
    y = C * conv(B * x)        (depthwise causal conv1d of kernel L = conv_L_cache, its bias by conv_bias, no
                                activation, continuing from the sequence's conv state)
    out_proj(y)

Its per-sequence state is the convolution's last L - 1 inputs (the RecurrentStateSpec of a layer with no state
matrices), in the runner's state slots as the other recurrent layers' (layers/linear_attention.py): prefix-cache
snapshots, speculative backups and replays included. The convolution is kernels/gated_delta_rule's, without its
silu (one Triton launch on CUDA, in a CUDA graph for uniform steps; mixed steps run eagerly).

Tensor parallelism: a rank holds hidden / tp channels (its rows of each of in_proj's B, C and x, its conv channels
and a state of only those; out_proj row-parallel, one all-reduce).
"""

from __future__ import annotations

import torch
from torch import nn

from atlas.kernels.gated_delta_rule import causal_conv1d_uniform, causal_conv1d_varlen
from atlas.layers.attention import AttentionMetadata
from atlas.layers.linear import Linear, RowParallelLinear, plain_weight, sharded_loader
from atlas.layers.linear_attention import RecurrentStateSpec, save_verify_inputs
from atlas.layers.mamba2 import RowPieces
from atlas.layers.parallel import current


class ShortConv(nn.Module):
    def __init__(self, hidden_size: int, kernel: int, bias: bool):
        super().__init__()
        mp = current()
        tp, rank = mp.tp_size, mp.tp_rank
        if hidden_size % tp:
            raise ValueError(f"the tensor-parallel size {tp} does not divide the hidden size {hidden_size}")
        c = hidden_size // tp
        self.channels, self.conv_kernel = c, kernel
        with plain_weight():  # (read as one fused tensor: its rows cut per rank below)
            self.in_proj = Linear(hidden_size, 3 * c, bias=bias)
        self.conv = nn.Conv1d(c, c, kernel, groups=c, bias=bias)
        self.out_proj = RowParallelLinear(hidden_size, hidden_size, bias=bias)
        if tp > 1:
            rows = RowPieces(3 * hidden_size, [(i * c, i * hidden_size + rank * c, c) for i in range(3)])
            self.in_proj.weight.weight_loader = rows.loader("in_proj.weight")
            if bias:
                self.in_proj.bias.weight_loader = rows.loader("in_proj.bias")
                self.conv.bias.weight_loader = sharded_loader(0, rank, hidden_size)
            self.conv.weight.weight_loader = sharded_loader(0, rank, hidden_size)
        # This layer's conv state pool, bound by the runner (the state-matrix pool it is given is empty); None: no
        # state is kept (a profiling forward).
        self.conv_state: torch.Tensor | None = None
        # With speculative decoding: the convolution's inputs of the rows of each slot's last verify step.
        self.verify_inputs: torch.Tensor | None = None

    def state_spec(self) -> RecurrentStateSpec:
        return RecurrentStateSpec(self.channels, self.conv_kernel, 0, 0, 0, gates_per_head=0)

    def bind_state(self, conv_state: torch.Tensor | None, ssm_state: torch.Tensor | None,
                   verify_inputs: torch.Tensor | None = None) -> None:
        self.conv_state, self.verify_inputs = conv_state, verify_inputs

    def _weight(self) -> torch.Tensor:
        return self.conv.weight[:, 0]

    def replay(self, slots: torch.Tensor, rows: int) -> None:
        """Advance the conv state at `slots` [n] by the first `rows` rows of each one's last verify step."""
        saved = self.verify_inputs.index_select(0, slots)[:, :rows].reshape(slots.shape[0] * rows, -1)
        causal_conv1d_uniform(saved, self._weight(), self.conv_state, slots,
                              torch.ones_like(slots, dtype=torch.bool), rows, bias=self.conv.bias, silu=False)

    def forward(self, h: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """h [T, hidden] (the step's rows) -> [T, hidden]; each sequence's conv state advances by its rows."""
        T = h.shape[0]
        B, C, x = self.in_proj(h).split(self.channels, dim=-1)
        bx = B * x
        if meta.state_rows is not None and self.conv_state is not None:
            raise RuntimeError("a short-convolution layer in a mixed-step CUDA graph: its model keeps mixed steps "
                               "eager")
        slots = meta.state_slots_cpu
        keep = slots is not None and self.conv_state is not None
        uniform = slots is None and meta.state_slots is not None and self.conv_state is not None
        q_len = T // meta.state_slots.shape[0] if uniform else None
        if self.verify_inputs is not None and (uniform or keep):
            save_verify_inputs(self.verify_inputs, bx, meta, q_len)
        if uniform:
            if meta.state_continues is None:  # (False: the sequence's first row is its position 0)
                meta.state_continues = meta.seq_lens > q_len
            conv = causal_conv1d_uniform(bx, self._weight(), self.conv_state, meta.state_slots, meta.state_continues,
                                         q_len, bias=self.conv.bias, silu=False)
        else:
            conv = causal_conv1d_varlen(bx, self._weight(), self.conv_state if keep else None,
                                        meta.query_start_loc_cpu, meta.seq_lens_cpu, slots,
                                        splits=meta.state_splits if keep else (), cache=meta.varlen_cache,
                                        bias=self.conv.bias, silu=False)
        return self.out_proj(C * conv)
