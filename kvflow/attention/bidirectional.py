"""Bidirectional attention within an image's run of placeholder tokens (Gemma 3: each image's
tokens see each other, later ones included; text stays causal), on top of whatever causal
attention the backend computed for the step.

The scheduler never ends a chunk inside a run (core/scheduler.py), so every key of a run is in
the cache once the step's K/V are written; the queries of the run's tokens computed this step
are then attended again over the keys up to the run's end, with the layer's window (HF's
AND(window, OR(causal, block))), and their rows of the output replaced. Every other row keeps
the backend's result."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from kvflow.attention.kv_layout import UNIT_KV_SCALES, read_rows
from kvflow.attention.metadata import AttentionMetadata


@dataclass(frozen=True, slots=True)
class BidirectionalRun:
    """The part of one image run computed this step: flat rows [row, row + end - first) hold
    the positions [first, end) of request `seq` (its index in the step), `end` the run's end."""

    seq: int
    row: int
    first: int
    end: int


def attend_runs(out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float,
                kv_scales: tuple[float, float] = UNIT_KV_SCALES) -> torch.Tensor:
    """`out` [T, H * D] with the rows of meta.bidirectional_runs attended again, q [T, H, D]
    (rotated, scaled) over the keys before each run's end (its K/V written already)."""
    t, heads, d = q.shape
    out = out.view(t, heads, d)
    bs, w = meta.block_size, meta.sliding_window
    for r in meta.bidirectional_runs:
        n = r.end - r.first
        lo = 0 if w is None else max(0, r.first - w + 1)
        pos = np.arange(lo, r.end)
        table = meta.block_tables[r.seq]
        slots = torch.from_numpy(table[pos // bs] * bs + pos % bs).to(k_cache.device)
        k, v = read_rows(k_cache, v_cache, slots, kv_scales)  # [S, kvh, D]
        qpos = np.arange(r.first, r.end)
        mask = np.ones((n, len(pos)), dtype=bool)  # every key before the run's end ...
        if w is not None:  # ... within the window
            mask &= pos[None, :] > qpos[:, None] - w
        qr = q[r.row:r.row + n].transpose(0, 1).unsqueeze(0)
        kr = k.transpose(0, 1).unsqueeze(0).to(q.dtype)
        vr = v.transpose(0, 1).unsqueeze(0).to(q.dtype)
        o = F.scaled_dot_product_attention(qr, kr, vr, attn_mask=torch.from_numpy(mask).to(q.device),
                                           scale=scale, enable_gqa=heads != k.shape[1])
        out[r.row:r.row + n] = o.squeeze(0).transpose(0, 1)
    return out.view(t, heads * d)
