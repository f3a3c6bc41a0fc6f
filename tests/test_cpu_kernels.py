"""kvflow's C kernels (kvflow/csrc) give the same numbers as their PyTorch equivalents: the
paged decode attention straight from scattered blocks, and the fused RMSNorm / RoPE / SiLU."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kvflow.csrc import load_library
from kvflow.csrc import ops
from kvflow import attention as A
from kvflow.attention import c_kernels
from kvflow.model.cpu_features import cpu_features
from kvflow.attention.kv_layout import cache_shape, read_rows, write_rows

torch.set_num_threads(1)


def test_kernels_build_on_this_machine():
    assert load_library() is not None, "the C kernels should compile here (gcc is part of the setup)"


def _nan_cache_with_rows(num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
                         tables: list[list[int]], seq_lens, dtype: torch.dtype, seed: int = 0):
    """K/V caches whose every slot is NaN but the sequences' own keys (random): a kernel that
    lets a slot past a sequence's end into its sums gives NaN."""
    shape = cache_shape(num_blocks, block_size, kv_heads, head_dim)
    k_cache, v_cache = torch.full(shape, float("nan"), dtype=dtype), torch.full(shape, float("nan"), dtype=dtype)
    slots = torch.tensor([table[t // block_size] * block_size + t % block_size
                          for table, n in zip(tables, seq_lens) for t in range(int(n))])
    g = torch.Generator().manual_seed(seed)
    write_rows(k_cache, v_cache, torch.randn(len(slots), kv_heads, head_dim, generator=g),
               torch.randn(len(slots), kv_heads, head_dim, generator=g), slots)
    return k_cache, v_cache


@pytest.mark.parametrize("cache_dtype,q_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                                 (torch.bfloat16, torch.bfloat16)])
@pytest.mark.parametrize("threads", [1, 2])
# 40: the scalar path for dims that are not x32; 128: the AVX-512 bf16 row's two 64-wide passes
@pytest.mark.parametrize("head_dim", [64, 40, 128])
# query heads per kv head: 3 (SmolLM2's), 1 (no GQA), 2, 4 (the AVX-512 bf16 row serves a
# group of up to four heads per pass over the keys) and 7 (more: the AVX2 row)
@pytest.mark.parametrize("heads,kv_heads", [(6, 2), (3, 3), (4, 2), (8, 2), (7, 1)])
# 4: the scalar path (the vector rows take 8 or 16 keys per load); 16: whole tiles plus
# partial last ones, of odd and even lengths
@pytest.mark.parametrize("block_size", [4, 16])
def test_paged_decode_kernel_matches_gathered_sdpa(cache_dtype, q_dtype, threads, head_dim, heads,
                                                   kv_heads, block_size, monkeypatch):
    monkeypatch.setattr(c_kernels, "MIN_PARALLEL_HEAD_KEYS", 0)  # split even this small batch
    rng = np.random.default_rng(0)
    num_blocks = 64
    seq_lens = np.array([1, 5, 13, 4, 9, 30])
    tables = []
    free = list(rng.permutation(num_blocks))
    for n in seq_lens:
        tables.append([int(free.pop()) for _ in range(-(-n // block_size) + 1)])  # one spare
    k_cache, v_cache = _nan_cache_with_rows(num_blocks, block_size, kv_heads, head_dim, tables, seq_lens,
                                            cache_dtype)
    meta = A.build_attention_metadata(np.ones(len(seq_lens), dtype=np.int64), seq_lens, tables, block_size)
    q = torch.randn(len(seq_lens), heads, head_dim).to(q_dtype)
    scale = head_dim ** -0.5

    got = torch.full(q.shape, float("nan"))  # fp32 out
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert A.decode_with_kernel(q, k_cache, v_cache, meta, scale, got)
    finally:
        torch.set_num_threads(old)
    # the bf16 row (bf16 q and cache) weighs values by bf16 probabilities: ~3 significant digits
    tol = 4e-3 if q_dtype == torch.bfloat16 else 1e-5
    # from first principles, each row from its own slots
    for i, n in enumerate(seq_lens):
        slots = torch.tensor([tables[i][t // block_size] * block_size + t % block_size for t in range(n)])
        k, v = (x.float().repeat_interleave(heads // kv_heads, 1) for x in read_rows(k_cache, v_cache, slots))
        p = torch.einsum("hd,thd->ht", q[i].float(), k).mul(scale).softmax(-1)
        torch.testing.assert_close(got[i], torch.einsum("ht,thd->hd", p, v), atol=tol, rtol=tol)


def test_paged_decode_torch_fallback_reads_the_tiles():
    """The PyTorch decode path (no kernels) reads the same tiles as the kernel."""
    block_size, kv_heads, heads, head_dim = 16, 2, 6, 64
    seq_lens = np.array([3, 17, 40])
    tables = [[5, 0], [7, 2], [1, 3, 6]]
    k_cache, v_cache = _nan_cache_with_rows(8, block_size, kv_heads, head_dim, tables, seq_lens, torch.float32)
    k_cache, v_cache = k_cache.nan_to_num(0.0), v_cache.nan_to_num(0.0)  # SDPA's mask still multiplies
    meta = A.build_attention_metadata(np.ones(3, dtype=np.int64), seq_lens, tables, block_size)
    q = torch.randn(3, heads, head_dim)
    got, want = torch.empty_like(q), torch.empty_like(q)
    A.decode_with_torch(q, k_cache, v_cache, meta, head_dim ** -0.5, want)
    assert A.decode_with_kernel(q, k_cache, v_cache, meta, head_dim ** -0.5, got)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_write_kv_kernel_matches_index_copy(cache_dtype):
    """The C writer stores each new token's K/V at its slot; into a bf16 cache each value is
    rounded to nearest even exactly as torch rounds (ties and infinities included; NaN stays NaN)."""
    t, kv_heads, head_dim, block_size, num_blocks = 11, 2, 8, 4, 8
    qkv = torch.randn(t, 3 * kv_heads * head_dim) * 100
    # values that sit exactly between two bf16 numbers, in both tie directions, and specials
    qkv[0, :4] = torch.tensor([1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, float("inf"), float("nan")])
    k = qkv[:, :kv_heads * head_dim].view(t, kv_heads, head_dim)  # strided views, as in the model
    v = qkv[:, kv_heads * head_dim:2 * kv_heads * head_dim].view(t, kv_heads, head_dim)
    slots = torch.from_numpy(np.random.default_rng(1).permutation(num_blocks * block_size)[:t].copy())
    shape = cache_shape(num_blocks, block_size, kv_heads, head_dim)
    got_k, got_v = torch.zeros(shape, dtype=cache_dtype), torch.zeros(shape, dtype=cache_dtype)
    A.write_kv_with_kernel(got_k, got_v, k, v, slots)
    want_k, want_v = torch.zeros(shape, dtype=cache_dtype), torch.zeros(shape, dtype=cache_dtype)
    write_rows(want_k, want_v, k, v, slots)
    nan = want_k.isnan()
    assert nan.sum() == 1 and torch.equal(got_k.isnan(), nan)  # NaN payloads may differ
    bits = torch.int16 if cache_dtype == torch.bfloat16 else torch.int32
    assert torch.equal(got_k.view(bits)[~nan], want_k.view(bits)[~nan])
    assert torch.equal(got_v, want_v)


def test_bf16_kv_rows_are_copied_into_a_bf16_cache():
    t, kv_heads, head_dim = 9, 3, 64
    qkv = torch.randn(t, 3 * kv_heads * head_dim).bfloat16()
    k = qkv[:, :kv_heads * head_dim].view(t, kv_heads, head_dim)
    v = qkv[:, kv_heads * head_dim:2 * kv_heads * head_dim].view(t, kv_heads, head_dim)
    slots = torch.from_numpy(np.random.default_rng(2).permutation(64)[:t].copy())
    shape = cache_shape(4, 16, kv_heads, head_dim)
    got_k, got_v = torch.zeros(shape).bfloat16(), torch.zeros(shape).bfloat16()
    A.write_kv_with_kernel(got_k, got_v, k, v, slots)
    want_k, want_v = torch.zeros_like(got_k), torch.zeros_like(got_v)
    write_rows(want_k, want_v, k, v, slots)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)


def test_fused_add_rms_norm_matches_reference():
    x, d, w = torch.randn(70, 96), torch.randn(70, 96), torch.randn(96)
    want_x = x + d
    want = w * (want_x * torch.rsqrt(want_x.pow(2).mean(-1, keepdim=True) + 1e-5))
    got = ops.add_rms_norm(x, d, w, 1e-5)
    torch.testing.assert_close(x, want_x)  # the residual is updated in place
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_fused_rope_matches_rotate_half():
    t, heads, dim = 9, 5, 16
    qkv = torch.randn(t, heads * dim + 7)  # extra columns (the v part) stay untouched
    pos = np.array([0, 3, 1, 8, 2, 2, 7, 5, 4], dtype=np.int64)
    freqs = torch.outer(torch.arange(16, dtype=torch.float32), 1.0 / 10000 ** (torch.arange(0, dim, 2) / dim))
    emb = torch.cat((freqs, freqs), -1)
    cos, sin = emb.cos(), emb.sin()
    x = qkv[:, :heads * dim].reshape(t, heads, dim)
    c, s = cos[pos].unsqueeze(1), sin[pos].unsqueeze(1)
    want = x * c + torch.cat((-x[..., dim // 2:], x[..., :dim // 2]), -1) * s
    tail = qkv[:, heads * dim:].clone()
    ops.rope_(qkv, heads, dim, pos, cos, sin)
    torch.testing.assert_close(qkv[:, :heads * dim].reshape(t, heads, dim), want, atol=1e-6, rtol=1e-5)
    assert torch.equal(qkv[:, heads * dim:], tail)


def test_fused_silu_mul_matches_reference():
    gate_up = torch.randn(33, 2 * 52) * 4
    gate, up = gate_up.chunk(2, -1)
    torch.testing.assert_close(ops.silu_mul(gate_up), F.silu(gate) * up, atol=1e-6, rtol=1e-5)


def _bf16_ulps(got: torch.Tensor, want: torch.Tensor) -> int:
    """Largest distance in bf16 steps (same-sign values; enough for these comparisons)."""
    g = got.view(torch.int16).to(torch.int32)
    w = want.view(torch.int16).to(torch.int32)
    return int((g - w).abs().max())


@pytest.mark.parametrize("width", [576, 584])  # 584: not whole 16-wide vectors (the scalar loop)
@pytest.mark.parametrize("with_delta", [True, False])
def test_fused_bf16_add_rms_norm_rounds_like_torch(width, with_delta):
    """bf16 activations: the residual add, the normalised value and the weighted output are
    each rounded to bf16 where PyTorch's bf16 ops round (HF's LlamaRMSNorm)."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(70, width, generator=g) * 3).bfloat16()
    d = torch.randn(70, width, generator=g).bfloat16()
    w = (1 + torch.randn(width, generator=g) * 0.1).bfloat16()
    want_x = x + d if with_delta else x.clone()
    xf = want_x.float()
    want = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(torch.bfloat16)
    got = ops.add_rms_norm(x, d if with_delta else None, w, 1e-5)
    assert got.dtype == torch.bfloat16 and torch.equal(x, want_x)  # residual in place, exact
    assert _bf16_ulps(got, want) <= 1  # the sum of squares is added in another order
    assert (got != want).float().mean() < 0.01


def test_fused_bf16_rope_is_exact():
    t, heads, dim = 9, 5, 64
    qkv = torch.randn(t, heads * dim + 7).bfloat16()
    pos = np.array([0, 3, 1, 8, 2, 2, 7, 5, 4], dtype=np.int64)
    freqs = torch.outer(torch.arange(16, dtype=torch.float32), 1.0 / 10000 ** (torch.arange(0, dim, 2) / dim))
    emb = torch.cat((freqs, freqs), -1)
    cos, sin = emb.cos(), emb.sin()
    x = qkv[:, :heads * dim].reshape(t, heads, dim)
    c, s = cos[pos].unsqueeze(1).bfloat16(), sin[pos].unsqueeze(1).bfloat16()
    want = x * c + torch.cat((-x[..., dim // 2:], x[..., :dim // 2]), -1) * s
    tail = qkv[:, heads * dim:].clone()
    ops.rope_(qkv, heads, dim, pos, cos, sin)
    assert torch.equal(qkv[:, :heads * dim].reshape(t, heads, dim), want)
    assert torch.equal(qkv[:, heads * dim:], tail)


@pytest.mark.parametrize("width", [1536, 1547])  # 1547: 16-wide, 8-wide and scalar tails
def test_fused_bf16_silu_mul_rounds_like_torch(width):
    gate_up = (torch.randn(33, 2 * width) * 4).bfloat16()
    gate, up = gate_up.chunk(2, -1)
    got = ops.silu_mul(gate_up)
    want = F.silu(gate) * up
    assert got.dtype == torch.bfloat16
    assert _bf16_ulps(got, want) <= 1  # exp may differ from PyTorch's in the last fp32 bit
    assert (got != want).float().mean() < 0.01


def _scattered_cache(seed: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
                     seq_lens: np.ndarray, dtype: torch.dtype):
    """Random K/V caches and one block table per sequence, its blocks scattered over the pool."""
    free = list(np.random.default_rng(seed).permutation(num_blocks))
    tables = [[int(free.pop()) for _ in range(-(-n // block_size))] for n in seq_lens]
    shape = cache_shape(num_blocks, block_size, kv_heads, head_dim)
    return tables, torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2])
def test_prompt_tokens_through_the_kernel_match_sdpa(dtype, threads, monkeypatch):
    """A step mixing a fresh prompt, a prompt chunk after cached context and decodes: with the
    kernel every token is a row over its causal prefix; without it (SDPA per prompt, the
    batched decode fallback) the same numbers come out."""
    monkeypatch.setattr(c_kernels, "MIN_PARALLEL_HEAD_KEYS", 0)
    heads, kv_heads, head_dim, block_size = 6, 2, 64, 4
    query_lens = np.array([11, 1, 7, 1])  # fresh prompt, decode, chunk after 9 cached, decode
    seq_lens = np.array([11, 6, 16, 3])
    tables, k_cache, v_cache = _scattered_cache(2, 40, block_size, kv_heads, head_dim, seq_lens, dtype)
    q = torch.randn(int(query_lens.sum()), heads, head_dim).to(dtype)
    scale = head_dim ** -0.5

    def attend(attend_with) -> torch.Tensor:
        meta = A.build_attention_metadata(query_lens, seq_lens, tables, block_size)
        return attend_with(q, k_cache, v_cache, meta, scale, kv_heads)

    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = attend(A.attention_with_kernels)
    finally:
        torch.set_num_threads(old)
    want = attend(A.attention_with_sdpa)
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16 outputs: one rounding apart
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_bf16_argmax_matches_torch_with_ties_and_nan():
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(9, 1000, generator=g).bfloat16()
    logits[1, 10] = logits[1, 700] = 50.0  # a tie: the first index wins
    logits[2, :] = -3.0  # all equal
    logits[3, 500] = float("nan")  # a NaN wins, as in torch.argmax
    logits[4, 5] = float("-inf")
    logits[5, 999] = 60.0  # the last column
    got = ops.argmax_rows(logits)
    assert got == logits.float().argmax(dim=-1).tolist()
    assert got[1] == 10 and got[2] == 0 and got[3] == 500 and got[5] == 999
    assert ops.argmax_rows(logits.float()) == got  # the fp32 path agrees


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2])
# query heads per kv head: 3 (SmolLM2's: two tokens a tile), 1, 2, 4 and 7 (tiles across tokens)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 4, 64), (6, 3, 64),
                                                     (8, 2, 64), (14, 2, 64), (6, 2, 128)])
def test_prompt_tokens_in_avx2_tiles_match_sdpa(cache_dtype, threads, heads, kv_heads, head_dim,
                                                 monkeypatch):
    """fp32 prompt tokens as rows of the decode kernel (every CPU without the prompt kernel for
    this cache) share their keys' and values' loads in tiles of (token, head) pairs, and give
    each token the numbers of its own row bit for bit (so fp32 outputs never depend on how a
    step was batched): a step of a fresh prompt, decodes, a chunk after cached context, a
    two-token chunk and a prompt ending mid-block, against one row at a time and SDPA."""
    monkeypatch.setattr(c_kernels, "MIN_PARALLEL_HEAD_KEYS", 0)
    block_size = 16
    query_lens = np.array([45, 1, 23, 2, 1, 37])
    seq_lens = np.array([45, 70, 63, 40, 17, 37])
    tables, k_cache, v_cache = _scattered_cache(5, 80, block_size, kv_heads, head_dim, seq_lens,
                                                cache_dtype)
    q = torch.randn(int(query_lens.sum()), heads, head_dim)
    scale = head_dim ** -0.5
    meta = A.build_attention_metadata(query_lens, seq_lens, tables, block_size)
    got, rows = torch.full(q.shape, float("nan")), torch.full(q.shape, float("nan"))
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert A.decode_with_kernel(q, k_cache, v_cache, meta, scale, got, all_tokens=True)
        assert A.decode_with_kernel(q, k_cache, v_cache, meta, scale, rows, all_tokens=True,
                                     tiles=False)
    finally:
        torch.set_num_threads(old)
    assert torch.equal(got, rows)
    want = A.attention_with_sdpa(q, k_cache, v_cache, meta, scale, kv_heads,
                                 decode_kernel=A.decode_with_kernel)
    torch.testing.assert_close(got.view(len(q), -1), want, atol=1e-5, rtol=1e-5)


def test_a_prompt_tokens_numbers_do_not_depend_on_its_chunks():
    """A token's (token, head) pairs come out bit for bit the same whichever tile they share:
    a 45-token prompt in one step, and as chunks of 20 and 25 (the second after the first's
    cache), give the same outputs for its last 25 tokens (fp32 q, an fp32 cache)."""
    heads, kv_heads, head_dim, block_size = 9, 3, 64, 16
    tables, k_cache, v_cache = _scattered_cache(6, 20, block_size, kv_heads, head_dim,
                                                np.array([45]), torch.float32)
    q = torch.randn(45, heads, head_dim)
    scale = head_dim ** -0.5
    whole = torch.empty(q.shape)
    meta = A.build_attention_metadata(np.array([45]), np.array([45]), tables, block_size)
    assert A.decode_with_kernel(q, k_cache, v_cache, meta, scale, whole, all_tokens=True)
    chunk = torch.empty(25, heads, head_dim)
    meta = A.build_attention_metadata(np.array([25]), np.array([45]), tables, block_size)
    assert A.decode_with_kernel(q[20:].contiguous(), k_cache, v_cache, meta, scale, chunk,
                                 all_tokens=True)
    assert torch.equal(chunk, whole[20:])


@pytest.mark.parametrize("threads", [1, 2])
# query heads per kv head: 3 (SmolLM2's), 1, 4 and 12 (a tile of one row); 128- and 96-wide heads
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(6, 2, 64), (4, 4, 64), (8, 2, 64),
                                                     (12, 1, 64), (6, 2, 128), (6, 2, 96)])
@pytest.mark.parametrize("amx", [False, True], ids=["avx512-bf16", "amx"])
def test_prompt_kernel_matches_sdpa_over_whole_blocks(threads, heads, kv_heads, head_dim, amx,
                                                      monkeypatch):
    """The flash-style prompt kernel (bf16 cache, 16-token blocks), on AVX512-BF16 and on AMX's
    tiles: prompts of several tiles and blocks, one that ends on a block boundary, a chunk
    after cached context, beside decodes; against SDPA per prompt from the same cache."""
    lib = load_library()
    if amx and not lib.prefill_amx_available():
        pytest.skip("no AMX here (or Linux did not grant its tiles)")
    monkeypatch.setattr(c_kernels, "MIN_PARALLEL_HEAD_KEYS", 0)
    block_size = 16
    query_lens = np.array([45, 1, 23, 32, 1])  # fresh, decode, chunk after 40 cached, fresh, decode
    seq_lens = np.array([45, 70, 63, 32, 17])
    tables, k_cache, v_cache = _scattered_cache(3, 60, block_size, kv_heads, head_dim, seq_lens,
                                                torch.bfloat16)
    q = torch.randn(int(query_lens.sum()), heads, head_dim).bfloat16()
    scale = head_dim ** -0.5
    meta = A.build_attention_metadata(query_lens, seq_lens, tables, block_size)
    lib = load_library()
    cpu = cpu_features()
    assert lib.paged_prefill_bf16_supported(heads, kv_heads, head_dim, block_size) == (
        cpu.avx512 and cpu.avx512_bf16)  # an AVX-512 CPU without BF16 has none

    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = A.attention_with_kernels(q, k_cache, v_cache, meta, scale, kv_heads, prompt_amx=amx)
    finally:
        torch.set_num_threads(old)
    want = A.attention_with_sdpa(q.float(), k_cache, v_cache, meta, scale, kv_heads,
                                 decode_kernel=A.decode_with_kernel)
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)  # got is rounded to bf16


@pytest.mark.parametrize("threads", [1, 2])
def test_bf16_q_and_out_are_the_kernels_fp32_out_rounded_once(threads, monkeypatch):
    """The kernels read a bf16 q in place (a strided view of the fused qkv, as the model passes
    it) and write a bf16 out themselves: bit for bit their fp32 output rounded to bf16, for
    prompt tokens (the prompt kernel) and decodes in one step; and close to the fp32-q path."""
    monkeypatch.setattr(c_kernels, "MIN_PARALLEL_HEAD_KEYS", 0)
    heads, kv_heads, head_dim, block_size = 6, 2, 64, 16
    query_lens = np.array([45, 1, 23, 1])  # fresh prompt, decode, chunk after 40 cached, decode
    seq_lens = np.array([45, 70, 63, 17])
    tables, k_cache, v_cache = _scattered_cache(4, 40, block_size, kv_heads, head_dim, seq_lens,
                                                torch.bfloat16)
    width = (heads + 2 * kv_heads) * head_dim
    qkv = torch.randn(int(query_lens.sum()), width).bfloat16()
    q = qkv[:, :heads * head_dim].view(-1, heads, head_dim)  # rows `width` apart
    assert not q.is_contiguous()
    meta = A.build_attention_metadata(query_lens, seq_lens, tables, block_size)
    scale = head_dim ** -0.5
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = A.attention_with_kernels(q, k_cache, v_cache, meta, scale, kv_heads)
        want = torch.full((len(q), heads, head_dim), float("nan"))
        if A.prefill_with_kernel(q, k_cache, v_cache, meta, scale, want):
            assert A.decode_with_kernel(q, k_cache, v_cache, meta, scale, want)
        else:  # no prompt kernel on this CPU: the C backend runs prompt tokens as decode rows
            assert A.decode_with_kernel(q, k_cache, v_cache, meta, scale, want, all_tokens=True)
        dec_got = torch.full((len(q), heads, head_dim), float("nan")).bfloat16()
        assert A.decode_with_kernel(q, k_cache, v_cache, meta, scale, dec_got)
        from_fp32 = A.attention_with_kernels(q.float(), k_cache, v_cache, meta, scale, kv_heads)
    finally:
        torch.set_num_threads(old)
    assert got.dtype == torch.bfloat16 and not want.isnan().any()
    assert torch.equal(got, want.bfloat16().view(len(q), -1))
    rows = torch.from_numpy(meta.decode_rows)
    assert torch.equal(dec_got[rows], want[rows].bfloat16())
    torch.testing.assert_close(got.float(), from_fp32, atol=2e-2, rtol=2e-2)  # bf16 probabilities, rounding


@pytest.mark.parametrize("contiguous", [False, True], ids=["scattered", "contiguous"])
def test_decode_prefetching_every_block_gives_the_same_bits(contiguous):
    """`prefetch_all` (the bf16 row prefetches blocks that follow in memory too, on a Xeon with
    AMX) changes only what is fetched early: the outputs are the plain row's, bit for bit, for
    blocks scattered over the pool and for runs of consecutive blocks."""
    heads, kv_heads, head_dim, bs = 9, 3, 64, 16
    seq_lens = np.array([300, 70, 16, 17, 1])
    tables, k_cache, v_cache = _scattered_cache(7, 60, bs, kv_heads, head_dim, seq_lens, torch.bfloat16)
    if contiguous:
        starts = np.cumsum([0] + [len(t) for t in tables])
        tables = [list(range(int(a), int(b))) for a, b in zip(starts[:-1], starts[1:])]
    meta = A.build_attention_metadata(np.ones(len(seq_lens), dtype=np.int64), seq_lens, tables, bs)
    q = torch.randn(len(seq_lens), heads, head_dim).bfloat16()
    plain, pf = (torch.full(q.shape, float("nan")).bfloat16() for _ in range(2))
    assert A.decode_with_kernel(q, k_cache, v_cache, meta, head_dim ** -0.5, plain)
    assert A.decode_with_kernel(q, k_cache, v_cache, meta, head_dim ** -0.5, pf, prefetch_all=True)
    assert not plain.isnan().any() and torch.equal(plain, pf)
    want = A.attention_with_sdpa(q.float(), k_cache, v_cache, meta, head_dim ** -0.5, kv_heads)
    torch.testing.assert_close(pf.float().view(len(q), -1), want, atol=2e-2, rtol=2e-2)


NO_AMX_CHECK = """
import json, sys
import kvflow.csrc as c
c._FLAGS = c._FLAGS + ["-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8"]
sys.path.insert(0, sys.argv[1])
import numpy as np, torch
from kvflow.csrc import library
from kvflow import attention as A
from test_cpu_kernels import _scattered_cache
query_lens, seq_lens = np.array([45, 1, 23]), np.array([45, 70, 63])
tables, k, v = _scattered_cache(3, 40, 16, 3, 64, seq_lens, torch.bfloat16)
q = torch.randn(int(query_lens.sum()), 9, 64).bfloat16()
meta = A.build_attention_metadata(query_lens, seq_lens, tables, 16)
plain, asked = (torch.full(q.shape, float("nan")) for _ in range(2))
ran = [A.prefill_with_kernel(q, k, v, meta, 0.125, plain),
       A.prefill_with_kernel(q, k, v, meta, 0.125, asked, amx=True)]
rows = torch.from_numpy(np.concatenate([np.arange(45), 46 + np.arange(23)]))
print(json.dumps({"amx": library().prefill_amx_available(), "ran": ran,
                  "equal": bool(torch.equal(plain[rows], asked[rows])) and not plain[rows].isnan().any().item()}))
"""


@pytest.mark.slow  # builds the whole kernel library again (~12 s)
def test_a_build_without_amx_serves_prompts_on_avx512_bf16(tmp_path):
    """The kernel library built with AMX masked (as on a Zen 4 or an older Xeon): it reports no
    AMX, and a prompt asked for on AMX runs the AVX512-BF16 tiles, bit for bit the plain call."""
    if not cpu_features().avx512_bf16:
        pytest.skip("the prompt kernel needs AVX512-BF16")
    env = {**os.environ, "KVFLOW_CACHE_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", NO_AMX_CHECK, os.path.dirname(__file__)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"amx": 0, "ran": [True, True], "equal": True}
