"""The hybrid families' state layers over a prompt: kvflow/csrc/state_scan.c (each ISA path)
against the PyTorch chunked forms, same process, alternating, medians, in prompt tokens/s.

One layer per family, random weights of real shapes: Qwen3.5-0.8B's Gated DeltaNet (hidden
1024, 16 q/k and 16 v heads of 128, conv 4) and Granite-4.0-H-tiny's Mamba2 (hidden 1536, 48
heads of 64, state 128, 1 group, conv 4). One fresh request's prompt of --tokens tokens in one
chunk; per thread count, the whole layer's forward (projections included) and the state part
alone (the layer with its projections replaced by a copy of prepared outputs).

    .venv/bin/python benchmarks/state_prompt.py [--threads 1 2] [--dtype bfloat16]
        [--tokens 512] [--isas avx512 avx2] [--rounds 7] [--out results/<date>-state-prompt.json]
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

from kvflow.csrc import state_update  # noqa: E402
from kvflow.layers.gated_deltanet import GatedDeltaNet  # noqa: E402
from kvflow.layers.mamba2 import Mamba2  # noqa: E402
from kvflow.model.kernels import select_kernels  # noqa: E402
from state_decode import _Prepared  # noqa: E402

FAMILIES = {
    "qwen3.5-0.8b gated deltanet": (1024, lambda dt: GatedDeltaNet(1024, 16, 16, 128, 128, 4, 1e-6, dt)),
    "granite-4.0-h-tiny mamba2": (1536, lambda dt: Mamba2(1536, 48, 64, 128, 1, 4, 1e-5, False, False,
                                                           (0.0, float("inf")), dt)),
}


def bench_family(name: str, dtype: torch.dtype, tokens: int, threads: list[int], isas: list[str],
                 rounds: int) -> list[list]:
    torch.manual_seed(0)
    hidden, make = FAMILIES[name]
    layer = make(dtype)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p.float()) * 0.05)
        layer.A_log.uniform_(-1.0, 0.5)
    kernels = select_kernels(dtype)
    paths = {"torch": replace(kernels, state_isa=None)}
    paths.update({f"c {isa}": replace(kernels, state_isa=isa) for isa in isas})
    packed = {n: kernels.pack(getattr(layer, n)) if kernels.pack else None for n in ("in_proj", "out_proj")}
    layer.allocate_state(4, dtype)
    assert layer.c_kernels
    lens = np.array([tokens], dtype=np.int64)
    meta = SimpleNamespace(query_lens=lens, seq_lens=lens.copy(),
                           query_start_loc=np.array([0, tokens], dtype=np.int64),
                           state_slots=np.array([2], dtype=np.int64), state_saves=None)
    h = torch.randn(tokens, hidden).to(dtype)
    outs = {w.shape[0]: torch.randn(tokens, w.shape[0]).to(dtype) for w in (layer.in_proj, layer.out_proj)}
    rows = []
    for n_threads in threads:
        torch.set_num_threads(n_threads)
        cases = {(part, path): (_Prepared(k, outs) if part == "state part" else k)
                 for part in ("layer", "state part") for path, k in paths.items()}
        times = {key: [] for key in cases}
        cpu = {key: [] for key in cases}  # process CPU time: on a shared host, the steadier figure
        with torch.no_grad():
            for k in cases.values():  # warm
                layer(h, meta, k, packed)
            for _ in range(rounds):  # alternating: every case once per round
                for key, k in cases.items():
                    t0, c0 = time.perf_counter(), time.process_time()
                    layer(h, meta, k, packed)
                    times[key].append(time.perf_counter() - t0)
                    cpu[key].append(time.process_time() - c0)
        for part in ("layer", "state part"):
            base = statistics.median(times[(part, "torch")])
            base_cpu = statistics.median(cpu[(part, "torch")])
            for path in paths:
                med, med_cpu = statistics.median(times[(part, path)]), statistics.median(cpu[(part, path)])
                rows.append([name, n_threads, part, path, tokens, round(med * 1e3, 2),
                             round(tokens / med), round(base / med, 2), round(med_cpu * 1e3, 2),
                             round(base_cpu / med_cpu, 2)])
                print(rows[-1], flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--isas", nargs="+", default=None, help="C paths to time (default: those built)")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    from results_io import cpu_info, git_commit

    dtype = getattr(torch, args.dtype)
    isas = args.isas or [i for i in state_update.state_isas() if i != "scalar"]
    print(select_kernels(dtype).describe(), flush=True)
    load_before = os.getloadavg()  # the host is shared: its load, for reading the numbers
    rows = [r for name in FAMILIES
            for r in bench_family(name, dtype, args.tokens, args.threads, isas, args.rounds)]
    result = {"schema": "kvflow-bench/1", "kind": "table",
              "title": "state layers over a prompt: C scans against the PyTorch chunked forms",
              "date": time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime()), "commit": git_commit(ROOT),
              "command": "benchmarks/state_prompt.py " + " ".join(sys.argv[1:]), "cpu": cpu_info(),
              "source": "benchmarks/state_prompt.py",
              "host_check": {"before": f"load average {load_before}", "after": f"load average {os.getloadavg()}"},
              "notes": [f"dtype {args.dtype}; one fresh request's {args.tokens}-token prompt in one "
                        f"chunk; alternating rounds ({args.rounds}), medians; 'torch': the layers' "
                        "chunked forms (64-token chunks), 'c <isa>': kvflow/csrc/state_scan.c; "
                        "'state part': the layer with its two projections replaced by copies of "
                        "prepared outputs; the machine was shared with other jobs (noisy): 'cpu ms' is the "
                        "process's CPU time (all threads), steadier than wall time there"],
              "columns": ["family", "threads", "part", "path", "tokens", "ms", "tokens/s",
                          "speed-up over torch", "cpu ms (all threads)", "cpu speed-up"],
              "rows": rows}
    out = args.out or os.path.join(HERE, "results", time.strftime("%Y%m%d-%H%M") + "-state-prompt.json")
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print("wrote", out)


if __name__ == "__main__":
    main()
