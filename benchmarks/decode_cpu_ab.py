"""Single-stream decode cost of one kvflow checkout, in CPU time (user + system, all threads)
per output token: on a shared, noisy machine, CPU time moves far less with the neighbours'
load than wall time does, so two checkouts can be compared while other work runs.

    .venv/bin/python benchmarks/decode_cpu_ab.py /path/to/checkout [--w1]   # RESULT {json}

The default model as it ships, 1 thread; 6 rounds of one 64-token random prompt for 1 token
and another for 129 tokens (the first round warms up and is left out): a decode token costs
(CPU of the long run - CPU of the short one) / 128. Run it alternately on the checkouts to
compare and take the medians' ratio. `--w1`: the W1 batch instead (128 random prompts of
32-512 tokens, 128 greedy output tokens each, one `generate` call): its CPU seconds and
output tokens per CPU second."""
from __future__ import annotations

import json
import os
import random
import resource
import sys
import time

root = sys.argv[1]
sys.path.insert(0, os.path.abspath(root))
os.environ.setdefault("OMP_NUM_THREADS", "1")

from kvflow.entrypoints.llm import LLM  # noqa: E402  (the checkout's own kvflow)
from kvflow.sampling_params import SamplingParams  # noqa: E402


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def w1(llm) -> None:
    from kvflow.utils.w1_prompts import make_w1

    prompts = make_w1(128, 32, 512, llm.engine.core.arch.vocab_size, 0)
    params = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:4], params, use_tqdm=False)  # warm-up
    c0, w0 = cpu_s(), time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    cpu, wall = cpu_s() - c0, time.perf_counter() - w0
    llm.engine.shutdown()
    print("RESULT", json.dumps({"checkout": root, "w1_cpu_s": cpu, "w1_wall_s": wall,
                                "w1_output_tok_per_cpu_s": 128 * 128 / cpu}))


def main() -> None:
    llm = LLM(None, num_threads=1)
    if "--w1" in sys.argv:
        return w1(llm)
    rng = random.Random(0)
    per_token, wall = [], []
    for i in range(6):
        costs = []
        for max_tokens in (1, 129):
            prompt = [rng.randrange(100, 40000) for _ in range(64)]
            c0, w0 = cpu_s(), time.perf_counter()
            llm.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                  ignore_eos=True), use_tqdm=False)
            costs.append((cpu_s() - c0, time.perf_counter() - w0))
        if i:
            per_token.append((costs[1][0] - costs[0][0]) / 128 * 1e3)
            wall.append((costs[1][1] - costs[0][1]) / 128 * 1e3)
    llm.engine.shutdown()
    per_token.sort()
    wall.sort()
    print("RESULT", json.dumps({"checkout": root, "cpu_ms_per_token": per_token[len(per_token) // 2],
                                "wall_ms_per_token": wall[len(wall) // 2], "rounds": per_token}))


if __name__ == "__main__":
    main()
