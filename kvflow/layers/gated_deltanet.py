"""Gated DeltaNet (Qwen3.5's and Qwen3-Next's linear attention), as Hugging Face's
Qwen3_5GatedDeltaNet computes it with its PyTorch fallbacks: one projection gives the conv
channels q|k|v, the output gate z and the per-head b (write strength beta = sigmoid(b)) and a
(decay g = -exp(A_log) * softplus(a + dt_bias)); q|k|v pass a causal depthwise convolution with
SiLU; q and k are L2-normalised per head (q scaled by head_k_dim ** -0.5, each q/k head serving
num_v_heads / num_k_heads value heads); each value head keeps a matrix S [head_k_dim, head_v_dim]:

    S <- exp(g_t) S;   S <- S + k_t (beta_t (v_t - S^T k_t))^T;   o_t = S^T q_t

then o is RMS-normed per head, times the norm weight and silu(z), and projected out.

Each request's state, in slot `meta.state_slots[i]`: the convolution's last kernel_size - 1
inputs (model dtype) and S for every value head (fp32, as HF's kernels keep it). A request's
first token in this step (a new prompt, or one recomputed after a preemption) starts from
zeros; a prompt arriving in chunks carries both across steps; a prefix-cache hit starts from a
snapshot kept where an earlier request passed a block boundary (`meta.state_saves`: the state
after a given token of a request's chunk, copied into a snapshot slot; `copy_states`). Decodes (one token) run the
recurrence above for all of them at once; a prompt chunk runs the chunked form (the delta rule
over chunks of up to 64 tokens through a triangular solve, HF's torch_chunk_gated_delta_rule).
Where the backend has the C kernels (`kernels.state_isa`), the conv (decodes and chunks) and
the decodes' step run in kvflow/csrc/state_update.c on the states in their slots, the step with
its l2norm, beta and g fused (and, in a decode-only step, the gated norm); a prompt chunk runs
the same recurrence token after token in kvflow/csrc/state_scan.c (on a CPU the one pass, a
strip of S in L1 across the tokens, is faster than the chunked form's solves and products).
On a GPU (`kernels.state_triton`) the conv, the decodes' step and the chunks' scan are the
Triton kernels of kvflow/model/triton/state_update.py and state_scan.py, the same way."""
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

CHUNK = 64  # tokens per chunk of the chunked form (HF's chunk_size)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                           beta: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's tokens, heads first, fp32: q, k [H, L, dk] (normalised, q scaled),
    v [H, L, dv], g, beta [H, L]; `state` [H, dk, dv] before the first token (left as it is).
    Returns the outputs [H, L, dv] and the state after the last token."""
    h, n, _ = k.shape
    chunk = min(CHUNK, n)
    pad = -n % chunk
    if pad:  # padded tokens: no decay (g 0), no write (beta 0)
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    num_chunks = (n + pad) // chunk
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    q, k, k_beta, v_beta = (x.reshape(h, num_chunks, chunk, -1) for x in (q, k, k_beta, v_beta))
    g = g.reshape(h, num_chunks, chunk).cumsum(-1)  # log of the decay from the chunk's start
    later = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    decay = (g[..., :, None] - g[..., None, :]).masked_fill(later, float("-inf")).exp()
    # (I + strictly-lower(beta k k^T decay)) u = beta v: the chunk's writes, each corrected
    # for what the earlier ones in the chunk already wrote (the UT transform)
    ut = (k_beta @ k.transpose(-1, -2)) * decay
    new_values = torch.linalg.solve_triangular(ut, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(ut, k_beta * g.exp()[..., None], upper=False,
                                               unitriangular=True)
    intra = (q @ k.transpose(-1, -2)) * decay
    q = q * g.exp()[..., None]
    k = k * (g[..., -1:] - g).exp()[..., None]
    chunk_decay = g[..., -1].exp()[..., None, None]
    out = torch.empty_like(new_values)
    state = state.clone()
    for i in range(num_chunks):
        v_new = torch.baddbmm(new_values[:, i], k_cumdecay[:, i], state, alpha=-1)
        torch.baddbmm(q[:, i] @ state, intra[:, i], v_new, out=out[:, i])
        state.mul_(chunk_decay[:, i]).baddbmm_(k[:, i].transpose(-1, -2), v_new)
    return out.reshape(h, -1, out.shape[-1])[:, :n], state


def recurrent_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each of B requests, fp32: q, k [B, H, dk], v [B, H, dv], g, beta [B, H];
    `state` [B, H, dk, dv], updated in place. Returns the outputs [B, H, dv]."""
    b, h, dk, dv = state.shape
    state.mul_(g.exp()[..., None, None])
    read = (k.unsqueeze(-2) @ state).squeeze(-2)  # S^T k: what the state holds for this key
    write = ((v - read) * beta[..., None]).reshape(b * h, 1, dv)
    state.view(b * h, dk, dv).baddbmm_(k.reshape(b * h, dk, 1), write)
    return (q.unsqueeze(-2) @ state).squeeze(-2)


