"""Projections through prepacked weights (the bf16 panel GEMM, bucketed oneDNN): the same
result as F.linear for every row count, bounded shapes."""
import pytest
import torch
import torch.nn.functional as F

from kvflow.model.cpu_features import cpu_features
from kvflow.model.kernels import KernelOptions, select_kernels
from kvflow.model.packed_linear import linear, onednn_available, row_bucket

DEFAULTS = KernelOptions()  # nothing opted out, whatever the environment says


def pack_weight(w: torch.Tensor, gate_up: bool = False, options: KernelOptions = DEFAULTS):
    """How a model in w's dtype packs w here (None: F.linear serves it)."""
    pack = select_kernels(w.dtype, options=options).pack
    return None if pack is None else pack(w, gate_up=gate_up)


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
    assert onednn_available()  # the pinned CPU torch ships oneDNN
    no_gemv = KernelOptions(gemv=False)  # oneDNN alone (AVX2 CPUs give fp32 to the GEMV)
    assert select_kernels(torch.float32, options=no_gemv).names["linear"] == "onednn"
    g = torch.Generator().manual_seed(m)
    w = torch.randn(96, 64, generator=g)
    bias = torch.randn(96, generator=g)
    x = torch.randn(m, 64, generator=g)
    out = linear(x, w, pack_weight(w, options=no_gemv), bias)
    assert out.shape == (m, 96) and out.is_contiguous()
    torch.testing.assert_close(out, F.linear(x, w, bias), rtol=1e-5, atol=1e-5)


def test_bf16_packing_only_where_the_cpu_has_bf16():
    no_panels = select_kernels(torch.bfloat16, options=KernelOptions(panel_gemm=False))
    assert no_panels.names["linear"] == ("onednn" if cpu_features().native_bf16 else "torch")


@pytest.mark.parametrize("m", [1, 40, 300])
@pytest.mark.parametrize("panel_gemm", [True, False])  # False: oneDNN where the CPU has bf16
def test_packed_bf16_linear_matches_f_linear(m, panel_gemm):
    g = torch.Generator().manual_seed(m)
    w = torch.randn(96, 64, generator=g).bfloat16()
    x = torch.randn(m, 64, generator=g).bfloat16()
    out = linear(x, w, pack_weight(w, options=KernelOptions(panel_gemm=panel_gemm)))
    assert out.dtype == torch.bfloat16 and out.shape == (m, 96)
    # both accumulate in fp32 and round once to bf16: at most one bf16 ulp apart
    torch.testing.assert_close(out.float(), F.linear(x, w).float(), rtol=1e-2, atol=1e-2)


def test_bf16_weights_take_the_panel_gemm_exactly_where_the_cpu_has_avx512_bf16():
    has_it = cpu_features().avx512_bf16
    packed = pack_weight(torch.randn(96, 64).bfloat16())
    assert (packed is not None and packed.panels is not None) == has_it
    assert pack_weight(torch.randn(96, 64)).panels is None  # fp32 stays with oneDNN


@pytest.mark.parametrize("m", [1, 5, 6, 7, 13, 24, 40, 300])
@pytest.mark.parametrize("threads", [1, 2])
def test_packed_bf16_linear_with_bias_and_ragged_outputs(m, threads):
    """200 outputs (not a multiple of the 64-wide panels), a bias, rows over several tiles,
    input rows with a stride: within one bf16 rounding of the fp32 product on every path."""
    g = torch.Generator().manual_seed(1000 * threads + m)
    w = torch.randn(200, 96, generator=g).bfloat16()
    bias = torch.randn(200, generator=g).bfloat16()
    x = torch.randn(m, 128, generator=g).bfloat16()[:, :96]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = linear(x, w, pack_weight(w), bias)
    finally:
        torch.set_num_threads(before)
    exact = x.float() @ w.float().T + bias.float()
    assert out.dtype == torch.bfloat16 and out.shape == (m, 200)
    torch.testing.assert_close(out.float(), exact, rtol=8e-3, atol=1e-2)
    if threads == 2:  # the row split computes each row as one thread would
        assert torch.equal(out, linear(x, w, pack_weight(w), bias))


@pytest.mark.parametrize("m", [1, 7, 40, 200])  # 200: split by rows on two threads
@pytest.mark.parametrize("threads", [1, 2])
def test_gate_up_with_silu_fused_is_the_unfused_result_bit_for_bit(m, threads):
    """An MLP's [gate; up] packed for the fused kernel: silu(gate) * up comes out of the GEMM
    with the same bf16 roundings as the projection stored, then silu_mul (input rows with a
    stride, as the model's views have)."""
    from kvflow.csrc.ops import silu_mul
    g = torch.Generator().manual_seed(m)
    inter, k = 96, 80
    w = torch.randn(2 * inter, k, generator=g).bfloat16()
    x = torch.randn(m, 2 * k, generator=g).bfloat16()[:, :k]
    fused = pack_weight(w, gate_up=True)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = select_kernels(w.dtype, options=DEFAULTS).linear_silu_mul(x, w, fused)
        want = silu_mul(linear(x, w, pack_weight(w)))
    finally:
        torch.set_num_threads(before)
    assert got.shape == (m, inter) and got.dtype == torch.bfloat16
    assert torch.equal(got, want)
    if fused is not None:
        assert fused.gate_up == (fused.panels is not None)
    # and against first principles: silu(gate) * up, each rounded to bf16 as torch's ops do
    gate, up = (x.float() @ w.float().T).bfloat16().chunk(2, dim=-1)
    torch.testing.assert_close(got.float(), (F.silu(gate) * up).float(), rtol=2e-2, atol=2e-2)


def test_gate_up_rows_that_do_not_fill_whole_panels_stay_unfused():
    w = torch.randn(2 * 40, 64).bfloat16()  # I = 40: not a multiple of 32
    packed = pack_weight(w, gate_up=True)
    assert packed is None or not packed.gate_up
