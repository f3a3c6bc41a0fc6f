"""The quantized GEMM (kvflow/csrc/gemm_quant.c) against dequantise-then-matmul: every GGUF
format kvflow serves natively (Q8_0, Q4_0, Q4_1, Q4_K) and two it requantizes (Q5_K, Q6_K),
int8 W8A8, on each instruction set this machine has (the scalar reference, AVX2, AVX-512
VNNI), plus the AVX2 path from a build with AVX-512 switched off."""
from __future__ import annotations

import ctypes
import os
import subprocess

import numpy as np
import pytest
import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize, quantize

import kvflow.csrc
from kvflow.model.quant.gguf_blocks import decode
from kvflow.model.quant.int8 import quantize_int8
from kvflow.model.quant.packing import dequantize_rows, pack
from kvflow.model.quant.qlinear import (QuantizedWeight, available_isas, quant_linear,
                                        quantize_activations)

ISAS = available_isas()


def gguf_weight(type_name: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """n rows of k values in GGUF's `type_name` blocks: gguf's own quantizer where it has one,
    else random blocks with sane fp16 scales (every bit pattern of the rest is valid)."""
    rng = np.random.default_rng(seed)
    qtype = GGMLQuantizationType[type_name]
    if type_name in ("Q8_0", "Q4_0", "Q4_1"):
        return quantize(rng.standard_normal((n, k)).astype(np.float32) * 0.05, qtype)
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (n * k // block, size), dtype=np.uint8)
    d = (rng.uniform(0.5, 1.5, len(raw)) * 1e-3).astype(np.float16).view(np.uint8).reshape(-1, 2)
    if type_name == "Q6_K":
        raw[:, -2:] = d
    else:  # Q4_K, Q5_K: d then dmin
        raw[:, 0:2] = d
        raw[:, 2:4] = (rng.uniform(0.5, 1.5, len(raw)) * 5e-4).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return raw.reshape(n, -1)


def quantized(type_name: str, n: int, k: int, isa: str) -> tuple[QuantizedWeight, torch.Tensor]:
    raw = gguf_weight(type_name, n, k)
    kind, q, d, m = decode(raw, type_name, n, k)
    w = QuantizedWeight(kind=kind, n=n, k=k, packed=pack(kind, q, d, m), isa=isa, source=type_name)
    ref = dequantize(raw, GGMLQuantizationType[type_name]).reshape(n, k)
    return w, torch.from_numpy(ref.astype(np.float32))


def reference(x: torch.Tensor, w: torch.Tensor, kb: int, per_row: bool) -> torch.Tensor:
    """Dequantised weights times the activations as the kernel quantizes them, in float64."""
    qx, dx, _ = quantize_activations(x, kb, per_row, 1)
    k = w.shape[1]
    xq = (qx.double().view(x.shape[0], kb, 32) * dx.double()[..., None]).reshape(x.shape[0], -1)[:, :k]
    return xq @ w.double().T


# (format, tolerance against dequantise-then-matmul with the same int8 activations, relative
# to the largest output): the native formats are exact but for float rounding; Q4_K's scales
# are rounded to fp16; Q5_K and Q6_K are requantized to 8 bits
FORMATS = [("Q8_0", 1e-5), ("Q4_0", 1e-5), ("Q4_1", 1e-5), ("Q4_K", 2e-3), ("Q5_K", 1.5e-2),
           ("Q6_K", 1.5e-2)]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("type_name,tol", FORMATS)
# N: whole panels of 16 and a partial last one; M: decode rows, a partial tile, a prefill
@pytest.mark.parametrize("m,n,k", [(1, 72, 256), (7, 40, 512), (64, 48, 256), (2048, 24, 256)])
def test_gguf_formats_match_dequantise_then_matmul(isa, type_name, tol, m, n, k):
    w, ref_w = quantized(type_name, n, k, isa)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    threads = 2 if m in (7, 2048) else 1  # split by panels (7) and by rows (2048)
    got = quant_linear(x, w, threads=threads)
    ref = reference(x, ref_w, w.kb, per_row=False)
    scale = ref.abs().max().item()
    assert (got.double() - ref).abs().max().item() <= tol * scale
    # and against the float activations: the activations' own 8-bit rounding
    exact = x.double() @ ref_w.double().T
    assert (got.double() - exact).abs().max().item() <= 0.03 * scale


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("m,n,k", [(1, 33, 100), (7, 16, 64), (64, 50, 200), (2048, 17, 40)])
def test_int8_w8a8_matches_dequantise_then_matmul(isa, m, n, k):
    """Per-channel weights, per-token activations; K not a multiple of the 32-block."""
    g = torch.Generator().manual_seed(k)
    w_float = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g)
    w = quantize_int8(w_float, isa)
    ref_w = dequantize_rows("q8", w.packed, w.kb * 32, torch.arange(n), torch.float32)[:, :k]
    assert (ref_w - w_float).abs().max() <= w_float.abs().amax(1).max() / 127 * 0.51
    x = torch.randn(m, k, generator=g)
    got = quant_linear(x, w, threads=2)
    ref = reference(x, ref_w, w.kb, per_row=True)
    assert (got.double() - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()


@pytest.mark.parametrize("isa", ISAS)
def test_bf16_activations_bias_and_output(isa):
    w, ref_w = quantized("Q4_1", 40, 64, isa)
    x = torch.randn(5, 64).bfloat16()
    bias = torch.randn(40).bfloat16()
    got = quant_linear(x, w, bias, threads=2)
    assert got.dtype == torch.bfloat16
    ref = reference(x, ref_w, w.kb, per_row=False) + bias.double()
    assert (got.double() - ref).abs().max().item() <= 1e-2 * ref.abs().max().item()  # bf16 output


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_0", "Q4_1", "Q4_K"])
def test_embedding_rows_are_the_files_rows(type_name):
    """A tied model's embedding reads rows of the packed LM head: exactly gguf's dequantize."""
    n, k = 37, 256
    raw = gguf_weight(type_name, n, k)
    kind, q, d, m = decode(raw, type_name, n, k)
    ids = torch.tensor([0, 36, 5, 16, 5])
    rows = dequantize_rows(kind, pack(kind, q, d, m), k, ids, torch.float32)
    ref = torch.from_numpy(dequantize(raw, GGMLQuantizationType[type_name]).reshape(n, k))[ids]
    tol = 2e-3 * ref.abs().max().item() if type_name == "Q4_K" else 0  # fp16-rounded scales
    assert (rows - ref).abs().max().item() <= tol


def test_avx2_path_from_a_build_without_avx512(tmp_path):
    """gemm_quant.c compiled for an AVX2-only CPU (Zen 3: AVX-512 off) has the scalar and AVX2
    paths only, and its AVX2 path gives the scalar reference's numbers."""
    src = os.path.join(os.path.dirname(kvflow.csrc.__file__), "gemm_quant.c")
    so = tmp_path / "gemm_quant_avx2.so"
    subprocess.run(["cc", "-O3", "-march=x86-64-v3", "-mno-avx512f", "-shared", "-fPIC", "-std=c11",
                    src, "-o", str(so), "-lm"], check=True, capture_output=True)
    lib = ctypes.CDLL(str(so))
    lib.gemm_quant_isas.restype = ctypes.c_int64
    assert lib.gemm_quant_isas() == 0b011  # scalar + AVX2, no VNNI
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.gemm_quant_panels.argtypes = [ptr, ptr, ptr, i64, i64, ptr, i64, i64, ptr, ptr, i64, i64,
                                      i64, i64, i64]
    for type_name in ("Q4_1", "Q8_0"):
        w, _ = quantized(type_name, 40, 256, "scalar")
        x = torch.randn(7, 256)
        qx, dx, dxs = quantize_activations(x, w.kb, False, 1)
        outs = []
        for isa in (0, 1):
            out = torch.zeros(7, 40)
            lib.gemm_quant_panels(qx.data_ptr(), dx.data_ptr(), dxs.data_ptr(), w.kb, 7,
                                  w.packed.data_ptr(), int(w.kind == "q8"), isa, None,
                                  out.data_ptr(), 40, 40, 0, 0, 3)
            outs.append(out)
        torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(outs[1], quant_linear(x, w), rtol=1e-5, atol=1e-5)


def test_this_machine_builds_every_path_its_cpu_has():
    from kvflow.model.cpu_features import cpu_features

    flags = cpu_features().flags
    assert "scalar" in ISAS
    assert ("avx2" in ISAS) == ({"avx2", "fma", "f16c"} <= flags)
    assert ("avx512-vnni" in ISAS) == ({"avx512_vnni", "avx512bw", "avx512f"} <= flags)
