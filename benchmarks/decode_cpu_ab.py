"""Single-stream decode cost of one kvflow checkout, in CPU time (user + system, all threads)
per output token: on a shared, noisy machine, CPU time moves far less with the neighbours'
load than wall time does, so two checkouts can be compared while other work runs.

    .venv/bin/python benchmarks/decode_cpu_ab.py /path/to/checkout   # prints RESULT {json}

The default model as it ships, 1 thread; 6 rounds of one 64-token random prompt for 1 token
and another for 129 tokens (the first round warms up and is left out): a decode token costs
(CPU of the long run - CPU of the short one) / 128. Run it alternately on the checkouts to
compare and take the medians' ratio."""
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


def main() -> None:
    llm = LLM(None, num_threads=1)
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
