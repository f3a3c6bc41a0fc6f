"""Projections through oneDNN's prepacked fp32 GEMM, with the row count rounded up to a bucket.

oneDNN builds (and caches) a GEMM primitive for every input shape it sees. A serving engine
sees a different number of tokens almost every step, so without buckets the primitive cache
fills with one-off shapes: ~1 MiB each, which showed as the engine process growing ~1 MiB per
request in the soak test until the cache's 1,024 entries were full. Rounding the rows up to a
few dozen buckets (eight per doubling) keeps the set of shapes small and the memory flat
(~0.6 MiB per shape and weight); the padded rows cost at most 7 rows below 64 and under 12.5%
above. Coarser buckets (multiples of 128 above 256) padded a serving step of 256 prompt tokens
plus 50 decodes from 306 to 384 rows: 25% more GEMM time on the steps that dominate serving."""
from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F


def onednn_usable(dtype: torch.dtype) -> bool:
    """oneDNN's prepacked GEMM beats F.linear here. fp32: ~1.5x for decode-sized batches and
    the LM head, the same for long prefills (benchmarks/README.md). bf16, on CPUs with native
    bf16 (AVX512-BF16/AMX): F.linear reorders the weight on every call, the packed copy does
    not (~1.25x at 40 rows, ~1.1x at 128, ~1.04x at 2,048). KVFLOW_NO_ONEDNN=1 opts out."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
            and os.environ.get("KVFLOW_NO_ONEDNN") != "1"):
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()) and cpu_has_native_bf16()
    return dtype == torch.float32


@functools.cache
def cpu_has_native_bf16() -> bool:
    """AVX512-BF16 or AMX: without them oneDNN emulates bf16 (several times slower than fp32)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = set(next((line for line in f if line.startswith("flags")), "").split())
    except OSError:
        return False
    return bool(flags & {"avx512_bf16", "amx_bf16"})


def pack_weight(w: torch.Tensor) -> torch.Tensor:
    """An (out, in) fp32 or bf16 weight in oneDNN's blocked layout, for `linear`."""
    return torch.ops.mkldnn._reorder_linear_weight(w.detach(), 64)  # 64: a decode-sized batch hint


def row_bucket(m: int) -> int:
    """Rows rounded up: powers of two to 8, then multiples of an eighth of the power of two
    below (at least 8, at most 128): 16, 24, ..., 64, 72, ..., 128, 144, ..., 256, 288, ..."""
    if m <= 8:
        return 1 << (m - 1).bit_length() if m > 0 else m
    step = min(128, max(8, 1 << (m.bit_length() - 4)))
    return -(-m // step) * step


def linear(x: torch.Tensor, w: torch.Tensor, packed: torch.Tensor | None,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w.T (+ bias): through `packed` (oneDNN) when given, else F.linear."""
    if packed is None:
        return F.linear(x, w, bias)
    m = x.shape[0]
    rows = row_bucket(m)
    if rows != m:
        padded = x.new_empty(rows, x.shape[1])
        padded[:m] = x
        padded[m:].zero_()
        return torch.ops.mkldnn._linear_pointwise(padded, packed, bias, "none", [], "")[:m]
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
