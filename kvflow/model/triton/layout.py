"""Element offsets into kvflow's cache tiles from inside a Triton kernel (kv_layout.py says
why the tiles look like this). A layer's cache is [num_blocks, kv_heads, block_size, head_dim],
contiguous; in one (block, head) tile keys pair dims and values pair keys.

KV_KIND says what a cache holds: 0 floats (read as they are), 1 int8 with a fp32 scale per
token after each tile (a tile is then block_size * (head_dim + 4) bytes), 2 fp8 e4m3 at a
per-tensor scale (the layer's k_scale or v_scale, a runtime argument), passed as its bytes
(uint8) and widened here through fp16 bits."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvflow.attention.kv_layout import FP8

KV_FLOAT, KV_INT8, KV_FP8 = 0, 1, 2


def kv_kind(cache: torch.Tensor) -> int:
    return KV_INT8 if cache.dtype == torch.int8 else KV_FP8 if cache.dtype == FP8 else KV_FLOAT


def kv_operands(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the tensor the kernels index, the fp32 view an int8 cache's scales are read through)."""
    if cache.dtype == FP8:
        return cache.view(torch.uint8), cache
    if cache.dtype == torch.int8:
        return cache, cache.view(torch.float32)
    return cache, cache


@triton.jit
def tile_base(block, kv_head, KV_HEADS: tl.constexpr, BLOCK_SIZE: tl.constexpr,
              HEAD_DIM: tl.constexpr, KV_KIND: tl.constexpr):
    if KV_KIND == 1:
        return (block.to(tl.int64) * KV_HEADS + kv_head) * (BLOCK_SIZE * (HEAD_DIM + 4))
    return (block.to(tl.int64) * KV_HEADS + kv_head) * (BLOCK_SIZE * HEAD_DIM)


@triton.jit
def load_kv(cache, scales, fp8_scale, base, offset, at, mask, row_ok, KV_KIND: tl.constexpr,
            BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Values at base + offset ([N, D]); a one-byte cache's dequantized to fp32 (fp8 times
    `fp8_scale`)."""
    # one branch a kind, each returning (the compiler types every return it meets)
    if KV_KIND == 0:
        return tl.load(cache + base + offset, mask=mask, other=0.0)
    elif KV_KIND == 2:  # e4m3 s.eeee.mmm -> fp16 s.0eeee.mmm0000000 = value / 256
        b = tl.load(cache + base + offset, mask=mask, other=0).to(tl.uint16)
        h = ((b & 0x7F) << 7) | ((b & 0x80) << 8)
        return h.to(tl.float16, bitcast=True).to(tl.float32) * (256.0 * fp8_scale)
    else:
        x = tl.load(cache + base + offset, mask=mask, other=0)
        s = tl.load(scales + (base + BLOCK_SIZE * HEAD_DIM) // 4 + at, mask=row_ok, other=0.0)
        return x.to(tl.float32) * s


@triton.jit
def round_even(y):
    # nearest, ties to even, for |y| < 2^22: the fp32 addition rounds at the units
    return (y + 12582912.0) - 12582912.0


@triton.jit
def to_fp8_bits(x):
    """fp32 -> e4m3 bits (nearest even, saturating at +-448) as int32: kv_layout.quantize_fp8."""
    u = x.to(tl.int32, bitcast=True)
    sign = (u >> 24) & 0x80
    a = tl.minimum(tl.abs(x), 448.0)
    ua = a.to(tl.int32, bitcast=True)
    ur = (ua + 0x7FFFF + ((ua >> 20) & 1)) & -1048576
    normal = (((ur >> 23) - 120) << 3) | ((ur >> 20) & 7)
    sub = round_even(a * 512.0).to(tl.int32)
    return sign | tl.where(a < 0.015625, sub, normal)


@triton.jit
def key_offset(token, dim, BLOCK_SIZE: tl.constexpr):
    # [head_dim / 2][block_size][2]
    return (dim // 2) * (BLOCK_SIZE * 2) + token * 2 + dim % 2


@triton.jit
def value_offset(token, dim, HEAD_DIM: tl.constexpr):
    # [block_size / 2][head_dim][2]
    return (token // 2) * (HEAD_DIM * 2) + dim * 2 + token % 2


@triton.jit
def soft_cap(scores, cap):
    # cap * tanh(scores / cap), tanh written with exp (tl has no tanh on every version)
    return cap * (1.0 - 2.0 / (tl.exp(2.0 * scores / cap) + 1.0))
