"""Tensor-level entry of the fp32 decode GEMV (gemv_f32.c): the weight packing it reads (fp32,
or bf16 / fp16 widened to fp32 in registers), its instruction sets, and the call, split over
the kernel pool by panels of outputs."""
from __future__ import annotations

import torch

from kvflow.csrc import library, run_kernel

GEMV_PANEL = 16  # outputs per packed panel (gemv_f32.c)
GEMV_ISAS = {"scalar": 0, "avx2": 1, "avx512": 2}  # gemv_f32.c's `isa` codes
# the weight storage types it widens, as gemv_f32.c's `wdt` codes
GEMV_WEIGHT_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
# The most rows the GEMV serves per instruction set, by measurement (benchmarks/gemv_f32.py,
# the default model's projections and LM head, one thread; docs/performance.md, "Single
# stream"). AVX-512 (a Zen 4) beat oneDNN at every M up to 8, its tile. AVX2 serves every
# batch (GEMV_ALL_ROWS): with its six-row tile over L2-sized groups of panels it is a GEMM that
# ran 1.05-2.3x oneDNN's prepacked fp32 GEMM (rows padded to their bucket, as served) from 8 to
# 2,100 rows on an AMD EPYC Zen 3 (AVX2 + FMA), level at 2,048, so an AVX2 CPU keeps no oneDNN
# copy of the weights (half the memory).
GEMV_ALL_ROWS = 1 << 62
GEMV_MAX_ROWS = {"avx2": GEMV_ALL_ROWS, "avx512": 8}


def gemv_isas() -> list[str]:
    """The paths the kernel library was built with, narrowest first."""
    lib = library()
    if lib is None:
        return []
    bits = int(lib.gemv_f32_isas())
    return [name for name, code in GEMV_ISAS.items() if bits >> code & 1]


def best_gemv_isa(features) -> str | None:
    """The widest vector path that both the build and the CPU offer (None: no vector path,
    oneDNN serves every row count)."""
    built = gemv_isas()
    if "avx512" in built and features.avx512:
        return "avx512"
    if "avx2" in built and {"avx2", "fma", "f16c"} <= features.flags:
        return "avx2"
    return None


def pack_gemv(w: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """(N, K) -> [ceil(N/16), K, 16] in `dtype` (default: w's; fp32, bf16 or fp16): per panel
    of 16 outputs, input k's 16 weights in one line (64 bytes in fp32, 32 in half precision),
    so a panel is one sequential stream (outputs past N are zero weights). Converting to a half
    dtype rounds to nearest even: exact where w's values are representable in it."""
    dtype = w.dtype if dtype is None else dtype
    if dtype not in GEMV_WEIGHT_DTYPES:
        raise ValueError(f"the GEMV reads fp32, bf16 or fp16 weights, not {dtype}")
    n, k = w.shape
    padded = w.new_zeros(-(-n // GEMV_PANEL) * GEMV_PANEL, k, dtype=dtype)
    padded[:n] = w
    return padded.view(-1, GEMV_PANEL, k).transpose(1, 2).contiguous()


def gemv_f32(x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None = None,
             isa: str = "avx512", threads: int = 1) -> torch.Tensor:
    """x [M, K] fp32 @ w.T (+ bias) -> [M, n] fp32, w given as pack_gemv(w) in any of its
    storage dtypes (the arithmetic is fp32 in every case)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, k = x.shape
    out = x.new_empty(m, n)
    words = [x.data_ptr(), x.stride(0), m, k, packed.data_ptr(),
             bias.data_ptr() if bias is not None else None, out.data_ptr(), n, n, GEMV_ISAS[isa],
             GEMV_WEIGHT_DTYPES[packed.dtype]]
    run_kernel("gemv_f32", words, packed.shape[0], threads)
    return out
