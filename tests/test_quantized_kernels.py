"""The quantized GEMM (kvflow/csrc/gemm_quant.c, gemm_q6.c) against dequantise-then-matmul: every
GGUF format kvflow serves natively (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K) and one it requantizes (Q5_K),
int8 W8A8, on each instruction set this machine has (the scalar reference, AVX2, AVX-512
VNNI), plus the AVX2 path from a build with AVX-512 switched off. The int8 path is forced
(wide_rows=NEVER) where the test checks its numbers; the widened path (gemm_quant_wide.c) has
its own tests at the end."""
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
from kvflow.checkpoint.gguf_blocks import decode
from kvflow.model.quant.int8 import int8_from_channels, quantize_int8
from kvflow.model.quant.packing import dequantize_rows, pack
from kvflow.model.quant.qlinear import (KIND_CODES, NEVER, QuantizedWeight, available_isas,
                                        quant_linear, quantize_activations)

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
# to the largest output): the native formats are exact but for float rounding; Q5_K is
# requantized to 8 bits
FORMATS = [("Q8_0", 1e-5), ("Q4_0", 1e-5), ("Q4_1", 1e-5), ("Q4_K", 1e-5), ("Q5_K", 1.5e-2),
           ("Q6_K", 1e-5)]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("type_name,tol", FORMATS)
