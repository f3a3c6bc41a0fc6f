"""Bucketed oneDNN projections: same result as F.linear for every row count, bounded shapes."""
import pytest
import torch
import torch.nn.functional as F

from kvflow.model.onednn import linear, onednn_usable, pack_weight, row_bucket


def test_row_buckets_cover_every_count_with_few_shapes():
    for m in range(1, 4097):
        b = row_bucket(m)
        slack = m if m <= 16 else 16 if m <= 256 else 128
        assert m <= b < m + slack or b == m == 1
    assert len({row_bucket(m) for m in range(1, 2049)}) <= 40


@pytest.mark.parametrize("m", [1, 3, 16, 17, 100, 256, 300, 1000])
def test_padded_linear_matches_f_linear(m):
    assert onednn_usable(torch.float32)  # the pinned CPU torch ships oneDNN
    g = torch.Generator().manual_seed(m)
    w = torch.randn(96, 64, generator=g)
    bias = torch.randn(96, generator=g)
    x = torch.randn(m, 64, generator=g)
    out = linear(x, w, pack_weight(w), bias)
    assert out.shape == (m, 96) and out.is_contiguous()
    torch.testing.assert_close(out, F.linear(x, w, bias), rtol=1e-5, atol=1e-5)
