"""One-byte KV caches (`kv_cache_dtype` fp8 and int8): how they are stored (kv_layout.py), the C
writer that quantizes into them, the decode kernel that reads them (paged_attention_quant.c) on
each of its paths (AVX-512, AVX2 from this build and from a build without AVX-512, scalar)
against PyTorch over the same quantized values, the kernel choice, the pool's sizing and the KV
transfer of their blocks."""
from __future__ import annotations

import ctypes
import os
import subprocess

import numpy as np
import pytest
import torch

import kvflow.csrc
from kvflow.config import CacheConfig
from kvflow.csrc import library
from kvflow.engine.kv_sizing import num_kv_blocks
from kvflow.kv_transfer.blocks import (KVShard, PagedKV, gather_into, scatter, scatter_tokens,
                                       transfer_bytes)
from kvflow import attention as A
from kvflow.attention import c_kernels
from kvflow.model.arch import LlamaArchConfig
from kvflow.model.cpu_features import CpuFeatures, cpu_features
from kvflow.model.kv_cache import allocate_kv_caches
from kvflow.model.kernels import KernelOptions, select_kernels
from kvflow.attention.kv_layout import (FP8, INT8_SCALE_BYTES, cache_geometry, cache_shape,
                                        fp8_rotated, hadamard_rotate, int8_scales, quantize_fp8,
                                        quantize_int8, read_rows, read_stored_rows, write_rows,
                                        write_stored_rows)

pytestmark = pytest.mark.skipif(library() is None, reason="no C compiler")
torch.set_num_threads(1)

ONE_BYTE = [torch.int8, FP8]
AVX2 = CpuFeatures.from_names("avx2", "fma", "f16c")
SPR = CpuFeatures.from_names("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_bf16")


def _isas_here() -> list[str]:
    f = cpu_features()
    runs = {"scalar": True, "avx2": {"avx2", "fma", "f16c"} <= f.flags,
            "avx512": {"avx512f", "avx512bw"} <= f.flags,
            "avx512-bf16": {"avx512f", "avx512bw", "avx512_bf16"} <= f.flags}
    return [i for i in A.q8_isas() if runs[i]]


