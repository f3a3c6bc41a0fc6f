"""The paged cache's tile layout (kvflow/attention/kv_layout.py, kvflow/csrc/tiles.h): where each
key and value lands, and that the PyTorch readers give back what was written."""
from __future__ import annotations

import pytest
import torch

from kvflow.attention.kv_layout import cache_shape, read_blocks, read_rows, write_rows


def test_each_value_lands_where_the_layout_says():
    """K(t, d) of block b, head h at tile (b, h) offset ((d // 2) * bs + t) * 2 + d % 2; V(t, d)
    at ((t // 2) * D + d) * 2 + t % 2 (the formulas of tiles.h)."""
    nb, bs, kvh, d = 3, 4, 2, 6
    k_cache, v_cache = torch.zeros(cache_shape(nb, bs, kvh, d)), torch.zeros(cache_shape(nb, bs, kvh, d))
    slots = torch.arange(nb * bs)
    # value = 1000 * slot + 100 * head + dim + 1: every number says where it came from
    rows = (1000 * slots[:, None, None] + 100 * torch.arange(kvh)[None, :, None]
            + torch.arange(d)[None, None, :] + 1).float()
    write_rows(k_cache, v_cache, rows, -rows, slots)
    for s in range(nb * bs):
        b, t = divmod(s, bs)
        for h in range(kvh):
            kt, vt = k_cache[b, h].flatten(), v_cache[b, h].flatten()
            for i in range(d):
                assert kt[((i // 2) * bs + t) * 2 + i % 2] == rows[s, h, i]
                assert vt[((t // 2) * d + i) * 2 + t % 2] == -rows[s, h, i]


def test_rows_and_blocks_read_back_what_was_written():
    nb, bs, kvh, d = 6, 16, 3, 8
    k_cache, v_cache = torch.zeros(cache_shape(nb, bs, kvh, d)), torch.zeros(cache_shape(nb, bs, kvh, d))
    slots = torch.randperm(nb * bs)[:40]
    k, v = torch.randn(40, kvh, d), torch.randn(40, kvh, d)
    write_rows(k_cache, v_cache, k, v, slots)
    got_k, got_v = read_rows(k_cache, v_cache, slots)
    assert torch.equal(got_k, k) and torch.equal(got_v, v)
    tables = torch.tensor([[4, 1], [0, 5]])
    bk, bv = read_blocks(k_cache, v_cache, tables)
    for i in range(2):
        block_slots = torch.cat([tables[i, j] * bs + torch.arange(bs) for j in range(2)])
        want_k, want_v = read_rows(k_cache, v_cache, block_slots)
        assert torch.equal(bk[i], want_k) and torch.equal(bv[i], want_v)


def test_odd_sizes_are_refused():
    with pytest.raises(ValueError, match="even"):
        cache_shape(4, 15, 2, 64)
    with pytest.raises(ValueError, match="even"):
        cache_shape(4, 16, 2, 63)
