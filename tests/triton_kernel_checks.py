"""The Triton paged-attention kernels (kvflow/model/triton/) against a PyTorch reference:
scattered block tables, GQA, odd lengths, split-K, sliding windows and soft-capping.

Run as its own pytest process: on CPU through Triton's interpreter, which works only when
TRITON_INTERPRET=1 is set before triton is first imported (triton.language's own helpers are
decorated then), so tests/test_triton_attention.py starts it in a fresh process; with
KERNEL_CHECKS_DEVICE=cuda (benchmarks/gpu_check.py) the same checks run compiled on a GPU."""
from __future__ import annotations

import os
import sys

DEVICE = os.environ.get("KERNEL_CHECKS_DEVICE", "cpu")
if DEVICE == "cpu":
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("triton was imported without TRITON_INTERPRET=1; run this file in "
                           "its own process (tests/test_triton_attention.py does)")
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from triton_reference import filled_cache, reference_attention, scattered_tables  # noqa: E402


@pytest.fixture(scope="module")
def kernels():
    from kvflow.model.triton import kv_write, layout, paged_decode, paged_prefill
    if DEVICE == "cpu":
        from triton.runtime.interpreter import InterpretedFunction
        assert isinstance(kv_write._write_kv_kernel, InterpretedFunction)
    return [layout, kv_write, paged_decode, paged_prefill]


def _case(seq_lens, query_lens, heads, kv_heads, head_dim, block_size, dtype, seed,
          cache_dtype=None):
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 3
    tables = scattered_tables(seq_lens, block_size, num_blocks, gen)
    k_cache, v_cache = filled_cache(seq_lens, tables, kv_heads, head_dim, block_size, num_blocks,
                                    cache_dtype or dtype, gen)
    q = torch.randn(sum(query_lens), heads, head_dim, generator=gen).to(dtype)
    return q, k_cache, v_cache, tables


def _dev(*ts):
    return [t.to(DEVICE) for t in ts]


def _tol(dtype):
    return dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("seq_lens,heads,kv_heads,head_dim,block_size,splits,window,cap,dtype", [
    ([1, 17, 40], 4, 2, 32, 16, 1, None, None, torch.float32),        # GQA, odd lengths
    ([70, 5, 33], 6, 2, 24, 8, 4, None, None, torch.float32),         # split-K, head_dim not 2^k
    ([300, 129], 4, 1, 32, 16, 8, None, None, torch.bfloat16),        # MQA, bf16 cache, 8 splits
    ([45, 3, 64], 4, 4, 16, 16, 2, 20, None, torch.float32),          # sliding window
    ([37, 18], 8, 2, 16, 4, 2, None, 5.0, torch.float32),             # soft cap, block size 4
])
def test_paged_decode_matches_reference(kernels, seq_lens, heads, kv_heads, head_dim, block_size,
                                        splits, window, cap, dtype):
    decode = kernels[2]
    q, k_cache, v_cache, tables = _case(seq_lens, [1] * len(seq_lens), heads, kv_heads, head_dim,
                                        block_size, dtype, seed=len(seq_lens) + head_dim)
    want = reference_attention(q, k_cache, v_cache, tables, seq_lens, [1] * len(seq_lens),
                               0.3, window, cap)
    qd, kd, vd, td, lens = _dev(q, k_cache, v_cache, tables, torch.tensor(seq_lens))
    got = decode.paged_decode(qd, kd, vd, td, lens, 0.3, num_splits=splits,
                              sliding_window=window, logits_soft_cap=cap)
    assert got.dtype == q.dtype
    torch.testing.assert_close(got.cpu().double(), want, **_tol(dtype))


def test_paged_decode_padding_rows_write_zeros(kernels):
    """A zero-length row (a CUDA graph's padding) gives zeros, never NaN, beside real rows."""
    decode = kernels[2]
    q, k_cache, v_cache, tables = _case([9, 1], [1, 1], 2, 1, 16, 4, torch.float32, seed=3)
    want = reference_attention(q, k_cache, v_cache, tables, [9, 1], [1, 1], 0.25)
    qd, kd, vd, td, lens = _dev(q, k_cache, v_cache, tables, torch.tensor([9, 0]))
    got = decode.paged_decode(qd, kd, vd, td, lens, 0.25, num_splits=2).cpu()
    torch.testing.assert_close(got[0].double(), want[0], **_tol(torch.float32))
    assert torch.equal(got[1], torch.zeros_like(got[1]))


