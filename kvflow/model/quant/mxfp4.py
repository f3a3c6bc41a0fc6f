"""MXFP4 weights (OCP microscaling: per block of 32 inputs one e8m0 exponent byte and 32 e2m1
values, 4.25 bits a weight), as gpt-oss ships its experts, read into gemm_quant.c's panels
(packing.py, kind `mxfp4`) for kvflow/csrc/gemm_mxfp4.c. A weight is E2M1[code] * 2^(e - 127).

Two byte orders of the same blocks: Hugging Face's (`*_blocks` [..., rows, K/32, 16] beside
`*_scales` [..., rows, K/32]) holds element 2j in byte j's low nibble and 2j + 1 in its high one
(transformers' convert_moe_packed_tensors); GGUF's MXFP4 block (17 bytes: e8m0, then 16) holds
element j in byte j's low nibble and j + 16 in its high one (gguf-py's MXFP4)."""
from __future__ import annotations

import numpy as np
import torch

from kvflow.model.quant.packing import BLOCK, pack
from kvflow.model.quant.qlinear import QuantizedWeight

E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                 -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=np.float32)
GGUF_BLOCK_BYTES = 17


def hf_codes(blocks: np.ndarray) -> np.ndarray:
    """HF blocks [N, K/32, 16] uint8 -> the e2m1 codes [N, K] in input order."""
    n, kb, _ = blocks.shape
    codes = np.empty((n, kb, BLOCK), dtype=np.uint8)
    codes[..., 0::2] = blocks & 0x0F
    codes[..., 1::2] = blocks >> 4
    return codes.reshape(n, kb * BLOCK)


def gguf_codes(raw: np.ndarray, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """A GGUF MXFP4 tensor's bytes (n rows of k) -> (codes [n, k], e8m0 [n, k/32])."""
    blocks = np.asarray(raw, dtype=np.uint8).reshape(n, k // BLOCK, GGUF_BLOCK_BYTES)
    qs = blocks[..., 1:]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=2)  # elements 0..15, then 16..31
    return codes.reshape(n, k), np.ascontiguousarray(blocks[..., 0])


def mxfp4_weight(codes: np.ndarray, e8m0: np.ndarray, isa: str, source: str = "MXFP4") -> QuantizedWeight:
    """An (N, K) projection from its codes [N, K] and exponents [N, K/32], packed as stored."""
    n, k = codes.shape
    assert k % BLOCK == 0 and e8m0.shape == (n, k // BLOCK), (codes.shape, e8m0.shape)
    return QuantizedWeight(kind="mxfp4", n=n, k=k, packed=pack("mxfp4", codes, e8m0), isa=isa,
                           source=source)


def dequantize(codes: np.ndarray, e8m0: np.ndarray) -> torch.Tensor:
    """The float weights [N, K] (fp32, exact) of codes [N, K] and exponents [N, K/32]."""
    n, k = codes.shape
    scale = np.ldexp(np.float32(1), e8m0.astype(np.int32) - 127).astype(np.float32)
    w = E2M1[codes].reshape(n, k // BLOCK, BLOCK) * scale[..., None]
    return torch.from_numpy(w.reshape(n, k))


def hf_expert(blocks: np.ndarray, scales: np.ndarray, gate_up: bool) -> tuple[np.ndarray, np.ndarray]:
    """One expert's HF `{gate_up,down}_proj_{blocks,scales}` slice -> (codes, e8m0) of kvflow's
    (N, K): down [H, I] as stored; gate_up's rows interleave gate and up (row 2i gate i, row
    2i + 1 up i), regrouped as [gate; up] [2I, H]."""
    if gate_up:
        blocks = np.concatenate([blocks[0::2], blocks[1::2]])
        scales = np.concatenate([scales[0::2], scales[1::2]])
    return hf_codes(blocks), np.ascontiguousarray(scales)
