"""int8 W8A8 for any float model: each output channel's weights scaled to -127..127 once at
load (one scale per channel), the activations per token at each call (one scale per row);
both then meet in gemm_quant.c's q8 GEMM, whose per-block scales all carry the channel's.
compressed-tensors checkpoints (compressed_tensors.py) bring their own int8 values and scales."""
from __future__ import annotations

import numpy as np
import torch

from kvflow.model.quant.packing import BLOCK, pack
from kvflow.model.quant.qlinear import QuantizedWeight


def quantize_int8(w: torch.Tensor, isa: str) -> QuantizedWeight:
    """A float (N, K) weight -> per-channel int8 (K padded to whole blocks with zeros)."""
    n, k = w.shape
    kb = -(-k // BLOCK)
    a = np.zeros((n, kb * BLOCK), dtype=np.float32)
    a[:, :k] = w.detach().float().numpy()
    # the channel's scale as stored (fp16), so that q is rounded against the scale in use
    d = (np.abs(a).max(axis=1) / 127.0).astype(np.float16).astype(np.float32)
    inv = np.divide(1.0, d, out=np.zeros_like(d), where=d > 0)
    q = np.clip(np.round(a * inv[:, None]), -127, 127).astype(np.int8)
    return int8_from_channels(q, d, isa, k=k)


def int8_from_channels(q: np.ndarray, scale: np.ndarray, isa: str, source: str = "int8",
                       k: int | None = None) -> QuantizedWeight:
    """int8 values q (N, K') (-128..127) and one scale per output channel (N,), weight =
    scale * q, as W8A8 panels (q's columns past `k`, and K up to whole blocks, are zeros)."""
    n = q.shape[0]
    k = q.shape[1] if k is None else k
    kb = -(-k // BLOCK)
    if q.shape[1] != kb * BLOCK:
        padded = np.zeros((n, kb * BLOCK), dtype=np.int8)
        padded[:, : q.shape[1]] = q
        q = padded
    packed = pack("q8", q, np.repeat(np.asarray(scale, dtype=np.float32)[:, None], kb, axis=1))
    return QuantizedWeight(kind="q8", n=n, k=k, packed=packed, isa=isa, source=source, per_row=True)
