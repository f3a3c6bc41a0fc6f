"""GGUF block formats -> the integer values and per-32 scales/offsets of
kvflow/model/quant/packing.py, without going through floats where the format maps exactly:

- Q8_0 (d, 32 x int8)            -> q8: q, d
- Q4_0 (d, 32 x 4 bit, w = d(q-8)) -> q4s: q, d (m = -8 d implied)
- Q4_1 (d, m, 32 x 4 bit)        -> q4: q, d, m
- Q4_K (256: d, dmin, 8 x 6-bit scale/min, 256 x 4 bit; w = d sc q - dmin mn per 32)
                                  -> q4k: q, (d, dmin) per 256, the 12 scale bytes in place of m
- Q6_K (256: 128 B low 4 bits, 64 B top 2 bits, 16 x int8 scale, d; w = d sc (q - 32) per 16)
                                  -> q6: q (0..63), d per 256, the int8 scales in place of m
- anything else (Q5_K, Q5_0, Q2_K, F16, ...) is dequantised with gguf's own code and
  requantized to q8 per 32: 8 bits against the format's 5-6, so the error it adds is small
  against the format's own, and the GEMM is the Q8_0 one."""
from __future__ import annotations

import numpy as np

from kvflow.model.quant.packing import quantize_q8_blocks

NATIVE_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K")


def _f16(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes -> [..., 32] values: low nibbles are values 0..15, high ones 16..31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def decode(raw: np.ndarray, type_name: str, n: int, k: int
           ) -> tuple[str, np.ndarray, np.ndarray, np.ndarray | None]:
    """A GGUF tensor's bytes (n rows of k values) -> (kind, q (n, k), d (n, k/32), m or None)."""
    rows = np.ascontiguousarray(raw).reshape(n, -1)
    if type_name == "Q8_0":
        b = rows.reshape(n, k // 32, 34)
        return "q8", b[..., 2:].view(np.int8).reshape(n, k).clip(-127, 127), _f16(b[..., :2]).reshape(n, -1), None
    if type_name == "Q4_0":
        b = rows.reshape(n, k // 32, 18)
        d = _f16(b[..., :2]).reshape(n, -1)
        return "q4s", _nibbles(b[..., 2:]).reshape(n, k), d, None
    if type_name == "Q4_1":
        b = rows.reshape(n, k // 32, 20)
        return "q4", _nibbles(b[..., 4:]).reshape(n, k), _f16(b[..., :2]).reshape(n, -1), _f16(b[..., 2:4]).reshape(n, -1)
    if type_name == "Q4_K":
        b = rows.reshape(n * (k // 256), 144)
        # 4 runs of 32 bytes: low nibbles are sub-block 2j, high ones 2j + 1
        qs = b[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
        q = (qs & 0x0F).reshape(n, k)
        return "q4k", q, _f16(b[:, :4]).reshape(n, -1), np.ascontiguousarray(b[:, 4:16]).reshape(n, -1)
    if type_name == "Q6_K":  # gguf's own unpacking (its Q6_K.dequantize_blocks), stopped before floats
        b = rows.reshape(n * (k // 256), 210)
        ql = (b[:, :128].reshape(-1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 0x0F
        qh = (b[:, 128:192].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3
        q = ql.reshape(-1, 2, 128) | (qh.reshape(-1, 2, 128) << 4)
        return "q6", q.reshape(n, k), _f16(b[:, 208:210]).reshape(n, -1), b[:, 192:208].view(np.int8).reshape(n, -1)
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize

    w = dequantize(rows, GGMLQuantizationType[type_name]).astype(np.float32).reshape(n, k)
    q, d = quantize_q8_blocks(w)
    return "q8", q, d, None


def as_q4(kind: str, q: np.ndarray, d: np.ndarray, m: np.ndarray | None
          ) -> tuple[str, np.ndarray, np.ndarray, np.ndarray]:
    """q4s or q4k values as q4's (a d and m per 32; Q4_K's rounded to fp16 by the packing), for
    a fused weight whose 4-bit parts differ in kind."""
    if kind == "q4s":
        return "q4", q, d, -8.0 * d
    if kind == "q4k":
        from gguf.quants import Q4_K

        n = q.shape[0]
        sc, mn = Q4_K.get_scale_min(m.reshape(-1, 12))
        dd = d.reshape(-1, 2)
        return ("q4", q, (dd[:, :1] * sc.astype(np.float32)).reshape(n, -1),
                (-dd[:, 1:] * mn.astype(np.float32)).reshape(n, -1))
    return kind, q, d, m


def to_q8(kind: str, q: np.ndarray, d: np.ndarray, m: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """4-bit or q6 values requantized to q8 (for a fused weight whose parts differ in kind)."""
    if kind == "q8":
        return q, d
    n, k = q.shape
    if kind == "q6":  # m holds the int8 scales per 16
        sub = np.repeat(d, 16, axis=1) * m.astype(np.float32)  # (n, k/16)
        w = ((q.reshape(n, -1, 16).astype(np.float32) - 32) * sub[..., None]).reshape(n, k)
        return quantize_q8_blocks(w)
    kind, q, d, m = as_q4(kind, q, d, m)
    w = (q.reshape(n, -1, 32).astype(np.float32) * d[..., None] + m[..., None]).reshape(n, k)
    return quantize_q8_blocks(w)
