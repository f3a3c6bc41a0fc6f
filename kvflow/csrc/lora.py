"""Tensor-level entry of LoRA's batched shrink and expand (lora.c): its instruction sets, the
call (split over the kernel pool by rows), and the PyTorch reference it is tested against."""
from __future__ import annotations

import torch

from kvflow.csrc import library, run_kernel

LORA_ISAS = {"scalar": 0, "avx2": 1, "avx512": 2}  # lora.c's `isa` codes


def lora_isas() -> list[str]:
    """The paths the kernel library was built with, narrowest first."""
    lib = library()
    if lib is None:
        return []
    bits = int(lib.lora_isas())
    return [name for name, code in LORA_ISAS.items() if bits >> code & 1]


def best_lora_isa(features) -> str:
    """The widest path both the build and the CPU offer (scalar at least)."""
    built = lora_isas()
    if "avx512" in built and features.avx512:
        return "avx512"
    if "avx2" in built and {"avx2", "fma"} <= features.flags:
        return "avx2"
    return "scalar"


def _check(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, bt: torch.Tensor,
           slots: torch.Tensor) -> None:
    if x.dim() != 2 or y.dim() != 2 or x.shape[0] != y.shape[0] or slots.shape != (x.shape[0],):
        raise ValueError(f"lora: x {tuple(x.shape)}, y {tuple(y.shape)} and slots "
                         f"{tuple(slots.shape)} disagree")
    if a.shape[-1] != x.shape[1] or bt.shape[-1] != y.shape[1]:
        raise ValueError(f"lora: weights {tuple(a.shape)} / {tuple(bt.shape)} do not fit x "
                         f"{tuple(x.shape)} -> y {tuple(y.shape)}")


def lora_add(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, bt: torch.Tensor,
             ranks: torch.Tensor, starts: torch.Tensor, slots: torch.Tensor, isa: str = "avx512",
             threads: int = 1) -> None:
    """y[t] += B[slots[t]] (A[slots[t]] x[t]) in place for the rows whose slot is >= 0 (see
    lora.c for the layouts: a [S, n_slices * R, K], bt [S, R, N] fp32, ranks int64 [S], starts
    int64 [n_slices + 1], slots int64 [T]); x and y fp32 or bf16."""
    _check(y, x, a, bt, slots)
    if x.dtype not in (torch.float32, torch.bfloat16) or y.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"lora: activations must be fp32 or bf16, got {x.dtype} / {y.dtype}")
    if y.stride(1) != 1:
        raise ValueError("lora: the output's rows must be contiguous")
    if any(t.device.type != "cpu" for t in (y, x, a, bt, ranks, starts, slots)):
        raise ValueError("lora: the C kernel takes CPU tensors")
    if ranks.dtype != torch.int64 or starts.dtype != torch.int64 or slots.dtype != torch.int64:
        raise ValueError("lora: ranks, starts and slots must be int64")
    if not (a.is_contiguous() and bt.is_contiguous() and slots.is_contiguous()):
        raise ValueError("lora: the slots' weights and the rows' slots must be contiguous")
    if x.stride(1) != 1:
        x = x.contiguous()
    t, n_slices, r = x.shape[0], starts.numel() - 1, bt.shape[1]
    s = torch.empty(t, n_slices * r, dtype=torch.float32)  # each thread's rows: its own part
    run_kernel("lora", [x.data_ptr(), x.stride(0), int(x.dtype == torch.bfloat16), x.shape[1],
                        a.data_ptr(), bt.data_ptr(), n_slices, r, ranks.data_ptr(),
                        starts.data_ptr(), y.shape[1], slots.data_ptr(), s.data_ptr(),
                        y.data_ptr(), y.stride(0), int(y.dtype == torch.bfloat16), LORA_ISAS[isa]],
               t, threads)


def lora_add_torch(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, bt: torch.Tensor,
                   ranks: torch.Tensor, starts: torch.Tensor, slots: torch.Tensor) -> None:
    """lora_add in PyTorch (fp32 arithmetic, one rounding into y): the reference, and the path
    where the C kernels did not build."""
    _check(y, x, a, bt, slots)
    r = bt.shape[1]
    bounds = starts.tolist()
    for slot in torch.unique(slots[slots >= 0]).tolist():
        rows = (slots == slot).nonzero().squeeze(1)
        rank = int(ranks[slot])
        if rank == 0:
            continue
        s = x[rows].float() @ a[slot].T.float()
        for j in range(len(bounds) - 1):
            lo, hi = bounds[j], bounds[j + 1]
            delta = s[:, j * r:j * r + rank] @ bt[slot, :rank, lo:hi].float()
            y[rows, lo:hi] = (y[rows, lo:hi].float() + delta).to(y.dtype)
