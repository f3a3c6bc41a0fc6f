"""The MXFP4 GEMM (kvflow/csrc/gemm_mxfp4.c) against dequantise-then-matmul, on each
instruction set this machine has (the scalar reference, AVX2, AVX-512 VNNI) and the AVX2 path
from a build with AVX-512 switched off; and the two byte orders MXFP4 comes in (Hugging Face's
blocks, GGUF's) read as their own dequantisers read them."""
from __future__ import annotations

import ctypes
import os
import subprocess

import numpy as np
import pytest
import torch

import kvflow.csrc
from kvflow.model.quant.mxfp4 import dequantize, gguf_codes, hf_codes, hf_expert, mxfp4_weight
from kvflow.model.quant.packing import RECORD_BYTES
from kvflow.model.quant.qlinear import available_isas, quant_linear, quantize_activations

ISAS = available_isas()


def random_mxfp4(n: int, k: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Every code, and exponents around gpt-oss's (2^-10 .. 2^2), a few near the subnormals."""
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 16, (n, k), dtype=np.uint8)
    e8m0 = rng.integers(117, 130, (n, k // 32), dtype=np.uint8)
    e8m0[0, 0] = 1  # 2^-126: the kernels' scale takes the subnormal branch's neighbour exactly
    return codes, e8m0


def reference(x: torch.Tensor, w: torch.Tensor, kb: int) -> torch.Tensor:
    """The dequantised weights times the activations as the kernel quantizes them, in float64."""
    qx, dx, _ = quantize_activations(x, kb, False, 1)
    xq = (qx.double().view(x.shape[0], kb, 32) * dx.double()[..., None]).reshape(x.shape[0], -1)
    return xq @ w.double().T


@pytest.mark.parametrize("isa", ISAS)
# N: whole panels and a partial last one; M: decode, a partial tile of rows, a prefill split by rows
@pytest.mark.parametrize("m,n,k", [(1, 72, 256), (7, 40, 96), (45, 48, 256)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_gemm_matches_dequantise_then_matmul(isa, m, n, k, dtype):
    codes, e8m0 = random_mxfp4(n, k)
    w = mxfp4_weight(codes, e8m0, isa)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
    bias = torch.randn(n)
    got = quant_linear(x, w, bias, threads=2 if m > 1 else 1)
    want = reference(x, dequantize(codes, e8m0), w.kb) + bias.double()
    assert got.dtype == dtype and got.shape == (m, n)
    tol = 1e-5 if dtype == torch.float32 else 8e-3
    err = (got.double() - want).abs().max().item() / want.abs().max().item()
    assert err < tol, (isa, err)


def test_paths_agree_with_the_scalar_reference():
    """Integer dot products are exact in every path, the float sums in one order: the vector
    paths give the scalar reference's numbers within float rounding."""
    codes, e8m0 = random_mxfp4(40, 320, seed=3)
    x = torch.randn(5, 320)
    outs = [quant_linear(x, mxfp4_weight(codes, e8m0, isa), threads=1) for isa in ISAS]
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], rtol=1e-6, atol=1e-6)


def test_packed_weight_is_the_checkpoints_size():
    """4.25 bits a weight: the panels hold the codes and exponents and nothing else."""
    codes, e8m0 = random_mxfp4(64, 2880)
    w = mxfp4_weight(codes, e8m0, "scalar")
    assert w.nbytes == 64 * 2880 // 2 + 64 * 2880 // 32 == 64 // 16 * 90 * RECORD_BYTES["mxfp4"]


def test_avx2_path_from_a_build_without_avx512(tmp_path):
    """gemm_mxfp4.c compiled for an AVX2-only CPU (AVX-512 off) has the scalar and AVX2 paths
    only, and its AVX2 path gives the scalar reference's numbers."""
    src = os.path.join(os.path.dirname(kvflow.csrc.__file__), "gemm_mxfp4.c")
    so = tmp_path / "gemm_mxfp4_avx2.so"
    subprocess.run(["cc", "-O3", "-march=x86-64-v3", "-mno-avx512f", "-shared", "-fPIC", "-std=c11",
                    src, "-o", str(so), "-lm"], check=True, capture_output=True)
    lib = ctypes.CDLL(str(so))
    lib.gemm_mxfp4_isas.restype = ctypes.c_int64
    assert lib.gemm_mxfp4_isas() == 0b011
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.gemm_mxfp4_panels.argtypes = [ptr, ptr, i64, i64, ptr, i64, ptr, ptr, i64, i64, i64, i64, i64]
    n, k = 40, 96
    codes, e8m0 = random_mxfp4(n, k, seed=5)
    w = mxfp4_weight(codes, e8m0, "scalar")
    for m in (1, 6):
        x = torch.randn(m, k)
        qx, dx, _ = quantize_activations(x, w.kb, False, 1)
        outs = []
        for isa in (0, 1):
            out = torch.zeros(m, n)
            lib.gemm_mxfp4_panels(qx.data_ptr(), dx.data_ptr(), w.kb, m, w.packed.data_ptr(), isa,
                                  None, out.data_ptr(), n, n, 0, 0, 3)
            outs.append(out)
        torch.testing.assert_close(outs[1], outs[0], rtol=1e-6, atol=1e-6)
        want = reference(x, dequantize(codes, e8m0), w.kb)
        assert (outs[1].double() - want).abs().max() < 1e-5 * want.abs().max()


def test_hf_blocks_read_as_transformers_dequantises_them():
    """HF's blocks and scales (gate and up rows interleaved) -> kvflow's [gate; up] rows equal
    transformers' convert_moe_packed_tensors, regrouped."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    rng = np.random.default_rng(1)
    e, rows, kb = 2, 8, 3
    blocks = torch.from_numpy(rng.integers(0, 256, (e, rows, kb, 16), dtype=np.uint8))
    scales = torch.from_numpy(rng.integers(118, 130, (e, rows, kb), dtype=np.uint8))
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, K, rows]
    for i in range(e):
        codes, e8m0 = hf_expert(blocks[i].numpy(), scales[i].numpy(), gate_up=True)
        want = torch.cat([theirs[i][:, 0::2], theirs[i][:, 1::2]], dim=1).T
        assert torch.equal(dequantize(codes, e8m0), want)
    codes = hf_codes(blocks[0].numpy())
    assert torch.equal(dequantize(codes, scales[0].numpy()), theirs[0].T)


def test_gguf_blocks_read_as_gguf_py_dequantises_them():
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize, quantize

    w = np.random.default_rng(2).standard_normal((6, 128)).astype(np.float32)
    raw = quantize(w, GGMLQuantizationType.MXFP4)
    codes, e8m0 = gguf_codes(raw, 6, 128)
    want = gguf_dequantize(raw, GGMLQuantizationType.MXFP4).reshape(6, 128)
    assert torch.equal(dequantize(codes, e8m0), torch.from_numpy(want))
