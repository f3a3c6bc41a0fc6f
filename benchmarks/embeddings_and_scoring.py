"""Embedding and prompt-scoring throughput on the default model, offline (LLM), with the cost
of prompt_logprobs against the same prompts without them. Variants alternate, repeated;
medians are reported. Run under `flock /tmp/kvflow-bench.lock` on a shared machine.

    python benchmarks/embeddings_and_scoring.py [--prompts 32] [--tokens 128] [--repeats 3]
"""
from __future__ import annotations

import argparse
import statistics
import time

from results_io import cpu_name  # beside this script
from kvflow import LLM, SamplingParams




def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()
    llm = LLM(dtype=args.dtype, max_model_len=1024, enable_prefix_caching=False)
    vocab = llm.engine.core.arch.vocab_size
    prompts = [[(97 * i + 31 * k) % (vocab - 100) + 50 for i in range(args.tokens)]
               for k in range(args.prompts)]
    n_tokens = args.prompts * args.tokens
    variants = {
        "embed (LAST)": lambda: llm.embed(prompts, use_tqdm=False),
        "generate max_tokens=1": lambda: llm.generate(
            prompts, SamplingParams(max_tokens=1, temperature=0), use_tqdm=False),
        "generate max_tokens=1, prompt_logprobs=1": lambda: llm.generate(
            prompts, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1), use_tqdm=False),
        "generate max_tokens=1, prompt_logprobs=20": lambda: llm.generate(
            prompts, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=20), use_tqdm=False),
    }
    for run in variants.values():  # warm
        run()
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.repeats):
        for name, run in variants.items():
            t0 = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - t0)
    core = llm.engine.core
    print(f"{cpu_name()}; {core.startup_report().split('; kernels')[0]}")
    print(f"{args.prompts} prompts x {args.tokens} tokens, median of {args.repeats}")
    base = statistics.median(times["generate max_tokens=1"])
    for name, ts in times.items():
        m = statistics.median(ts)
        print(f"  {name:42s} {m * 1000:8.0f} ms  {n_tokens / m:8.0f} prompt tok/s  {m / base:5.2f}x")


if __name__ == "__main__":
    main()
