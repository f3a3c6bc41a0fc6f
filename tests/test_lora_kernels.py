"""LoRA's batched shrink/expand (kvflow/csrc/lora.c) gives the PyTorch reference on every
instruction set (AVX-512, AVX2 from a build without AVX-512, scalar), for fp32 and bf16
activations, fused projections of one to three slices, ranks below the slots' and rows of the
base model left alone; and select_kernels picks the widest path the CPU has."""
from __future__ import annotations

import ctypes
import os
import subprocess

import pytest
import torch

import kvflow.csrc
from kvflow.csrc import library
from kvflow.csrc.lora import LORA_ISAS, lora_add, lora_add_torch, lora_isas
from kvflow.model.cpu_features import CpuFeatures, cpu_features
from kvflow.model.kernels import KernelOptions, select_kernels

pytestmark = pytest.mark.skipif(library() is None, reason="no C compiler")

# (K, slice widths): ragged K (not a multiple of 8 or 16), the default model's q|k|v and down
CASES = [(37, [20, 9, 9]), (576, [576, 192, 192]), (1536, [576]), (64, [40, 40])]
SLOTS = [0, 0, 0, -1, 1, 1, 2, 0, 0, 0, 0, 0, 1, -1, -1, 2]  # runs of one adapter, base rows


def _case(k: int, widths: list[int], dtype: torch.dtype, seed: int, r: int = 8):
    g = torch.Generator().manual_seed(seed)
    bounds = [0]
    for w in widths:
        bounds.append(bounds[-1] + w)
    s, n = 3, bounds[-1]
    a = torch.randn(s, len(widths) * r, k, generator=g) / k ** 0.5
    bt = torch.randn(s, r, n, generator=g)
    ranks = torch.tensor([r, 3, 0])  # full rank, a smaller adapter, one that skips this projection
    slots = torch.tensor(SLOTS, dtype=torch.int64)
    x = torch.randn(len(SLOTS), k, generator=g).to(dtype)
    y = torch.randn(len(SLOTS), n, generator=g).to(dtype)
    return y, x, a, bt, ranks, torch.tensor(bounds), slots


def _isas_here() -> list[str]:
    f = cpu_features()
    runs = {"scalar": True, "avx2": {"avx2", "fma"} <= f.flags, "avx512": f.avx512}
    return [i for i in lora_isas() if runs[i]]


def test_this_build_has_every_path_its_cpu_runs():
    f = cpu_features()
    assert "scalar" in lora_isas()
    assert ("avx2" in lora_isas()) == ({"avx2", "fma"} <= f.flags)
    assert ("avx512" in lora_isas()) == f.avx512


def test_reference_adds_b_a_x_for_each_rows_adapter():
    y, x, a, bt, ranks, starts, slots = _case(37, [20, 9, 9], torch.float32, 0)
    got = y.clone()
    lora_add_torch(got, x, a, bt, ranks, starts, slots)
    for t, slot in enumerate(SLOTS):
        want = y[t].clone()
        if slot >= 0:
            r = int(ranks[slot])
            for j in range(3):
                lo, hi = int(starts[j]), int(starts[j + 1])
                want[lo:hi] += bt[slot, :r, lo:hi].T @ (a[slot, j * 8:j * 8 + r] @ x[t])
        torch.testing.assert_close(got[t], want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got[3], y[3]) and torch.equal(got[6], y[6])  # base rows; a rank-0 slot


@pytest.mark.parametrize("isa", ["scalar", "avx2", "avx512"])
@pytest.mark.parametrize("k,widths", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2])
def test_kernel_matches_the_reference(isa, k, widths, dtype, threads):
    if isa not in _isas_here():
        pytest.skip(f"this CPU has no {isa}")
    y, x, a, bt, ranks, starts, slots = _case(k, widths, dtype, k + len(widths))
    want = y.clone()
    lora_add_torch(want, x, a, bt, ranks, starts, slots)
    got = y.clone()
    lora_add(got, x, a, bt, ranks, starts, slots, isa, threads)
    assert not torch.equal(got, y)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    else:  # one rounding of the same fp32 sum: at most one bf16 ulp apart
        torch.testing.assert_close(got.float(), want.float(), rtol=8e-3, atol=1e-2)
    for t in (3, 13, 14, 6):  # the base model's rows and the rank-0 slot's stay bit for bit
        assert torch.equal(got[t], y[t])


