"""LoRA's batched shrink and expand on the GPU (Punica's BGMV as two Triton kernels), the same
contract and layouts as kvflow/csrc/lora.c: rows whose slot is -1 (the base model) are left
alone, the others get y[t] += B[slot] (A[slot] x[t]) in fp32, rounded once into y.

shrink: one program per (row, slice): s[t, j*R : j*R + R] = A[slot, j*R : j*R + R, :] @ x[t],
        K in blocks; expand: one program per (row, block of outputs): each output reads the
        slice its index falls in (up to three slices, found by comparing with the bounds)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, ranks_ptr, slots_ptr, s_ptr, stride_x, K, n_slices,
                   R: tl.constexpr, BLOCK_K: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1).to(tl.int64)
    slot = tl.load(slots_ptr + row)
    if slot >= 0:
        rank = tl.load(ranks_ptr + slot)
        r = tl.arange(0, R)
        acc = tl.zeros((R,), dtype=tl.float32)
        base = a_ptr + (slot * n_slices + j) * R * K
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            xv = tl.load(x_ptr + row * stride_x + k, mask=k < K, other=0.0).to(tl.float32)
            w = tl.load(base + r[:, None] * K + k[None, :],
                        mask=(r[:, None] < rank) & (k[None, :] < K), other=0.0)
            acc += tl.sum(w * xv[None, :], axis=1)
        tl.store(s_ptr + row * n_slices * R + j * R + r, acc)


@triton.jit
def _expand_kernel(s_ptr, bt_ptr, ranks_ptr, slots_ptr, y_ptr, stride_y, N, n_slices, b1, b2,
                   R: tl.constexpr, BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + row)
    if slot >= 0:
        rank = tl.load(ranks_ptr + slot)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        ok = n < N
        j = (n >= b1).to(tl.int64) + (n >= b2).to(tl.int64)  # the slice of each output
        r = tl.arange(0, R)
        s = tl.load(s_ptr + row * n_slices * R + j[None, :] * R + r[:, None],
                    mask=(r[:, None] < rank) & ok[None, :], other=0.0)
        b = tl.load(bt_ptr + slot * R * N + r[:, None] * N + n[None, :],
                    mask=(r[:, None] < rank) & ok[None, :], other=0.0)
        delta = tl.sum(s * b, axis=0)
        y = tl.load(y_ptr + row * stride_y + n, mask=ok, other=0.0).to(tl.float32)
        tl.store(y_ptr + row * stride_y + n, (y + delta).to(y_ptr.dtype.element_ty), mask=ok)


def lora_add(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, bt: torch.Tensor,
             ranks: torch.Tensor, starts: torch.Tensor, slots: torch.Tensor,
             bounds: list[int]) -> None:
    """kvflow/csrc/lora.py's lora_add on the device; `bounds` is `starts` as ints (1 to 3 slices)."""
    t, k = x.shape
    n_slices, r = len(bounds) - 1, bt.shape[1]
    if t == 0:
        return
    if not 1 <= n_slices <= 3 or r & (r - 1) or x.stride(1) != 1 or y.stride(1) != 1:
        raise ValueError("lora (triton): 1-3 slices, a power-of-two rank and dense rows")
    n = y.shape[1]
    s = torch.zeros(t, n_slices * r, dtype=torch.float32, device=x.device)
    _shrink_kernel[(t, n_slices)](x, a, ranks, slots, s, x.stride(0), k, n_slices, R=r,
                                  BLOCK_K=min(128, triton.next_power_of_2(k)))
    b1 = bounds[1] if n_slices > 1 else n
    b2 = bounds[2] if n_slices > 2 else n
    block_n = 128
    _expand_kernel[(t, triton.cdiv(n, block_n))](s, bt, ranks, slots, y, y.stride(0), n, n_slices,
                                                 b1, b2, R=r, BLOCK_N=block_n)