def _garbage_cache(num_blocks, block_size, kv_heads, head_dim, dtype, tables, seq_lens, seed=0):
    """A one-byte cache whose every byte is noise (fp8 NaNs, int8 scales NaN) but the sequences'
    own tokens, written through write_rows: a kernel that reads a slot past a sequence's end
    into its sums gives NaN (or a wrong answer)."""
    shape = cache_shape(num_blocks, block_size, kv_heads, head_dim, dtype)
    g = torch.Generator().manual_seed(seed)
    caches = []
    for _ in range(2):
        c = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8).view(dtype)
        if dtype == torch.int8:
            int8_scales(c).fill_(float("nan"))
        else:
            c.view(torch.uint8)[..., ::3] = 0x7F  # e4m3 NaN
        caches.append(c)
    slots = torch.tensor([t[i // block_size] * block_size + i % block_size
                          for t, n in zip(tables, seq_lens) for i in range(int(n))])
    k = torch.randn(len(slots), kv_heads, head_dim, generator=g) * 4
    v = torch.randn(len(slots), kv_heads, head_dim, generator=g)
    write_rows(*caches, k, v, slots)
    return caches


def test_int8_cache_stores_a_scale_per_token_beside_each_tile():
    shape = cache_shape(3, 16, 2, 64, torch.int8)
    assert shape == (3, 2, 16, 64 + INT8_SCALE_BYTES)
    kc, vc = torch.zeros(shape, dtype=torch.int8), torch.zeros(shape, dtype=torch.int8)
    assert cache_geometry(kc) == (16, 2, 64)
    x = torch.randn(5, 2, 64)
    write_rows(kc, vc, x, -x, torch.tensor([16, 17, 18, 19, 20]))
    q, s = quantize_int8(x)
    torch.testing.assert_close(int8_scales(kc)[1, :, :5], s.T)
    assert (int8_scales(kc)[[0, 2]] == 0).all() and (int8_scales(kc)[1, :, 5:] == 0).all()
    k, v = read_rows(kc, vc, torch.tensor([16, 17, 18, 19, 20]))
    torch.testing.assert_close(k, q.float() * s[..., None])
    assert (k - x).abs().max() <= s.max() / 2 + 1e-6  # half a step of each row's own scale


def _sylvester(n: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    return h


@pytest.mark.parametrize("d", [2, 16, 64, 128, 256])
def test_hadamard_rotation_is_orthonormal_and_its_own_inverse(d):
    x = torch.randn(5, 3, d) * 7
    want = (x.double() @ _sylvester(d) / d ** 0.5).float()  # H is symmetric
    torch.testing.assert_close(hadamard_rotate(x), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(hadamard_rotate(hadamard_rotate(x)), x, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(hadamard_rotate(x).norm(dim=-1), x.norm(dim=-1))


@pytest.mark.parametrize("head_dim,rotated", [(64, True), (128, True), (48, False), (24, False)])
def test_fp8_stores_rows_rotated_where_head_dim_is_a_power_of_two(head_dim, rotated):
    """The fp8 bytes are e4m3 of H x / sqrt(D) (power-of-two D; others as they are), written
    by the C writer as by write_rows, and read back in the model's own basis."""
    assert fp8_rotated(head_dim) == rotated
    kc, vc = (torch.zeros(cache_shape(2, 16, 2, head_dim, FP8), dtype=FP8) for _ in range(2))
    g = torch.Generator().manual_seed(head_dim)
    k, v = torch.randn(5, 2, head_dim, generator=g) * 3, torch.randn(5, 2, head_dim, generator=g)
    slots = torch.tensor([3, 17, 4, 30, 0])
    A.write_kv_with_kernel(kc, vc, k, v, slots)
    sk, sv = read_stored_rows(kc, vc, slots)
    for stored, x in ((sk, k), (sv, v)):
        want = quantize_fp8(hadamard_rotate(x) if rotated else x)
        assert torch.equal(stored.view(torch.uint8), want.view(torch.uint8))
    for back, x in zip(read_rows(kc, vc, slots), (k, v)):  # the model's basis again,
        # within e4m3's rounding: at most 2^-4 of each stored value, so of a row's norm (an
        # orthonormal rotation keeps both); typically ~2%
        err = (back - x).norm(dim=-1) / x.norm(dim=-1)
        assert err.max() <= 2 ** -4 and err.median() < 0.035


def test_rotation_shrinks_fp8_score_error_on_keys_with_outlier_channels():
    """Keys as models make them (a few channels ~20x the rest, after RoPE): e4m3's 3-bit
    mantissa rounds those channels' large products coarsely; rotated, the error spreads over
    64 small ones and the scores q . k come out closer."""
    g = torch.Generator().manual_seed(0)
    d, n = 64, 512
    k = torch.randn(n, 1, d, generator=g)
    k[..., [5, 37]] *= 20
    q = torch.randn(d, generator=g)
    q[[5, 37]] *= 3
    exact = k[:, 0] @ q
    err = {}
    for name, head_dim_keys in (("plain", k), ("rotated", k)):
        if name == "plain":
            back = quantize_fp8(head_dim_keys).float()
        else:
            kc, vc = (torch.zeros(cache_shape(n // 16, 16, 1, d, FP8), dtype=FP8) for _ in range(2))
            write_rows(kc, vc, head_dim_keys, head_dim_keys, torch.arange(n))
            back = read_rows(kc, vc, torch.arange(n))[0]
        err[name] = (back[:, 0] @ q - exact).pow(2).mean().sqrt().item()
    assert err["rotated"] < 0.5 * err["plain"], err


@pytest.mark.parametrize("dtype", ONE_BYTE)
def test_written_tokens_stay_exact_as_their_block_fills(dtype):
    """A token's stored bytes never change when later tokens of its block are written (int8:
    each keeps its own scale; fp8: one fixed scale), so prefix-cached and transferred blocks
    hold what was computed."""
    kc, vc = (torch.zeros(cache_shape(2, 16, 2, 32, dtype), dtype=dtype) for _ in range(2))
    write_rows(kc, vc, torch.randn(3, 2, 32) * 0.01, torch.randn(3, 2, 32), torch.arange(3))
    before = kc.view(torch.uint8).clone(), vc.view(torch.uint8).clone()
    big = torch.randn(13, 2, 32) * 300  # much larger values land in the same block
    write_rows(kc, vc, big, big, torch.arange(3, 16))
    k0, v0 = read_rows(kc, vc, torch.arange(3))
    b0 = read_rows(*(t.view(dtype) for t in before), torch.arange(3))
    assert torch.equal(k0, b0[0]) and torch.equal(v0, b0[1])


@pytest.mark.parametrize("dtype", ONE_BYTE)
@pytest.mark.parametrize("src", [torch.float32, torch.bfloat16])
def test_c_writer_stores_the_bytes_write_rows_stores(dtype, src):
    t, kvh, d, bs = 11, 2, 64, 16
    qkv = (torch.randn(t, 3 * kvh * d) * 60).to(src)
    qkv[0, :6] = torch.tensor([0.0, -0.0, 1e-3, 2.0 ** -10, 449.0, -1e4]).to(src)
    qkv[1, kvh * d:2 * kvh * d] = 0  # an all-zero row: scale 0
    k = qkv[:, :kvh * d].view(t, kvh, d)  # strided views, as in the model
    v = qkv[:, kvh * d:2 * kvh * d].view(t, kvh, d)
    slots = torch.from_numpy(np.random.default_rng(1).permutation(4 * bs)[:t].copy())
    got = [torch.zeros(cache_shape(4, bs, kvh, d, dtype), dtype=dtype) for _ in range(2)]
    want = [torch.zeros_like(got[0]) for _ in range(2)]
    A.write_kv_with_kernel(*got, k, v, slots)
    write_rows(*want, k, v, slots)
    for g, w in zip(got, want):
        assert torch.equal(g.view(torch.uint8), w.view(torch.uint8))


@pytest.mark.parametrize("dtype", ONE_BYTE)
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
# 64 and 128: the vector paths (16-wide and 8-wide); 40: D % 16 != 0, the scalar row
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(6, 2, 64), (4, 4, 128), (7, 1, 40)])
# 16: every path; 8: AVX2 (the AVX-512 row takes 16 keys a tile); 4: scalar
@pytest.mark.parametrize("block_size", [16, 8, 4])
@pytest.mark.parametrize("window", [0, 11])
def test_decode_kernel_matches_torch_on_every_path(dtype, q_dtype, heads, kv_heads, head_dim,
                                                   block_size, window, monkeypatch):
    monkeypatch.setattr(c_kernels, "MIN_PARALLEL_HEAD_KEYS", 0)
    rng = np.random.default_rng(0)
    nb = 48
    seq_lens = np.array([1, 5, 13, 16, 30, 47])
    free = list(rng.permutation(nb))
    tables = [[int(free.pop()) for _ in range(-(-n // block_size) + 1)] for n in seq_lens]
    kc, vc = _garbage_cache(nb, block_size, kv_heads, head_dim, dtype, tables, seq_lens)
    meta = A.build_attention_metadata(np.ones(len(seq_lens), dtype=np.int64), seq_lens, tables,
                                      block_size, sliding_window=window or None)
    q = torch.randn(len(seq_lens), heads, head_dim).to(q_dtype)
    scale = head_dim ** -0.5
    want = torch.empty(q.shape)
    for i, n in enumerate(seq_lens):
        keys = np.arange(n)
        if window:
            keys = keys[keys >= n - window]
        slots = torch.tensor([tables[i][t // block_size] * block_size + t % block_size for t in keys])
        k, v = (x.repeat_interleave(heads // kv_heads, 1) for x in read_rows(kc, vc, slots))
        p = torch.einsum("hd,thd->ht", q[i].float(), k).mul(scale).softmax(-1)
        want[i] = torch.einsum("ht,thd->hd", p, v)
    for isa in _isas_here():
        got = torch.full(q.shape, float("nan"))
        assert A.decode_with_kernel(q, kc, vc, meta, scale, got, q8_isa=isa)
        if isa == "avx512-bf16" and dtype == FP8:
            # its query and weights rounded to bf16 (2^-9), as the bf16 cache's row: scores of
            # keys this large (|k| ~ 4 sqrt(D)) move by a few hundredths (int8 runs AVX-512's row)
            err = (got - want).abs()
            assert err.max() < 3e-2 and err.mean() < 2e-3, (float(err.max()), float(err.mean()))
            continue
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5, msg=lambda m: f"{isa}: {m}")
    # bf16 out: each value rounded once (on the path this CPU takes: its bf16 query and weights)
    got = torch.empty(q.shape, dtype=torch.bfloat16)
    here = A.best_q8_isa(cpu_features(), dtype)
    assert A.decode_with_kernel(q, kc, vc, meta, scale, got, q8_isa=here)
    tol = 3e-2 if here == "avx512-bf16" else 1e-2
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


@pytest.mark.skipif("avx512-bf16" not in _isas_here(), reason="no AVX512-BF16 here")
def test_bf16_row_reads_every_fp8_code_exactly():
    """fp8's AVX512-BF16 row looks e4m3 up as bf16: with one key per sequence (its weight
    exactly 1) each output is the stored value itself, for all 256 codes (subnormals, both
    signs, NaN); head_dim 48 is not rotated."""
    d, bs, n = 48, 16, 6
    codes = torch.arange(n * d) % 256  # every code, some twice
    kc, vc = (torch.zeros(cache_shape(n, bs, 1, d, FP8), dtype=FP8) for _ in range(2))
    slots = torch.arange(n) * bs  # token 0 of block i: sequence i
    stored = codes.to(torch.uint8).view(n, 1, d)
    write_stored_rows(kc, vc, torch.zeros_like(stored), stored, slots)  # keys 0: no NaN score
    meta = A.build_attention_metadata(np.ones(n, dtype=np.int64), np.ones(n, dtype=np.int64),
                                      [[i] for i in range(n)], bs)
    got = torch.full((n, 1, d), float("nan"))
    assert A.decode_with_kernel(torch.ones(n, 1, d), kc, vc, meta, 0.125, got, q8_isa="avx512-bf16")
    want = stored.view(FP8).float()
    assert torch.equal(got.isnan(), want.isnan()) and int(want.isnan().sum()) == 2
    assert torch.equal(got.nan_to_num(), want.nan_to_num())


def test_each_path_serves_the_shapes_it_claims():
    lib = library()
    isas = A.q8_isas()
    assert "scalar" in isas
    f = cpu_features()
    assert ("avx512" in isas) == ({"avx512f", "avx512bw", "f16c", "avx2", "fma"} <= f.flags)
    if "avx512" in isas:
        assert lib.paged_decode_q8_serves(2, 64, 16) and not lib.paged_decode_q8_serves(2, 64, 8)
    # fp8's AVX512-BF16 row: built with -march=native where the CPU has AVX512-BF16
    assert ("avx512-bf16" in isas) <= ("avx512" in isas and "avx512_bf16" in f.flags)
    if "avx512-bf16" in isas:
        assert lib.paged_decode_q8_serves(3, 64, 16) and not lib.paged_decode_q8_serves(3, 64, 8)
    if "avx2" in isas:
        assert lib.paged_decode_q8_serves(1, 64, 8) and not lib.paged_decode_q8_serves(1, 40, 8)
    assert lib.paged_decode_q8_serves(0, 40, 4)


def _masked_build(tmp_path, *march):
    """paged_attention_quant.c alone, compiled for another CPU kind."""
    src = os.path.join(os.path.dirname(kvflow.csrc.__file__), "paged_attention_quant.c")
    so = tmp_path / f"q8{''.join(march)}.so"
    subprocess.run(["cc", "-O3", *march, "-fno-math-errno", "-shared", "-fPIC", "-std=c11", src,
                    "-o", str(so), "-lm"], check=True, capture_output=True)
    lib = ctypes.CDLL(str(so))
    lib.hadamard_lanes.restype = ctypes.c_int64
    lib.hadamard_rotate_rows.restype = None
    lib.hadamard_rotate_rows.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]
    return lib


@pytest.mark.parametrize("build", ["native", "avx2", "scalar"])
def test_rotation_gives_the_same_bits_on_every_path(tmp_path, build):
    """The C rotation (AVX-512 16 lanes, AVX2 8, scalar) gives kv_layout.hadamard_rotate's bits."""
    if build == "native":
        lib = library()
        flags = cpu_features().flags
        assert lib.hadamard_lanes() == (16 if "avx512f" in flags else 8 if "avx2" in flags else 0)
    elif build == "avx2":
        if not {"avx2", "fma", "f16c"} <= cpu_features().flags:
            pytest.skip("this CPU runs no AVX2 code")
        lib = _masked_build(tmp_path, "-march=x86-64-v3", "-mno-avx512f")
        assert lib.hadamard_lanes() == 8
    else:
        lib = _masked_build(tmp_path, "-march=x86-64")
        assert lib.hadamard_lanes() == 0
    for d in (2, 8, 16, 32, 64, 128, 256):
        x = torch.randn(7, d) * torch.logspace(-3, 3, 7)[:, None]
        got = x.clone()
        lib.hadamard_rotate_rows(got.data_ptr(), 7, d)
        assert torch.equal(got, hadamard_rotate(x)), d


def _q8_build(tmp_path, *march):
    """paged_attention_quant.c compiled for another CPU kind, its decode entry points typed."""
    lib = _masked_build(tmp_path, *march)
    lib.paged_decode_q8_isas.restype = ctypes.c_int64
    lib.paged_decode_q8_serves.restype = ctypes.c_int64
    lib.paged_decode_q8_serves.argtypes = [ctypes.c_int64] * 3
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.paged_decode_q8.restype = None
    lib.paged_decode_q8.argtypes = [ptr, i64, ptr, ptr, ptr, i64, ptr, ptr, i64, i64, i64, i64,
                                    i64, i64, ctypes.c_float, ptr, i64, i64, i64, i64, i64, i64,
                                    i64]
    return lib


@pytest.mark.parametrize("dtype", ONE_BYTE)
def test_avx2_path_from_a_build_without_avx512(tmp_path, dtype):
    """The AVX2-only build has the scalar and AVX2 paths; asked for AVX-512 (or AVX512-BF16) it
    runs AVX2, and gives what the scalar path gives over the same quantized cache."""
    if not {"avx2", "fma", "f16c"} <= cpu_features().flags:
        pytest.skip("this CPU runs no AVX2 code")
    lib = _q8_build(tmp_path, "-march=x86-64-v3", "-mno-avx512f")  # Zen 3: AVX2, FMA, F16C
    assert lib.paged_decode_q8_isas() == 0b011
    assert lib.paged_decode_q8_serves(1, 64, 16) and not lib.paged_decode_q8_serves(2, 64, 16)
    _check_q8_build(lib, dtype, (1, 2, 3))  # asked for AVX-512 or AVX512-BF16, it runs AVX2


def _check_q8_build(lib, dtype, isas):
    """Each of `isas` asked of `lib` gives what the scalar path gives (2e-5), on a cache whose
    unused bytes are noise."""
    heads, kvh, d, bs = 6, 2, 64, 16
    seq_lens = np.array([3, 16, 41])
    tables = [[4, 0], [2, 7], [1, 5, 6]]
    kc, vc = _garbage_cache(8, bs, kvh, d, dtype, tables, seq_lens, seed=3)
    meta = A.build_attention_metadata(np.ones(3, dtype=np.int64), seq_lens, tables, bs)
    q = torch.randn(3, heads, d)
    want = torch.empty(q.shape)
    assert A.decode_with_kernel(q, kc, vc, meta, 0.125, want, q8_isa="scalar")
    one = int(np.array(1.0, dtype=np.float32).view(np.uint32))
    for isa in isas:
        got = torch.full(q.shape, float("nan"))
        bt = meta.decode_block_tables
        lib.paged_decode_q8(q.data_ptr(), q.stride(0), kc.data_ptr(), vc.data_ptr(), bt.ctypes.data,
                            bt.shape[1], meta.decode_seq_lens.ctypes.data,
                            meta.decode_rows.ctypes.data, 0, 3, heads, kvh, d, bs, 0.125,
                            got.data_ptr(), heads * d, 0, 0, 0, A.Q8_KINDS[dtype], isa, one, one)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", ONE_BYTE)
def test_avx512_path_from_a_build_without_avx512_bf16(tmp_path, dtype):
    """An AVX-512 CPU without AVX512-BF16 (Skylake-X, Ice Lake): no fp8 bf16 row is built, and
    asked for it the kernel runs the AVX-512 row (fp32 products, as exact as the scalar path)."""
    if not {"avx512f", "avx512bw", "avx2", "fma", "f16c"} <= cpu_features().flags:
        pytest.skip("this CPU runs no AVX-512 code")
    lib = _q8_build(tmp_path, "-march=native", "-mno-avx512bf16")
    assert lib.paged_decode_q8_isas() == 0b0111
    assert lib.paged_decode_q8_serves(2, 64, 16) and not lib.paged_decode_q8_serves(3, 64, 16)
    _check_q8_build(lib, dtype, (2, 3))


def test_kernel_choice_follows_the_cpu_and_names_it():
    for kv, tag in ((torch.int8, "int8"), (FP8, "fp8")):
        widest = select_kernels(torch.bfloat16, kv, features=SPR, options=KernelOptions())
        # the prompt kernel where this build has it (it widens one-byte tiles as it gathers)
        prompt = "+c-prompt" if library().paged_prefill_bf16_supported(1, 1, 32, 16) else ""
        # the widest path this build has (a build on an AVX2-only CPU has no AVX-512 one; fp8
        # has its own where the build has AVX512-BF16)
        built = ("avx512-bf16" if kv == FP8 and "avx512-bf16" in A.q8_isas()
                 else "avx512" if "avx512" in A.q8_isas() else "avx2")
        assert widest.names["attention"] == f"c-decode-{tag}-{built}{prompt}"
        zen3 = select_kernels(torch.float32, kv, features=AVX2, options=KernelOptions())
        assert zen3.names["attention"] == f"c-decode-{tag}-avx2"
        plain = select_kernels(torch.float32, kv, features=CpuFeatures.from_names(),
                               options=KernelOptions())
        assert plain.names["attention"] == f"c-decode-{tag}-scalar"
        off = select_kernels(torch.float32, kv, options=KernelOptions(c_kernels=False))
        assert off.names["attention"] == "sdpa"
    # the runner's cache dtype changes attention and the KV write only
    base = select_kernels(torch.bfloat16, features=SPR, options=KernelOptions())
    renamed = type(base)(**{**base.__dict__, "names": {**base.names, "linear": "quant-x"}})
    assert renamed.with_kv_dtype(torch.int8).names["linear"] == "quant-x"


def _arch(**kw) -> LlamaArchConfig:
    return LlamaArchConfig(**{"architecture": "LlamaForCausalLM", "vocab_size": 49152,
                              "hidden_size": 576, "intermediate_size": 1536,
                              "num_hidden_layers": 30, "num_attention_heads": 9,
                              "num_key_value_heads": 3, "head_dim": 64, "rms_norm_eps": 1e-5,
                              "rope_theta": 1e5, "rope_scaling": None,
                              "max_position_embeddings": 8192, "tie_word_embeddings": True,
                              "attention_bias": False, "bos_token_id": 1, "eos_token_id": 2,
                              **kw})


def test_the_same_memory_holds_about_twice_the_blocks():
    arch = _arch()
    cc = CacheConfig(kv_cache_memory="256MiB")
    bf16 = num_kv_blocks(cc, arch.kv_bytes_per_token(2))
    fp8 = num_kv_blocks(cc, arch.kv_bytes_per_token(1))
    int8 = num_kv_blocks(cc, arch.kv_bytes_per_token(1, INT8_SCALE_BYTES))
    fp32 = num_kv_blocks(cc, arch.kv_bytes_per_token(4))
    assert arch.kv_bytes_per_token(1, INT8_SCALE_BYTES) == 30 * 2 * 3 * (64 + 4)
    assert 1.99 <= fp8 / bf16 <= 2.01 and 3.98 <= fp8 / fp32 <= 4.02
    assert 1.85 <= int8 / bf16 <= 1.9  # the scales: 4 bytes per 64 values
    # and the tensors allocated are those bytes
    for dtype, per_token in ((FP8, arch.kv_bytes_per_token(1)),
                             (torch.int8, arch.kv_bytes_per_token(1, INT8_SCALE_BYTES))):
        caches = allocate_kv_caches(arch, 4, 16, dtype)
        assert sum(t.numel() * t.element_size() for p in caches for t in p) == 4 * 16 * per_token


@pytest.mark.parametrize("config,want", [("fp8", "fp8_e4m3"), ("fp8_e4m3", "fp8_e4m3"),
                                         ("int8", "int8"), ("bf16", "bfloat16")])
def test_kv_cache_dtype_names(config, want):
    assert CacheConfig(cache_dtype=config).cache_dtype == want


def test_an_unknown_kv_cache_dtype_is_refused_by_name():
    with pytest.raises(ValueError, match="kv_cache_dtype must be"):
        CacheConfig(cache_dtype="fp4")


@pytest.mark.parametrize("dtype", ONE_BYTE)
def test_transfer_moves_quantized_blocks_with_their_scales(dtype):
    """Raw block bytes (values and int8's scales) from one engine's cache into another's; and
    into a cache of another block size, token by token, the same values."""
    kvh, d = 2, 32
    src = [tuple(torch.zeros(cache_shape(6, 16, kvh, d, dtype), dtype=dtype) for _ in range(2))
           for _ in range(2)]
    x = torch.randn(40, kvh, d) * 3
    for kc, vc in src:
        write_rows(kc, vc, x, -x, torch.arange(16, 56))
    kv = PagedKV([KVShard(0, src)])
    frames = [torch.empty(transfer_bytes(kv, 3)[1], dtype=torch.uint8)]  # a staging buffer
    gather_into(kv, [1, 2, 3], frames[0])
    dst = [tuple(torch.zeros_like(src[0][0]) for _ in range(2)) for _ in range(2)]
    scatter(PagedKV([KVShard(0, dst)]), [5, 0, 4], frames)
    for (sk, sv), (dk, dv) in zip(src, dst):
        assert torch.equal(dk[[5, 0, 4]].view(torch.uint8), sk[[1, 2, 3]].view(torch.uint8))
        assert torch.equal(dv[[5, 0, 4]].view(torch.uint8), sv[[1, 2, 3]].view(torch.uint8))
    small = [tuple(torch.zeros(cache_shape(12, 8, kvh, d, dtype), dtype=dtype) for _ in range(2))
             for _ in range(2)]
    scatter_tokens(PagedKV([KVShard(0, small)]), frames, 16, 3, [3, 9, 1, 7, 2], 0, 40)
    slots = torch.tensor([b * 8 + i for b in (3, 9, 1, 7, 2) for i in range(8)])
    for (sk, sv), (dk, dv) in zip(src, small):  # the stored bytes, scales included
        want = read_stored_rows(sk, sv, torch.arange(16, 56))
        got = read_stored_rows(dk, dv, slots)
        assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8))
        assert torch.equal(got[1].view(torch.uint8), want[1].view(torch.uint8))


@pytest.mark.parametrize("dtype", ONE_BYTE)
@pytest.mark.parametrize("head_dim", [64, 24])  # 24: prompts through SDPA, decodes scalar
def test_mixed_step_through_the_kernels_matches_the_torch_path(dtype, head_dim):
    """A step with a prompt, a chunk of one and decodes: the C path (prompt tokens as rows of
    the one-byte decode kernel) gives what the PyTorch path (SDPA over dequantized rows, as
    KVFLOW_NO_KERNELS=1 runs) gives."""
    bs, kvh, heads = 16, 2, 6
    query_lens, seq_lens = np.array([20, 7, 1, 1]), np.array([20, 40, 9, 33])
    tables = [[0, 1], [2, 3, 4], [5], [6, 7, 8]]
    kc, vc = (torch.zeros(cache_shape(9, bs, kvh, head_dim, dtype), dtype=dtype) for _ in range(2))
    meta = A.build_attention_metadata(query_lens, seq_lens, tables, bs)
    ctx = torch.tensor([t[i // bs] * bs + i % bs for t, n, q in zip(tables, seq_lens, query_lens)
                        for i in range(int(n - q))])
    write_rows(kc, vc, torch.randn(len(ctx), kvh, head_dim), torch.randn(len(ctx), kvh, head_dim), ctx)
    k, v = torch.randn(29, kvh, head_dim), torch.randn(29, kvh, head_dim)
    A.write_kv_with_kernel(kc, vc, k, v, meta.slot_mapping)
    q = torch.randn(29, heads, head_dim)
    want = A.attention_with_sdpa(q, kc, vc, meta, 0.125, kvh)  # every key from the cache
    here = A.best_q8_isa(cpu_features(), dtype)
    got = A.attention_with_kernels(q, kc, vc, meta, 0.125, kvh, k, v, prompt_kernel=False, q8_isa=here)
    # fp8's AVX512-BF16 row: q and the weights in bf16, like the prompt kernel below
    tol = 2e-2 if here == "avx512-bf16" else 2e-5
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    # the prompt kernel (AVX512-BF16): q, the widened tiles and the probabilities in bf16
    got = A.attention_with_kernels(q, kc, vc, meta, 0.125, kvh, k, v, prompt_kernel=True, q8_isa=here)
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", ONE_BYTE)
@pytest.mark.parametrize("window", [0, 24])
@pytest.mark.parametrize("amx", [False, True], ids=["avx512-bf16", "amx"])
def test_prompt_kernel_widens_one_byte_tiles_as_the_reference_does(dtype, window, amx):
    """The prompt kernel over a one-byte cache gives what it gives over a bf16 cache holding
    the same values widened (int8 times its token's scale, fp8's rotated back, rounded to
    bf16)."""
    lib = library()
    if not lib.paged_prefill_bf16_supported(6, 2, 64, 16):
        pytest.skip("the prompt kernel needs AVX512-BF16")
    if amx and not lib.prefill_amx_available():
        pytest.skip("no AMX here (or Linux did not grant its tiles)")
    bs, kvh, heads, d = 16, 2, 6, 64
    query_lens, seq_lens = np.array([40, 9]), np.array([40, 50])
    tables = [[3, 0, 5], [1, 6, 2, 4]]
    kc, vc = _garbage_cache(8, bs, kvh, d, dtype, tables, seq_lens, seed=5)
    wide = [torch.zeros(cache_shape(8, bs, kvh, d, torch.bfloat16), dtype=torch.bfloat16)
            for _ in range(2)]
    slots = torch.tensor([t[i // bs] * bs + i % bs for t, n in zip(tables, seq_lens)
                          for i in range(int(n))])
    write_rows(*wide, *read_rows(kc, vc, slots), slots)  # fp32 values -> bf16, nearest even
    meta = A.build_attention_metadata(query_lens, seq_lens, tables, bs, sliding_window=window or None)
    q = torch.randn(int(query_lens.sum()), heads, d).bfloat16()
    got, want = torch.empty(q.shape), torch.empty(q.shape)
    assert A.prefill_with_kernel(q, kc, vc, meta, 0.125, got, amx=amx)
    assert A.prefill_with_kernel(q, *wide, meta, 0.125, want, amx=amx)
    assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", ONE_BYTE)
def test_tensor_parallel_shards_assemble_into_whole_quantized_blocks(dtype):
    """Two ranks holding kv heads [0, 1) and [1, 2) send whole blocks (each head's tile with its
    own scales); a one-rank consumer gets the same bytes as a one-rank producer would send."""
    d = 32
    whole = [tuple(torch.zeros(cache_shape(4, 16, 2, d, dtype), dtype=dtype) for _ in range(2))]
    x = torch.randn(30, 2, d) * 5
    write_rows(*whole[0], x, x * 0.1, torch.arange(2, 32))
    shards = [KVShard(h, [tuple(c[:, h:h + 1].contiguous() for c in whole[0])]) for h in (0, 1)]
    tp, one = PagedKV(shards), PagedKV([KVShard(0, whole)])
    bufs = [torch.empty(transfer_bytes(kv, 2)[1], dtype=torch.uint8) for kv in (tp, one)]
    gather_into(tp, [0, 1], bufs[0])
    gather_into(one, [0, 1], bufs[1])
    assert torch.equal(bufs[0], bufs[1])
    dst = [tuple(torch.zeros_like(c) for c in whole[0])]
    scatter(PagedKV([KVShard(0, dst)]), [3, 2], [bufs[0]])
    assert torch.equal(dst[0][0][[3, 2]].view(torch.uint8), whole[0][0][[0, 1]].view(torch.uint8))
