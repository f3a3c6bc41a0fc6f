"""The hybrid families' state layers in a decode step: kvflow/csrc/state_update.c against the
PyTorch paths, same process, alternating, medians.

One layer per family, random weights of small real shapes: LFM2's gated short conv (hidden
1024, kernel 3), Qwen3.5's Gated DeltaNet (hidden 1024, 16 q/k and 16 v heads of 128, conv 4)
and Granite 4.0-H's Mamba2 (hidden 1024, 32 heads of 64, state 128, 1 group, conv 4). Per
family and batch: the whole layer's forward (projections included) and the state part alone
(the layer with its projections replaced by a copy of prepared outputs), for a batch of
decodes in scattered slots, at two context lengths (which a state layer never reads: the
times should not move with it).

    .venv/bin/python benchmarks/state_decode.py [--threads 1] [--dtype bfloat16]
        [--batches 1 8] [--rounds 30] [--out results/<date>-state-decode.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import replace
from types import SimpleNamespace

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

import numpy as np  # noqa: E402
import torch  # noqa: E402

from kvflow.layers.gated_deltanet import GatedDeltaNet  # noqa: E402
from kvflow.layers.mamba2 import Mamba2  # noqa: E402
from kvflow.layers.short_conv import ShortConv  # noqa: E402
from kvflow.model.kernels import select_kernels  # noqa: E402

HIDDEN = 1024
FAMILIES = {
    "lfm2 short conv": lambda dt: ShortConv(HIDDEN, 3, False, dt),
    "qwen3.5 gated deltanet": lambda dt: GatedDeltaNet(HIDDEN, 16, 16, 128, 128, 4, 1e-6, dt),
    "granite4h mamba2": lambda dt: Mamba2(HIDDEN, 32, 64, 128, 1, 4, 1e-5, False, False,
                                          (0.0, float("inf")), dt),
}


def _meta(batch: int, context: int, slots: np.ndarray) -> SimpleNamespace:
    lens = np.ones(batch, dtype=np.int64)
    return SimpleNamespace(query_lens=lens, seq_lens=np.full(batch, context, dtype=np.int64),
                           query_start_loc=np.arange(batch + 1, dtype=np.int64),
                           state_slots=slots, state_saves=None)


class _Prepared:
    """Kernels whose `linear` hands back prepared outputs: the layer's state part alone."""

    def __init__(self, kernels, outs: dict):
        self.k, self.outs = kernels, outs

    def __getattr__(self, name):
        return getattr(self.k, name)

    def linear(self, x, w, packed=None, bias=None):
        return self.outs[w.shape[0]].clone()


def bench_family(name: str, dtype: torch.dtype, batch: int, contexts: list[int], rounds: int,
                 reps: int) -> list[list]:
    torch.manual_seed(0)
    layer = FAMILIES[name](dtype)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p.float()) * 0.05)
        if hasattr(layer, "A_log"):
            layer.A_log.uniform_(-1.0, 0.5)
    c_kernels = select_kernels(dtype)
    torch_kernels = replace(c_kernels, state_isa=None)
    packed = {n: c_kernels.pack(getattr(layer, n)) if c_kernels.pack else None
              for n in ("in_proj", "out_proj")}
    layer.allocate_state(4 * batch + 4, dtype)
    assert layer.c_kernels
    state_bytes = {n: getattr(layer, n).nbytes for n in ("state", "conv_state", "recurrent_state")
                   if getattr(layer, n, None) is not None}
    slots = np.random.default_rng(batch).permutation(4 * batch + 4)[:batch].astype(np.int64)
    h = torch.randn(batch, HIDDEN).to(dtype)
    with torch.no_grad():
        outs = {layer.in_proj.shape[0]: torch.randn(batch, layer.in_proj.shape[0]).to(dtype),
                layer.out_proj.shape[0]: torch.randn(batch, layer.out_proj.shape[0]).to(dtype)}
    cases = {}
    for context in contexts:
        meta = _meta(batch, context, slots)
        for path, k in (("c", c_kernels), ("torch", torch_kernels)):
            cases[("layer", context, path)] = (k, meta)
            cases[("state part", context, path)] = (_Prepared(k, outs), meta)
    times = {key: [] for key in cases}
    with torch.no_grad():
        for key, (k, meta) in cases.items():  # warm
            layer(h, meta, k, packed)
        for _ in range(rounds):  # alternating: every case once per round
            for key, (k, meta) in cases.items():
                t0 = time.perf_counter()
                for _ in range(reps):
                    layer(h, meta, k, packed)
                times[key].append((time.perf_counter() - t0) / reps)
    # nothing the layer holds grew with the contexts it was called at
    assert state_bytes == {n: getattr(layer, n).nbytes for n in state_bytes}
    rows = []
    for part in ("layer", "state part"):
        for context in contexts:
            c = statistics.median(times[(part, context, "c")]) * 1e6
            t = statistics.median(times[(part, context, "torch")]) * 1e6
            rows.append([name, batch, part, context, round(t, 1), round(c, 1), round(t / c, 2)])
            print(rows[-1], flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--contexts", type=int, nargs="+", default=[512, 8192])
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    from results_io import cpu_info, git_commit

    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    kernels = select_kernels(dtype)
    print(kernels.describe(), flush=True)
    load_before = os.getloadavg()  # the host is shared: its load, for reading the numbers
    rows = [r for name in FAMILIES for b in args.batches
            for r in bench_family(name, dtype, b, args.contexts, args.rounds, args.reps)]
    result = {"schema": "kvflow-bench/1", "kind": "table",
              "title": "state layers' decode step: C kernels against the PyTorch paths",
              "date": time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime()), "commit": git_commit(ROOT),
              "command": "benchmarks/state_decode.py " + " ".join(sys.argv[1:]), "cpu": cpu_info(),
              "source": "benchmarks/state_decode.py",
              "host_check": {"before": f"load average {load_before}", "after": f"load average {os.getloadavg()}"},
              "notes": [f"threads {args.threads}, dtype {args.dtype}, state isa {kernels.state_isa}; "
                        f"alternating rounds ({args.rounds} x {args.reps} calls), medians; "
                        "'state part': the layer with its two projections replaced by copies of "
                        "prepared outputs; the machine was shared with other jobs (noisy)"],
              "columns": ["family", "batch", "part", "context", "torch us", "c us", "speed-up"],
              "rows": rows}
    out = args.out or os.path.join(HERE, "results", time.strftime("%Y%m%d-%H%M") + "-state-decode.json")
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print("wrote", out)


if __name__ == "__main__":
    main()
