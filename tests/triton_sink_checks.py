"""The Triton paged-attention kernels with attention sinks (one logit per query head in every
softmax's denominator, a key whose value is zero) against the fp64 reference: the split-K
decode (the sinks join in the merge of the splits) and the varlen prefill, GQA, a sliding
window, one-byte caches, and the limits (-1e30: no sink; a huge sink: zeros).

Run as its own pytest process (tests/test_attention_sinks.py starts it): on CPU through
Triton's interpreter, which must be on before triton is first imported; with
KERNEL_CHECKS_DEVICE=cuda the same checks run compiled on a GPU."""
from __future__ import annotations

import os
import sys

DEVICE = os.environ.get("KERNEL_CHECKS_DEVICE", "cpu")
if DEVICE == "cpu":
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("triton was imported without TRITON_INTERPRET=1; run this file in "
                           "its own process (tests/test_attention_sinks.py does)")
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from triton_reference import filled_cache, reference_attention, scattered_tables  # noqa: E402

HEADS, KV_HEADS, DIM, BS = 8, 2, 64, 16


@pytest.fixture(scope="module")
def kernels():
    from kvflow.model.triton import paged_decode, paged_prefill
    return paged_decode.paged_decode, paged_prefill.paged_prefill


def _case(seq_lens, query_lens, cache_dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // BS) for n in seq_lens) + 2
    tables = scattered_tables(seq_lens, BS, num_blocks, gen)
    k_cache, v_cache = filled_cache(seq_lens, tables, KV_HEADS, DIM, BS, num_blocks, cache_dtype, gen)
    q = torch.randn(sum(query_lens), HEADS, DIM, generator=gen)
    sinks = torch.randn(HEADS, generator=gen) * 2
    return q, k_cache, v_cache, tables, sinks


def _dev(*ts):
    return [t.to(DEVICE) for t in ts]


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float8_e4m3fn, torch.int8],
                         ids=["f32", "fp8", "int8"])
@pytest.mark.parametrize("splits,window", [(1, None), (3, None), (2, 20)])
def test_paged_decode_with_sinks(kernels, cache_dtype, splits, window):
    seq_lens = [1, 17, 40, 70]
    q, k_cache, v_cache, tables, sinks = _case(seq_lens, [1] * 4, cache_dtype, seed=splits)
    want = reference_attention(q, k_cache, v_cache, tables, seq_lens, [1] * 4, 0.125, window,
                               sinks=sinks)
    qd, kd, vd, td, lens, sd = _dev(q, k_cache, v_cache, tables, torch.tensor(seq_lens), sinks)
    got = kernels[0](qd, kd, vd, td, lens, 0.125, num_splits=splits, sliding_window=window, sinks=sd)
    torch.testing.assert_close(got.cpu().double(), want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.int8], ids=["f32", "int8"])
@pytest.mark.parametrize("window", [None, 16])
def test_paged_prefill_with_sinks(kernels, cache_dtype, window):
    seq_lens, query_lens = [23, 40, 9, 70], [23, 7, 1, 33]  # a prompt, chunks, a decode
    q, k_cache, v_cache, tables, sinks = _case(seq_lens, query_lens, cache_dtype, seed=4)
    want = reference_attention(q, k_cache, v_cache, tables, seq_lens, query_lens, 0.125, window,
                               sinks=sinks)
    qsl = torch.tensor([0] + query_lens).cumsum(0)
    qd, kd, vd, td, lens, qsl, sd = _dev(q, k_cache, v_cache, tables, torch.tensor(seq_lens), qsl, sinks)
    got = kernels[1](qd, kd, vd, td, lens, qsl, max(query_lens), 0.125, sliding_window=window,
                     block_m=16, block_n=16, sinks=sd)
    torch.testing.assert_close(got.cpu().double(), want, atol=1e-4, rtol=1e-4)


def test_sink_limits(kernels):
    seq_lens, query_lens = [23, 40], [23, 1]
    q, k_cache, v_cache, tables, _ = _case(seq_lens, query_lens, torch.float32, seed=5)
    qsl = torch.tensor([0] + query_lens).cumsum(0)
    qd, kd, vd, td, lens, qsl = _dev(q, k_cache, v_cache, tables, torch.tensor(seq_lens), qsl)
    last = qd[[22, 23]].contiguous()  # each sequence's last token, as decode rows

    def both(sinks):
        return (kernels[0](last, kd, vd, td, lens, 0.125, num_splits=2, sinks=sinks),
                kernels[1](qd, kd, vd, td, lens, qsl, max(query_lens), 0.125, block_m=16,
                           block_n=16, sinks=sinks))

    for got, plain in zip(both(torch.full((HEADS,), -1e30, device=DEVICE)), both(None)):
        torch.testing.assert_close(got, plain, atol=1e-6, rtol=1e-6)
    for sink in (40.0, 1e30):
        for got in both(torch.full((HEADS,), sink, device=DEVICE)):
            assert got.isfinite().all() and got.abs().max() < 1e-9
