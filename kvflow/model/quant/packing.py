"""The panel layout of kvflow/csrc/gemm_quant.c, written from (and read back to) plain arrays.

A quantized (N, K) weight is given as integer values q (N, K) with a scale d and an offset m per
output and block of 32 inputs: weight = d * q + m. Two kinds:

- q4: q in 0..15, any d and m (GGUF Q4_1 and Q4_K: their own mins);
- q4s: q in 0..15 and m = -8 d implied, not stored (GGUF Q4_0 as stored: 18 B per 32);
- q6: GGUF Q6_K as stored: q in 0..63, weight = d * sc * (q - 32) with d per output and
  super-block of 256 inputs (given as `d`, (N, K/256)) and int8 sc per 16 (given as `m`,
  (N, K/16)): 26.25 B per 32, served by kvflow/csrc/gemm_q6.c (its header has the bytes);
- q4k: GGUF Q4_K as stored: q in 0..15, per output and super-block of 256 inputs fp16 d and
  dmin (given as `d`, (N, 2 K/256): d, dmin, d, dmin, ...) and the file's 12 bytes of 6-bit
  sub-block scales and mins (given as `m`, (N, 12 K/256) uint8): 18 B per 32, served by
  kvflow/csrc/gemm_q4k.c;
- q8: q in -128..127 and m = 0 (GGUF Q8_0, everything requantized to it, int8 W8A8; only
  compressed-tensors checkpoints reach -128);
- parts: a fused projection whose parts are packed in different kinds (a Q4_K_M file's qkv with
  a Q6_K v), each as its own panels after an int64 header (pack_parts; kvflow/csrc/pool.c);
- mxfp4: q the e2m1 codes 0..15 (bit 3 the sign) and d the e8m0 exponent bytes, no m
  (gpt-oss's experts, kvflow/model/quant/mxfp4.py; served by kvflow/csrc/gemm_mxfp4.c).

Outputs go in panels of 16; each panel is one run of records, one per block of 32 inputs
(the C file's header has the bytes). N is padded to whole panels with zero weights."""
from __future__ import annotations

import numpy as np
import torch

PANEL = 16
BLOCK = 32
RECORD_BYTES = {"q4": 320, "q4s": 288, "q8": 544, "mxfp4": 272, "q6": 420, "q4k": 288}  # per 32 inputs
Q4K_RECORD = 2304  # per 256 inputs
Q6_SUPER = 256
Q6_RECORD = 3360  # per 256 inputs


def _panels(a: np.ndarray, n_pad: int) -> np.ndarray:
    """(N, ...) -> (N padded to a multiple of PANEL, ...) with zero rows."""
    if a.shape[0] == n_pad:
        return a
    out = np.zeros((n_pad, *a.shape[1:]), dtype=a.dtype)
    out[: a.shape[0]] = a
    return out