def test_kernel_reads_strided_rows():
    y, x, a, bt, ranks, starts, slots = _case(37, [20, 9, 9], torch.float32, 5)
    wide = torch.randn(x.shape[0], 80)
    wide[:, :37] = x
    want, got = y.clone(), y.clone()
    lora_add_torch(want, x, a, bt, ranks, starts, slots)
    lora_add(got, wide[:, :37], a, bt, ranks, starts, slots, _isas_here()[-1])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


def test_mismatched_shapes_are_refused():
    y, x, a, bt, ranks, starts, slots = _case(37, [20, 9, 9], torch.float32, 1)
    with pytest.raises(ValueError, match="do not fit"):
        lora_add(y, x[:, :30], a, bt, ranks, starts, slots)
    with pytest.raises(ValueError, match="disagree"):
        lora_add(y, x, a, bt, ranks, starts, slots[:5])


def _avx2_only_build(tmp_path):
    """lora.c compiled for an AVX2-only CPU (Zen 3: AVX2 and FMA, AVX-512 off)."""
    src = os.path.join(os.path.dirname(kvflow.csrc.__file__), "lora.c")
    so = tmp_path / "lora_avx2.so"
    subprocess.run(["cc", "-O3", "-march=x86-64-v3", "-mno-avx512f", "-shared", "-fPIC", "-std=c11",
                    src, "-o", str(so)], check=True, capture_output=True)
    lib = ctypes.CDLL(str(so))
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.lora_isas.restype = i64
    lib.lora_shrink.restype = lib.lora_expand.restype = None
    lib.lora_shrink.argtypes = [ptr, i64, i64, i64, ptr, i64, i64, ptr, ptr, ptr, i64, i64, i64]
    lib.lora_expand.argtypes = [ptr, i64, i64, ptr, ptr, ptr, i64, ptr, ptr, i64, i64, i64, i64, i64]
    return lib


def test_avx2_path_from_a_build_without_avx512(tmp_path):
    lib = _avx2_only_build(tmp_path)
    assert lib.lora_isas() == 0b011  # scalar + AVX2, no AVX-512
    isa = LORA_ISAS["avx2"]
    for k, widths in CASES:
        for dtype in (torch.float32, torch.bfloat16):
            y, x, a, bt, ranks, starts, slots = _case(k, widths, dtype, k)
            want = y.clone()
            lora_add_torch(want, x, a, bt, ranks, starts, slots)
            t, n_slices, r, n = x.shape[0], len(widths), bt.shape[1], y.shape[1]
            s = torch.empty(t, n_slices * r)
            bf = int(dtype == torch.bfloat16)
            lib.lora_shrink(x.data_ptr(), k, bf, k, a.data_ptr(), n_slices, r, ranks.data_ptr(),
                            slots.data_ptr(), s.data_ptr(), isa, 0, t)
            got = y.clone()
            lib.lora_expand(s.data_ptr(), n_slices, r, ranks.data_ptr(), bt.data_ptr(),
                            starts.data_ptr(), n, slots.data_ptr(), got.data_ptr(), n, bf, isa, 0, t)
            tol = dict(rtol=1e-5, atol=1e-4) if bf == 0 else dict(rtol=8e-3, atol=1e-2)
            torch.testing.assert_close(got.float(), want.float(), **tol)


def test_the_kernel_is_chosen_per_cpu_and_opt_out():
    zen3 = select_kernels(torch.float32, features=CpuFeatures.from_names("avx2", "fma", "f16c"),
                          options=KernelOptions())
    assert zen3.lora.keywords["isa"] == "avx2"
    if "avx512" in lora_isas():
        zen4 = select_kernels(torch.bfloat16, features=CpuFeatures.from_names(
            "avx2", "fma", "avx512f", "avx512_bf16"), options=KernelOptions())
        assert zen4.lora.keywords["isa"] == "avx512"
    old = select_kernels(torch.float32, features=CpuFeatures.from_names("sse4_2"), options=KernelOptions())
    assert old.lora.keywords["isa"] == "scalar"
    plain = select_kernels(torch.float32, options=KernelOptions(c_kernels=False))
    assert plain.lora.__name__ == "_lora_torch"
