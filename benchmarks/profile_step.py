"""Where one engine step's time goes: a prefill step and a decode step of the default model,
timed and broken down by torch.profiler, against the GEMM rate this machine reaches.

    .venv/bin/python benchmarks/profile_step.py [--dtype auto] [--threads 1] [--batch 64]
        [--context 360] [--prefill-tokens 2048] [--profile]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def matmul_flops_per_token(arch, with_logits: bool) -> float:
    """FLOPs of the projections (and the LM head) for one token."""
    h, i, d = arch.hidden_size, arch.intermediate_size, arch.head_dim
    q, kv = arch.num_attention_heads * d, arch.num_key_value_heads * d
    per_layer = 2 * h * (q + 2 * kv) + 2 * q * h + 2 * h * 2 * i + 2 * i * h
    return arch.num_hidden_layers * per_layer + (2 * h * arch.vocab_size if with_logits else 0)


def gemm_rate(dtype, m=512, k=576, n=3072, reps=20) -> float:
    """GFLOP/s of F.linear at a shape typical of this model."""
    import torch
    import torch.nn.functional as F
    x, w = torch.randn(m, k).to(dtype), torch.randn(n, k).to(dtype)
    F.linear(x, w)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(reps):
            F.linear(x, w)
        best = min(best, (time.perf_counter() - t0) / reps)
    return 2 * m * k * n / best / 1e9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=360)
    p.add_argument("--prefill-tokens", type=int, default=2048)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--profile", action="store_true", help="print the torch.profiler op table")
    args = p.parse_args()

    import kvflow  # noqa: F401  (first: it sets OMP_WAIT_POLICY=PASSIVE before torch loads)
    import numpy as np
    import torch

    from kvflow.attention.metadata import build_attention_metadata
    from kvflow.model.kv_cache import allocate_kv_caches
    from kvflow.model.loader import load_model, resolve_dtype
    from kvflow.model.malloc_tuning import retain_freed_memory
    from kvflow.model_path import default_model_path

    torch.set_num_threads(args.threads)
    dtype = resolve_dtype(args.dtype)
    model, arch = load_model(default_model_path(), dtype)
    bs = 16
    blocks_per_seq = -(-(args.context + 8) // bs)
    n_blocks = max(args.batch * blocks_per_seq, -(-args.prefill_tokens // bs) + 64) + 1
    kv = allocate_kv_caches(arch, n_blocks, bs, dtype)
    retain_freed_memory()  # as the engine's runner does: activations reuse the heap
    rng = np.random.default_rng(0)
    perm = rng.permutation(np.arange(1, n_blocks))

    def run(query_lens, seq_lens, tables, logits_rows):
        meta = build_attention_metadata(np.array(query_lens), np.array(seq_lens), tables, bs)
        ids = torch.from_numpy(rng.integers(100, arch.vocab_size - 100, meta.num_tokens))
        with torch.inference_mode():
            hidden = model(ids, torch.from_numpy(meta.positions), kv, meta)
            model.compute_logits(hidden[logits_rows]).argmax(-1)

    # prefill: prompts of ~300 tokens, no prior context
    lens, left = [], args.prefill_tokens
    while left > 0:
        lens.append(min(300, left))
        left -= lens[-1]
    tables, at = [], 0
    for n in lens:
        k = -(-n // bs)
        tables.append(perm[at:at + k].tolist())
        at += k
    starts = torch.tensor(np.cumsum(lens) - 1)
    prefill = lambda: run(lens, lens, tables, starts)  # noqa: E731
    # decode: batch rows of one token at `context` positions
    dtables = [perm[i * blocks_per_seq:(i + 1) * blocks_per_seq].tolist() for i in range(args.batch)]
    ctx = (args.context + rng.integers(-5, 5, args.batch)).tolist()
    decode = lambda: run([1] * args.batch, ctx, dtables, torch.arange(args.batch))  # noqa: E731

    rate = gemm_rate(dtype)
    print(f"dtype {dtype}, threads {torch.get_num_threads()}, F.linear 512x576x3072: {rate:.1f} GFLOP/s")
    for name, fn, n_tok, n_logits in [("prefill", prefill, sum(lens), len(lens)),
                                      ("decode", decode, args.batch, args.batch)]:
        fn()
        times = []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        t = statistics.median(times)
        flops = n_tok * matmul_flops_per_token(arch, False) + n_logits * 2 * arch.hidden_size * arch.vocab_size
        print(f"{name}: {n_tok} tokens in {t * 1e3:.1f} ms = {n_tok / t:.0f} tok/s; "
              f"matmuls {flops / 1e9:.1f} GFLOP -> {flops / t / 1e9:.1f} GFLOP/s "
              f"({100 * flops / t / 1e9 / rate:.0f}% of F.linear's rate)")
        if args.profile:
            from torch.profiler import ProfilerActivity, profile
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                fn()
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18))


if __name__ == "__main__":
    main()
