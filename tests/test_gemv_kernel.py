"""The fp32 decode GEMV (kvflow/csrc/gemv_f32.c) gives torch's matmul on every instruction set
(AVX-512, AVX2 from a build without AVX-512, scalar), for odd shapes and every row tile, and
serves exactly the decode-sized fp32 batches it was chosen for. From bf16 or fp16 panels it
gives bit for bit what it gives from fp32 panels of the widened weights."""
from __future__ import annotations

import ctypes
import os
import subprocess

import pytest
import torch
import torch.nn.functional as F

import kvflow.csrc
from kvflow.csrc import library
from kvflow.csrc.gemv import GEMV_ALL_ROWS, GEMV_ISAS, GEMV_MAX_ROWS, gemv_f32, gemv_isas, pack_gemv
from kvflow.model.cpu_features import CpuFeatures, cpu_features
from kvflow.model.kernels import KernelOptions, select_kernels
from kvflow.model.packed_linear import linear

pytestmark = pytest.mark.skipif(library() is None, reason="no C compiler")

AVX2 = CpuFeatures.from_names("avx2", "fma", "f16c")
HALF = [torch.bfloat16, torch.float16]
ZEN4 = CpuFeatures.from_names("avx2", "fma", "avx512f", "avx512_bf16")
# (N, K): ragged last panels (37, 100), K not a multiple of any unroll (13, 577), the model's
SHAPES = [(37, 13), (100, 577), (64, 576)]


def _reference(x, w, bias):
    out = x.double() @ w.double().T
    return (out + bias.double() if bias is not None else out).float()


def _isas_here() -> list[str]:
    f = cpu_features()
    runs = {"scalar": True, "avx2": {"avx2", "fma", "f16c"} <= f.flags, "avx512": f.avx512}
    return [i for i in gemv_isas() if runs[i]]


def test_this_build_has_every_path_its_cpu_runs():
    f = cpu_features()
    assert "scalar" in gemv_isas()
    assert ("avx2" in gemv_isas()) == ({"avx2", "fma", "f16c"} <= f.flags)
    assert ("avx512" in gemv_isas()) == f.avx512


