"""Time prompt attention alone: the C backend (kvflow/attention/c_kernels.py) over 30 layers of
prompts read from a bf16 paged cache, through the flash-style prompt kernel (on AVX512-BF16,
and on AMX's tiles where the CPU has them; alternating, medians) and (`--rows`) through the decode kernel
with every prompt token as a row, the path the prompt kernel replaced (the only path for an fp32
q over an fp32 or bf16 cache: `--q-dtype float32` times its tiles of consecutive tokens against
one row at a time). With `--window W` every
layer is a sliding-window layer, and `--rows` times what windowed prompts ran through before
the prompt kernel took the window: decode rows (head sizes 64, 128) or SDPA with the window's
mask (others, such as Gemma 3's 256).

    .venv/bin/python benchmarks/prompt_attention.py [--lens 293,293,293,293,293,293,293]
        [--threads 1] [--rows] [--window 512 --heads 4,1,256 --layers 15]
        [--caches bfloat16,fp8,int8] [--q-dtype float32 --caches float32]

`--caches`: the prompt kernel over each KV cache dtype in turn, holding the same values (a
one-byte cache's tiles are widened into the kernel's scratch as it gathers them; fp8's rotated
rows rotated back).
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

from kvflow import attention as A  # noqa: E402
from kvflow.csrc import load_library  # noqa: E402
from kvflow.attention.kv_layout import cache_shape, resolve_kv_dtype, write_rows  # noqa: E402
from kvflow.model.cpu_features import cpu_features  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lens", default="293,293,293,293,293,293,293", help="prompt lengths")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--rows", action="store_true", help="also time prompt tokens as decode rows")
    p.add_argument("--window", type=int, default=None, help="sliding window of every layer")
    p.add_argument("--heads", default="9,3,64", help="query heads, kv heads, head size (SmolLM2-135M)")
    p.add_argument("--caches", default="bfloat16",
                   help="KV cache dtypes to time the prompt kernel over (bfloat16, fp8, int8)")
    p.add_argument("--q-dtype", default="bfloat16", choices=["bfloat16", "float32"],
                   help="the queries' dtype (float32: as an fp32 model passes them)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    heads, kv_heads, head_dim = (int(x) for x in args.heads.split(","))
    bs = 16
    lens = [int(n) for n in args.lens.split(",")]
    num_blocks = sum(-(-n // bs) for n in lens) + 1
    free = list(np.random.default_rng(0).permutation(num_blocks))
    tables = [[int(free.pop()) for _ in range(-(-n // bs))] for n in lens]
    slots = torch.arange(num_blocks * bs)
    rows = [(torch.randn(len(slots), kv_heads, head_dim), torch.randn(len(slots), kv_heads, head_dim))
            for _ in range(args.layers)]

    def filled(name: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
        dtype = resolve_kv_dtype({"fp8": "fp8_e4m3"}.get(name, name))
        out = []
        for k, v in rows:
            kc, vc = (torch.zeros(cache_shape(num_blocks, bs, kv_heads, head_dim, dtype), dtype=dtype)
                      for _ in range(2))
            write_rows(kc, vc, k, v, slots)
            out.append((kc, vc))
        return out

    cache_names = args.caches.split(",")
    by_dtype = {name: filled(name) for name in cache_names}
    caches = by_dtype[cache_names[0]]
    q = torch.randn(sum(lens), heads, head_dim).to(getattr(torch, args.q_dtype))
    meta = A.build_attention_metadata(np.array(lens), np.array(lens), tables, bs,
                                      sliding_window=args.window)

    def one_step(cache: str | None = None, **kw) -> float:
        layers = by_dtype[cache] if cache else caches
        # a one-byte cache's decode path (prompt tokens as its rows): the one this CPU takes
        kv_dtype = layers[0][0].dtype
        attend = A.CAttention(kv_dtype, q8_isa=A.best_q8_isa(cpu_features(), kv_dtype), **kw)
        t0 = time.perf_counter()
        for k, v in layers:
            attend(q, k, v, meta, head_dim ** -0.5, kv_heads)
        return time.perf_counter() - t0

    old = "decode rows" if args.window is None or head_dim in A.VECTOR_HEAD_DIMS else "masked SDPA"
    variants = {"prompt kernel": dict(prompt_kernel=True)}
    if load_library().prefill_amx_available():  # the same kernel's tile products on AMX
        variants["prompt kernel, AMX"] = dict(prompt_kernel=True, prompt_amx=True)
    if args.rows:
        variants[old] = dict(prompt_kernel=False)
        if q.dtype == torch.float32:
            variants[old + ", one at a time"] = dict(prompt_kernel=False, prompt_tiles=False)
    for name in cache_names[1:]:
        variants[f"prompt kernel, {name} cache"] = dict(prompt_kernel=True, cache=name)
    times: dict[str, list[float]] = {name: [] for name in variants}
    for kw in variants.values():
        one_step(**kw)  # warm-up
    for _ in range(args.reps):  # alternating
        for name, kw in variants.items():
            times[name].append(one_step(**kw))
    base = statistics.median(times["prompt kernel"])
    print(f"cache {cache_names[0]} unless named")
    for name, t in times.items():
        print(f"{name}: {args.layers} layers x prompts {args.lens}: "
              f"{statistics.median(t) * 1000:.1f} ms median of {args.reps} "
              f"({base / statistics.median(t):.2f}x the first line: the prompt kernel, or what "
              "serves where it has none)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
