"""Time prompt attention alone: `attention_with_kernels` over 30 layers of prompts read from a bf16
paged cache, through the flash-style prompt kernel and (`--rows`) through the decode kernel
with every prompt token as a row, the path the prompt kernel replaced. With `--window W` every
layer is a sliding-window layer, and `--rows` times what windowed prompts ran through before
the prompt kernel took the window: decode rows (head sizes 64, 128) or SDPA with the window's
mask (others, such as Gemma 3's 256).

    .venv/bin/python benchmarks/prompt_attention.py [--lens 293,293,293,293,293,293,293]
        [--threads 1] [--rows] [--window 512 --heads 4,1,256 --layers 15]
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

from kvflow.model import attention as A  # noqa: E402
from kvflow.model.kv_layout import cache_shape  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lens", default="293,293,293,293,293,293,293", help="prompt lengths")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--rows", action="store_true", help="also time prompt tokens as decode rows")
    p.add_argument("--window", type=int, default=None, help="sliding window of every layer")
    p.add_argument("--heads", default="9,3,64", help="query heads, kv heads, head size (SmolLM2-135M)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    heads, kv_heads, head_dim = (int(x) for x in args.heads.split(","))
    bs = 16
    lens = [int(n) for n in args.lens.split(",")]
    num_blocks = sum(-(-n // bs) for n in lens) + 1
    free = list(np.random.default_rng(0).permutation(num_blocks))
    tables = [[int(free.pop()) for _ in range(-(-n // bs))] for n in lens]
    shape = cache_shape(num_blocks, bs, kv_heads, head_dim)
    caches = [(torch.randn(shape).bfloat16(), torch.randn(shape).bfloat16()) for _ in range(args.layers)]
    q = torch.randn(sum(lens), heads, head_dim).bfloat16()
    meta = A.build_attention_metadata(np.array(lens), np.array(lens), tables, bs,
                                      sliding_window=args.window)

    def one_step(prompt_kernel: bool) -> float:
        t0 = time.perf_counter()
        for k, v in caches:
            A.attention_with_kernels(q, k, v, meta, head_dim ** -0.5, kv_heads,
                                     prompt_kernel=prompt_kernel)
        return time.perf_counter() - t0

    old = "decode rows" if args.window is None or head_dim in A.VECTOR_HEAD_DIMS else "masked SDPA"
    for name in ["prompt kernel", old] * 2 if args.rows else ["prompt kernel"]:
        one_step(name == "prompt kernel")
        times = [one_step(name == "prompt kernel") for _ in range(args.reps)]
        print(f"{name}: {args.layers} layers x prompts {args.lens}: "
              f"{statistics.median(times) * 1000:.1f} ms median of {args.reps}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
