"""The state layers' one-token updates for NVIDIA GPUs in Triton, with the semantics (and the
signatures, less the instruction set) of the C kernels in kvflow/csrc/state_update.py:

- gated_delta_decode: Gated DeltaNet's recurrent step (q, k L2-normalised, q scaled by dk^-0.5,
  beta = sigmoid(b), g = -exp(A_log) softplus(a + dt_bias)):
      S <- exp(g) S;  S <- S + k (beta (v - S^T k))^T;  o = S^T q
- ssm_decode: Mamba2's selective state update (dt = softplus(dt + dt_bias) clamped):
      S <- exp(dt A) S + dt x B^T;  y = S C          (the D skip is the caller's)

Each program owns one request's head (and a block of the state's columns or rows), reads the
state from the request's slot and writes it back there: no gather, no scatter. The states are
fp32, the activations the model's dtype; sums in fp32. The conv and the prompt chunks are
state_scan.py's."""
from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl


@triton.jit
def _softplus(x):
    return tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(x)))


@triton.jit
def _round_to(x, dtype: tl.constexpr):
    """x (fp32) rounded to `dtype` and back: bf16 to nearest even by its bits (the
    interpreter's cast need not round so), fp32 as it is."""
    if dtype == tl.bfloat16:
        u = x.to(tl.uint32, bitcast=True)
        u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
        x = u.to(tl.float32, bitcast=True)
    return x


@triton.jit
def _gdn_decode_kernel(x_ptr, stride_x, ba_ptr, stride_ba, a_log_ptr, dt_bias_ptr, state_ptr,
                       rows_ptr, slots_ptr, out_ptr, scale, NK: tl.constexpr, NV: tl.constexpr,
                       DK: tl.constexpr, DV: tl.constexpr, BLOCK_K: tl.constexpr,
                       BLOCK_V: tl.constexpr):
    r, h = tl.program_id(0), tl.program_id(1)
    kh = h // (NV // NK)
    i = tl.arange(0, BLOCK_K)
    j = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    ik, jv = i < DK, j < DV
    row = tl.load(rows_ptr + r).to(tl.int64)
    xr = x_ptr + row * stride_x
    q = tl.load(xr + kh * DK + i, mask=ik, other=0.0).to(tl.float32)
    k = tl.load(xr + NK * DK + kh * DK + i, mask=ik, other=0.0).to(tl.float32)
    v = tl.load(xr + 2 * NK * DK + h * DV + j, mask=jv, other=0.0).to(tl.float32)
    q = q * (1.0 / tl.sqrt(tl.sum(q * q, axis=0) + 1e-6)) * scale
    k = k * (1.0 / tl.sqrt(tl.sum(k * k, axis=0) + 1e-6))
    b = tl.load(ba_ptr + row * stride_ba + h).to(tl.float32)
    a = tl.load(ba_ptr + row * stride_ba + NV + h).to(tl.float32)
    beta = _round_to(tl.sigmoid(b), ba_ptr.dtype.element_ty)  # in the model dtype, as b.sigmoid()
    eg = tl.exp(-tl.exp(tl.load(a_log_ptr + h)) * _softplus(a + tl.load(dt_bias_ptr + h)))
    at = (tl.load(slots_ptr + r).to(tl.int64) * NV + h) * DK * DV + i[:, None] * DV + j[None, :]
    mask = ik[:, None] & jv[None, :]
    s = tl.load(state_ptr + at, mask=mask, other=0.0) * eg
    delta = (v - tl.sum(s * k[:, None], axis=0)) * beta
    s = s + k[:, None] * delta[None, :]
    tl.store(state_ptr + at, s, mask=mask)
    tl.store(out_ptr + (row * NV + h) * DV + j, tl.sum(s * q[:, None], axis=0), mask=jv)


@triton.jit
def _ssm_decode_kernel(x_ptr, stride_x, dt_ptr, stride_dt, a_log_ptr, dt_bias_ptr, state_ptr,
                       rows_ptr, slots_ptr, y_ptr, dt_min, dt_max, NH: tl.constexpr,
                       G: tl.constexpr, P: tl.constexpr, N: tl.constexpr, BLOCK_P: tl.constexpr,
                       BLOCK_N: tl.constexpr):
    r, h = tl.program_id(0), tl.program_id(1)
    g = h // (NH // G)
    p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    pv, nv = p < P, n < N
    row = tl.load(rows_ptr + r).to(tl.int64)
    xr = x_ptr + row * stride_x
    d = _softplus(tl.load(dt_ptr + row * stride_dt + h).to(tl.float32) + tl.load(dt_bias_ptr + h))
    d = tl.minimum(tl.maximum(d, dt_min), dt_max)
    da = tl.exp(d * -tl.exp(tl.load(a_log_ptr + h)))
    xdt = tl.load(xr + h * P + p, mask=pv, other=0.0).to(tl.float32) * d
    bv = tl.load(xr + NH * P + g * N + n, mask=nv, other=0.0).to(tl.float32)
    cv = tl.load(xr + NH * P + G * N + g * N + n, mask=nv, other=0.0).to(tl.float32)
    at = (tl.load(slots_ptr + r).to(tl.int64) * NH + h) * P * N + p[:, None] * N + n[None, :]
    mask = pv[:, None] & nv[None, :]
    s = tl.load(state_ptr + at, mask=mask, other=0.0) * da + xdt[:, None] * bv[None, :]
    tl.store(state_ptr + at, s, mask=mask)
    tl.store(y_ptr + (row * NH + h) * P + p, tl.sum(s * cv[None, :], axis=1), mask=pv)


