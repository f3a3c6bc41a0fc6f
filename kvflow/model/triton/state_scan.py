"""The state layers' prompt chunks for NVIDIA GPUs in Triton, with the semantics (and the
signatures, less the instruction set) of kvflow/csrc/state_update.py's `causal_conv`,
`gated_delta_chunks` and `ssm_chunks`:

- causal_conv: every request's tokens (a decode is a one-token chunk) through its window
  (conv state [slots, taps, C], then its tokens), bias, rounding to the model dtype, optional
  SiLU; the window's last taps rows become the state, and a snapshot's where one is asked for;
- gated_delta_chunks / ssm_chunks: each chunk's tokens through Gated DeltaNet's / Mamba2's
  recurrence (as state_update.py's one-token kernels), token after token, the state tile held
  in registers from the chunk's first token to its last and written back to its slot (and to a
  snapshot slot after a given token).

The sequential form: one program per (chunk, head, block of the state's columns or rows),
O(T dk dv) per head; the chunked (WY / SSD) form that uses tensor cores is not written yet."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch
import triton
import triton.language as tl

from kvflow.model.triton.state_update import (_index, _round_to, _rows_of, _softplus,
                                              gated_delta_decode, ssm_decode)


@triton.jit
def _conv_kernel(x_ptr, stride_x, out_ptr, stride_o, state_ptr, w_ptr, bias_ptr, starts_ptr,
                 lens_ptr, slots_ptr, snap_after_ptr, snap_slot_ptr, C, TAPS: tl.constexpr,
                 K_P2: tl.constexpr, TAPS_P2: tl.constexpr, HAS_BIAS: tl.constexpr,
                 SILU: tl.constexpr, HAS_SNAP: tl.constexpr, BLOCK_C: tl.constexpr):
    i = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    ok = c < C
    start = tl.load(starts_ptr + i)
    n = tl.load(lens_ptr + i)
    own = state_ptr + tl.load(slots_ptr + i).to(tl.int64) * TAPS * C
    kk = tl.arange(0, K_P2)
    tap_ok = (kk < TAPS + 1)[:, None] & ok[None, :]
    wt = tl.load(w_ptr + c[None, :] * (TAPS + 1) + kk[:, None], mask=tap_ok, other=0.0).to(tl.float32)
    bias = tl.load(bias_ptr + c, mask=ok, other=0.0).to(tl.float32) if HAS_BIAS else 0.0
    for t in range(0, n):  # window rows t .. t + taps: the state's rows, then the tokens
        r = t + kk[:, None]
        src = tl.where(r < TAPS, own + r * C + c[None, :],
                       x_ptr + (start + r - TAPS).to(tl.int64) * stride_x + c[None, :])
        win = tl.load(src, mask=tap_ok, other=0.0).to(tl.float32)
        acc = _round_to(tl.sum(win * wt, axis=0) + bias, out_ptr.dtype.element_ty)
        if SILU:
            acc = acc * tl.sigmoid(acc)
        tl.store(out_ptr + (start + t).to(tl.int64) * stride_o + c, acc.to(out_ptr.dtype.element_ty), mask=ok)
    rr = tl.arange(0, TAPS_P2)
    row_ok = (rr < TAPS)[:, None] & ok[None, :]
    if HAS_SNAP:  # before the state moves on: it may read the state's rows
        snap = tl.load(snap_slot_ptr + i)
        if snap >= 0:
            r = tl.load(snap_after_ptr + i) + 1 + rr[:, None]
            src = tl.where(r < TAPS, own + r * C + c[None, :],
                           x_ptr + (start + r - TAPS).to(tl.int64) * stride_x + c[None, :])
            rows = tl.load(src, mask=row_ok, other=0.0)
            tl.store(state_ptr + snap.to(tl.int64) * TAPS * C + rr[:, None] * C + c[None, :], rows, mask=row_ok)
    r = n + rr[:, None]  # the window's last taps rows: all read, then written
    src = tl.where(r < TAPS, own + r * C + c[None, :],
                   x_ptr + (start + r - TAPS).to(tl.int64) * stride_x + c[None, :])
    rows = tl.load(src, mask=row_ok, other=0.0)
    tl.store(own + rr[:, None] * C + c[None, :], rows, mask=row_ok)


@triton.jit
def _gdn_chunk_kernel(x_ptr, stride_x, ba_ptr, stride_ba, a_log_ptr, dt_bias_ptr, state_ptr,
                      starts_ptr, lens_ptr, slots_ptr, snap_after_ptr, snap_slot_ptr, out_ptr,
                      scale, NK: tl.constexpr, NV: tl.constexpr, DK: tl.constexpr,
                      DV: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    ci, h = tl.program_id(0), tl.program_id(1)
    kh = h // (NV // NK)
    i = tl.arange(0, BLOCK_K)
    j = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    ik, jv = i < DK, j < DV
    mask = ik[:, None] & jv[None, :]
    start = tl.load(starts_ptr + ci)
    n = tl.load(lens_ptr + ci)
    after = tl.load(snap_after_ptr + ci)  # -1: no snapshot
    tile = i[:, None] * DV + j[None, :]
    own = state_ptr + (tl.load(slots_ptr + ci).to(tl.int64) * NV + h) * DK * DV
    snap = state_ptr + (tl.load(snap_slot_ptr + ci).to(tl.int64) * NV + h) * DK * DV
    neg_a = -tl.exp(tl.load(a_log_ptr + h))
    dt_bias = tl.load(dt_bias_ptr + h)
    s = tl.load(own + tile, mask=mask, other=0.0)
    for t in range(0, n):
        row = (start + t).to(tl.int64)
        xr = x_ptr + row * stride_x
        q = tl.load(xr + kh * DK + i, mask=ik, other=0.0).to(tl.float32)
        k = tl.load(xr + NK * DK + kh * DK + i, mask=ik, other=0.0).to(tl.float32)
        v = tl.load(xr + 2 * NK * DK + h * DV + j, mask=jv, other=0.0).to(tl.float32)
        q = q * (1.0 / tl.sqrt(tl.sum(q * q, axis=0) + 1e-6)) * scale
        k = k * (1.0 / tl.sqrt(tl.sum(k * k, axis=0) + 1e-6))
        b = tl.load(ba_ptr + row * stride_ba + h).to(tl.float32)
        a = tl.load(ba_ptr + row * stride_ba + NV + h).to(tl.float32)
        beta = _round_to(tl.sigmoid(b), ba_ptr.dtype.element_ty)
        s = s * tl.exp(neg_a * _softplus(a + dt_bias))
        delta = (v - tl.sum(s * k[:, None], axis=0)) * beta
        s = s + k[:, None] * delta[None, :]
        tl.store(out_ptr + (row * NV + h) * DV + j, tl.sum(s * q[:, None], axis=0), mask=jv)
        if t == after:
            tl.store(snap + tile, s, mask=mask)
    tl.store(own + tile, s, mask=mask)


@triton.jit
def _ssm_chunk_kernel(x_ptr, stride_x, dt_ptr, stride_dt, a_log_ptr, dt_bias_ptr, state_ptr,
                      starts_ptr, lens_ptr, slots_ptr, snap_after_ptr, snap_slot_ptr, y_ptr,
                      dt_min, dt_max, NH: tl.constexpr, G: tl.constexpr, P: tl.constexpr,
                      N: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    ci, h = tl.program_id(0), tl.program_id(1)
    g = h // (NH // G)
    p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    nn = tl.arange(0, BLOCK_N)
    pv, nv = p < P, nn < N
    mask = pv[:, None] & nv[None, :]
    start = tl.load(starts_ptr + ci)
    n = tl.load(lens_ptr + ci)
    after = tl.load(snap_after_ptr + ci)
    tile = p[:, None] * N + nn[None, :]
    own = state_ptr + (tl.load(slots_ptr + ci).to(tl.int64) * NH + h) * P * N
    snap = state_ptr + (tl.load(snap_slot_ptr + ci).to(tl.int64) * NH + h) * P * N
    a = -tl.exp(tl.load(a_log_ptr + h))
    dt_bias = tl.load(dt_bias_ptr + h)
    s = tl.load(own + tile, mask=mask, other=0.0)
    for t in range(0, n):
        row = (start + t).to(tl.int64)
        xr = x_ptr + row * stride_x
        d = _softplus(tl.load(dt_ptr + row * stride_dt + h).to(tl.float32) + dt_bias)
        d = tl.minimum(tl.maximum(d, dt_min), dt_max)
        xdt = tl.load(xr + h * P + p, mask=pv, other=0.0).to(tl.float32) * d
        bv = tl.load(xr + NH * P + g * N + nn, mask=nv, other=0.0).to(tl.float32)
        cv = tl.load(xr + NH * P + G * N + g * N + nn, mask=nv, other=0.0).to(tl.float32)
        s = s * tl.exp(d * a) + xdt[:, None] * bv[None, :]
        tl.store(y_ptr + (row * NH + h) * P + p, tl.sum(s * cv[None, :], axis=1), mask=pv)
        if t == after:
            tl.store(snap + tile, s, mask=mask)
    tl.store(own + tile, s, mask=mask)


def _chunks(starts, lens, slots, saves: dict, device):
    """The chunks' index tensors on the device; snapshots as (after, slot) per chunk, -1
    after where a chunk has none (its slot then its own, never written)."""
    n = len(lens)
    starts, lens, slots = (np.asarray(a, dtype=np.int64)[:n] for a in (starts, lens, slots))
    snap_after, snap_slot = np.full(n, -1, dtype=np.int64), slots.copy()
    for i, (after, snap) in saves.items():
        snap_after[i], snap_slot[i] = after, snap
    return [_index(a, device) for a in (starts, lens, slots, snap_after, snap_slot)]


def causal_conv(conv_state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                x: torch.Tensor, starts, lens, slots, saves: dict, silu: bool) -> torch.Tensor:
    """state_update.causal_conv's result on a GPU: x [T, C] (rows may be strided), starts
    [N + 1], lens and slots [N], `saves` request -> (after, snapshot slot)."""
    _rows_of(x, "causal_conv")
    c, k = weight.shape
    if not (x.dtype == conv_state.dtype and x.shape[1] == c and conv_state.shape[1:] == (k - 1, c)
            and conv_state.is_contiguous() and k > 1):
        raise ValueError(f"causal_conv: x {tuple(x.shape)} {x.dtype}, state "
                         f"{tuple(conv_state.shape)} {conv_state.dtype} and weight "
                         f"{tuple(weight.shape)} do not fit")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    starts, lens, slots, snap_after, snap_slot = _chunks(starts, lens, slots, saves, x.device)
    if len(lens):
        block = min(triton.next_power_of_2(c), 256)
        _conv_kernel[(len(lens), triton.cdiv(c, block))](
            x, x.stride(0), out, out.stride(0), conv_state, weight.contiguous(),
            weight if bias is None else bias.contiguous(), starts, lens, slots, snap_after,
            snap_slot, c, TAPS=k - 1, K_P2=triton.next_power_of_2(k),
            TAPS_P2=max(triton.next_power_of_2(k - 1), 2), HAS_BIAS=bias is not None, SILU=silu,
            HAS_SNAP=bool(saves), BLOCK_C=block)
    return out


def gated_delta_chunks(x: torch.Tensor, ba: torch.Tensor, a_log: torch.Tensor,
                       dt_bias: torch.Tensor, state: torch.Tensor, starts, lens, slots,
                       saves: dict, out: torch.Tensor, num_k_heads: int) -> None:
    """state_update.gated_delta_chunks on a GPU: the chunks' outputs into out [T, nv, dv] fp32,
    their states moved on in their slots (and snapshots kept)."""
    _rows_of(x, "gated_delta_chunks")
    _rows_of(ba, "gated_delta_chunks")
    _, nv, dk, dv = state.shape
    if not (state.dtype == out.dtype == torch.float32 and state.is_contiguous()
            and out.is_contiguous() and out.shape[1:] == (nv, dv)
            and x.shape[1] == 2 * num_k_heads * dk + nv * dv and ba.shape[1] == 2 * nv
            and nv % num_k_heads == 0):
        raise ValueError(f"gated_delta_chunks: x {tuple(x.shape)}, ba {tuple(ba.shape)}, state "
                         f"{tuple(state.shape)} and out {tuple(out.shape)} do not fit")
    args = _chunks(starts, lens, slots, saves, x.device)
    if len(lens):
        block_v = min(triton.next_power_of_2(dv), 32)
        _gdn_chunk_kernel[(len(lens), nv, triton.cdiv(dv, block_v))](
            x, x.stride(0), ba, ba.stride(0), a_log.float().contiguous(),
            dt_bias.float().contiguous(), state, *args, out, dk ** -0.5, NK=num_k_heads, NV=nv,
            DK=dk, DV=dv, BLOCK_K=triton.next_power_of_2(dk), BLOCK_V=block_v)


def ssm_chunks(x: torch.Tensor, dt: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor,
               state: torch.Tensor, starts, lens, slots, saves: dict, y: torch.Tensor,
               n_groups: int, dt_limit: tuple[float, float]) -> None:
    """state_update.ssm_chunks on a GPU: the chunks' outputs into y [T, nh, P] fp32 (without
    the D skip), their states moved on in their slots (and snapshots kept)."""
    _rows_of(x, "ssm_chunks")
    _rows_of(dt, "ssm_chunks")
    _, nh, p, n = state.shape
    if not (state.dtype == y.dtype == torch.float32 and state.is_contiguous()
            and y.is_contiguous() and y.shape[1:] == (nh, p)
            and x.shape[1] == nh * p + 2 * n_groups * n and dt.shape[1] == nh
            and nh % n_groups == 0):
        raise ValueError(f"ssm_chunks: x {tuple(x.shape)}, dt {tuple(dt.shape)}, state "
                         f"{tuple(state.shape)} and y {tuple(y.shape)} do not fit")
    args = _chunks(starts, lens, slots, saves, x.device)
    if len(lens):
        block_p = min(triton.next_power_of_2(p), 16)
        _ssm_chunk_kernel[(len(lens), nh, triton.cdiv(p, block_p))](
            x, x.stride(0), dt, dt.stride(0), a_log.float().contiguous(),
            dt_bias.float().contiguous(), state, *args, y, float(dt_limit[0]),
            float(dt_limit[1]), NH=nh, G=n_groups, P=p, N=n, BLOCK_P=block_p,
            BLOCK_N=triton.next_power_of_2(n))


def ops() -> SimpleNamespace:
    """The state layers' operations on a GPU, by the names the layers call (as
    kvflow/csrc/state_update.py's `ops(isa)` on a CPU)."""
    return SimpleNamespace(name="triton", causal_conv=causal_conv, gated_delta_decode=gated_delta_decode,
                           gated_delta_chunks=gated_delta_chunks, ssm_decode=ssm_decode,
                           ssm_chunks=ssm_chunks)