@pytest.mark.parametrize("seq_lens,query_lens,heads,kv_heads,head_dim,block_size,window,cap,dtype", [
    ([23, 40, 1], [23, 7, 1], 4, 2, 32, 16, None, None, torch.float32),   # prompt, chunk, decode
    ([50, 9], [50, 9], 6, 3, 24, 8, None, None, torch.float32),           # two prompts, odd dims
    ([70, 33], [38, 2], 4, 1, 32, 16, 24, None, torch.float32),           # window over a chunk
    ([35, 4], [35, 1], 2, 2, 16, 4, None, 8.0, torch.float32),            # soft cap
    ([48, 20], [16, 20], 4, 2, 32, 16, None, None, torch.bfloat16),       # bf16
])
def test_paged_prefill_matches_reference(kernels, seq_lens, query_lens, heads, kv_heads, head_dim,
                                         block_size, window, cap, dtype):
    prefill = kernels[3]
    q, k_cache, v_cache, tables = _case(seq_lens, query_lens, heads, kv_heads, head_dim, block_size,
                                        dtype, seed=sum(query_lens))
    want = reference_attention(q, k_cache, v_cache, tables, seq_lens, query_lens, 0.2, window, cap)
    qsl = torch.tensor([0] + query_lens).cumsum(0)
    qd, kd, vd, td, lens, qsl = _dev(q, k_cache, v_cache, tables, torch.tensor(seq_lens), qsl)
    got = prefill.paged_prefill(qd, kd, vd, td, lens, qsl, max(query_lens), 0.2,
                                sliding_window=window, logits_soft_cap=cap, block_m=16, block_n=16)
    torch.testing.assert_close(got.cpu().double(), want, **_tol(dtype))


@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float32, torch.float32),
                                               (torch.float32, torch.bfloat16)])
def test_write_kv_matches_write_rows(kernels, dtype, cache_dtype):
    """Rows land where kv_layout.write_rows puts them (strided views of a fused qkv included);
    negative slots (padding) write nothing."""
    from kvflow.attention.kv_layout import cache_shape, write_rows
    write = kernels[1]
    gen = torch.Generator().manual_seed(7)
    qkv = torch.randn(5, 3 * 2 * 8 + 4 * 8, generator=gen).to(dtype)
    k = qkv[:, 32:48].view(5, 2, 8)
    v = qkv[:, 48:64].view(5, 2, 8)
    slots = torch.tensor([13, 2, -1, 7, 0])
    want_k, want_v = (torch.zeros(cache_shape(4, 4, 2, 8), dtype=cache_dtype) for _ in range(2))
    keep = slots >= 0
    write_rows(want_k, want_v, k[keep], v[keep], slots[keep])
    got_k, got_v = (torch.zeros_like(want_k, device=DEVICE) for _ in range(2))
    write.write_kv(got_k, got_v, *_dev(k, v, slots))
    if cache_dtype == dtype:
        assert torch.equal(got_k.cpu(), want_k) and torch.equal(got_v.cpu(), want_v)
    else:  # the interpreter rounds fp32 -> bf16 toward zero, the GPU to nearest: one ulp apart
        for got, want in ((got_k, want_k), (got_v, want_v)):
            torch.testing.assert_close(got.cpu().float(), want.float(), atol=0, rtol=2 ** -7)
            assert torch.equal(got.cpu() == 0, want == 0)  # the same slots written


# -- one-byte KV caches (kv_cache_dtype fp8 / int8) ------------------------------------------
ONE_BYTE = [torch.float8_e4m3fn, torch.int8]