def _index(a, device) -> torch.Tensor:
    return torch.as_tensor(np.ascontiguousarray(a, dtype=np.int64) if isinstance(a, np.ndarray) else a,
                           dtype=torch.int64, device=device)


def _rows_of(x: torch.Tensor, name: str) -> None:
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"{name}: expected a [T, width] tensor with contiguous rows, got "
                         f"{tuple(x.shape)} strides {x.stride()}")


def gated_delta_decode(x: torch.Tensor, ba: torch.Tensor, a_log: torch.Tensor,
                       dt_bias: torch.Tensor, state: torch.Tensor, rows, slots,
                       out: torch.Tensor, num_k_heads: int) -> None:
    """Gated DeltaNet's step for one token of each request: x [T, 2 nk dk + nv dv] (the conv's
    q|k|v after SiLU), ba [T, 2 nv] (b, then a), state [slots, nv, dk, dv] fp32 updated in place
    at `slots`; out [T, nv, dv] fp32 gets rows `rows`."""
    _rows_of(x, "gated_delta_decode")
    _rows_of(ba, "gated_delta_decode")
    _, nv, dk, dv = state.shape
    if not (state.dtype == out.dtype == torch.float32 and state.is_contiguous()
            and out.is_contiguous() and out.shape[1:] == (nv, dv)
            and x.shape[1] == 2 * num_k_heads * dk + nv * dv and ba.shape[1] == 2 * nv
            and nv % num_k_heads == 0):
        raise ValueError(f"gated_delta_decode: x {tuple(x.shape)}, ba {tuple(ba.shape)}, state "
                         f"{tuple(state.shape)} and out {tuple(out.shape)} do not fit")
    rows, slots = _index(rows, x.device), _index(slots, x.device)
    if len(rows):
        block_v = min(triton.next_power_of_2(dv), 32)
        _gdn_decode_kernel[(len(rows), nv, triton.cdiv(dv, block_v))](
            x, x.stride(0), ba, ba.stride(0), a_log.float().contiguous(),
            dt_bias.float().contiguous(), state, rows, slots, out, dk ** -0.5, NK=num_k_heads,
            NV=nv, DK=dk, DV=dv, BLOCK_K=triton.next_power_of_2(dk), BLOCK_V=block_v)


def ssm_decode(x: torch.Tensor, dt: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor,
               state: torch.Tensor, rows, slots, y: torch.Tensor, n_groups: int,
               dt_limit: tuple[float, float]) -> None:
    """Mamba2's selective state update for one token of each request: x [T, nh P + 2 G N] (the
    conv's x|B|C after SiLU), dt [T, nh] raw, state [slots, nh, P, N] fp32 updated in place at
    `slots`; y [T, nh, P] fp32 gets rows `rows` (without the D skip)."""
    _rows_of(x, "ssm_decode")
    _rows_of(dt, "ssm_decode")
    _, nh, p, n = state.shape
    if not (state.dtype == y.dtype == torch.float32 and state.is_contiguous()
            and y.is_contiguous() and y.shape[1:] == (nh, p)
            and x.shape[1] == nh * p + 2 * n_groups * n and dt.shape[1] == nh
            and nh % n_groups == 0):
        raise ValueError(f"ssm_decode: x {tuple(x.shape)}, dt {tuple(dt.shape)}, state "
                         f"{tuple(state.shape)} and y {tuple(y.shape)} do not fit")
    rows, slots = _index(rows, x.device), _index(slots, x.device)
    if len(rows):
        block_p = min(triton.next_power_of_2(p), 16)
        _ssm_decode_kernel[(len(rows), nh, triton.cdiv(p, block_p))](
            x, x.stride(0), dt, dt.stride(0), a_log.float().contiguous(),
            dt_bias.float().contiguous(), state, rows, slots, y, float(dt_limit[0]),
            float(dt_limit[1]), NH=nh, G=n_groups, P=p, N=n, BLOCK_P=block_p,
            BLOCK_N=triton.next_power_of_2(n))
