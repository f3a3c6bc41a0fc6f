"""The panel layout of kvflow/csrc/gemm_quant.c, written from (and read back to) plain arrays.

A quantized (N, K) weight is given as integer values q (N, K) with a scale d and an offset m per
output and block of 32 inputs: weight = d * q + m. Two kinds:

- q4: q in 0..15, any d and m (GGUF Q4_0 has m = -8 d, Q4_1 and Q4_K their own mins);
- q8: q in -128..127 and m = 0 (GGUF Q8_0, everything requantized to it, int8 W8A8; only
  compressed-tensors checkpoints reach -128);
- mxfp4: q the e2m1 codes 0..15 (bit 3 the sign) and d the e8m0 exponent bytes, no m
  (gpt-oss's experts, kvflow/model/quant/mxfp4.py; served by kvflow/csrc/gemm_mxfp4.c).

Outputs go in panels of 16; each panel is one run of records, one per block of 32 inputs
(the C file's header has the bytes). N is padded to whole panels with zero weights."""
from __future__ import annotations

import numpy as np
import torch

PANEL = 16
BLOCK = 32
RECORD_BYTES = {"q4": 320, "q8": 544, "mxfp4": 272}


def _panels(a: np.ndarray, n_pad: int) -> np.ndarray:
    """(N, ...) -> (N padded to a multiple of PANEL, ...) with zero rows."""
    if a.shape[0] == n_pad:
        return a
    out = np.zeros((n_pad, *a.shape[1:]), dtype=a.dtype)
    out[: a.shape[0]] = a
    return out


def pack(kind: str, q: np.ndarray, d: np.ndarray, m: np.ndarray | None = None) -> torch.Tensor:
    """q (N, K) (uint8 0..15 for q4 and mxfp4, int8 for q8), d and m (N, K/32) -> the packed uint8 panels
    [ceil(N/16) * K/32 * record bytes]."""
    n, k = q.shape
    kb = k // BLOCK
    assert k % BLOCK == 0 and d.shape == (n, kb), (q.shape, d.shape)
    n_pad = -(-n // PANEL) * PANEL
    p = n_pad // PANEL
    # quads: [P, 16 outputs, Kb, 8 quads, 4] -> [P, Kb, 8, 16, 4]
    quads = _panels(q, n_pad).reshape(p, PANEL, kb, 8, 4).transpose(0, 2, 3, 1, 4)
    scale_type = np.uint8 if kind == "mxfp4" else np.float16
    scale = np.ascontiguousarray(_panels(d.astype(scale_type), n_pad).reshape(p, PANEL, kb).transpose(0, 2, 1))
    parts = []
    if kind == "mxfp4":  # q4's nibbles, then the e8m0 bytes
        u = quads.astype(np.uint8)
        parts = [(u[:, :, :4] | (u[:, :, 4:] << 4)).reshape(p, kb, 256), scale]
    elif kind == "q4":
        u = quads.astype(np.uint8)
        data = (u[:, :, :4] | (u[:, :, 4:] << 4)).reshape(p, kb, 256)
        mins = np.ascontiguousarray(_panels(m.astype(np.float16), n_pad).reshape(p, PANEL, kb).transpose(0, 2, 1))
        parts = [data, scale.view(np.uint8), mins.view(np.uint8)]
    elif kind == "q8":
        data = quads.astype(np.int8).reshape(p, kb, 512)
        parts = [data.view(np.uint8), scale.view(np.uint8)]
    else:
        raise ValueError(f"unknown quantized kind {kind!r}")
    rec = np.concatenate([np.ascontiguousarray(x).reshape(p, kb, -1) for x in parts], axis=2)
    assert rec.shape[2] == RECORD_BYTES[kind]
    return torch.from_numpy(np.ascontiguousarray(rec).reshape(-1))


def dequantize_rows(kind: str, packed: torch.Tensor, k: int, rows: torch.Tensor,
                    dtype: torch.dtype) -> torch.Tensor:
    """Rows `rows` of the (N, K) weight in `packed`, as floats [len(rows), K]: the embedding
    lookup of a tied model reads its quantized LM head this way."""
    kb = k // BLOCK
    p, c = rows // PANEL, rows % PANEL
    rec = packed.view(-1, kb, RECORD_BYTES[kind])[p]  # [T, Kb, record]: only the rows' panels
    t = torch.arange(len(rows))
    if kind == "q4":
        data = rec[:, :, :256].reshape(len(rows), kb, 4, PANEL, 4)[t, :, :, c, :]  # [T, Kb, 4, 4]
        q = torch.cat([data & 0x0F, data >> 4], dim=2).float()  # quads 0..3, then 4..7
        d = rec[:, :, 256:288].contiguous().view(torch.float16)[t, :, c]
        m = rec[:, :, 288:320].contiguous().view(torch.float16)[t, :, c]
        w = q.reshape(len(rows), kb, BLOCK) * d.float()[..., None] + m.float()[..., None]
    else:
        data = rec[:, :, :512].reshape(len(rows), kb, 8, PANEL, 4)[t, :, :, c, :]
        q = data.view(torch.int8).float()
        d = rec[:, :, 512:544].contiguous().view(torch.float16)[t, :, c]
        w = q.reshape(len(rows), kb, BLOCK) * d.float()[..., None]
    return w.reshape(len(rows), k).to(dtype)


def quantize_q8_blocks(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Float (N, K) (K a multiple of 32) -> symmetric int8 per block of 32: (q, d) as GGUF's
    Q8_0 rounds (d = amax / 127, kept in fp16)."""
    n, k = w.shape
    blocks = w.astype(np.float32).reshape(n, k // BLOCK, BLOCK)
    # the scale as it is stored (fp16), so that q is rounded against the scale in use
    d = (np.abs(blocks).max(axis=2) / 127.0).astype(np.float16).astype(np.float32)
    inv = np.divide(1.0, d, out=np.zeros_like(d), where=d > 0)
    q = np.clip(np.round(blocks * inv[..., None]), -127, 127).astype(np.int8)
    return q.reshape(n, k), d.astype(np.float32)
