"""Mamba2's mixer (IBM Granite 4.0-H's `mamba` layers), as Hugging Face's
GraniteMoeHybridMambaLayer computes it in its PyTorch fallback: one projection gives the gate z,
the conv channels x|B|C and the per-head time step dt; x|B|C pass a causal depthwise
convolution (with bias) and SiLU; then the SSD, per head h with A_h = -exp(A_log_h),
dt = softplus(dt + dt_bias) clamped to the time-step limit, and B, C shared by the heads of
each of n_groups groups; each head keeps a state S [head_dim, d_state]:

    S <- exp(dt A) S + dt x_t B_t^T;   y_t = S C_t + D x_t

then y times silu(z), RMS-normed per group (norm after the gate), times the norm weight, and
projected out.

Each request's state, in slot `meta.state_slots[i]`: the convolution's last kernel_size - 1
inputs (model dtype) and S for every head (fp32, as HF's scan keeps it). A request whose first
token is in this step (a new prompt, or one recomputed after a preemption) starts from zeros; a
prompt arriving in chunks carries both across steps; a prefix-cache hit starts from a snapshot
kept where an earlier request passed a block boundary (`meta.state_saves`: the state after a
given token of a request's chunk, written into a snapshot slot; `copy_states`); the conv
windows are kvflow/layers/causal_conv.py's. Decodes (one token) run the recurrence above for
all of them at once; a prompt chunk runs the chunked form (SSD over chunks of up to 64 tokens:
within a chunk as masked attention, between chunks through the state; HF's torch chunk scan).
Where the backend has the C kernels (`kernels.state_isa`), the conv (decodes and chunks), the
decodes' update (dt's softplus and clamp fused), the D skip and the gated norm run in
kvflow/csrc/state_update.c on the states in their slots, and a prompt chunk runs the same
recurrence token after token in kvflow/csrc/state_scan.c (a row of S held in registers across
the tokens: on a CPU faster than the chunked form's products). On a GPU (`kernels.state_triton`)
the conv, the decodes' update and the chunks' scan are the Triton kernels of
kvflow/model/triton/state_update.py and state_scan.py; D, the gate and the norm in PyTorch.

Numerics: HF's chunked path (prompts) computes the scan and the gated norm in fp32 and rounds
once before out_proj; kvflow does that for decodes too (HF's one-token path rounds the scan's
output to the model dtype first, and keeps dt in the model dtype): equal in fp32, within a
rounding in bf16. HF clamps dt to the time-step limit on its chunked path only; kvflow on both
(the same wherever the limit is HF's default (0, inf), as in Granite 4.0-H's configs)."""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from kvflow.attention.metadata import AttentionMetadata
from kvflow.csrc import state_update
from kvflow.layers.causal_conv import causal_conv1d
from kvflow.layers.parameter import weight
from kvflow.model.kernels import Kernels

CHUNK = 64  # tokens per chunk of the chunked form


def _segment_sum(a: torch.Tensor) -> torch.Tensor:
    """a [..., L] -> [..., L, L]: out[t, s] = a[s+1] + ... + a[t] for s <= t, -inf above the
    diagonal (summed per segment, not as a difference of cumulative sums: HF's stable form)."""
    n = a.shape[-1]
    x = a[..., None].expand(*a.shape, n)  # x[..., j, s] = a[j]
    strictly_lower = torch.ones(n, n, dtype=torch.bool, device=a.device).tril(-1)
    seg = x.masked_fill(~strictly_lower, 0).cumsum(-2)
    return seg.masked_fill(~strictly_lower.logical_or(torch.eye(n, dtype=torch.bool, device=a.device)),
                           float("-inf"))


