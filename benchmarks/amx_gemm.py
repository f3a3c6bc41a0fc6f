"""bf16 projections on a CPU with AMX: kvflow's AVX512-BF16 panel GEMM (kvflow/csrc/gemm_bf16.c)
against oneDNN through torch, at the default model's projection shapes and a range of row
counts, to find where each is faster (model/kernels.py chooses from these figures).

    .venv/bin/python benchmarks/amx_gemm.py [--threads 1,2] [--rows 1,4,16,64,256,1024]
        [--rounds 5] [--json benchmarks/results/NAME.json]

Methods, alternated inside each round (medians of the rounds are quoted, in microseconds per
call, and the GFLOP/s they make):
- `panel`: kvflow's panel GEMM (what serves bf16 on AVX512-BF16 CPUs before this benchmark);
- `F.linear`: torch's bf16 linear on the plain (N, K) weight: oneDNN's matmul, which takes its
  AMX kernel (`brg_matmul:avx10_1_512_amx` under ONEDNN_VERBOSE=1) where the CPU has AMX;
- `onednn`: torch's prepacked mkldnn linear (`_reorder_linear_weight` once, then
  `_linear_pointwise`; AMX's blocked weight layout, a second copy of the weight);
- `amx-panels`: kvflow's AMX kernel over the same panels as `panel` (kvflow/csrc/gemm_amx.c),
  where this build has AMX: what serves bf16 batches past a few rows on AMX CPUs.
The shapes are the default model's (SmolLM2-135M: hidden 576, 9 query and 3 KV heads of 64,
MLP 1536, vocabulary 49152): qkv 576->960, o 576->576, gate_up 576->3072, down 1536->576, and
the LM head 576->49152 (rows up to 256: only sampled rows reach it); `--shapes 1b_qkv,...` the
Llama-3.2-1B shapes (hidden 2048, 32/8 heads of 64, MLP 8192). `--verbose-check` runs
one call of each under ONEDNN_VERBOSE=1 and prints the kernel oneDNN names."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SHAPES = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576),
          "lm_head": (576, 49152), "1b_qkv": (2048, 3072), "1b_o": (2048, 2048),
          "1b_gate_up": (2048, 16384), "1b_down": (8192, 2048)}
DEFAULT_SHAPES = "qkv,o,gate_up,down,lm_head"
LM_HEAD_MAX_ROWS = 256


def _time(fn, budget_s: float = 0.03) -> float:
    """Seconds per call: repeated calls until `budget_s` has passed (after one warm call)."""
    fn()
    n, t0 = 0, time.perf_counter()
    while True:
        fn()
        n += 1
        t = time.perf_counter() - t0
        if t >= budget_s and n >= 3:
            return t / n


def verbose_check() -> str:
    """The oneDNN kernel names for one bf16 F.linear and one prepacked call (a subprocess, so
    ONEDNN_VERBOSE is set before torch loads oneDNN)."""
    code = ("import torch, torch.nn.functional as F\n"
            "x=torch.randn(64,576).bfloat16(); w=torch.randn(3072,576).bfloat16()\n"
            "F.linear(x,w)\n"
            "p=torch.ops.mkldnn._reorder_linear_weight(w,64)\n"
            "torch.ops.mkldnn._linear_pointwise(x,p,None,'none',[],'')\n")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "ONEDNN_VERBOSE": "1"},
                         capture_output=True, text=True).stdout
    kernels = [line.split(",")[5:7] for line in out.splitlines()
               if line.startswith("onednn_verbose") and ",exec," in line]
    return "; ".join(f"{kind}={impl}" for kind, impl in kernels)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rows", default="1,4,16,64,256,1024")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--shapes", default=DEFAULT_SHAPES)
    ap.add_argument("--json", help="write a results file (benchmarks/results_io.py's 'table')")
    args = ap.parse_args()

    import torch
    import torch.nn.functional as F

    from benchmarks import results_io
    from kvflow.csrc.gemm import amx_panel_gemm, amx_panels_built, pack_panels, panel_gemm, panel_gemm_built

    if not panel_gemm_built():
        sys.exit("the panel GEMM did not build here (it needs AVX512-BF16)")
    check = verbose_check()
    print(f"oneDNN kernels: {check}")
    torch.manual_seed(0)
    start = time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime())
    load_before = os.getloadavg()[0]
    rows_out = []
    for threads in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(threads)
        for name in args.shapes.split(","):
            k, n = SHAPES[name]
            w = (torch.randn(n, k) * 0.05).bfloat16()
            panels = pack_panels(w)
            prepacked = torch.ops.mkldnn._reorder_linear_weight(w, 64)
            for m in [int(r) for r in args.rows.split(",")]:
                if name == "lm_head" and m > LM_HEAD_MAX_ROWS:
                    continue
                x = torch.randn(m, k).bfloat16()
                ref = F.linear(x.float(), w.float())
                methods = {
                    "panel": lambda: panel_gemm(x, panels, n, None, threads),
                    "F.linear": lambda: F.linear(x, w),
                    "onednn": lambda: torch.ops.mkldnn._linear_pointwise(x, prepacked, None, "none", [], ""),
                }
                if amx_panels_built():
                    methods["amx-panels"] = lambda: amx_panel_gemm(x, panels, n, None, threads)
                for label, fn in methods.items():  # each agrees with fp32 to bf16 rounding
                    err = (fn().float() - ref).abs().max().item()
                    assert err <= 0.02 * ref.abs().max().item() + 1e-3, (label, name, m, err)
                times = {label: [] for label in methods}
                for _ in range(args.rounds):
                    for label, fn in methods.items():
                        times[label].append(_time(fn))
                med = {label: statistics.median(t) for label, t in times.items()}
                flops = 2 * m * k * n
                best = min(med, key=med.get)
                cells = [f"{med[lbl] * 1e6:,.1f} us ({flops / med[lbl] / 1e9:.0f})" for lbl in methods]
                row = [str(threads), name, f"{k}x{n}", str(m), *cells, best,
                       f"{med['panel'] / med['onednn']:.2f}x"]
                if "amx-panels" in med:
                    row.append(f"{med['amx-panels'] / med['onednn']:.2f}x")
                rows_out.append(row)
                print(" | ".join(row), flush=True)
    end = time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime())
    load_after = os.getloadavg()[0]
    columns = ["threads", "projection", "K x N", "rows M", "panel (GFLOP/s)",
               "F.linear bf16 (GFLOP/s)", "oneDNN prepacked (GFLOP/s)", "fastest",
               "panel / oneDNN prepacked"]
    if amx_panels_built():
        columns[-2:-2] = ["AMX over the panels (GFLOP/s)"]
        columns.append("AMX over the panels / oneDNN prepacked")
    print(f"load average before {load_before:.1f}, after {load_after:.1f}")
    if args.json:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        report = {
            "schema": results_io.SCHEMA, "kind": "table",
            "title": "bf16 projections of the default model: kvflow's panel GEMM vs oneDNN (AMX)",
            "date": start, "end": end, "commit": results_io.git_commit(root),
            "command": "python benchmarks/amx_gemm.py " + " ".join(sys.argv[1:]),
            "cpu": results_io.cpu_info(),
            "conditions": (f"load average {load_before:.1f} before, {load_after:.1f} after, on "
                           f"{os.cpu_count()} vCPUs shared with other jobs; medians of "
                           f"{args.rounds} rounds, methods alternated"),
            "source": "this run", "columns": columns, "rows": rows_out,
            "notes": [f"oneDNN kernels (ONEDNN_VERBOSE=1): {check}",
                      "times are microseconds per call; GFLOP/s in brackets"],
        }
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
            f.write("\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