def packed_bytes(kind: str, n: int, k: int) -> int:
    """The bytes an (n, k) weight of `kind` takes packed (what a one-row GEMV reads)."""
    return -(-n // PANEL) * -(-k // BLOCK) * RECORD_BYTES[kind]


def _pack_q6(q: np.ndarray, d: np.ndarray, sc: np.ndarray) -> torch.Tensor:
    n, k = q.shape
    assert k % Q6_SUPER == 0 and d.shape == (n, k // Q6_SUPER) and sc.shape == (n, k // 16)
    kb, s = k // BLOCK, k // Q6_SUPER
    n_pad = -(-n // PANEL) * PANEL
    p = n_pad // PANEL
    quads = _panels(q.astype(np.uint8), n_pad).reshape(p, PANEL, kb, 8, 4).transpose(0, 2, 3, 1, 4)
    low, top = quads & 0x0F, (quads >> 4).reshape(p, kb, 2, 4, PANEL, 4)
    nibbles = (low[:, :, :4] | (low[:, :, 4:] << 4)).reshape(p, kb, 256)
    tops = (top[:, :, :, 0] | top[:, :, :, 1] << 2 | top[:, :, :, 2] << 4 | top[:, :, :, 3] << 6).reshape(p, kb, 128)
    values = np.concatenate([nibbles, tops], axis=2).reshape(p, s, 8 * 384)
    scales = _panels(sc.astype(np.int8), n_pad).reshape(p, PANEL, s, 16).transpose(0, 2, 3, 1).reshape(p, s, 256)
    ds = _panels(d.astype(np.float16), n_pad).reshape(p, PANEL, s).transpose(0, 2, 1)
    rec = np.concatenate([values, scales.view(np.uint8), np.ascontiguousarray(ds).view(np.uint8).reshape(p, s, 32)], axis=2)
    assert rec.shape[2] == Q6_RECORD
    return torch.from_numpy(np.ascontiguousarray(rec).reshape(-1))


def _pack_q4k(q: np.ndarray, d: np.ndarray, scales: np.ndarray) -> torch.Tensor:
    n, k = q.shape
    s, kb = k // Q6_SUPER, k // BLOCK
    assert k % Q6_SUPER == 0 and d.shape == (n, 2 * s) and scales.shape == (n, 12 * s)
    n_pad = -(-n // PANEL) * PANEL
    p = n_pad // PANEL
    u = _panels(q.astype(np.uint8), n_pad).reshape(p, PANEL, kb, 8, 4).transpose(0, 2, 3, 1, 4)
    nibbles = (u[:, :, :4] | (u[:, :, 4:] << 4)).reshape(p, s, 8 * 256)
    sc = _panels(scales.astype(np.uint8), n_pad).reshape(p, PANEL, s, 12).transpose(0, 2, 3, 1).reshape(p, s, 192)
    ds = _panels(d.astype(np.float16), n_pad).reshape(p, PANEL, s, 2).transpose(0, 2, 3, 1)
    rec = np.concatenate([nibbles, sc, np.ascontiguousarray(ds).view(np.uint8).reshape(p, s, 64)], axis=2)
    assert rec.shape[2] == Q4K_RECORD
    return torch.from_numpy(np.ascontiguousarray(rec).reshape(-1))


def pack(kind: str, q: np.ndarray, d: np.ndarray, m: np.ndarray | None = None) -> torch.Tensor:
    """q (N, K) (uint8 0..15 for q4 and mxfp4, int8 for q8), d and m (N, K/32) -> the packed uint8 panels
    [ceil(N/16) * K/32 * record bytes]. q6: q uint8 0..63, d (N, K/256), m the int8 scales (N, K/16)."""
    if kind == "q6":
        return _pack_q6(q, d, m)
    if kind == "q4k":
        return _pack_q4k(q, d, m)
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
    elif kind in ("q4", "q4s"):
        u = quads.astype(np.uint8)
        parts = [(u[:, :, :4] | (u[:, :, 4:] << 4)).reshape(p, kb, 256), scale.view(np.uint8)]
        if kind == "q4":
            mins = np.ascontiguousarray(_panels(m.astype(np.float16), n_pad).reshape(p, PANEL, kb).transpose(0, 2, 1))
            parts.append(mins.view(np.uint8))
    elif kind == "q8":
        data = quads.astype(np.int8).reshape(p, kb, 512)
        parts = [data.view(np.uint8), scale.view(np.uint8)]
    else:
        raise ValueError(f"unknown quantized kind {kind!r}")
    rec = np.concatenate([np.ascontiguousarray(x).reshape(p, kb, -1) for x in parts], axis=2)
    assert rec.shape[2] == RECORD_BYTES[kind]
    return torch.from_numpy(np.ascontiguousarray(rec).reshape(-1))


def pack_parts(parts: list[tuple[str, int, torch.Tensor]]) -> torch.Tensor:
    """[(kind, outputs, packed)] stacked by outputs -> one buffer: int64 words [count, then per
    part: its kind's code, first output, outputs, byte offset], then each part's panels at a
    64-byte boundary. Every part but the last has whole panels (outputs a multiple of 16)."""
    from kvflow.model.quant.qlinear import KIND_CODES

    assert all(n % PANEL == 0 for _, n, _ in parts[:-1])
    words, chunks, n0 = [len(parts)], [], 0
    at = -(-8 * (1 + 4 * len(parts)) // 64) * 64
    for kind, n, packed in parts:
        words += [KIND_CODES[kind], n0, n, at]
        chunks.append((at, packed))
        n0, at = n0 + n, at + -(-packed.numel() // 64) * 64
    out = torch.zeros(at, dtype=torch.uint8)
    out[: 8 * len(words)] = torch.tensor(words, dtype=torch.int64).view(torch.uint8)
    for offset, packed in chunks:
        out[offset: offset + packed.numel()] = packed
    return out


def _parts_rows(packed: torch.Tensor, k: int, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    from kvflow.model.quant.qlinear import KIND_CODES

    names = {code: name for name, code in KIND_CODES.items()}
    count = int(packed[:8].clone().view(torch.int64))  # clones: a cached weight starts at any byte
    words = packed[8: 8 + 32 * count].clone().view(torch.int64).reshape(count, 4).tolist()
    out = torch.empty(len(rows), k, dtype=dtype)
    for i, (code, n0, n, at) in enumerate(words):
        end = words[i + 1][3] if i + 1 < count else packed.numel()
        mine = (rows >= n0) & (rows < n0 + n)
        if mine.any():
            out[mine] = dequantize_rows(names[code], packed[at:end], k, rows[mine] - n0, dtype)
    return out


def dequantize_rows(kind: str, packed: torch.Tensor, k: int, rows: torch.Tensor,
                    dtype: torch.dtype) -> torch.Tensor:
    """Rows `rows` of the (N, K) weight in `packed`, as floats [len(rows), K]: the embedding
    lookup of a tied model reads its quantized LM head this way."""
    if kind == "parts":
        return _parts_rows(packed, k, rows, dtype)
    if kind == "q6":
        return _q6_rows(packed, k, rows).to(dtype)
    if kind == "q4k":
        return _q4k_rows(packed, k, rows).to(dtype)
    kb = k // BLOCK
    p, c = rows // PANEL, rows % PANEL
    rec = packed.view(-1, kb, RECORD_BYTES[kind])[p]  # [T, Kb, record]: only the rows' panels
    t = torch.arange(len(rows))
    if kind in ("q4", "q4s"):
        data = rec[:, :, :256].reshape(len(rows), kb, 4, PANEL, 4)[t, :, :, c, :]  # [T, Kb, 4, 4]
        q = torch.cat([data & 0x0F, data >> 4], dim=2).float()  # quads 0..3, then 4..7
        d = rec[:, :, 256:288].contiguous().view(torch.float16)[t, :, c].float()
        m = rec[:, :, 288:320].contiguous().view(torch.float16)[t, :, c].float() if kind == "q4" else -8 * d
        w = q.reshape(len(rows), kb, BLOCK) * d[..., None] + m[..., None]
    else:
        data = rec[:, :, :512].reshape(len(rows), kb, 8, PANEL, 4)[t, :, :, c, :]
        q = data.view(torch.int8).float()
        d = rec[:, :, 512:544].contiguous().view(torch.float16)[t, :, c]
        w = q.reshape(len(rows), kb, BLOCK) * d.float()[..., None]
    return w.reshape(len(rows), k).to(dtype)


def _q6_rows(packed: torch.Tensor, k: int, rows: torch.Tensor) -> torch.Tensor:
    s, n_rows = k // Q6_SUPER, len(rows)
    p, c, t = rows // PANEL, rows % PANEL, torch.arange(n_rows)
    rec = packed.view(-1, s, Q6_RECORD)[p]  # [T, S, record]
    blocks = rec[:, :, :8 * 384].reshape(n_rows, s, 8, 384)
    nib = blocks[..., :256].reshape(n_rows, s, 8, 4, PANEL, 4)[t, :, :, :, c, :]  # [T, S, 8, 4, 4]
    low = torch.cat([nib & 0x0F, nib >> 4], dim=3)  # [T, S, 8 blocks, 8 quads, 4]
    tops = blocks[..., 256:].reshape(n_rows, s, 8, 2, PANEL, 4)[t, :, :, :, c, :]  # [T, S, 8, 2, 4]
    top = torch.stack([(tops >> (2 * j)) & 3 for j in range(4)], dim=4).reshape(n_rows, s, 8, 8, 4)
    q = (low | (top << 4)).reshape(n_rows, s, 16, 16).float() - 32
    sc = rec[:, :, 3072:3328].contiguous().view(torch.int8).reshape(n_rows, s, 16, PANEL)[t, :, :, c].float()
    d = rec[:, :, 3328:].contiguous().view(torch.float16).reshape(n_rows, s, PANEL)[t, :, c].float()
    return (q * (d[..., None] * sc)[..., None]).reshape(n_rows, k)


def _q4k_rows(packed: torch.Tensor, k: int, rows: torch.Tensor) -> torch.Tensor:
    from gguf.quants import Q4_K

    s, n_rows = k // Q6_SUPER, len(rows)
    p, c, t = rows // PANEL, rows % PANEL, torch.arange(n_rows)
    rec = packed.view(-1, s, Q4K_RECORD)[p]  # [T, S, record]
    nib = rec[:, :, :2048].reshape(n_rows, s, 8, 4, PANEL, 4)[t, :, :, :, c, :]  # [T, S, 8, 4, 4]
    q = torch.cat([nib & 0x0F, nib >> 4], dim=3).reshape(n_rows, s, 8, 32).float()
    raw = rec[:, :, 2048:2240].reshape(n_rows, s, 12, PANEL)[t, :, :, c].contiguous().numpy()
    sc, mn = (torch.from_numpy(a.astype(np.float32)).reshape(n_rows, s, 8) for a in Q4_K.get_scale_min(raw.reshape(-1, 12)))
    d = rec[:, :, 2240:].contiguous().view(torch.float16).reshape(n_rows, s, 2, PANEL)[t, :, :, c].float()
    w = (d[..., 0:1] * sc)[..., None] * q - (d[..., 1:2] * mn)[..., None]
    return w.reshape(n_rows, k)


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
