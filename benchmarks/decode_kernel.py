"""Time kvflow's decode attention kernel alone: one call per layer over a W1-sized batch whose
blocks are scattered over each layer's own cache, as in a real decode step.

    .venv/bin/python benchmarks/decode_kernel.py [--cache-dtype bfloat16] [--batch 128]
        [--context 340] [--threads 1] [--hot] [--io-bf16]

--hot points every request at the same blocks, so they stay in L2: what is left is compute.
--io-bf16 passes q and out in bf16, as the engine does with bf16 weights: with a bf16 cache on
AVX512-BF16 that is the vdpbf16ps row; without it, the fp32-q (AVX2) row. --prefetch-all: that
row prefetches every next block (kvflow's choice on a CPU with AMX), not only scattered ones.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import kvflow  # noqa: E402,F401 - first, so OMP_WAIT_POLICY applies before torch loads
import numpy as np  # noqa: E402
import torch  # noqa: E402

from kvflow.csrc import load_library, run_kernel  # noqa: E402
from kvflow.model import hugepages  # noqa: E402
from kvflow.attention.kv_layout import cache_shape  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cache-dtype", choices=["float32", "bfloat16"], default="bfloat16")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--context", type=int, default=340)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--threads", type=int, default=1, help="split over kvflow's kernel pool")
    p.add_argument("--hot", action="store_true", help="every request reads the same blocks")
    p.add_argument("--contiguous", action="store_true",
                   help="each request's blocks in a row, as a prompt's blocks after prefill")
    p.add_argument("--prefetch-all", action="store_true",
                   help="with --io-bf16: the bf16 row prefetches contiguous blocks too (as kvflow "
                        "chooses on a CPU with AMX)")
    p.add_argument("--io-bf16", action="store_true",
                   help="bf16 q and out, as the engine passes them with bf16 weights")
    args = p.parse_args()
    torch.set_num_threads(1)
    lib = load_library()
    if lib is None:
        print("the C kernels did not build here")
        return 1
    dtype = getattr(torch, args.cache_dtype)
    kernel = "paged_decode_bf16" if dtype == torch.bfloat16 else "paged_decode_f32"
    b, h, kvh, d, bs = args.batch, args.heads, args.kv_heads, args.head_dim, args.block_size
    per_req = -(-args.context // bs)
    rng = np.random.default_rng(0)
    shape = cache_shape(b * per_req, bs, kvh, d)
    # on huge pages where granted, as the engine's cache (KVFLOW_HUGEPAGES=0: 4 KiB pages)
    caches = [tuple(hugepages.copy_of(torch.randn(shape).to(dtype)) for _ in "kv")
              for _ in range(args.layers)]
    tables = np.stack([rng.permutation(b * per_req)[:per_req] for _ in range(b)]).astype(np.int64)
    if args.hot:
        tables[:] = tables[0]
    elif args.contiguous:
        tables = np.arange(b * per_req, dtype=np.int64).reshape(b, per_req)
    seq_lens = np.full(b, args.context, dtype=np.int64)
    rows = np.arange(b, dtype=np.int64)
    io_dtype = torch.bfloat16 if args.io_bf16 else torch.float32
    q, out = torch.randn(b, h, d).to(io_dtype), torch.empty(b, h, d, dtype=io_dtype)

    def one_step() -> float:
        t0 = time.perf_counter()
        for k, v in caches:
            run_kernel(kernel, [q.data_ptr(), h * d, k.data_ptr(), v.data_ptr(), tables.ctypes.data,
                                per_req, seq_lens.ctypes.data, rows.ctypes.data, h, kvh, d, bs,
                                out.data_ptr(), h * d, (3 if args.io_bf16 else 0) | (4 if args.prefetch_all else 0), 0, 0],
                   b, args.threads, farg=d ** -0.5)
        return time.perf_counter() - t0

    one_step()
    times = [one_step() for _ in range(args.reps)]
    read = 2 * args.layers * b * args.context * kvh * d * caches[0][0].element_size()
    med = statistics.median(times)
    print(f"{args.cache_dtype} cache, {args.threads} thread(s), {args.layers} layers x {b} requests x {args.context} tokens"
          f"{', bf16 q/out' if args.io_bf16 else ''}{', every block prefetched' if args.prefetch_all else ''}{' (hot blocks)' if args.hot else ' (contiguous blocks)' if args.contiguous else ''}: {med * 1000:.1f} ms median of {args.reps} "
          f"(min {min(times) * 1000:.1f}); K/V read {read / 1e9:.2f} GB -> {read / med / 1e9:.1f} GB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