@pytest.mark.parametrize("isa", ["scalar", "avx2", "avx512"])
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("threads", [1, 2])
def test_gemv_matches_torch_for_every_row_tile(isa, n, k, threads):
    if isa not in _isas_here():
        pytest.skip(f"this CPU has no {isa}")
    g = torch.Generator().manual_seed(n * k)
    w, bias = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    packed = pack_gemv(w)
    assert packed.shape == (-(-n // 16), k, 16)
    for m in (1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 40):  # one tile of each size on both ISAs, then several
        x = torch.randn(m, k, generator=g)
        for b in (bias, None):
            got = gemv_f32(x, packed, n, b, isa, threads)
            assert got.shape == (m, n) and got.dtype == torch.float32
            torch.testing.assert_close(got, _reference(x, w, b), rtol=1e-5, atol=2e-5 * k ** 0.5)


def test_gemv_reads_strided_rows():
    w, x = torch.randn(40, 24), torch.randn(3, 48)[:, :24]  # row stride 48
    torch.testing.assert_close(gemv_f32(x, pack_gemv(w), 40, None, _isas_here()[-1]),
                               _reference(x, w, None), rtol=1e-5, atol=1e-4)


def _half_weights(n: int, k: int, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """(n, k) fp32 weights whose values are all exactly `dtype`'s, with a few of its edge values
    (fp16 subnormals and its largest finite value, bf16's smallest normals, signed zeros)."""
    w = torch.randn(n, k, generator=g).to(dtype)
    edges = torch.tensor([0.0, -0.0, 6e-8, -6e-8, 3e-5, 65504.0, -65504.0] if dtype == torch.float16
                         else [0.0, -0.0, 1.2e-38, -1.2e-38, 3e38, 1e-3, -1e-3], dtype=dtype)
    w.view(-1)[:edges.numel()] = edges
    return w.float()


def _assert_near_reference(got, x, w, bias):
    """Within fp32 rounding of the float64 product: sums with large terms that cancel (the
    edge values) are bounded by the sum of the terms' magnitudes, not by the result's."""
    scale = x.abs().double() @ w.abs().double().T
    err = (got.double() - _reference(x, w, bias).double()).abs()
    assert bool((err <= 1e-5 * scale + 1e-5).all()), float((err - 1e-5 * scale).max())


@pytest.mark.parametrize("isa", ["scalar", "avx2", "avx512"])
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("threads", [1, 2])
def test_half_panels_give_the_fp32_gemv_of_the_widened_weights(isa, dtype, n, k, threads):
    if isa not in _isas_here():
        pytest.skip(f"this CPU has no {isa}")
    g = torch.Generator().manual_seed(n + k)
    w, bias = _half_weights(n, k, dtype, g), torch.randn(n, generator=g)
    half, full = pack_gemv(w, dtype), pack_gemv(w)
    assert half.dtype == dtype and half.shape == full.shape
    assert torch.equal(half.float(), full)  # the same panels, half the bytes
    for m in [*range(1, 14), 40]:  # every tile size (AVX2 to 6, AVX-512 to 8), then several
        x = torch.randn(m, k, generator=g)
        if dtype == torch.bfloat16:
            x[:, :7] = 0  # the bf16 edge columns hold 3e38: keep the sums finite
        for b in (bias, None):
            got = gemv_f32(x, half, n, b, isa, threads)
            assert torch.equal(got, gemv_f32(x, full, n, b, isa)), (isa, dtype, m)
            _assert_near_reference(got, x, w, b)


def test_half_panels_round_to_nearest_even():
    w = torch.randn(20, 33)
    for dtype in HALF:
        assert torch.equal(pack_gemv(w, dtype).float(), pack_gemv(w.to(dtype).float()))
    with pytest.raises(ValueError, match="fp32, bf16 or fp16"):
        pack_gemv(w, torch.float64)


def _avx2_only_build(tmp_path):
    """gemv_f32.c compiled for an AVX2-only CPU (Zen 3: AVX2, FMA, F16C; AVX-512 off)."""
    src = os.path.join(os.path.dirname(kvflow.csrc.__file__), "gemv_f32.c")
    so = tmp_path / "gemv_f32_avx2.so"
    subprocess.run(["cc", "-O3", "-march=x86-64-v3", "-mno-avx512f", "-shared", "-fPIC", "-std=c11",
                    src, "-o", str(so)], check=True, capture_output=True)
    lib = ctypes.CDLL(str(so))
    lib.gemv_f32_isas.restype = ctypes.c_int64
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.gemv_f32_panels.restype = None
    lib.gemv_f32_panels.argtypes = [ptr, i64, i64, i64, ptr, ptr, ptr, i64, i64, i64, i64, i64, i64]
    return lib


def _call(lib, x, packed, n, bias, isa):
    m, k = x.shape
    wdt = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}[packed.dtype]
    out = torch.full((m, n), float("nan"))
    lib.gemv_f32_panels(x.data_ptr(), k, m, k, packed.data_ptr(), bias.data_ptr(), out.data_ptr(),
                        n, n, GEMV_ISAS[isa], wdt, 0, packed.shape[0])
    return out


def test_avx2_path_from_a_build_without_avx512(tmp_path):
    """The AVX2-only build has the scalar and AVX2 paths only; its AVX2 path gives torch's
    numbers from fp32 panels, and the same bits from bf16 and fp16 panels of those weights."""
    lib = _avx2_only_build(tmp_path)
    assert lib.gemv_f32_isas() == 0b011  # scalar + AVX2, no AVX-512
    g = torch.Generator().manual_seed(0)
    for n, k in SHAPES:
        w, bias = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
        packed = pack_gemv(w)
        for m in (1, 2, 3, 4, 5, 6, 7, 13, 40):
            x = torch.randn(m, k, generator=g)
            out = _call(lib, x, packed, n, bias, "avx2")
            torch.testing.assert_close(out, _reference(x, w, bias), rtol=1e-5, atol=2e-5 * k ** 0.5)
        for dtype in HALF:
            wh = _half_weights(n, k, dtype, g)
            for m in (1, 2, 3, 4, 5, 6, 9, 13):
                x = torch.randn(m, k, generator=g)
                x[:, :7] = 0
                got = _call(lib, x, pack_gemv(wh, dtype), n, bias, "avx2")
                assert torch.equal(got, _call(lib, x, pack_gemv(wh), n, bias, "avx2")), (dtype, m)
                _assert_near_reference(got, x, wh, bias)


def test_fp32_batches_take_the_gemv_up_to_its_rows_and_longer_ones_onednn():
    k = select_kernels(torch.float32, options=KernelOptions())
    isa = _isas_here()[-1]
    every = GEMV_MAX_ROWS[isa] >= GEMV_ALL_ROWS  # AVX2: the GEMV serves every batch
    assert k.names["linear"] == (f"gemv-{isa}" if every else f"gemv-{isa}+onednn")
    w, bias = torch.randn(96, 64), torch.randn(96)
    packed = k.pack(w)
    assert packed.gemv is not None and (packed.onednn is None) == every
    assert packed.gemv_isa == isa and packed.gemv_rows == GEMV_MAX_ROWS[isa]
    for m in [*range(1, 12), 64, 300]:
        x = torch.randn(m, 64)
        torch.testing.assert_close(linear(x, w, packed, bias), F.linear(x, w, bias), rtol=1e-5, atol=1e-4)
    # the GEMV serves exactly the rows up to gemv_rows: with its panels zeroed, those rows read 0
    packed.gemv.zero_()
    if every:
        assert linear(torch.randn(300, 64), w, packed).abs().max() == 0
    else:
        rows = packed.gemv_rows
        assert linear(torch.randn(rows, 64), w, packed).abs().max() == 0
        assert linear(torch.randn(rows + 1, 64), w, packed).abs().max() > 0


def test_the_gemv_is_chosen_per_cpu_and_opt_out():
    avx2 = select_kernels(torch.float32, features=AVX2, options=KernelOptions())
    assert avx2.names["linear"] == "gemv-avx2"
    assert avx2.pack(torch.randn(32, 16)).gemv_isa == "avx2"
    if "avx512" in gemv_isas():
        zen4 = select_kernels(torch.float32, features=ZEN4, options=KernelOptions())
        assert zen4.names["linear"] == "gemv-avx512+onednn"
        forced = select_kernels(torch.float32, features=ZEN4, options=KernelOptions(gemv_isa="avx2"))
        assert forced.names["linear"] == "gemv-avx2"
    off = select_kernels(torch.float32, features=AVX2, options=KernelOptions(gemv=False))
    assert off.names["linear"] == "onednn" and off.pack(torch.randn(32, 16)).gemv is None
    # no vector path on the CPU: no GEMV (the scalar path is the tests' reference only)
    assert select_kernels(torch.float32, features=CpuFeatures(), options=KernelOptions()).names["linear"] == "onednn"
    # bf16 models never take it
    assert "gemv" not in select_kernels(torch.bfloat16, features=AVX2, options=KernelOptions()).names["linear"]


def test_an_unknown_forced_isa_is_refused(monkeypatch):
    monkeypatch.setenv("KVFLOW_GEMV_ISA", "avx512")
    with pytest.raises(ValueError, match="KVFLOW_GEMV_ISA"):
        KernelOptions.from_env()
