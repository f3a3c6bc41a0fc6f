"""Element offsets into kvflow's cache tiles from inside a Triton kernel (kv_layout.py says
why the tiles look like this). A layer's cache is [num_blocks, kv_heads, block_size, head_dim],
contiguous; in one (block, head) tile keys pair dims and values pair keys."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def tile_base(block, kv_head, KV_HEADS: tl.constexpr, BLOCK_SIZE: tl.constexpr,
              HEAD_DIM: tl.constexpr):
    return (block.to(tl.int64) * KV_HEADS + kv_head) * (BLOCK_SIZE * HEAD_DIM)


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
