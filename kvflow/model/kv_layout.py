"""How K/V sit in the paged cache, for the PyTorch paths (kvflow/csrc/tiles.h for the kernels).

Each layer's K and V cache is [num_blocks, kv_heads, block_size, head_dim] in size: one tile of
block_size keys x head_dim dims per block and kv head, contiguous, so a request's keys of one
head are read as whole tiles. Inside a tile the values go in pairs:

- keys with dims paired, [head_dim / 2][block_size][2]: one vector load is 16 keys x 2 dims,
  the scores of 16 keys come out of one multiply-add per dim pair;
- values with keys paired, [block_size / 2][head_dim][2]: one load is 16 dims x 2 keys, the
  weighted sum takes two keys per multiply-add.

Both sizes must be even. Rows here are the plain [tokens, kv_heads, head_dim] of the model.
"""
from __future__ import annotations

import torch


def cache_shape(num_blocks: int, block_size: int, kv_heads: int, head_dim: int) -> tuple[int, ...]:
    if block_size % 2 or head_dim % 2:
        raise ValueError(f"the paged cache pairs keys and dims: block_size ({block_size}) and "
                         f"head_dim ({head_dim}) must be even")
    return (num_blocks, kv_heads, block_size, head_dim)


def cache_geometry(cache: torch.Tensor) -> tuple[int, int, int]:
    """(block_size, kv_heads, head_dim) of a cache made with cache_shape."""
    return cache.shape[2], cache.shape[1], cache.shape[3]


def _key_tiles(cache: torch.Tensor) -> torch.Tensor:
    nb, kvh, bs, d = cache.shape
    return cache.view(nb, kvh, d // 2, bs, 2)  # [block, head, dim pair, key, 2]


def _value_tiles(cache: torch.Tensor) -> torch.Tensor:
    nb, kvh, bs, d = cache.shape
    return cache.view(nb, kvh, bs // 2, d, 2)  # [block, head, key pair, dim, 2]


def write_rows(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               slots: torch.Tensor) -> None:
    """k/v [T, kv_heads, head_dim] into the flat slots (block * block_size + offset)."""
    bs, kvh, d = cache_geometry(k_cache)
    blk, at = slots // bs, slots % bs
    _key_tiles(k_cache)[blk, :, :, at, :] = k.reshape(-1, kvh, d // 2, 2).to(k_cache.dtype)
    _value_tiles(v_cache)[blk, :, at // 2, :, at % 2] = v.to(v_cache.dtype)


def read_rows(k_cache: torch.Tensor, v_cache: torch.Tensor,
              slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The K/V rows [S, kv_heads, head_dim] at the flat slots."""
    bs, kvh, d = cache_geometry(k_cache)
    blk, at = slots // bs, slots % bs
    k = _key_tiles(k_cache)[blk, :, :, at, :].reshape(-1, kvh, d)
    return k, _value_tiles(v_cache)[blk, :, at // 2, :, at % 2]


def read_blocks(k_cache: torch.Tensor, v_cache: torch.Tensor,
                tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Whole blocks as rows: tables [B, n] -> K/V [B, n * block_size, kv_heads, head_dim]."""
    bs, kvh, d = cache_geometry(k_cache)
    b, n = tables.shape
    k = _key_tiles(k_cache)[tables].permute(0, 1, 4, 2, 3, 5)  # [B, n, key, head, pair, 2]
    v = _value_tiles(v_cache)[tables].permute(0, 1, 3, 5, 2, 4)  # [B, n, pair, 2, head, dim]
    return k.reshape(b, n * bs, kvh, d), v.reshape(b, n * bs, kvh, d)
