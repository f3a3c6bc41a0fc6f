"""How K/V sit in the paged cache, for the PyTorch paths (kvflow/csrc/tiles.h for the kernels).

Each layer's K and V cache is [num_blocks, kv_heads, block_size, head_dim] in size: one tile of
block_size keys x head_dim dims per block and kv head, contiguous, so a request's keys of one
head are read as whole tiles. Inside a tile the values go in pairs:

- keys with dims paired, [head_dim / 2][block_size][2]: one vector load is 16 keys x 2 dims,
  the scores of 16 keys come out of one multiply-add per dim pair;
- values with keys paired, [block_size / 2][head_dim][2]: one load is 16 dims x 2 keys, the
  weighted sum takes two keys per multiply-add.

Both sizes must be even. Rows here are the plain [tokens, kv_heads, head_dim] of the model.

Quantized caches (the `kv_cache_dtype` fp8 and int8, docs/kv_cache_quantization.md) keep the
same tiles, one byte a value:

- fp8 (torch.float8_e4m3fn): the values over a per-tensor scale, one for K and one for V per
  layer (`kv_scales`: the checkpoint's k_scale/v_scale, kvflow/model/kv_scales.py, else FP8_KV_SCALE,
  1.0, vLLM's default), saturated at +-448 on the write. Where head_dim is a power of two each
  token's key and value of a head are rotated first (`hadamard_rotate`: H x / sqrt(head_dim),
  H the Sylvester-Hadamard matrix, orthonormal and its own inverse; csrc/rotation.h): the few
  large channels of a head's keys are spread over all its values, so e4m3's 3-bit mantissa
  rounds many small terms of q . k instead of its largest ones. Readers rotate back (or rotate
  the query alike and the output back), so every path computes the same attention;
- int8 (torch.int8): each token's row of each kv head quantized on its own (symmetric, absmax /
  127), its fp32 scale stored beside the tile: a (block, kv head) is bs * head_dim int8 values
  in the tile layout above, then bs fp32 scales, one per token, so the tensor is
  [num_blocks, kv_heads, block_size, head_dim + 4] in size and a block's bytes still carry all of
  it (prefix caching, KV transfer). A written token is never requantized: its scale is its own.
"""
from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
FP8_KV_SCALE = 1.0
UNIT_KV_SCALES = (FP8_KV_SCALE, FP8_KV_SCALE)  # a layer's (k_scale, v_scale) without a checkpoint's
INT8_SCALE_BYTES = 4  # one fp32 scale per token and kv head, after the tile
QUANTIZED = (FP8, torch.int8)


def is_quantized(dtype: torch.dtype) -> bool:
    return dtype in QUANTIZED


def resolve_kv_dtype(name: str) -> torch.dtype:
    """CacheConfig.cache_dtype (not auto) -> the cache tensors' dtype."""
    return {"bfloat16": torch.bfloat16, "float32": torch.float32, "fp8_e4m3": FP8,
            "int8": torch.int8}[name]


def token_bytes(dtype: torch.dtype, head_dim: int) -> int:
    """Bytes one token's K (or V) takes per kv head in a cache of `dtype` (scales included)."""
    if dtype == torch.int8:
        return head_dim + INT8_SCALE_BYTES
    return head_dim * dtype.itemsize


def cache_shape(num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
                dtype: torch.dtype | None = None) -> tuple[int, ...]:
    if block_size % 2 or head_dim % 2:
        raise ValueError(f"the paged cache pairs keys and dims: block_size ({block_size}) and "
                         f"head_dim ({head_dim}) must be even")
    if dtype == torch.int8:
        if head_dim % 4:
            raise ValueError(f"an int8 KV cache needs head_dim % 4 == 0 (its fp32 scales follow "
                             f"each tile), got {head_dim}")
        return (num_blocks, kv_heads, block_size, head_dim + INT8_SCALE_BYTES)
    return (num_blocks, kv_heads, block_size, head_dim)


def cache_geometry(cache: torch.Tensor) -> tuple[int, int, int]:
    """(block_size, kv_heads, head_dim) of a cache made with cache_shape."""
    d = cache.shape[3] - (INT8_SCALE_BYTES if cache.dtype == torch.int8 else 0)
    return cache.shape[2], cache.shape[1], d


def _tile(cache: torch.Tensor) -> torch.Tensor:
    """The value tiles [block, head, bs * D] (an int8 cache: without its scales; fp8 as its
    bytes, which indexing takes)."""
    nb, kvh, bs, _ = cache.shape
    d = cache_geometry(cache)[2]
    flat = cache.view(torch.uint8) if cache.dtype == FP8 else cache
    return flat.view(nb, kvh, -1)[:, :, :bs * d]


