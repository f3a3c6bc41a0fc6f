"""A gated short convolution with a per-request state (LFM2's `conv` layers), as Hugging Face's
Lfm2ShortConv computes it: in_proj gives B, C and x; y = C * conv(B * x), where conv is a causal
depthwise convolution over the last `kernel_size` positions of each channel; then out_proj.

Each request's state is the last kernel_size - 1 inputs of the convolution (B * x), held in
slot `meta.state_slots[i]` of this layer's state tensor [slots, kernel_size - 1, hidden] between
steps, so a prompt can arrive in chunks over several steps and decodes read only the state,
whatever the context length. A request whose first token is in this step (a new prompt, or one
recomputed after a preemption) starts from zeros; one whose prompt starts with cached blocks
starts from the snapshot kept at their end (`meta.state_saves` names where a step keeps one).
Where the backend has the C kernels (`kernels.state_isa`), one call of
kvflow/csrc/state_update.c convolves every request's tokens in their slots."""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

from kvflow.attention.metadata import AttentionMetadata
from kvflow.csrc import state_update
from kvflow.layers.parameter import weight
from kvflow.model.kernels import Kernels


class ShortConv(nn.Module):
    def __init__(self, hidden_size: int, kernel_size: int, bias: bool, dtype: torch.dtype, device=None):
        super().__init__()
        self.hidden_size, self.kernel_size = hidden_size, kernel_size
        self.in_proj = weight(3 * hidden_size, hidden_size, dtype=dtype, device=device)
        self.out_proj = weight(hidden_size, hidden_size, dtype=dtype, device=device)
        self.conv_weight = weight(hidden_size, kernel_size, dtype=dtype, device=device)  # [channel, tap]
        self.in_bias = weight(3 * hidden_size, dtype=dtype, device=device) if bias else None
        self.out_bias = weight(hidden_size, dtype=dtype, device=device) if bias else None
        self.conv_bias = weight(hidden_size, dtype=dtype, device=device) if bias else None
        self.state: torch.Tensor | None = None  # [slots, kernel_size - 1, hidden] (allocate_state)
        self.c_kernels = False  # set by allocate_state

    def state_bytes(self, dtype: torch.dtype) -> int:
        """One request's state."""
        return (self.kernel_size - 1) * self.hidden_size * torch.empty(0, dtype=dtype).element_size()

    def allocate_state(self, num_slots: int, dtype: torch.dtype) -> None:
        self.state = torch.zeros(num_slots, self.kernel_size - 1, self.hidden_size, dtype=dtype,
                                 device=self.in_proj.device)
        # whether the C kernels can serve it (where the backend has them)
        self.c_kernels = (self.state.device.type == "cpu" and dtype == self.in_proj.dtype
                          and state_update.supports(dtype)
                          and self.kernel_size <= state_update.CONV_MAX_TAPS)

    def copy_states(self, pairs: list[tuple[int, int]]) -> None:
        """Copy slot `a`'s state into slot `b` for each (a, b): a prefix-cache snapshot kept,
        or one a new request resumes from."""
        src, dst = zip(*pairs)
        self.state[list(dst)] = self.state[list(src)]

    def forward(self, h: torch.Tensor, meta: AttentionMetadata, kernels: Kernels,
                packed: dict) -> torch.Tensor:
        """h [T, hidden], the normed residual stream of the step's flat batch -> [T, hidden]."""
        bcx = kernels.linear(h, self.in_proj, packed.get("in_proj"), self.in_bias)
        b, c, x = bcx.split(self.hidden_size, dim=-1)
        bx = b * x
        # the kernels' conv: C on this CPU's path, or Triton on a GPU; None: the loop below
        ops = kernels.state_triton or (state_update.ops(kernels.state_isa)
                                       if kernels.state_isa and self.c_kernels else None)
        if ops:  # every request's conv in one call
            return kernels.linear(c * self._conv_kernel(bx, meta, ops), self.out_proj,
                                  packed.get("out_proj"), self.out_bias)
        conv = torch.empty_like(bx)
        state, taps = self.state, self.kernel_size - 1
        starts, lens, seq_lens = meta.query_start_loc, meta.query_lens, meta.seq_lens
        saves = meta.state_saves or {}
        for i, slot in enumerate(meta.state_slots):
            start, n = int(starts[i]), int(lens[i])
            if n == 0:
                continue
            if seq_lens[i] == n:  # its first token is in this step: no earlier inputs
                state[slot].zero_()
            window = torch.cat((state[slot], bx[start:start + n]))  # [taps + n, hidden]
            # out[t] = sum_k w[:, k] * window[t + k]: the last kernel_size inputs up to t
            conv[start:start + n] = (window.unfold(0, self.kernel_size, 1) * self.conv_weight).sum(-1)
            if i in saves:  # a prefix-cache snapshot: the state after the chunk's token `after`
                after, snap = saves[i]
                state[snap] = window[after + 1:after + 1 + taps]
            state[slot] = window[-taps:]
        if self.conv_bias is not None:
            conv += self.conv_bias
        return kernels.linear(c * conv, self.out_proj, packed.get("out_proj"), self.out_bias)

    def _conv_kernel(self, bx: torch.Tensor, meta: AttentionMetadata, ops) -> torch.Tensor:
        """The convolution plus bias of all requests' tokens (decodes and prompt chunks) over
        their windows, the states moved on in place (kvflow/csrc/state_update.c, or Triton's
        kvflow/model/triton/state_scan.py on a GPU). Its sums are fp32, rounded once (the loop
        above rounds each product in bf16)."""
        lens, slots = meta.query_lens, np.asarray(meta.state_slots, dtype=np.int64)
        fresh_rows = meta.seq_lens == lens  # their first token is in this step: no earlier inputs
        if fresh_rows.any():
            self.state[torch.from_numpy(slots[fresh_rows])] = 0
        return ops.causal_conv(self.state, self.conv_weight, self.conv_bias, bx, meta.query_start_loc,
                               lens, slots, meta.state_saves or {}, False)