@pytest.mark.parametrize("cache_dtype", ONE_BYTE)
@pytest.mark.parametrize("seq_lens,heads,kv_heads,head_dim,block_size,splits", [
    ([1, 17, 40], 6, 2, 32, 16, 1),    # GQA, partial last blocks
    ([70, 5], 4, 4, 64, 8, 4),         # split-K
])
def test_paged_decode_reads_a_one_byte_cache(kernels, cache_dtype, seq_lens, heads, kv_heads,
                                             head_dim, block_size, splits):
    """Against the reference over the same quantized values (read_rows dequantizes them)."""
    q, k_cache, v_cache, tables = _case(seq_lens, [1] * len(seq_lens), heads, kv_heads, head_dim,
                                        block_size, torch.float32, seed=11,
                                        cache_dtype=cache_dtype)
    want = reference_attention(q, k_cache, v_cache, tables, seq_lens, [1] * len(seq_lens), 0.3)
    qd, kd, vd, td, lens = _dev(q, k_cache, v_cache, tables, torch.tensor(seq_lens))
    got = kernels[2].paged_decode(qd, kd, vd, td, lens, 0.3, num_splits=splits)
    torch.testing.assert_close(got.cpu().double(), want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("cache_dtype", ONE_BYTE)
def test_paged_prefill_reads_a_one_byte_cache(kernels, cache_dtype):
    seq_lens, query_lens = [23, 40, 1], [23, 7, 1]  # a prompt, a chunk, a decode
    q, k_cache, v_cache, tables = _case(seq_lens, query_lens, 4, 2, 32, 16, torch.float32,
                                        seed=5, cache_dtype=cache_dtype)
    want = reference_attention(q, k_cache, v_cache, tables, seq_lens, query_lens, 0.2)
    qsl = torch.tensor([0] + query_lens).cumsum(0)
    qd, kd, vd, td, lens, qsl = _dev(q, k_cache, v_cache, tables, torch.tensor(seq_lens), qsl)
    got = kernels[3].paged_prefill(qd, kd, vd, td, lens, qsl, max(query_lens), 0.2,
                                   block_m=16, block_n=16)
    torch.testing.assert_close(got.cpu().double(), want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("cache_dtype", ONE_BYTE)
def test_write_kv_quantizes_as_write_rows(kernels, cache_dtype):
    """The same bytes as kv_layout.write_rows (int8: values and per-token scales; fp8: e4m3
    rounded to nearest even, saturated), padding slots untouched."""
    from kvflow.attention.kv_layout import cache_shape, write_rows
    gen = torch.Generator().manual_seed(8)
    qkv = torch.randn(6, 3 * 2 * 16, generator=gen) * 40  # past fp8's 448 now and then
    qkv[0, 32:36] = torch.tensor([0.0, 1e-3, -2.0 ** -8, 449.0])  # zero, subnormals, saturation
    k, v = qkv[:, 32:64].view(6, 2, 16), qkv[:, 64:96].view(6, 2, 16)
    slots = torch.tensor([13, 2, -1, 7, 0, 30])
    want_k, want_v = (torch.zeros(cache_shape(8, 4, 2, 16, cache_dtype), dtype=cache_dtype)
                      for _ in range(2))
    keep = slots >= 0
    write_rows(want_k, want_v, k[keep], v[keep], slots[keep])
    got_k, got_v = (torch.zeros_like(want_k, device=DEVICE) for _ in range(2))
    kernels[1].write_kv(got_k, got_v, *_dev(k, v, slots))
    for got, want in ((got_k, want_k), (got_v, want_v)):
        assert torch.equal(got.cpu().view(torch.uint8), want.view(torch.uint8))


# fp8 at a checkpoint's per-layer scales (model/kv_scales.py): values of ~0.01, which e4m3 at
# scale 1.0 would hold mostly as subnormals, stored at k_scale / v_scale of that size
FP8_SCALES = (0.0123, 0.0071)


def test_fp8_cache_at_checkpoint_scales_is_written_and_read_as_the_cpu_does(kernels):
    from kvflow.attention.kv_layout import cache_shape, write_rows
    seq_lens, query_lens = [23, 40, 1], [23, 7, 1]
    gen = torch.Generator().manual_seed(21)
    fp8 = torch.float8_e4m3fn
    tables = scattered_tables(seq_lens, 16, 8, gen)
    k_cache, v_cache = filled_cache(seq_lens, tables, 2, 32, 16, 8, fp8, gen,
                                    kv_scales=FP8_SCALES, magnitude=0.01)
    q = torch.randn(sum(query_lens), 4, 32, generator=gen)
    want = reference_attention(q, k_cache, v_cache, tables, seq_lens, query_lens, 0.2,
                               kv_scales=FP8_SCALES)
    qsl = torch.tensor([0] + query_lens).cumsum(0)
    qd, kd, vd, td, lens, qsl = _dev(q, k_cache, v_cache, tables, torch.tensor(seq_lens), qsl)
    got = kernels[3].paged_prefill(qd, kd, vd, td, lens, qsl, max(query_lens), 0.2,
                                   block_m=16, block_n=16, kv_scales=FP8_SCALES)
    torch.testing.assert_close(got.cpu().double(), want, atol=1e-4, rtol=1e-4)
    rows = qsl[1:].cpu() - 1  # each sequence's last token as a decode row
    want = reference_attention(q[rows], k_cache, v_cache, tables, seq_lens, [1] * 3, 0.2,
                               kv_scales=FP8_SCALES)
    got = kernels[2].paged_decode(qd[rows.to(DEVICE)], kd, vd, td, lens, 0.2, num_splits=2,
                                  kv_scales=FP8_SCALES)
    torch.testing.assert_close(got.cpu().double(), want, atol=1e-4, rtol=1e-4)
    # the writer: the CPU's bytes at the same scales
    x = torch.randn(5, 2, 2, 32, generator=gen) * 0.02
    slots = torch.tensor([3, 17, 40, 9, 77])
    want_k, want_v = (torch.zeros(cache_shape(8, 16, 2, 32, fp8), dtype=fp8) for _ in range(2))
    write_rows(want_k, want_v, x[:, 0], x[:, 1], slots, FP8_SCALES)
    got_k, got_v = (torch.zeros_like(want_k, device=DEVICE) for _ in range(2))
    kernels[1].write_kv(got_k, got_v, *_dev(x[:, 0], x[:, 1], slots), FP8_SCALES)
    for got, want in ((got_k, want_k), (got_v, want_v)):
        assert torch.equal(got.cpu().view(torch.uint8), want.view(torch.uint8))


# -- the fused per-token ops against their PyTorch versions (kvflow/csrc/ops.py) --------------
def _close_or_ulp(got, want):
    """fp32: equal to rounding; bf16: within two ulps on a GPU (it rounds to nearest, as PyTorch
    does, but a sum of squares in another order can move a rounding by one, then the weight's
    product by another), a few under the interpreter, which rounds toward zero every time."""
    if want.dtype == torch.float32:
        torch.testing.assert_close(got.cpu(), want, atol=1e-5, rtol=1e-5)
    elif DEVICE == "cpu":
        torch.testing.assert_close(got.cpu().float(), want.float(), atol=3e-2, rtol=3e-2)
    else:
        torch.testing.assert_close(got.cpu().float(), want.float(), atol=1e-2, rtol=2 ** -6)


@pytest.fixture(scope="module")
def fused():
    from kvflow.model.triton import fused_ops
    return fused_ops


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_delta", [True, False])
def test_add_rms_norm_matches_torch(fused, dtype, with_delta):
    from kvflow.csrc.ops import add_rms_norm_torch
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(5, 96, generator=gen).to(dtype)
    delta = torch.randn(5, 96, generator=gen).to(dtype) if with_delta else None
    w = (1 + 0.1 * torch.randn(96, generator=gen)).to(dtype)
    want_x = x.clone()
    want = add_rms_norm_torch(want_x, delta, w, 1e-5)
    got_x = x.clone().to(DEVICE)
    got = fused.add_rms_norm(got_x, None if delta is None else delta.to(DEVICE), w.to(DEVICE), 1e-5)
    _close_or_ulp(got_x, want_x)  # the residual stream, updated in place
    _close_or_ulp(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_matches_torch(fused, dtype):
    from kvflow.csrc.ops import silu_mul_torch
    gu = torch.randn(3, 2 * 80, generator=torch.Generator().manual_seed(2)).to(dtype)
    _close_or_ulp(fused.silu_mul(gu.to(DEVICE)), silu_mul_torch(gu))


@pytest.mark.parametrize("head_dim,dtype", [(32, torch.float32), (24, torch.float32),
                                            (64, torch.bfloat16)])
def test_rope_matches_torch_on_the_q_and_k_heads_only(fused, head_dim, dtype):
    from kvflow.csrc.ops import rope_torch_
    import numpy as np
    gen = torch.Generator().manual_seed(4)
    heads, kv = 3, 1
    qkv = torch.randn(6, (heads + 2 * kv) * head_dim, generator=gen).to(dtype)
    freqs = torch.outer(torch.arange(64, dtype=torch.float32),
                        1.0 / 10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    emb = torch.cat((freqs, freqs), dim=-1)
    positions = np.array([0, 5, 63, 2, 2, 40])
    want = qkv.clone()
    rope_torch_(want, heads + kv, head_dim, positions, emb.cos(), emb.sin())
    got = qkv.clone().to(DEVICE)
    fused.rope_(got, heads + kv, head_dim, torch.from_numpy(positions).to(DEVICE),
                emb.cos().to(DEVICE), emb.sin().to(DEVICE))
    _close_or_ulp(got, want)
    assert torch.equal(got.cpu()[:, (heads + kv) * head_dim:], qkv[:, (heads + kv) * head_dim:])  # v untouched
