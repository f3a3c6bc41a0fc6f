"""This step's K/V rows into the paged cache at their flat slots (block * block_size + offset).
A negative slot is a padding row (a CUDA graph's batch padded to its captured size): skipped.
A one-byte cache (layout.py's KV_KIND) is quantized here as kv_layout.write_rows does: int8 per
token and kv head (absmax / 127, the scale stored after the tile), fp8 e4m3 as x / the
layer's scale, saturated (its rows rotated first where kv_layout.rotates says so)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvflow.attention.kv_layout import UNIT_KV_SCALES, cache_geometry, hadamard_rotate, rotates
from kvflow.model.triton.layout import (key_offset, kv_kind, kv_operands, round_even, tile_base,
                                        to_fp8_bits, value_offset)


@triton.jit
def _store_kv(cache, scales, fp8_scale, x, tiles, offset, at, mask, row_ok, KV_KIND: tl.constexpr,
              BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr):
    base = tiles[:, None]
    if KV_KIND == 0:
        tl.store(cache + base + offset, x.to(cache.dtype.element_ty), mask=mask)
    elif KV_KIND == 2:
        x = x.to(tl.float32)
        q = to_fp8_bits(tl.math.div_rn(x, tl.zeros_like(x) + fp8_scale))  # a true division
        tl.store(cache + base + offset, q.to(tl.uint8), mask=mask)
    else:
        x = tl.where(mask, x.to(tl.float32), 0.0)
        amax = tl.max(tl.abs(x), axis=1)  # [H]
        # true divisions (IEEE, nearest), as the CPU's: a GPU's `/` may be approximate
        full = tl.zeros_like(amax) + 127.0
        inv = tl.where(amax > 0.0, tl.math.div_rn(full, tl.where(amax > 0.0, amax, 1.0)), 0.0)
        q = tl.minimum(tl.maximum(round_even(x * inv[:, None]), -127.0), 127.0)
        tl.store(cache + base + offset, q.to(tl.int8), mask=mask)
        tl.store(scales + (tiles + BLOCK_SIZE * HEAD_DIM) // 4 + at, tl.math.div_rn(amax, full),
                 mask=row_ok)


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, k_cache, v_cache, k_scales, v_scales, slot_mapping,
                     k_fp8_scale, v_fp8_scale, stride_k_tok, stride_k_head, stride_v_tok, stride_v_head,
                     KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, KV_KIND: tl.constexpr):
    tok = tl.program_id(0)
    slot = tl.load(slot_mapping + tok)
    block = tl.maximum(slot, 0) // BLOCK_SIZE
    at = tl.maximum(slot, 0) % BLOCK_SIZE
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    row_ok = (h < KV_HEADS) & (slot + tl.zeros([BLOCK_H], tl.int64) >= 0)
    mask = row_ok[:, None] & (d[None, :] < HEAD_DIM)
    k = tl.load(k_ptr + tok * stride_k_tok + h[:, None] * stride_k_head + d[None, :], mask=mask)
    v = tl.load(v_ptr + tok * stride_v_tok + h[:, None] * stride_v_head + d[None, :], mask=mask)
    tiles = tile_base(block, h, KV_HEADS, BLOCK_SIZE, HEAD_DIM, KV_KIND)  # [H]
    _store_kv(k_cache, k_scales, k_fp8_scale, k, tiles, key_offset(at, d[None, :], BLOCK_SIZE), at, mask,
              row_ok, KV_KIND, BLOCK_SIZE, HEAD_DIM)
    _store_kv(v_cache, v_scales, v_fp8_scale, v, tiles, value_offset(at, d[None, :], HEAD_DIM), at, mask,
              row_ok, KV_KIND, BLOCK_SIZE, HEAD_DIM)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor, kv_scales: tuple[float, float] = UNIT_KV_SCALES) -> None:
    """k/v [T, kv_heads, head_dim] (heads dense; rows may be strided views of the fused qkv)
    into the flat slots (fp8 over the layer's `kv_scales`); kv_layout.write_rows in one kernel
    launch."""
    block_size, kv_heads, head_dim = cache_geometry(k_cache)
    if k.stride(2) != 1 or v.stride(2) != 1 or not k_cache.is_contiguous() or not v_cache.is_contiguous():
        raise ValueError("write_kv needs dense head dims and contiguous caches")
    num_tokens = k.shape[0]
    if num_tokens == 0:
        return
    if rotates(k_cache):  # fp32 rows, rotated as kv_layout.write_rows rotates them
        k, v = hadamard_rotate(k), hadamard_rotate(v)
    (kc, ks), (vc, vs) = kv_operands(k_cache), kv_operands(v_cache)
    _write_kv_kernel[(num_tokens,)](
        k, v, kc, vc, ks, vs, slot_mapping, float(kv_scales[0]), float(kv_scales[1]),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        KV_HEADS=kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_H=triton.next_power_of_2(kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
        KV_KIND=kv_kind(k_cache))
