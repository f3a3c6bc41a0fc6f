"""The small per-token operations of a Llama layer as one Triton kernel each, with the
rounding of their PyTorch versions in kvflow/csrc/ops.py (every op that PyTorch runs in the
model's dtype is rounded to it here too), so they agree with transformers as those do:

- add_rms_norm: residual += delta in place, then RMSNorm in fp32, rounded, times the weight;
- silu_mul: silu(gate) * up of the fused gate|up projection;
- rope_: rotate_half RoPE on the first n_heads heads of each row of the fused qkv, in place,
  with positions read on the device (a CUDA graph's buffer)."""
from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl


@triton.jit
def _add_rms_norm_kernel(x_ptr, delta_ptr, w_ptr, out_ptr, stride_x, stride_d, stride_o, n, eps,
                         HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK)
    ok = i < n
    x = tl.load(x_ptr + row * stride_x + i, mask=ok, other=0.0)
    if HAS_DELTA:
        x = (x.to(tl.float32) + tl.load(delta_ptr + row * stride_d + i, mask=ok, other=0.0).to(tl.float32))
        x = x.to(x_ptr.dtype.element_ty)
        tl.store(x_ptr + row * stride_x + i, x, mask=ok)
    xf = x.to(tl.float32)
    normed = xf * tl.rsqrt(tl.sum(xf * xf, axis=0) / n + eps)
    w = tl.load(w_ptr + i, mask=ok, other=0.0)
    y = w.to(tl.float32) * normed.to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_o + i, y.to(out_ptr.dtype.element_ty), mask=ok)


def add_rms_norm(residual: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> torch.Tensor:
    """residual += delta (in place, if given); return RMSNorm(residual) * weight (rows of [T, H])."""
    t, h = residual.shape
    out = torch.empty(t, h, dtype=torch.promote_types(weight.dtype, residual.dtype),
                      device=residual.device)
    if t == 0:
        return out
    if residual.stride(1) != 1 or (delta is not None and delta.stride(1) != 1):
        raise ValueError("add_rms_norm needs rows with a dense hidden dim")
    _add_rms_norm_kernel[(t,)](residual, residual if delta is None else delta, weight, out,
                               residual.stride(0), 0 if delta is None else delta.stride(0),
                               out.stride(0), h, eps, HAS_DELTA=delta is not None,
                               BLOCK=triton.next_power_of_2(h))
    return out


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, stride_gu, stride_o, n, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n
    gate = tl.load(gu_ptr + row * stride_gu + i, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(gu_ptr + row * stride_gu + n + i, mask=ok, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_o + i, (act * up).to(out_ptr.dtype.element_ty), mask=ok)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = [gate | up] along the last dim ([T, 2I] -> [T, I])."""
    t, two_i = gate_up.shape
    n = two_i // 2
    out = torch.empty(t, n, dtype=gate_up.dtype, device=gate_up.device)
    if t == 0:
        return out
    if gate_up.stride(1) != 1:
        raise ValueError("silu_mul needs rows with a dense last dim")
    block = min(triton.next_power_of_2(n), 1024)
    _silu_mul_kernel[(t, triton.cdiv(n, block))](gate_up, out, gate_up.stride(0), out.stride(0),
                                                 n, BLOCK=block)
    return out


@triton.jit
def _rope_kernel(qkv_ptr, pos_ptr, cos_ptr, sin_ptr, stride_t, stride_pos, n_heads,
                 HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_J: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + row).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    j = tl.arange(0, BLOCK_J)
    j_ok = j < HEAD_DIM // 2
    ok = (h < n_heads)[:, None] & j_ok[None, :]
    base = qkv_ptr + row * stride_t + h[:, None] * HEAD_DIM + j[None, :]
    x1 = tl.load(base, mask=ok, other=0.0)
    x2 = tl.load(base + HEAD_DIM // 2, mask=ok, other=0.0)
    dt = x1.dtype
    # the tables' halves are equal (cat(freqs, freqs)); each in the model's dtype, as PyTorch
    c1 = tl.load(cos_ptr + pos * stride_pos + j, mask=j_ok, other=0.0).to(dt).to(tl.float32)[None, :]
    s1 = tl.load(sin_ptr + pos * stride_pos + j, mask=j_ok, other=0.0).to(dt).to(tl.float32)[None, :]
    c2 = tl.load(cos_ptr + pos * stride_pos + HEAD_DIM // 2 + j, mask=j_ok, other=0.0).to(dt).to(tl.float32)[None, :]
    s2 = tl.load(sin_ptr + pos * stride_pos + HEAD_DIM // 2 + j, mask=j_ok, other=0.0).to(dt).to(tl.float32)[None, :]
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    # out1 = x1 * c - x2 * s, out2 = x2 * c + x1 * s; each product rounded as PyTorch rounds it
    o1 = (a * c1).to(dt).to(tl.float32) + (-b * s1).to(dt).to(tl.float32)
    o2 = (b * c2).to(dt).to(tl.float32) + (a * s2).to(dt).to(tl.float32)
    tl.store(base, o1.to(dt), mask=ok)
    tl.store(base + HEAD_DIM // 2, o2.to(dt), mask=ok)


def rope_(qkv: torch.Tensor, n_heads: int, head_dim: int, positions: torch.Tensor | np.ndarray,
          cos: torch.Tensor, sin: torch.Tensor) -> None:
    """ops.rope_torch_ in one kernel: positions on the device (host ones are copied there)."""
    if isinstance(positions, np.ndarray):
        positions = torch.from_numpy(positions).to(qkv.device, non_blocking=True)
    t = qkv.shape[0]
    if t == 0:
        return
    if qkv.stride(1) != 1 or cos.stride(1) != 1 or sin.stride() != cos.stride():
        raise ValueError("rope_ needs dense rows and matching cos/sin tables")
    block_h = min(triton.next_power_of_2(n_heads), 16)
    _rope_kernel[(t, triton.cdiv(n_heads, block_h))](
        qkv, positions, cos, sin, qkv.stride(0), cos.stride(0), n_heads,
        HEAD_DIM=head_dim, BLOCK_H=block_h, BLOCK_J=triton.next_power_of_2(head_dim // 2))