class GatedDeltaNet(nn.Module):
    """One linear-attention layer: its projections, convolution, decay constants, gated norm
    and, once `allocate_state` ran, each slot's conv window and recurrent state."""

    def __init__(self, hidden_size: int, num_k_heads: int, num_v_heads: int, head_k_dim: int,
                 head_v_dim: int, conv_kernel_size: int, eps: float, dtype: torch.dtype, device=None):
        super().__init__()
        if num_v_heads % num_k_heads:
            raise ValueError(f"linear_num_value_heads ({num_v_heads}) must be a multiple of "
                             f"linear_num_key_heads ({num_k_heads})")
        self.num_k_heads, self.num_v_heads = num_k_heads, num_v_heads
        self.head_k_dim, self.head_v_dim = head_k_dim, head_v_dim
        self.key_dim, self.value_dim = num_k_heads * head_k_dim, num_v_heads * head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.kernel_size, self.eps = conv_kernel_size, eps
        # [q | k | v (the conv channels); z; b; a] rows: one matmul for all four
        self.in_proj = weight(self.conv_dim + self.value_dim + 2 * num_v_heads, hidden_size,
                              dtype=dtype, device=device)
        self.conv_weight = weight(self.conv_dim, conv_kernel_size, dtype=dtype, device=device)  # [channel, tap]
        self.A_log = weight(num_v_heads, dtype=torch.float32, device=device)
        self.dt_bias = weight(num_v_heads, dtype=torch.float32, device=device)
        self.norm = weight(head_v_dim, dtype=dtype, device=device)
        self.out_proj = weight(hidden_size, self.value_dim, dtype=dtype, device=device)
        # [slots, kernel_size - 1, conv_dim] and [slots, num_v_heads, head_k_dim, head_v_dim]
        self.conv_state: torch.Tensor | None = None
        self.recurrent_state: torch.Tensor | None = None
        self.c_kernels = False  # set by allocate_state

    def allocate_state(self, num_slots: int, dtype: torch.dtype) -> None:
        device = self.in_proj.device
        self.conv_state = torch.zeros(num_slots, self.kernel_size - 1, self.conv_dim, dtype=dtype, device=device)
        self.recurrent_state = torch.zeros(num_slots, self.num_v_heads, self.head_k_dim, self.head_v_dim,
                                           dtype=torch.float32, device=device)
        # whether the C kernels can serve these shapes and dtypes (where the backend has them)
        self.c_kernels = (device.type == "cpu" and dtype == self.in_proj.dtype
                          and state_update.supports(dtype, self.head_k_dim, self.head_v_dim)
                          and self.kernel_size <= state_update.CONV_MAX_TAPS)

    def copy_states(self, pairs: list[tuple[int, int]]) -> None:
        """Copy slot `a`'s state into slot `b` for each (a, b)."""
        src, dst = (list(x) for x in zip(*pairs))
        self.conv_state[dst] = self.conv_state[src]
        self.recurrent_state[dst] = self.recurrent_state[src]

    def forward(self, h: torch.Tensor, meta: AttentionMetadata, kernels: Kernels,
                packed: dict) -> torch.Tensor:
        """h [T, hidden], the normed residual stream of the step's flat batch -> [T, hidden]."""
        t, nv = h.shape[0], self.num_v_heads
        proj = kernels.linear(h, self.in_proj, packed.get("in_proj"))
        mixed, z, b, a = proj.split([self.conv_dim, self.value_dim, nv, nv], dim=-1)
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
        if ops:  # conv + SiLU in one pass, windows moved on in place
            x = ops.causal_conv(self.conv_state, self.conv_weight, None, mixed, starts, lens,
                                slot_ids, saves, True)
        else:
            x = F.silu(causal_conv1d(self.conv_state, self.conv_weight, None, mixed, starts, lens,
                                     slots, saves))
        one = np.flatnonzero(lens == 1)
        if isa and len(one) == len(lens):  # a decode-only step: the step and the gated norm in C
            gated = torch.empty(t, nv, self.head_v_dim, dtype=h.dtype)
            state_update.gated_delta_decode(x, proj[:, self.conv_dim + self.value_dim:], self.A_log,
                                            self.dt_bias, self.recurrent_state, starts[one],
                                            slot_ids[one], gated, self.num_k_heads, isa,
                                            gate=(z, self.norm, self.eps))
            self._snapshots_after_one_token(one, saves, slots)
            return kernels.linear(gated.view(t, -1), self.out_proj, packed.get("out_proj"))
        out = torch.empty(t, nv, self.head_v_dim, dtype=torch.float32, device=h.device)
        chunks = np.flatnonzero(lens > 1)
        if ops:  # the kernels: decodes' step, then the prompt chunks' scan, in their slots
            ba = proj[:, self.conv_dim + self.value_dim:]
            if len(one):
                ops.gated_delta_decode(x, ba, self.A_log, self.dt_bias, self.recurrent_state,
                                       starts[one], slot_ids[one], out, self.num_k_heads)
            self._snapshots_after_one_token(one, saves, slots)
            if len(chunks):
                chunk_saves = {j: saves[i] for j, i in enumerate(chunks) if i in saves}
                ops.gated_delta_chunks(x, ba, self.A_log, self.dt_bias, self.recurrent_state,
                                       starts[chunks], lens[chunks], slot_ids[chunks], chunk_saves,
                                       out, self.num_k_heads)
            if isa:  # the gated norm in C too
                gated = state_update.gdn_gated_norm(out, z, self.norm, self.eps)
                return kernels.linear(gated.view(t, -1), self.out_proj, packed.get("out_proj"))
        else:
            self._torch_recurrence(x, b, a, out, one, chunks, starts, lens, slots, saves)
        return kernels.linear(self._gated_norm(out.to(h.dtype), z).view(t, -1), self.out_proj,
                              packed.get("out_proj"))

    def _torch_recurrence(self, x, b, a, out, one, chunks, starts, lens, slots, saves) -> None:
        """The PyTorch path: decodes (and one-token prompts) in one recurrent update, then each
        prompt chunk in the chunked form; outputs into `out` [T, nv, dv] fp32."""
        heads = self._heads(x, b, a)
        if len(one):
            rows, s = torch.from_numpy(starts[one]), slots[one]
            state = self.recurrent_state[s]  # a copy (gathered), written back after
            out[rows] = recurrent_gated_delta_rule(*(y[rows] for y in heads), state)
            self.recurrent_state[s] = state
        self._snapshots_after_one_token(one, saves, slots)
        for i in chunks:  # prompt chunks, one by one
            start, n, slot = int(starts[i]), int(lens[i]), int(slots[i])
            # a snapshot after token `after` splits the chunk there
            after, snap = saves.get(i, (n - 1, None))
            for lo, hi in ((0, after + 1), (after + 1, n)):
                if lo == hi:
                    continue
                span = slice(start + lo, start + hi)
                o, self.recurrent_state[slot] = chunk_gated_delta_rule(
                    *(y[span].transpose(0, 1) for y in heads), self.recurrent_state[slot])
                out[span] = o.transpose(0, 1)
                if snap is not None and hi == after + 1:
                    self.recurrent_state[snap] = self.recurrent_state[slot]

    def _snapshots_after_one_token(self, one: np.ndarray, saves: dict, slots: torch.Tensor) -> None:
        for i in one:  # a snapshot after its one token: the state just written
            if i in saves:
                self.recurrent_state[saves[i][1]] = self.recurrent_state[slots[i]]

    def _heads(self, x: torch.Tensor, b: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The recurrence's inputs, fp32: q, k [T, nv, dk] (normalised, q scaled; each q/k head
        repeated for the v heads it serves), v [T, nv, dv], g and beta [T, nv]."""
        t, nv = x.shape[0], self.num_v_heads
        q, k, v = x.float().split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        groups = nv // self.num_k_heads  # each q/k head serves this many consecutive v heads
        q = (l2norm(q.view(t, -1, self.head_k_dim)) * self.head_k_dim ** -0.5).repeat_interleave(groups, 1)
        k = l2norm(k.view(t, -1, self.head_k_dim)).repeat_interleave(groups, 1)
        g = -self.A_log.exp() * F.softplus(a.float() + self.dt_bias)
        return q, k, v.view(t, nv, self.head_v_dim), g, b.sigmoid().float()

    def _gated_norm(self, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """RMSNorm over each value head, times the weight, times silu(z) (HF's RMSNormGated:
        normed in fp32, rounded, weighted, gated in fp32, rounded)."""
        t, dtype = o.shape[0], o.dtype
        of = o.float()
        normed = (of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + self.eps)).to(dtype) * self.norm
        return (normed * F.silu(z.float().view(t, self.num_v_heads, -1))).to(dtype)
