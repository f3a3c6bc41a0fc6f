"""Projections through oneDNN's prepacked fp32 GEMM, with the row count rounded up to a bucket.

oneDNN builds (and caches) a GEMM primitive for every input shape it sees. A serving engine
sees a different number of tokens almost every step, so without buckets the primitive cache
fills with one-off shapes: ~1 MiB each, which showed as the engine process growing ~1 MiB per
request in the soak test until the cache's 1,024 entries were full. Rounding the rows up to a
few dozen buckets keeps the set of shapes small and the memory flat; the padded rows cost at
most 15 extra rows below 256 and under 6% above, and no slower in the W1 benchmark."""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F


def onednn_usable(dtype: torch.dtype) -> bool:
    """oneDNN's prepacked fp32 GEMM beats MKL's F.linear here: ~1.5x for decode-sized batches
    and the LM head, the same for long prefills (benchmarks/README.md). KVFLOW_NO_ONEDNN=1 opts out."""
    return (dtype == torch.float32 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise")
            and os.environ.get("KVFLOW_NO_ONEDNN") != "1")


def pack_weight(w: torch.Tensor) -> torch.Tensor:
    """An (out, in) fp32 weight in oneDNN's blocked layout, for `linear`."""
    return torch.ops.mkldnn._reorder_linear_weight(w.detach(), 64)  # 64: a decode-sized batch hint


def row_bucket(m: int) -> int:
    """Rows rounded up: powers of two to 16, multiples of 16 to 256, then multiples of 128."""
    if m <= 16:
        return 1 << (m - 1).bit_length() if m > 0 else m
    if m <= 256:
        return -(-m // 16) * 16
    return -(-m // 128) * 128


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
