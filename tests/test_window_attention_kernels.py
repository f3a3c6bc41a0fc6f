"""The C decode kernel's sliding window: a row of seq_len L sees only keys L - window .. L - 1,
on both CPU paths (AVX-512, and AVX2 built here with AVX-512 masked off), against a PyTorch
reference; blocks wholly before the window are never read (they hold NaN here), as the
sliding-window KV cache hands them back to the pool."""
from __future__ import annotations

import ctypes
import os
import subprocess

import numpy as np
import pytest
import torch

from kvflow.csrc import _SIGNATURES, library
from kvflow import attention as A
from kvflow.attention.kv_layout import cache_shape, read_rows, write_rows

CSRC = os.path.join(os.path.dirname(os.path.dirname(A.__file__)), "csrc")


@pytest.fixture(scope="module")
def libs(tmp_path_factory):
    """{"native": the engine's library (AVX-512 here), "avx2": paged_attention.c built with
    every AVX-512 extension off, as on a Zen 3}."""
    out = str(tmp_path_factory.mktemp("avx2") / "paged_attention_avx2.so")
    subprocess.run(["cc", "-O3", "-march=native", "-mno-avx512f", "-fno-math-errno", "-shared",
                    "-fPIC", "-std=c11", os.path.join(CSRC, "paged_attention.c"), "-o", out, "-lm"],
                   check=True, capture_output=True, timeout=120)
    avx2 = ctypes.CDLL(out)
    for name in ("paged_decode_f32", "paged_decode_bf16"):
        fn = getattr(avx2, name)
        fn.restype, fn.argtypes = None, _SIGNATURES[name]
    assert library() is not None
    return {"native": library(), "avx2": avx2}


