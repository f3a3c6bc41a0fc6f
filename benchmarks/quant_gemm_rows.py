"""The quantized linear by row count, on the default model's shapes: the int8 GEMM (activations
quantized per block of 32), the widened path (weights widened to floats per thread,
kvflow/csrc/gemm_quant_wide.c) and the bf16 panel GEMM on the same shapes, each forced through
quant_linear's `wide_rows`; the three alternate inside each round and the medians are printed.
This is how kvflow/model/quant/qlinear.py's WIDE_ROWS was chosen.

    python benchmarks/quant_gemm_rows.py [--rows 1,8,32,128,512] [--rounds 9] [--threads 1]
        [--isa avx2 --dtype float32] [--kinds q8] [--per-row]

--isa forces one of the build's paths (avx2 on an AVX-512 machine runs the Zen 3 code: there the
widened path is the fp32 FMA one and the model's dtype fp32, so pair it with --dtype float32,
whose float column is then F.linear in fp32). --per-row quantizes the int8 column's
activations per row (int8 W8A8) instead of per block of 32 (GGUF).

Shapes: SmolLM2-135M's qkv (960 x 576), o (576 x 576), gate/up (3072 x 576), down (576 x 1536)
as 4-bit (its file is Q4_1) and 8-bit, and its tied LM head (49152 x 576, Q8_0). Random weights:
the time does not depend on the values."""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from kvflow.csrc.gemm import pack_panels, panel_gemm, panel_gemm_built  # noqa: E402
from kvflow.model.cpu_features import cpu_features  # noqa: E402
from kvflow.model.quant.packing import pack  # noqa: E402
from kvflow.model.quant.qlinear import NEVER, QuantizedWeight, best_isa, quant_linear  # noqa: E402

SHAPES = [("qkv", 960, 576, "q4"), ("o", 576, 576, "q4"), ("gate/up", 3072, 576, "q4"),
          ("down", 576, 1536, "q4"), ("qkv", 960, 576, "q8"), ("gate/up", 3072, 576, "q8"),
          ("down", 576, 1536, "q8"), ("lm_head", 49152, 576, "q8")]


def weight(kind: str, n: int, k: int, isa: str, rng, per_row: bool = False) -> QuantizedWeight:
    d = (rng.random((n, k // 32)) * 0.01).astype(np.float32)
    if kind == "q4":
        return QuantizedWeight(kind, n, k, pack(kind, rng.integers(0, 16, (n, k)).astype(np.uint8), d, -8 * d),
                               isa, "Q4_1")
    return QuantizedWeight(kind, n, k, pack(kind, rng.integers(-127, 128, (n, k)).astype(np.int8), d), isa,
                           "int8" if per_row else "Q8_0", per_row=per_row)


def dtype_name(dtype: torch.dtype) -> str:
    return "bf16" if dtype == torch.bfloat16 else "fp32"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,8,32,128,512")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--isa", help="a path the build has (default: the CPU's best)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                   help="the activations' (and the float GEMM's) dtype")
    p.add_argument("--kinds", default="q4,q8", help="weight kinds to run")
    p.add_argument("--per-row", action="store_true", help="int8 W8A8's per-row activation scales")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    isa = a.isa or best_isa(cpu_features())
    dtype = getattr(torch, a.dtype)
    print(f"{os.uname().machine}, quantized path {isa}, {a.dtype} activations, float column: "
          f"{'bf16 panel GEMM' if dtype == torch.bfloat16 else 'F.linear fp32'}, {a.threads} thread(s), {a.rounds} rounds, per-row {a.per_row}, "
          f"load average {os.getloadavg()[0]:.1f}")
    print(f"| shape | kind | rows | int8 ms | widened ms | {dtype_name(dtype)} ms |\n|---|---|---|---|---|---|")
    rng = np.random.default_rng(0)
    for name, n, k, kind in SHAPES:
        if kind not in a.kinds.split(","):
            continue
        w = weight(kind, n, k, isa, rng, per_row=a.per_row)
        wf = torch.randn(n, k).to(dtype)
        panels = pack_panels(wf) if panel_gemm_built() and dtype == torch.bfloat16 else None
        for m in (int(r) for r in a.rows.split(",")):
            x = torch.randn(m, k).to(dtype)
            fns = [lambda: quant_linear(x, w, threads=a.threads, wide_rows=NEVER),
                   lambda: quant_linear(x, w, threads=a.threads, wide_rows=1)]
            if panels is not None:
                fns.append(lambda: panel_gemm(x, panels, n, None, a.threads))
            elif dtype == torch.float32:
                fns.append(lambda: torch.nn.functional.linear(x, wf))
            times = [[] for _ in fns]
            for f in fns:
                f()
            for _ in range(a.rounds):
                for f, t in zip(fns, times):
                    t0 = time.perf_counter()
                    f()
                    t.append((time.perf_counter() - t0) * 1e3)
            cells = [f"{statistics.median(t):.3f}" for t in times] + ["-"] * (3 - len(times))
            print(f"| {name} {n}x{k} | {kind} | {m} | " + " | ".join(cells) + " |", flush=True)
    print(f"load average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