def int8_scales(cache: torch.Tensor) -> torch.Tensor:
    """An int8 cache's per-token scales [block, head, bs] (fp32, a view of the cache)."""
    nb, kvh, bs, _ = cache.shape
    d = cache_geometry(cache)[2]
    return cache.view(nb, kvh, -1)[:, :, bs * d:].view(torch.float32)


def _key_tiles(cache: torch.Tensor) -> torch.Tensor:
    bs, kvh, d = cache_geometry(cache)
    return _tile(cache).view(cache.shape[0], kvh, d // 2, bs, 2)  # [block, head, dim pair, key, 2]


def _value_tiles(cache: torch.Tensor) -> torch.Tensor:
    bs, kvh, d = cache_geometry(cache)
    return _tile(cache).view(cache.shape[0], kvh, bs // 2, d, 2)  # [block, head, key pair, dim, 2]


def fp8_rotated(head_dim: int) -> bool:
    """An fp8 cache of this head size stores its rows rotated (hadamard_rotate)."""
    return head_dim >= 2 and head_dim & (head_dim - 1) == 0


def rotates(cache: torch.Tensor) -> bool:
    """This cache holds rotated keys and values: fp8 with a power-of-two head_dim."""
    return cache.dtype == FP8 and fp8_rotated(cache_geometry(cache)[2])


def hadamard_norm(head_dim: int) -> torch.Tensor:
    """1 / sqrt(head_dim) in fp32, rounded as the C kernels' 1.f / sqrtf(D)."""
    return 1.0 / torch.tensor(float(head_dim), dtype=torch.float32).sqrt()


def hadamard_rotate(x: torch.Tensor) -> torch.Tensor:
    """Rows [..., D] (D a power of two) -> H x / sqrt(D) in fp32: butterflies of stride 1, 2,
    4, ... then the norm, the C kernels' operations in their order (the same bits). Its own
    inverse."""
    d = x.shape[-1]
    lead = x.shape[:-1]
    y = x.float()
    h = 1
    while h < d:
        pairs = y.reshape(*lead, d // (2 * h), 2, h)
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        y = torch.stack((a + b, a - b), dim=-2).reshape(*lead, d)
        h *= 2
    return y * hadamard_norm(d).to(y.device)


def quantize_fp8(x: torch.Tensor, scale: float = FP8_KV_SCALE) -> torch.Tensor:
    """Rows to e4m3 as x / scale, saturating (NaN stays NaN)."""
    x = x.float()
    # a true division by a tensor, as the C writer's (over a Python number torch may multiply
    # by the reciprocal, which rounds differently)
    return (x / torch.full_like(x, scale)).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows [..., D] -> (int8 values, fp32 scales [...]): scale = absmax / 127 per row,
    values rint(x * (127 / absmax)) (an all-zero row: scale 0, values 0)."""
    x = x.float()
    amax = x.abs().amax(-1)
    # a true division, as the C writer's (a Python number over a tensor is a reciprocal times it)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    q = torch.round(x * inv[..., None]).clamp(-127, 127).to(torch.int8)
    return q, amax / 127.0


def _stored(x: torch.Tensor, cache: torch.Tensor,
            fp8_scale: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rows as the cache stores them: (values in the tiles' dtype, int8 scales or None)."""
    if cache.dtype == torch.int8:
        return quantize_int8(x)
    if cache.dtype == FP8:
        x = hadamard_rotate(x) if rotates(cache) else x
        return quantize_fp8(x, fp8_scale).view(torch.uint8), None
    return x.to(cache.dtype), None


def write_rows(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               slots: torch.Tensor, kv_scales: tuple[float, float] = UNIT_KV_SCALES) -> None:
    """k/v [T, kv_heads, head_dim] into the flat slots (block * block_size + offset),
    quantized as the cache's dtype says (fp8 over the layer's `kv_scales`)."""
    (qk, sk), (qv, sv) = _stored(k, k_cache, kv_scales[0]), _stored(v, v_cache, kv_scales[1])
    _write_stored(k_cache, v_cache, qk, qv, sk, sv, slots)


def _write_stored(k_cache, v_cache, qk, qv, sk, sv, slots) -> None:
    bs, kvh, d = cache_geometry(k_cache)
    blk, at = slots // bs, slots % bs
    _key_tiles(k_cache)[blk, :, :, at, :] = qk.reshape(-1, kvh, d // 2, 2)
    _value_tiles(v_cache)[blk, :, at // 2, :, at % 2] = qv
    if sk is not None:
        int8_scales(k_cache)[blk, :, at] = sk
        int8_scales(v_cache)[blk, :, at] = sv


def read_stored_rows(k_cache: torch.Tensor, v_cache: torch.Tensor,
                     slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The K/V rows at the flat slots as stored, [S, kv_heads, head_dim] (a one-byte cache's as
    uint8, int8's with its 4 scale bytes after each row): moved between caches of different
    block sizes unchanged, by write_stored_rows."""
    bs, kvh, d = cache_geometry(k_cache)
    blk, at = slots // bs, slots % bs
    k = _key_tiles(k_cache)[blk, :, :, at, :].reshape(-1, kvh, d)
    v = _value_tiles(v_cache)[blk, :, at // 2, :, at % 2]
    if k_cache.dtype == torch.int8:
        k, v = (torch.cat([x, int8_scales(c)[blk, :, at].unsqueeze(-1).view(torch.int8)], -1)
                for x, c in ((k, k_cache), (v, v_cache)))
    return k, v


def write_stored_rows(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor,
                      v: torch.Tensor, slots: torch.Tensor) -> None:
    """Rows from read_stored_rows into the flat slots of a cache of the same dtype."""
    d = cache_geometry(k_cache)[2]
    if k_cache.dtype == torch.int8:
        sk, sv = (x[..., d:].contiguous().view(torch.float32)[..., 0] for x in (k, v))
        k, v = k[..., :d], v[..., :d]
    else:
        sk = sv = None
    _write_stored(k_cache, v_cache, k, v, sk, sv, slots)


def _dequantized(x: torch.Tensor, scales: torch.Tensor | None, cache: torch.Tensor,
                 fp8_scale: float) -> torch.Tensor:
    """Stored values back to fp32 (a float cache's: as they are; fp8's rotated back)."""
    if cache.dtype == torch.int8:
        return x.float() * scales[..., None]
    if cache.dtype == FP8:
        x = x.view(FP8).float() * fp8_scale
        return hadamard_rotate(x) if rotates(cache) else x
    return x


def read_rows(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
              kv_scales: tuple[float, float] = UNIT_KV_SCALES) -> tuple[torch.Tensor, torch.Tensor]:
    """The K/V rows [S, kv_heads, head_dim] at the flat slots (a quantized cache's in fp32,
    dequantized; fp8 at the layer's `kv_scales`)."""
    bs, kvh, d = cache_geometry(k_cache)
    blk, at = slots // bs, slots % bs
    k = _key_tiles(k_cache)[blk, :, :, at, :].reshape(-1, kvh, d)
    v = _value_tiles(v_cache)[blk, :, at // 2, :, at % 2]
    ks = int8_scales(k_cache)[blk, :, at] if k_cache.dtype == torch.int8 else None
    vs = int8_scales(v_cache)[blk, :, at] if k_cache.dtype == torch.int8 else None
    return (_dequantized(k, ks, k_cache, kv_scales[0]),
            _dequantized(v, vs, v_cache, kv_scales[1]))


def read_blocks(k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                kv_scales: tuple[float, float] = UNIT_KV_SCALES) -> tuple[torch.Tensor, torch.Tensor]:
    """Whole blocks as rows: tables [B, n] -> K/V [B, n * block_size, kv_heads, head_dim]
    (a quantized cache's in fp32, dequantized; fp8 at the layer's `kv_scales`)."""
    bs, kvh, d = cache_geometry(k_cache)
    b, n = tables.shape
    k = _key_tiles(k_cache)[tables].permute(0, 1, 4, 2, 3, 5)  # [B, n, key, head, pair, 2]
    v = _value_tiles(v_cache)[tables].permute(0, 1, 3, 5, 2, 4)  # [B, n, pair, 2, head, dim]
    k, v = k.reshape(b, n * bs, kvh, d), v.reshape(b, n * bs, kvh, d)
    ks = vs = None
    if k_cache.dtype == torch.int8:
        ks, vs = (int8_scales(c)[tables].permute(0, 1, 3, 2).reshape(b, n * bs, kvh)
                  for c in (k_cache, v_cache))
    return (_dequantized(k, ks, k_cache, kv_scales[0]),
            _dequantized(v, vs, v_cache, kv_scales[1]))
