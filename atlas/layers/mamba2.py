"""Mamba-2, the state-space token mixer of the Mamba-2 hybrid models (Granite 4.0-H), and its state spec.

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
CausalLM.recurrent_state_in_mixed_graphs). One device: the layer is not split for tensor parallelism (refused by
name).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from atlas.errors import UnsupportedModelError
from atlas.kernels.gated_delta_rule import causal_conv1d_uniform, causal_conv1d_varlen
from atlas.kernels.mamba2 import DEFAULT_CHUNK, ssd_uniform, ssd_varlen, time_steps
from atlas.layers.attention import AttentionMetadata
from atlas.layers.linear import Linear, plain_weight
from atlas.layers.linear_attention import RecurrentStateSpec, save_verify_inputs
from atlas.layers.parallel import current


def gated_group_rms_norm(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, groups: int, eps: float
                         ) -> torch.Tensor:
    """Mamba-2's output norm: y * silu(z) [T, I] in float32, RMS-normalised over each of `groups` equal groups of
    channels, times weight [I] (in the weight's dtype: the model's)."""
    h = y.float() * F.silu(z.float())
    g = h.view(h.shape[0], groups, -1)
    g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + eps)
    return weight * g.view(h.shape).to(weight.dtype)


class Mamba2Mixer(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, state_size: int, n_groups: int,
                 conv_kernel: int, eps: float, conv_bias: bool = True, proj_bias: bool = False,
                 time_step_limit: tuple[float, float] = (0.0, float("inf")), chunk_size: int = DEFAULT_CHUNK,
                 act: str = "silu"):
        super().__init__()
        if current().tp_size > 1:
            raise UnsupportedModelError("tensor parallelism over Mamba-2 layers is not implemented in Atlas: serve "
                                        "this model with --tensor-parallel-size 1")
        if act not in ("silu", "swish"):
            raise UnsupportedModelError(f"a Mamba-2 layer with hidden_act {act!r}: Atlas implements silu")
        if num_heads % n_groups:
            raise ValueError(f"mamba_n_heads ({num_heads}) is not a multiple of mamba_n_groups ({n_groups})")
        self.num_heads, self.head_dim, self.state_size, self.n_groups = num_heads, head_dim, state_size, n_groups
        self.intermediate = num_heads * head_dim
        self.conv_dim = self.intermediate + 2 * n_groups * state_size
        self.conv_kernel = conv_kernel
        self.eps = eps
        self.time_step_limit = (float(time_step_limit[0]), float(time_step_limit[1]))
        # (the chunk of the prompt scan: the checkpoint's (Granite's 256) where it is at most 64, whose intra-chunk
        #  products' memory grows with its square; the sums are the same recurrence in another order)
        self.chunk_size = min(chunk_size, DEFAULT_CHUNK)
        # (the model dtype whatever a checkpoint's quantization: the model families with these layers load none)
        with plain_weight():
            self.in_proj = Linear(hidden_size, self.intermediate + self.conv_dim + num_heads, bias=proj_bias)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, conv_kernel, groups=self.conv_dim, bias=conv_bias)
        self.dt_bias = nn.Parameter(torch.empty(num_heads))
        self.A_log = nn.Parameter(torch.empty(num_heads))
        self.D = nn.Parameter(torch.empty(num_heads))
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.empty(self.intermediate))
        with plain_weight():
            self.out_proj = Linear(self.intermediate, hidden_size, bias=proj_bias)
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
        z, xbc, dt = self.in_proj(h).split([self.intermediate, self.conv_dim, self.num_heads], dim=-1)
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
        out = gated_group_rms_norm(y.view(T, self.intermediate), z, self.norm.weight, self.n_groups, self.eps)
        return self.out_proj(out)
