"""One decode step of the default model per KV cache dtype, at a few batch sizes, with and without
the one-call decode step (model/decode_graph.py): where a W2 run's time per step goes.

    flock /tmp/kvflow-bench.lock .venv/bin/python benchmarks/kv_cache_step.py [--rows 4 8 16]

Steps over `--context` tokens of cache each (blocks scattered; the cache's values do not move the
time), variants alternating, medians. Prints JSON rows; writes benchmarks/results/kv_cache_step.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import kvflow  # noqa: E402,F401
import numpy as np  # noqa: E402
import torch  # noqa: E402


def main() -> int:
    from kv_cache_quant import cpu_name

    from kvflow.attention.metadata import build_attention_metadata
    from kvflow.model.kv_cache import allocate_kv_caches
    from kvflow.attention.kv_layout import resolve_kv_dtype
    from kvflow.model.loader import load_model, resolve_dtype
    from kvflow.model_path import default_model_path

    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, nargs="+", default=[4, 8, 16])
    p.add_argument("--context", type=int, default=320)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--caches", nargs="+", default=["float32", "bfloat16", "fp8_e4m3", "int8"])
    p.add_argument("--out", default=os.path.join(HERE, "results", "kv_cache_step.json"))
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    model, arch = load_model(default_model_path(), resolve_dtype("auto"), quantization="gguf")
    base = model.kernels
    bs = 16
    per_req = -(-(a.context + 1) // bs)
    nb = max(a.rows) * per_req
    tables = [list(range(r * per_req, (r + 1) * per_req))[::-1] for r in range(max(a.rows))]
    caches = {c: allocate_kv_caches(arch, nb, bs, resolve_kv_dtype(c)) for c in a.caches}
    variants = [(c, r, g) for r in a.rows for c in a.caches for g in (True, False)]
    times = {v: [] for v in variants}

    kernels = {c: base.with_kv_dtype(resolve_kv_dtype(c)) for c in a.caches}
    graphs = {}  # cache -> the model's (kernels, graph), built on its first step

    def step(cache, rows, graph):
        model.kernels = kernels[cache]
        model._decode_graph = graphs.get(cache, (None, None)) if graph else (model.kernels, None)
        meta = build_attention_metadata(np.ones(rows, dtype=np.int64), np.full(rows, a.context + 1),
                                        tables[:rows], bs)
        ids = torch.arange(100, 100 + rows)
        pos = torch.full((rows,), a.context)
        t0 = time.perf_counter()
        with torch.no_grad():
            hidden = model(ids, pos, caches[cache], meta)
            model.compute_logits(hidden)
        dt = time.perf_counter() - t0
        took = model._decode_graph[1] is not None
        if graph:
            graphs[cache] = model._decode_graph
        return dt, took

    for v in variants:
        step(*v)
    took = {}
    for _ in range(a.reps):
        for v in variants:
            dt, took[v] = step(*v)
            times[v].append(dt)
    rows = [{"cache": c, "rows": r, "one_call": g, "graph_built": took[(c, r, g)],
             "ms_per_step": statistics.median(times[(c, r, g)]) * 1e3,
             "min_ms": min(times[(c, r, g)]) * 1e3} for (c, r, g) in variants]
    for row in rows:
        print(json.dumps(row))
    with open(a.out, "w") as f:
        json.dump({"cpu": cpu_name(), "threads": a.threads, "context": a.context,
                   "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                   "command": "python benchmarks/kv_cache_step.py " + " ".join(sys.argv[1:]),
                   "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, HERE)
    sys.exit(main())
