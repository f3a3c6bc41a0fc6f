"""A PyTorch reference for the Triton attention tests: random scattered block tables, a cache
filled through kv_layout.write_rows, and attention computed per sequence in fp64."""
from __future__ import annotations

import torch

from kvflow.attention.kv_layout import UNIT_KV_SCALES, cache_shape, read_rows, write_rows


def scattered_tables(seq_lens: list[int], block_size: int, num_blocks: int,
                     gen: torch.Generator) -> torch.Tensor:
    """Each sequence's blocks drawn from a shuffled pool (never two sequences on one block),
    padded with block 0 to the widest table: [N, max_blocks] int64."""
    need = [-(-n // block_size) for n in seq_lens]
    perm = torch.randperm(num_blocks, generator=gen)
    assert sum(need) <= num_blocks
    width = max(need)
    tables = torch.zeros(len(seq_lens), width, dtype=torch.int64)
    at = 0
    for i, n in enumerate(need):
        tables[i, :n] = perm[at:at + n]
        at += n
    return tables


def slots_of(tables: torch.Tensor, i: int, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    return tables[i, positions // block_size] * block_size + positions % block_size


def filled_cache(seq_lens: list[int], tables: torch.Tensor, kv_heads: int, head_dim: int,
                 block_size: int, num_blocks: int, dtype: torch.dtype, gen: torch.Generator,
                 kv_scales=UNIT_KV_SCALES, magnitude: float = 1.0):
    """(k_cache, v_cache) holding random K/V (times `magnitude`) at every sequence's positions
    0..len-1 (a one-byte cache's quantized by write_rows, fp8 at `kv_scales`)."""
    shape = cache_shape(num_blocks, block_size, kv_heads, head_dim, dtype)
    k_cache, v_cache = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
    for i, n in enumerate(seq_lens):
        slots = slots_of(tables, i, torch.arange(n), block_size)
        write_rows(k_cache, v_cache, torch.randn(n, kv_heads, head_dim, generator=gen) * magnitude,
                   torch.randn(n, kv_heads, head_dim, generator=gen) * magnitude, slots, kv_scales)
    return k_cache, v_cache


def reference_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        tables: torch.Tensor, seq_lens: list[int], query_lens: list[int],
                        scale: float, window: int | None = None,
                        cap: float | None = None, kv_scales=UNIT_KV_SCALES,
                        sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, H, D] flat, sequence i's query_lens[i] rows last in its sequence -> [T, H, D].
    `sinks` [H]: each head's sink logit, one more column of the softmax whose value is zero."""
    block_size = k_cache.shape[2]
    heads = q.shape[1]
    out = torch.empty(q.shape, dtype=torch.float64)
    row = 0
    for i, (s_len, q_len) in enumerate(zip(seq_lens, query_lens)):
        k, v = read_rows(k_cache, v_cache, slots_of(tables, i, torch.arange(s_len), block_size),
                         kv_scales)
        group = heads // k.shape[1]
        k = k.double().repeat_interleave(group, dim=1)  # [S, H, D]
        v = v.double().repeat_interleave(group, dim=1)
        qi = q[row:row + q_len].double()
        scores = torch.einsum("qhd,shd->hqs", qi, k) * scale
        if cap is not None:
            scores = cap * torch.tanh(scores / cap)
        pos = torch.arange(s_len - q_len, s_len)[:, None]
        keys = torch.arange(s_len)[None, :]
        seen = keys <= pos
        if window is not None:
            seen &= pos - keys < window
        scores = scores.masked_fill(~seen, float("-inf"))
        if sinks is None:
            probs = scores.softmax(-1)
        else:
            column = sinks.double().view(-1, 1, 1).expand(-1, q_len, 1)
            probs = torch.cat([scores, column], dim=-1).softmax(-1)[..., :-1]
        out[row:row + q_len] = torch.einsum("hqs,shd->qhd", probs, v)
        row += q_len
    return out
