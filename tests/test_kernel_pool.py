"""kvflow's kernel thread pool (kvflow/csrc/pool.c): a kernel split over any number of
threads, by rows or by weight, gives the single-thread result exactly; the workers are real
threads, survive a fork and let a concurrent caller through."""
from __future__ import annotations

import os
import threading

import numpy as np
import pytest
import torch

from kvflow.csrc import run_kernel
from kvflow.csrc.gemm import pack_panels, panel_gemm_built
from kvflow import attention as A


def _silu(x: torch.Tensor, threads: int) -> torch.Tensor:
    n = x.shape[1] // 2
    out = torch.full((x.shape[0], n), float("nan"))
    run_kernel("silu_mul_f32", [x.data_ptr(), out.data_ptr(), n], x.shape[0], threads)
    return out


def _pool_threads() -> int:
    """The pool's workers among this process's threads, by the name they give themselves (other
    tests' threads may start or end meanwhile)."""
    n = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                n += f.read().strip() == "kvflow-pool"
        except FileNotFoundError:  # the thread ended while we looked
            pass
    return n


@pytest.mark.parametrize("threads", [2, 3, 5])
@pytest.mark.parametrize("rows", [2, 7, 64])
def test_split_rows_match_one_thread(threads, rows):
    x = torch.randn(rows, 2 * 48)
    want = _silu(x, 1)
    assert not want.isnan().any()
    assert torch.equal(_silu(x, threads), want)


def test_pool_runs_on_worker_threads():
    x = torch.randn(64, 96)
    _silu(x, 4)  # the pool holds three workers from here on
    before = _pool_threads()
    _silu(x, 4)
    _silu(x, 2)
    assert _pool_threads() == before, "the pool reuses its workers"
    assert before >= 3, "three pool workers besides the calling thread"
    # a worker that ran a range wrote it: rows in the last quarter are right
    assert torch.equal(_silu(x, 4)[48:], _silu(x, 1)[48:])


@pytest.mark.parametrize("threads", [2, 3])
def test_weighted_split_of_decode_rows_matches_one_thread(threads):
    """Rows of very different lengths: the ranges follow the key counts, and every row is
    computed exactly once (a row left out stays NaN, one computed twice would be the same)."""
    bs, kvh, h, d = 16, 2, 6, 64
    seq_lens = np.array([900, 3, 5, 1, 400, 2, 2, 7, 1, 64], dtype=np.int64)
    blocks = [list(range(sum(-(-int(s) // bs) for s in seq_lens[:i]),
                         sum(-(-int(s) // bs) for s in seq_lens[:i + 1]))) for i in range(len(seq_lens))]
    n_blocks = blocks[-1][-1] + 1
    k_cache = torch.randn(n_blocks, kvh, bs, d).to(torch.bfloat16)  # the tiles' shape (kv_layout.py)
    v_cache = torch.randn(n_blocks, kvh, bs, d).to(torch.bfloat16)
    meta = A.build_attention_metadata(np.ones(len(seq_lens), dtype=np.int64), seq_lens, blocks, bs)
    q = torch.randn(len(seq_lens), h, d)

    def run(t: int) -> torch.Tensor:
        out = torch.full_like(q, float("nan"))
        run_kernel("paged_decode_bf16",
                   [q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
                    meta.decode_block_tables.ctypes.data, meta.decode_block_tables.shape[1],
                    meta.decode_seq_lens.ctypes.data, meta.decode_rows.ctypes.data, h, kvh, d, bs,
                    out.data_ptr(), h * d, 0, 0, 0],
                   len(meta.decode_rows), t, farg=d ** -0.5, weights=meta.decode_seq_lens)
        return out

    want = run(1)
    assert not want.isnan().any()
    assert torch.equal(run(threads), want)


@pytest.mark.skipif(not panel_gemm_built(), reason="the panel GEMM needs AVX512-BF16")
@pytest.mark.parametrize("kernel,m", [("gemm_rows", 50), ("gemm_panels", 5), ("gemm_panels", 50)])
def test_gemm_split_by_rows_or_panels_matches_one_thread(kernel, m):
    n, k = 200, 96  # 4 panels, the last one partial
    w = torch.randn(n, k).to(torch.bfloat16)
    x = torch.randn(m, k).to(torch.bfloat16)
    panels = pack_panels(w)

    def run(t: int) -> torch.Tensor:
        out = torch.full((m, n), float("nan"), dtype=torch.bfloat16)
        words = [x.data_ptr(), k, k, panels.data_ptr(), None, out.data_ptr(), n, n, m, 0]
        run_kernel(kernel, words, m if kernel == "gemm_rows" else panels.shape[0], t)
        return out

    want = run(1)
    torch.testing.assert_close(want.float(), x.float() @ w.float().T, atol=0.1, rtol=0.02)
    for t in (2, 3):
        assert torch.equal(run(t), want)


def test_a_forked_child_starts_its_own_workers():
    x = torch.randn(64, 96)
    want = _silu(x, 1)
    _silu(x, 3)  # workers exist in the parent
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: the parent's workers are not here; a split must still finish
        try:
            ok = torch.equal(_silu(x, 3), want) and torch.equal(_silu(x, 2), want)
            os.write(w, b"1" if ok else b"0")
        finally:
            os._exit(0)
    os.close(w)
    got = os.read(r, 1)
    os.waitpid(pid, 0)
    assert got == b"1"


def test_concurrent_callers_both_get_their_results():
    """One job at a time: a caller that finds the pool busy runs its job alone."""
    xs = [torch.randn(256, 96) for _ in range(4)]
    wants = [_silu(x, 1) for x in xs]
    bad = []

    def work(i: int) -> None:
        for _ in range(50):
            if not torch.equal(_silu(xs[i], 2), wants[i]):
                bad.append(i)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads) and not bad