def chunk_scan(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
               state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's tokens, heads first, fp32: x [H, L, P], dt [H, L] (after softplus), a [H]
    (A, negative), b, c [H, L, N] (each head's group's); `state` [H, P, N] before the first
    token (left as it is). Returns the SSD's outputs [H, L, P] (without the D skip) and the
    state after the last token."""
    h, n, p = x.shape
    chunk = min(CHUNK, n)
    pad = -n % chunk
    if pad:  # padded tokens: no decay (dt 0) and no write
        x, b, c = (F.pad(y, (0, 0, 0, pad)) for y in (x, b, c))
        dt = F.pad(dt, (0, pad))
    k = (n + pad) // chunk
    xdt = (x * dt[..., None]).reshape(h, k, chunk, p)
    b, c = b.reshape(h, k, chunk, -1), c.reshape(h, k, chunk, -1)
    log_decay = (dt * a[:, None]).reshape(h, k, chunk)
    cum = log_decay.cumsum(-1)  # the log of the decay from the chunk's start to each token
    # within a chunk: y_t = sum_{s<=t} (C_t . B_s) exp(sum_{s<j<=t} log_decay_j) xdt_s
    y = ((c @ b.transpose(-1, -2)) * _segment_sum(log_decay).exp()) @ xdt
    # what each chunk writes into the state, decayed to its end
    writes = (xdt * (cum[..., -1:] - cum).exp()[..., None]).transpose(-1, -2) @ b  # [H, k, P, N]
    chunk_decay = cum[..., -1].exp()[..., None, None]  # [H, k, 1, 1]
    into = cum.exp()[..., None]  # the state at the chunk's start, decayed to each token
    state = state.clone()
    for i in range(k):  # between chunks: through the state
        y[:, i] += (c[:, i] @ state.transpose(-1, -2)) * into[:, i]
        state.mul_(chunk_decay[:, i]).add_(writes[:, i])
    return y.reshape(h, -1, p)[:, :n], state


def recurrent_scan(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
                   state: torch.Tensor) -> torch.Tensor:
    """One token of each of R requests, fp32: x [R, H, P], dt [R, H], a [H], b, c [R, H, N];
    `state` [R, H, P, N], updated in place. Returns the outputs [R, H, P] (without the D skip)."""
    r, h, p, n = state.shape
    state.mul_((dt * a).exp()[..., None, None])
    # the write x dt B^T as a batch of outer products, added in place
    state.view(r * h, p, n).baddbmm_((x * dt[..., None]).reshape(r * h, p, 1), b.reshape(r * h, 1, n))
    return (state @ c.unsqueeze(-1)).squeeze(-1)


class Mamba2(nn.Module):
    """One Mamba2 mixer: its projections, convolution, SSM constants (fp32), gated norm and,
    once `allocate_state` ran, each slot's conv window and SSM state."""

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, state_size: int, n_groups: int,
                 conv_kernel_size: int, eps: float, conv_bias: bool, proj_bias: bool,
                 time_step_limit: tuple[float, float], dtype: torch.dtype, device=None):
        super().__init__()
        if num_heads % n_groups:
            raise ValueError(f"mamba_n_heads ({num_heads}) must be a multiple of mamba_n_groups ({n_groups})")
        self.num_heads, self.head_dim, self.state_size, self.n_groups = num_heads, head_dim, state_size, n_groups
        self.intermediate = num_heads * head_dim
        self.conv_dim = self.intermediate + 2 * n_groups * state_size
        self.kernel_size, self.eps = conv_kernel_size, eps
        self.time_step_limit = (float(time_step_limit[0]), float(time_step_limit[1]))
        # [z; x | B | C (the conv channels); dt] rows: one matmul for all three
        rows = self.intermediate + self.conv_dim + num_heads
        self.in_proj = weight(rows, hidden_size, dtype=dtype, device=device)
        self.in_bias = weight(rows, dtype=dtype, device=device) if proj_bias else None
        self.conv_weight = weight(self.conv_dim, conv_kernel_size, dtype=dtype, device=device)  # [channel, tap]
        self.conv_bias = weight(self.conv_dim, dtype=dtype, device=device) if conv_bias else None
        self.A_log = weight(num_heads, dtype=torch.float32, device=device)
        self.D = weight(num_heads, dtype=torch.float32, device=device)
        self.dt_bias = weight(num_heads, dtype=torch.float32, device=device)
        self.norm = weight(self.intermediate, dtype=dtype, device=device)
        self.out_proj = weight(hidden_size, self.intermediate, dtype=dtype, device=device)
        self.out_bias = weight(hidden_size, dtype=dtype, device=device) if proj_bias else None
        # [slots, kernel_size - 1, conv_dim] and [slots, num_heads, head_dim, state_size]
        self.conv_state: torch.Tensor | None = None
        self.recurrent_state: torch.Tensor | None = None
        self.c_kernels = False  # set by allocate_state

    def allocate_state(self, num_slots: int, dtype: torch.dtype) -> None:
        device = self.in_proj.device
        self.conv_state = torch.zeros(num_slots, self.kernel_size - 1, self.conv_dim, dtype=dtype, device=device)
        self.recurrent_state = torch.zeros(num_slots, self.num_heads, self.head_dim, self.state_size,
                                           dtype=torch.float32, device=device)
        # whether the C kernels can serve these shapes and dtypes (where the backend has them)
        self.c_kernels = (device.type == "cpu" and dtype == self.in_proj.dtype
                          and state_update.supports(dtype, self.head_dim, self.state_size)
                          and self.intermediate // self.n_groups <= 8 * state_update.HEAD_MAX
                          and self.kernel_size <= state_update.CONV_MAX_TAPS)

    def copy_states(self, pairs: list[tuple[int, int]]) -> None:
        """Copy slot `a`'s state into slot `b` for each (a, b)."""
        src, dst = (list(x) for x in zip(*pairs))
        self.conv_state[dst] = self.conv_state[src]
        self.recurrent_state[dst] = self.recurrent_state[src]

    def forward(self, h: torch.Tensor, meta: AttentionMetadata, kernels: Kernels,
                packed: dict) -> torch.Tensor:
        """h [T, hidden], the normed residual stream of the step's flat batch -> [T, hidden]."""
        t, nh, p = h.shape[0], self.num_heads, self.head_dim
        proj = kernels.linear(h, self.in_proj, packed.get("in_proj"), self.in_bias)
        z, xbc, dt = proj.split([self.intermediate, self.conv_dim, nh], dim=-1)
        lens, seq_lens, starts = meta.query_lens, meta.seq_lens, meta.query_start_loc
        slot_ids = np.asarray(meta.state_slots, dtype=np.int64)
        slots = torch.from_numpy(slot_ids)
        fresh_rows = seq_lens == lens  # their first token is in this step: they start from zeros
        if fresh_rows.any():
            fresh = slots[torch.from_numpy(fresh_rows)]
            self.conv_state[fresh] = 0
            self.recurrent_state[fresh] = 0
        saves = meta.state_saves or {}
        isa = kernels.state_isa if self.c_kernels else None
        # the kernels' operations: C on this CPU's path, or Triton on a GPU; None: PyTorch
        ops = kernels.state_triton or (state_update.ops(isa) if isa else None)
        if ops:  # conv + bias + SiLU in one pass, windows moved on in place
            xbc = ops.causal_conv(self.conv_state, self.conv_weight, self.conv_bias, xbc, starts, lens,
                                  slot_ids, saves, True)
        else:
            xbc = F.silu(causal_conv1d(self.conv_state, self.conv_weight, self.conv_bias, xbc,
                                       starts, lens, slots, saves))
        y = torch.empty(t, nh, p, dtype=torch.float32, device=h.device)
        one, chunks = np.flatnonzero(lens == 1), np.flatnonzero(lens > 1)
        if ops:  # the kernels: decodes' step, the prompt chunks' scan, then D, gate and norm
            if len(one):
                ops.ssm_decode(xbc, dt, self.A_log, self.dt_bias, self.recurrent_state, starts[one],
                               slot_ids[one], y, self.n_groups, self.time_step_limit)
            self._snapshots_after_one_token(one, saves, slots)
            if len(chunks):
                chunk_saves = {j: saves[i] for j, i in enumerate(chunks) if i in saves}
                ops.ssm_chunks(xbc, dt, self.A_log, self.dt_bias, self.recurrent_state, starts[chunks],
                               lens[chunks], slot_ids[chunks], chunk_saves, y, self.n_groups,
                               self.time_step_limit)
            if isa:  # D, the gate and the norm in C, rounded once
                out = state_update.ssm_gated_norm(y, xbc, z, self.D, self.norm, self.eps, self.n_groups)
            else:
                y += self.D[:, None] * xbc[:, :self.intermediate].float().view(t, nh, p)
                out = self._gated_norm(y.view(t, -1), z).to(h.dtype)
            return kernels.linear(out, self.out_proj, packed.get("out_proj"), self.out_bias)
        bc = self.n_groups * self.state_size
        x, b, c = xbc.float().split([self.intermediate, bc, bc], dim=-1)
        x = x.view(t, nh, p)
        per_group = nh // self.n_groups  # each group's B and C serve this many consecutive heads
        b = b.view(t, self.n_groups, -1).repeat_interleave(per_group, 1)  # [T, H, N]
        c = c.view(t, self.n_groups, -1).repeat_interleave(per_group, 1)
        dt = F.softplus(dt.float() + self.dt_bias).clamp(*self.time_step_limit)
        a = -self.A_log.exp()
        if len(one):  # decodes (and one-token prompts) together: one recurrent update
            one = one[np.argsort(meta.state_slots[one], kind="stable")]  # in slot order
            rows, s = torch.from_numpy(starts[one]), slots[one]
            first, last = int(s[0]), int(s[-1])
            if last - first == len(one) - 1:  # consecutive slots: their states updated in place
                y[rows] = recurrent_scan(x[rows], dt[rows], a, b[rows], c[rows], self.recurrent_state[first:last + 1])
            else:
                state = self.recurrent_state[s]  # a copy (gathered), written back after
                y[rows] = recurrent_scan(x[rows], dt[rows], a, b[rows], c[rows], state)
                self.recurrent_state[s] = state
        self._snapshots_after_one_token(one, saves, slots)
        for i in chunks:  # prompt chunks, one by one, in the chunked form
            start, n, slot = int(starts[i]), int(lens[i]), int(slots[i])
            # a snapshot after token `after` splits the chunk there
            after, snap = saves.get(i, (n - 1, None))
            for lo, hi in ((0, after + 1), (after + 1, n)):
                if lo == hi:
                    continue
                span = slice(start + lo, start + hi)
                o, self.recurrent_state[slot] = chunk_scan(
                    x[span].transpose(0, 1), dt[span].transpose(0, 1), a, b[span].transpose(0, 1),
                    c[span].transpose(0, 1), self.recurrent_state[slot])
                y[span] = o.transpose(0, 1)
                if snap is not None and hi == after + 1:
                    self.recurrent_state[snap] = self.recurrent_state[slot]
        y += self.D[:, None] * x
        return kernels.linear(self._gated_norm(y.view(t, -1), z).to(h.dtype), self.out_proj,
                              packed.get("out_proj"), self.out_bias)

    def _snapshots_after_one_token(self, one: np.ndarray, saves: dict, slots: torch.Tensor) -> None:
        for i in one:  # a snapshot after its one token: the state just written
            if i in saves:
                self.recurrent_state[saves[i][1]] = self.recurrent_state[slots[i]]

    def _gated_norm(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """y times silu(z), RMS-normed over each group's channels, times the weight, in fp32
        (HF's GraniteMoeHybridRMSNormGated with the gate before the norm)."""
        t = y.shape[0]
        g = (y * F.silu(z.float())).view(t, self.n_groups, -1)
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.norm.float() * g.view(t, -1)