def _reference(q, k_cache, v_cache, table, n, window, scale, heads, kv_heads, bs):
    first = max(0, n - window)
    slots = torch.tensor([table[t // bs] * bs + t % bs for t in range(first, n)])
    k, v = (x.float().repeat_interleave(heads // kv_heads, 1) for x in read_rows(k_cache, v_cache, slots))
    p = torch.einsum("hd,thd->ht", q.float(), k).mul(scale).softmax(-1)
    return torch.einsum("ht,thd->hd", p, v)


@pytest.mark.parametrize("isa", ["native", "avx2"])
@pytest.mark.parametrize("cache_dtype,q_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                                 (torch.bfloat16, torch.bfloat16)])
@pytest.mark.parametrize("head_dim,heads,kv_heads", [(64, 6, 2), (128, 4, 4), (256, 4, 1)])
@pytest.mark.parametrize("window", [5, 16, 23])
def test_decode_kernel_window_matches_reference(libs, isa, cache_dtype, q_dtype, head_dim, heads,
                                                kv_heads, window):
    bs, num_blocks = 16, 40
    rng = np.random.default_rng(window)
    seq_lens = np.array([3, 16, 17, 40, 61], dtype=np.int64)  # shorter, equal and past the window
    free = [int(b) for b in rng.permutation(np.arange(1, num_blocks))]
    tables = [[free.pop() for _ in range(-(-int(n) // bs))] for n in seq_lens]
    shape = cache_shape(num_blocks, bs, kv_heads, head_dim)
    k_cache, v_cache = torch.zeros(shape, dtype=cache_dtype), torch.zeros(shape, dtype=cache_dtype)
    g = torch.Generator().manual_seed(0)
    for table, n in zip(tables, seq_lens):
        slots = torch.tensor([table[t // bs] * bs + t % bs for t in range(int(n))])
        write_rows(k_cache, v_cache, torch.randn(len(slots), kv_heads, head_dim, generator=g),
                   torch.randn(len(slots), kv_heads, head_dim, generator=g), slots)
    # block 0 is the null block: NaN, as garbage the kernel must never read
    k_cache[0], v_cache[0] = float("nan"), float("nan")
    for table, n in zip(tables, seq_lens):
        for b in range(max(0, int(n) - window) // bs):
            table[b] = 0
    bt = np.zeros((len(tables), max(map(len, tables))), dtype=np.int64)
    for i, t in enumerate(tables):
        bt[i, :len(t)] = t
    q = torch.randn(len(seq_lens), heads, head_dim).to(q_dtype)
    out = torch.full((len(seq_lens), heads, head_dim), float("nan"))
    rows = np.arange(len(seq_lens), dtype=np.int64)
    scale = head_dim ** -0.5
    kernel = "paged_decode_bf16" if cache_dtype == torch.bfloat16 else "paged_decode_f32"
    getattr(libs[isa], kernel)(q.data_ptr(), heads * head_dim, k_cache.data_ptr(), v_cache.data_ptr(),
                               bt.ctypes.data, bt.shape[1], seq_lens.ctypes.data, rows.ctypes.data, 0,
                               len(rows), heads, kv_heads, head_dim, bs, scale, out.data_ptr(),
                               heads * head_dim, int(q_dtype == torch.bfloat16), window, None)
    tol = 4e-3 if q_dtype == torch.bfloat16 else 1e-5
    for i, n in enumerate(seq_lens):
        want = _reference(q[i], k_cache, v_cache, tables[i], int(n), window, scale, heads, kv_heads, bs)
        torch.testing.assert_close(out[i], want, atol=tol, rtol=tol)


def test_torch_paths_take_the_window():
    """The PyTorch decode and prompt paths mask keys outside the window like the kernel."""
    bs, kvh, heads, d, window = 4, 2, 4, 64, 6
    seq_lens = np.array([3, 9, 14], dtype=np.int64)
    tables = [[1], [2, 3, 4], [5, 6, 7, 8]]
    shape = cache_shape(10, bs, kvh, d)
    k_cache, v_cache = torch.randn(shape), torch.randn(shape)
    q = torch.randn(3, heads, d)
    meta = A.build_attention_metadata(np.ones(3, dtype=np.int64), seq_lens, tables, bs, sliding_window=window)
    want, got = torch.empty_like(q), torch.empty_like(q)
    A.decode_with_torch(q, k_cache, v_cache, meta, d ** -0.5, want)
    assert A.decode_with_kernel(q, k_cache, v_cache, meta, d ** -0.5, got)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for i, n in enumerate(seq_lens):
        ref = _reference(q[i], k_cache, v_cache, tables[i], int(n), window, d ** -0.5, heads, kvh, bs)
        torch.testing.assert_close(want[i], ref, atol=1e-5, rtol=1e-5)
    # a 14-token prompt in one step: every query through SDPA with the window's mask, and as
    # decode-kernel rows; both equal a query-by-query reference
    qp = torch.randn(14, heads, d)
    meta = A.build_attention_metadata(np.array([14]), np.array([14]), [tables[2]], bs, sliding_window=window)
    sdpa = A.attention_with_sdpa(qp, k_cache, v_cache, meta, d ** -0.5, kvh).view(14, heads, d)
    rows = A.attention_with_kernels(qp, k_cache, v_cache, meta, d ** -0.5, kvh).view(14, heads, d)
    for p in range(14):
        ref = _reference(qp[p], k_cache, v_cache, tables[2], p + 1, window, d ** -0.5, heads, kvh, bs)
        torch.testing.assert_close(sdpa[p], ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(rows[p], ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("head_dim,heads,kv_heads", [(64, 6, 2), (128, 4, 4), (256, 4, 1)])
@pytest.mark.parametrize("window", [5, 16, 23])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("amx", [False, True], ids=["avx512-bf16", "amx"])
def test_prompt_kernel_window_matches_reference(head_dim, heads, kv_heads, window, threads, amx):
    """The prompt kernel (prefill_attention.c, AVX512-BF16 or AMX: an AVX2 CPU has no prompt
    kernel and runs prompt tokens as decode-kernel rows, tested above) takes the window: every
    query of fresh prompts and of chunks after cached context sees only its last `window`
    keys, and blocks before the window of a chunk's first query (the null block, NaN) are
    never read."""
    lib = library()
    if not lib.paged_prefill_bf16_supported(heads, kv_heads, head_dim, 16):
        pytest.skip("no prompt kernel on this CPU (AVX512-BF16)")
    if amx and not lib.prefill_amx_available():
        pytest.skip("no AMX here (or Linux did not grant its tiles)")
    bs, num_blocks = 16, 40
    query_lens = np.array([40, 23, 5, 17, 1], dtype=np.int64)  # fresh, chunks, a fresh short one, a decode
    seq_lens = np.array([40, 61, 37, 17, 30], dtype=np.int64)
    rng = np.random.default_rng(window)
    free = [int(b) for b in rng.permutation(np.arange(1, num_blocks))]
    tables = [[free.pop() for _ in range(-(-int(n) // bs))] for n in seq_lens]
    shape = cache_shape(num_blocks, bs, kv_heads, head_dim)
    k_cache, v_cache = torch.zeros(shape, dtype=torch.bfloat16), torch.zeros(shape, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(window)
    for table, n in zip(tables, seq_lens):
        slots = torch.tensor([table[t // bs] * bs + t % bs for t in range(int(n))])
        write_rows(k_cache, v_cache, torch.randn(len(slots), kv_heads, head_dim, generator=g),
                   torch.randn(len(slots), kv_heads, head_dim, generator=g), slots)
    k_cache[0], v_cache[0] = float("nan"), float("nan")
    nulled = 0
    for table, q_len, n in zip(tables, query_lens, seq_lens):
        for b in range(max(0, int(n - q_len) - window + 1) // bs):
            table[b], nulled = 0, nulled + 1
    assert nulled >= 1  # the case the kernel must not read is there
    meta = A.build_attention_metadata(query_lens, seq_lens, tables, bs, sliding_window=window)
    q = torch.randn(int(query_lens.sum()), heads, head_dim, generator=g).bfloat16()
    out = torch.full(q.shape, float("nan"))
    scale = head_dim ** -0.5
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert A.prefill_with_kernel(q, k_cache, v_cache, meta, scale, out, amx=amx)
    finally:
        torch.set_num_threads(old)
    row = 0
    for table, q_len, n in zip(tables, query_lens, seq_lens):
        for p in range(int(n - q_len), int(n)):
            if q_len > 1:  # prompt rows only: the decode row is left to the decode kernel
                want = _reference(q[row], k_cache, v_cache, table, p + 1, window, scale, heads, kv_heads, bs)
                torch.testing.assert_close(out[row], want, atol=2e-2, rtol=2e-2)  # bf16 probabilities
            else:
                assert out[row].isnan().all()
            row += 1