# N: whole panels of 16 and a partial last one; M: decode rows, a partial tile, a prefill
@pytest.mark.parametrize("m,n,k", [(1, 72, 256), (7, 40, 512), (64, 48, 256), (2048, 24, 256)])
def test_gguf_formats_match_dequantise_then_matmul(isa, type_name, tol, m, n, k):
    w, ref_w = quantized(type_name, n, k, isa)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    threads = 2 if m in (7, 2048) else 1  # split by panels (7) and by rows (2048)
    got = quant_linear(x, w, threads=threads, wide_rows=NEVER)
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
    got = quant_linear(x, w, threads=2, wide_rows=NEVER)
    ref = reference(x, ref_w, w.kb, per_row=True)
    assert (got.double() - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()


def checkpoint_int8(n: int, k: int, isa: str, seed: int = 0) -> tuple[QuantizedWeight, torch.Tensor]:
    """A compressed-tensors-style weight: int8 values over the whole -128..127 range (every
    row has -128 and 127 in it), one scale per channel; and its floats."""
    g = np.random.default_rng(seed)
    q = g.integers(-128, 128, size=(n, k)).astype(np.int8)
    q[:, 0], q[:, -1] = -128, 127
    scale = (g.random(n) * 0.02 + 1e-3).astype(np.float16).astype(np.float32)
    w = int8_from_channels(q, scale, isa, source="compressed-tensors")
    return w, torch.from_numpy(q.astype(np.float32) * scale[:, None])


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("m,n,k", [(1, 33, 96), (7, 40, 200), (64, 16, 256)])
def test_checkpoint_int8_with_minus_128_matches_dequantise_then_matmul(isa, m, n, k):
    """A checkpoint's own int8 values (down to -128, which kvflow's own quantizers never write)
    are read back exactly and multiplied exactly on every path."""
    w, ref_w = checkpoint_int8(n, k, isa)
    assert torch.equal(dequantize_rows("q8", w.packed, w.kb * 32, torch.arange(n), torch.float32)[:, :k], ref_w)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)) * 3
    got = quant_linear(x, w, threads=2, wide_rows=NEVER)
    ref = reference(x, ref_w, w.kb, per_row=True)
    assert (got.double() - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_0", "Q4_1"])
@pytest.mark.parametrize("k", [32, 96, 1024])
def test_one_row_with_an_odd_number_of_blocks(isa, type_name, k):
    """The decode kernel (M = 1) takes blocks two at a time: an odd count leaves one over."""
    w, ref_w = quantized(type_name, 56, k, isa)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(k))
    got = quant_linear(x, w, threads=2)
    ref = reference(x, ref_w, w.kb, per_row=False)
    assert (got.double() - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K"])
def test_a_row_alone_gives_the_numbers_it_gives_in_a_batch(isa, type_name):
    """The decode kernel (M = 1) and the tiles sum in the same order: a row's output does not
    depend on the rows beside it, so greedy tokens are the same alone, batched or verifying
    drafts (fp32)."""
    w, _ = quantized(type_name, 56, 96 if type_name not in ("Q4_K", "Q6_K") else 512, isa)
    x = torch.randn(9, w.k, generator=torch.Generator().manual_seed(3))
    batch = quant_linear(x, w, threads=2, wide_rows=NEVER)
    for i in range(x.shape[0]):
        assert torch.equal(quant_linear(x[i:i + 1], w, threads=2, wide_rows=NEVER)[0], batch[i])


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("m", [1, 7, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gate_up_with_silu_mul_fused_is_the_two_steps(isa, m, dtype):
    """silu_mul=True: one call gives silu(gate) * up of the [gate; up] product, exactly what
    the product followed by the SiLU kernel gives."""
    from kvflow.csrc import ops

    w, _ = quantized("Q4_1", 96, 256, isa)
    x = torch.randn(m, 256, generator=torch.Generator().manual_seed(m)).to(dtype)
    fused = quant_linear(x, w, silu_mul=True)
    assert fused.shape == (m, 48) and fused.dtype == dtype
    torch.testing.assert_close(fused, ops.silu_mul(quant_linear(x, w)), rtol=0, atol=0)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("m", [1, 7, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_then_projection_in_one_call_is_the_two_steps(isa, m, dtype):
    """norm_quant_linear: residual += delta in place and the projection of its RMSNorm, exactly
    what ops.add_rms_norm then quant_linear give (with and without a delta, with SiLU * up)."""
    from kvflow.csrc import ops
    from kvflow.model.quant.qlinear import norm_quant_linear

    w, _ = quantized("Q4_0", 64, 256, isa)
    g = torch.Generator().manual_seed(m)
    x, delta = torch.randn(m, 256, generator=g).to(dtype), torch.randn(m, 256, generator=g).to(dtype)
    norm_w = (1 + 0.1 * torch.randn(256, generator=g)).to(dtype)
    bias = torch.randn(64, generator=g)
    for d, silu in ((delta, False), (None, False), (delta, True)):
        r_fused, r_ref = x.clone(), x.clone()
        fused = norm_quant_linear(r_fused, d, norm_w, 1e-5, w, None if silu else bias, silu_mul=silu)
        h = ops.add_rms_norm(r_ref, d, norm_w, 1e-5)
        ref = quant_linear(h, w, silu_mul=True) if silu else quant_linear(h, w, bias)
        torch.testing.assert_close(fused, ref, rtol=0, atol=0)
        torch.testing.assert_close(r_fused, r_ref, rtol=0, atol=0)
        if d is not None:
            assert not torch.equal(r_fused, x)  # the residual took the delta


@pytest.mark.parametrize("isa", ISAS)
def test_bf16_activations_bias_and_output(isa):
    w, ref_w = quantized("Q4_1", 40, 64, isa)
    x = torch.randn(5, 64).bfloat16()
    bias = torch.randn(40).bfloat16()
    got = quant_linear(x, w, bias, threads=2)
    assert got.dtype == torch.bfloat16
    ref = reference(x, ref_w, w.kb, per_row=False) + bias.double()
    assert (got.double() - ref).abs().max().item() <= 1e-2 * ref.abs().max().item()  # bf16 output


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K"])
def test_embedding_rows_are_the_files_rows(type_name):
    """A tied model's embedding reads rows of the packed LM head: exactly gguf's dequantize."""
    n, k = 37, 256
    raw = gguf_weight(type_name, n, k)
    kind, q, d, m = decode(raw, type_name, n, k)
    ids = torch.tensor([0, 36, 5, 16, 5])
    rows = dequantize_rows(kind, pack(kind, q, d, m), k, ids, torch.float32)
    ref = torch.from_numpy(dequantize(raw, GGMLQuantizationType[type_name]).reshape(n, k))[ids]
    assert torch.equal(rows, ref)


@pytest.mark.parametrize("type_name,kind", [("Q8_0", "q8"), ("Q4_0", "q4s"), ("Q4_1", "q4"),
                                            ("Q6_K", "q6"), ("Q4_K", "q4k")])
def test_packed_records_take_the_files_bytes(type_name, kind):
    """Served as stored means read at no more bytes than the file holds: Q8_0's 34 B and
    Q4_0's 18 B per 32 weights (no stored correction or implied min), Q4_1's 20, Q6_K's 210
    per 256 (not widened to 8 bits), Q4_K's 144 per 256 (its 6-bit scales kept packed)."""
    n, k = 64, 512
    raw = gguf_weight(type_name, n, k)
    w, _ = quantized(type_name, n, k, "scalar")
    assert w.kind == kind and w.nbytes == raw.nbytes


def _fused(specs: list[tuple[str, int]], k: int, isa: str) -> tuple[QuantizedWeight, list, torch.Tensor]:
    from kvflow.model.quant.gguf_native import _quantized

    raws = [gguf_weight(t, n, k, seed=i) for i, (t, n) in enumerate(specs)]
    parts = [decode(raw, t, n, k) for raw, (t, n) in zip(raws, specs)]
    w = _quantized(parts, (sum(n for _, n in specs), k), isa, "mixed")
    ref = np.concatenate([dequantize(raw, GGMLQuantizationType[t]).reshape(n, k) for raw, (t, n) in zip(raws, specs)])
    return w, parts, torch.from_numpy(ref.astype(np.float32))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("m", [1, 7, 2048])
def test_a_fused_weight_of_different_kinds_runs_each_part_as_stored(isa, m):
    """A Q4_K_M file's qkv (Q4_K q and k, a Q6_K v) is packed part by part in its own kind
    (no part widened to 8 bits): its bytes are the parts' (and a 64-byte header), and one call
    gives, column for column, what each part alone gives (bias included), for one row, a tile
    and rows split over two threads."""
    k = 512
    w, parts, ref_w = _fused([("Q4_K", 64), ("Q4_K", 32), ("Q6_K", 40)], k, isa)
    alone = [QuantizedWeight(kind=p[0], n=p[1].shape[0], k=k, packed=pack(*p), isa=isa, source="") for p in parts]
    assert w.kind == "parts" and w.nbytes == 128 + sum(-(-a.nbytes // 64) * 64 for a in alone)
    assert torch.equal(dequantize_rows("parts", w.packed, k, torch.arange(136), torch.float32), ref_w)
    g = torch.Generator().manual_seed(m)
    x, bias = torch.randn(m, k, generator=g), torch.randn(136, generator=g)
    got = quant_linear(x, w, bias, threads=2, wide_rows=NEVER)
    n0 = 0
    for a in alone:
        part = quant_linear(x, a, bias[n0:n0 + a.n], threads=2, wide_rows=NEVER)
        assert torch.equal(got[:, n0:n0 + a.n], part)
        n0 += a.n
    ref = reference(x, ref_w, w.kb, per_row=False) + bias.double()
    assert (got.double() - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()


def test_a_fused_weight_of_different_kinds_read_at_any_byte_offset():
    """The packed-weights cache may place a weight at any byte of its buffer: a parts weight's
    header is read there as well (same numbers and rows)."""
    k = 256
    w, _, ref_w = _fused([("Q4_K", 32), ("Q6_K", 24)], k, ISAS[-1])
    buf = torch.zeros(w.nbytes + 3, dtype=torch.uint8)
    buf[3:] = w.packed
    moved = QuantizedWeight(kind="parts", n=w.n, k=k, packed=buf[3:], isa=w.isa, source="")
    x = torch.randn(2, k)
    assert torch.equal(quant_linear(x, moved), quant_linear(x, w))
    assert torch.equal(dequantize_rows("parts", moved.packed, k, torch.arange(w.n), torch.float32), ref_w)


def test_parts_off_whole_panels_are_requantized_to_8_bits():
    """Parts of different kinds whose first part does not fill whole panels of 16 cannot be
    packed apart: they go to q8 (4-bit ones to q4), as close to the file's numbers as 8 bits
    allow."""
    w, _, ref_w = _fused([("Q4_K", 40), ("Q6_K", 24)], 256, "scalar")
    assert w.kind == "q8"
    w4, _, _ = _fused([("Q4_K", 40), ("Q4_0", 24)], 256, "scalar")
    assert w4.kind == "q4"
    x = torch.randn(3, 256)
    ref = reference(x, ref_w, w.kb, per_row=False)
    assert (quant_linear(x, w).double() - ref).abs().max().item() <= 1.5e-2 * ref.abs().max().item()


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
    # M = 1: the decode kernel (Kb = 3: two blocks at a time and one over); M = 7: the tiles;
    # the checkpoint int8 rows have -128 weights
    for type_name, m, k in (("Q4_1", 7, 256), ("Q8_0", 7, 256), ("Q4_0", 7, 256), ("checkpoint int8", 7, 256),
                            ("Q4_1", 1, 96), ("Q8_0", 1, 96), ("Q4_0", 1, 256),
                            ("checkpoint int8", 1, 96)):
        if type_name == "checkpoint int8":
            w, _ = checkpoint_int8(40, k, "scalar")
        else:
            w, _ = quantized(type_name, 40, k, "scalar")
        x = torch.randn(m, k)
        qx, dx, dxs = quantize_activations(x, w.kb, w.per_row, 1)
        outs = []
        for isa in (0, 1):
            out = torch.zeros(m, 40)
            lib.gemm_quant_panels(qx.data_ptr(), dx.data_ptr(), dxs.data_ptr(), w.kb, m,
                                  w.packed.data_ptr(), KIND_CODES[w.kind], isa, None,
                                  out.data_ptr(), 40, 40, 0, 0, 3)
            outs.append(out)
        torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(outs[1], quant_linear(x, w), rtol=1e-5, atol=1e-5)
        if m == 1:  # the decode kernel gives the tiles' numbers (the row inside a batch of 2)
            out2 = torch.zeros(2, 40)
            x2 = torch.cat([x, torch.randn(1, k)])
            qx2, dx2, dxs2 = quantize_activations(x2, w.kb, w.per_row, 1)
            lib.gemm_quant_panels(qx2.data_ptr(), dx2.data_ptr(), dxs2.data_ptr(), w.kb, 2,
                                  w.packed.data_ptr(), KIND_CODES[w.kind], 1, None,
                                  out2.data_ptr(), 40, 40, 0, 0, 3)
            assert torch.equal(out2[0], outs[1][0])


@pytest.mark.parametrize("type_name,name", [("Q6_K", "q6"), ("Q4_K", "q4k")])
@pytest.mark.parametrize("flags,isas", [(["-march=x86-64-v3", "-mno-avx512f"], (0, 1)),
                                        (["-march=x86-64"], (0,))], ids=["avx2", "scalar"])
def test_k_quant_paths_from_builds_without_avx512(tmp_path, type_name, name, flags, isas):
    """gemm_q6.c and gemm_q4k.c compiled for an AVX2-only CPU (scalar and AVX2 paths) and for a
    plain x86-64 (scalar only): each path gives the dequantised GGUF weights' products, as the
    VNNI build's path does, for one row (decode) and a partial tile of rows, with a bias and
    bf16 output."""
    src = os.path.dirname(kvflow.csrc.__file__)
    so = tmp_path / f"{name}.so"
    subprocess.run(["cc", "-O3", *flags, "-shared", "-fPIC", "-std=c11", os.path.join(src, f"gemm_{name}.c"),
                    "-o", str(so), "-lm"], check=True, capture_output=True)
    lib = ctypes.CDLL(str(so))
    getattr(lib, f"gemm_{name}_isas").restype = ctypes.c_int64
    assert getattr(lib, f"gemm_{name}_isas")() == sum(1 << i for i in isas)
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    panels = getattr(lib, f"gemm_{name}_panels")
    panels.argtypes = [ptr] * (3 if name == "q4k" else 2) + [i64, i64, ptr, i64, ptr, ptr, i64, i64, i64, i64, i64]
    n, k = 40, 512
    w, ref_w = quantized(type_name, n, k, "scalar")
    bias = torch.randn(n)
    for m in (1, 6):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        qx, dx, dxs = quantize_activations(x, w.kb, False, 1)
        ref = reference(x, ref_w, w.kb, per_row=False) + bias.double()
        act = [qx.data_ptr(), dx.data_ptr()] + ([dxs.data_ptr()] if name == "q4k" else [])
        for isa in isas:
            for bf16 in (0, 1):
                out = torch.zeros(m, n, dtype=torch.bfloat16 if bf16 else torch.float32)
                panels(*act, w.kb, m, w.packed.data_ptr(), isa, bias.data_ptr(), out.data_ptr(), n, n,
                       bf16, 0, 3)
                tol = 1e-2 if bf16 else 1e-5
                assert (out.double() - ref).abs().max().item() <= tol * ref.abs().max().item(), (m, isa, bf16)


def test_this_machine_builds_every_path_its_cpu_has():
    from kvflow.model.cpu_features import cpu_features

    flags = cpu_features().flags
    assert "scalar" in ISAS
    assert ("avx2" in ISAS) == ({"avx2", "fma", "f16c"} <= flags)
    assert ("avx512-vnni" in ISAS) == ({"avx512_vnni", "avx512bw", "avx512f"} <= flags)


def _build(tmp_path, name: str, flags: list[str]) -> ctypes.CDLL:
    src = os.path.dirname(kvflow.csrc.__file__)
    so = tmp_path / f"{name}.so"
    subprocess.run(["cc", "-O3", *flags, "-shared", "-fPIC", "-std=c11",
                    os.path.join(src, "gemm_quant.c"), os.path.join(src, "gemm_quant_wide.c"),
                    os.path.join(src, "gemm_bf16.c"), "-o", str(so), "-lm"],
                   check=True, capture_output=True)
    return ctypes.CDLL(str(so))


def _quantize_with(lib, x: torch.Tensor, kb: int, per_row: bool = False) -> tuple[torch.Tensor, ...]:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.quantize_rows_q8.argtypes = [ptr, i64, i64, i64, i64, i64, ptr, ptr, ptr, i64, i64]
    m, k = x.shape
    qx = torch.empty(m, kb * 32, dtype=torch.int8)
    dx, dxs = torch.empty(m, kb), torch.empty(m, kb)
    lib.quantize_rows_q8(x.data_ptr(), k, k, kb, int(x.dtype == torch.bfloat16), int(per_row), qx.data_ptr(),
                         dx.data_ptr(), dxs.data_ptr(), 0, m)
    return qx, dx, dxs


@pytest.mark.parametrize("per_row", [False, True], ids=["per-block", "per-row"])
def test_vector_activation_quantization_gives_the_scalar_bytes(tmp_path, per_row):
    """quantize_rows_q8's AVX-512 and AVX2 block code (whole blocks) and its scalar code (every
    block, in a build without AVX2) round the same products the same way: identical bytes,
    scales and sums, for bf16 and fp32 rows, a partial last block and an all-zero block, with
    per-block scales (GGUF) and the row's scale (int8 W8A8: its largest |x| found in vector
    code too; a row of all zeros, and an outlier in the last value, past the AVX-512 loop's
    last whole 16)."""
    scalar = _build(tmp_path, "scalar", ["-march=x86-64"])
    avx2 = _build(tmp_path, "avx2", ["-march=x86-64-v3", "-mno-avx512f"])
    g = torch.Generator().manual_seed(3)
    for dtype in (torch.float32, torch.bfloat16):
        x = (torch.randn(9, 200, generator=g) * torch.rand(9, 1, generator=g) * 4).to(dtype)
        x[0, :32] = 0
        x[1, 40] = 1e4  # one outlier: the rest of its block rounds to small values
        x[2] = 0
        x[3, 199] = -300.0  # in the AVX-512 row maximum's scalar tail
        ref = _quantize_with(scalar, x, 7, per_row)
        for got in (_quantize_with(avx2, x, 7, per_row), quantize_activations(x, 7, per_row, 1)):
            for a, b in zip(got, ref):
                assert torch.equal(a, b)


def wide_reference(x: torch.Tensor, ref_w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The widened path's numbers: the float activations times the dequantised weights (bf16
    activations: the weights rounded to bf16 first, as the bf16 path widens them)."""
    w = ref_w.bfloat16() if x.dtype == torch.bfloat16 else ref_w
    out = x.double() @ w.double().T
    return out if bias is None else out + bias.double()


WIDE_ISAS = [isa for isa in ISAS if isa != "scalar"]


@pytest.mark.parametrize("isa", WIDE_ISAS)
@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_1", "Q6_K"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
# N: a partial last panel of 16 and a partial group of 64 (and whole groups)
@pytest.mark.parametrize("m,n,k", [(70, 72, 256), (9, 200, 64)])
def test_widened_path_matches_dequantise_then_matmul(isa, type_name, dtype, m, n, k):
    """gemm_quant_wide.c: on AVX-512 (bf16 activations: the bf16 panels and vdpbf16ps; fp32:
    the FMA path) and on AVX2 (the FMA path), with a bias, split over two threads. Q6_K records
    widen on the bf16 path only (elsewhere the call stays on the int8 GEMM)."""
    if type_name == "Q6_K":
        if not (isa == "avx512-vnni" and dtype == torch.bfloat16):
            return
        k = 256 * -(-k // 256)  # whole super-blocks
    w, ref_w = quantized(type_name, n, k, isa)
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=g).to(dtype)
    bias = torch.randn(n, generator=g)
    got = quant_linear(x, w, bias, threads=2, wide_rows=1)
    ref = wide_reference(x, ref_w, bias.bfloat16().float() if dtype == torch.bfloat16 and isa == "avx512-vnni" else bias)
    scale = ref.abs().max().item()
    tol = 1e-5 if dtype == torch.float32 else 8e-3  # bf16: the output's rounding
    assert (got.double() - ref).abs().max().item() <= tol * scale
    # the int8 path on the same call differs only by the activations' 8-bit rounding
    int8 = quant_linear(x, w, bias, threads=2, wide_rows=NEVER)
    assert (got.double() - int8.double()).abs().max().item() <= 0.03 * scale


@pytest.mark.parametrize("isa", WIDE_ISAS)
@pytest.mark.parametrize("k", [99, 100])
def test_widened_int8_w8a8_with_k_off_the_block(isa, k):
    """int8 W8A8 weights (K padded to whole blocks of 32 with zeros) widened: K odd (the bf16
    path takes pairs, so the FMA path serves it) and K even but not whole blocks."""
    g = torch.Generator().manual_seed(k)
    w_float = torch.randn(40, k, generator=g)
    w = quantize_int8(w_float, isa)
    ref_w = dequantize_rows("q8", w.packed, w.kb * 32, torch.arange(40), torch.float32)[:, :k]
    x = torch.randn(66, k, generator=g).bfloat16()
    got = quant_linear(x, w, threads=2, wide_rows=1)
    ref = wide_reference(x, ref_w, None)
    assert (got.double() - ref).abs().max().item() <= 8e-3 * ref.abs().max().item()


@pytest.mark.parametrize("isa", WIDE_ISAS)
def test_which_rows_take_the_widened_path(isa):
    """8-bit weights are widened only where the widened path is the bf16 one (AVX512-BF16, bf16
    activations): from 64 rows, with per-block activation scales (GGUF Q8_0) and per-row ones
    (int8 W8A8), whatever the number of outputs. Never with fp32 activations or on AVX2,
    where the widened path is the fp32-FMA one and the int8 GEMM beat it at every row count
    measured; never 4-bit weights. 6-bit weights (Q6_K) as 8-bit ones, on the bf16 path only."""
    g = torch.Generator().manual_seed(0)
    weights = {("Q8_0", 48): quantized("Q8_0", 48, 128, isa)[0],
               ("Q4_1", 48): quantized("Q4_1", 48, 128, isa)[0],
               ("Q6_K", 48): quantized("Q6_K", 48, 256, isa)[0]}
    for n in (48, 1040, 4112):
        weights["int8", n] = quantize_int8(torch.randn(n, 128, generator=g), isa)
    widen_from = {("Q8_0", 48): 64, ("Q6_K", 48): 64, ("int8", 48): 64, ("int8", 1040): 64,
                  ("int8", 4112): 64}
    for (name, n), w in weights.items():
        for dtype in (torch.bfloat16, torch.float32):
            vnni_bf16 = isa == "avx512-vnni" and dtype == torch.bfloat16
            rows = widen_from.get((name, n)) if vnni_bf16 else None
            for m in (15, 16, 31, 32, 63, 64):
                x = torch.randn(m, w.k, generator=g).to(dtype)
                int8 = quant_linear(x, w, threads=1, wide_rows=NEVER)
                wide = quant_linear(x, w, threads=1, wide_rows=1)
                if name == "Q6_K" and not vnni_bf16:  # no widened path: the int8 GEMM's numbers
                    assert torch.equal(int8, wide)
                else:
                    assert not torch.equal(int8, wide)  # the two paths tell themselves apart
                want = wide if rows is not None and m >= rows else int8
                assert torch.equal(quant_linear(x, w, threads=1), want), (name, n, dtype, m)


def test_widened_avx2_path_from_a_build_without_avx512(tmp_path):
    """gemm_quant_wide.c compiled for an AVX2-only CPU has the FMA path only, and gives the
    dequantised weights' products through pool-free calls over every group of 64 outputs."""
    lib = _build(tmp_path, "wide_avx2", ["-march=x86-64-v3", "-mno-avx512f"])
    lib.gemm_quant_wide_isas.restype = ctypes.c_int64
    assert lib.gemm_quant_wide_isas() == 0b010
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.gemm_quant_wide.restype = i64
    lib.gemm_quant_wide.argtypes = [ptr, i64, i64, i64, i64, i64, ptr, i64, i64, ptr, ptr, i64, i64,
                                    i64, i64, i64]
    m, n, k = 13, 100, 96
    for type_name in ("Q4_1", "Q8_0"):
        w, ref_w = quantized(type_name, n, k, "avx2")
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(m, k).to(dtype)
            out = torch.zeros(m, n, dtype=dtype)
            assert lib.gemm_quant_wide(x.data_ptr(), k, k, w.kb, int(dtype == torch.bfloat16), m,
                                       w.packed.data_ptr(), KIND_CODES[w.kind], 1, None,
                                       out.data_ptr(), n, n, int(dtype == torch.bfloat16), 0, 2) == 0
            ref = x.double() @ ref_w.double().T
            tol = 1e-5 if dtype == torch.float32 else 8e-3
            assert (out.double() - ref).abs().max().item() <= tol * ref.abs().max().item()
