"""Bucketed oneDNN projections: same result as F.linear for every row count, bounded shapes."""
import pytest
import torch
import torch.nn.functional as F

from kvflow.model.onednn import linear, onednn_usable, pack_weight, row_bucket


def test_row_buckets_cover_every_count_with_few_shapes():
    for m in range(1, 4097):
        b = row_bucket(m)
        slack = m if m <= 8 else 8 if m <= 64 else min(128, m // 8 + 1)  # < 12.5% padding above 64
        assert m <= b < m + slack or b == m == 1
        assert row_bucket(b) == b  # a bucket is its own bucket
    assert row_bucket(306) == 320  # 256 prompt tokens + 50 decodes: 5% padding, not 25%
    assert len({row_bucket(m) for m in range(1, 2049)}) <= 52
    assert len({row_bucket(m) for m in range(1, 4097)}) <= 68


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


def test_bf16_packing_only_where_the_cpu_has_bf16():
    from kvflow.model.onednn import cpu_has_native_bf16
    assert onednn_usable(torch.bfloat16) == cpu_has_native_bf16()


@pytest.mark.parametrize("m", [1, 40, 300])
def test_packed_bf16_linear_matches_f_linear(m):
    g = torch.Generator().manual_seed(m)
    w = torch.randn(96, 64, generator=g).bfloat16()
    x = torch.randn(m, 64, generator=g).bfloat16()
    out = linear(x, w, pack_weight(w))
    assert out.dtype == torch.bfloat16 and out.shape == (m, 96)
    # both accumulate in fp32 and round once to bf16: at most one bf16 ulp apart
    torch.testing.assert_close(out.float(), F.linear(x, w).float(), rtol=1e-2, atol=1e-2)
