"""The quantized linear by row count, on the default model's shapes: the int8 GEMM (activations
quantized per block of 32), the widened path (weights widened to floats per thread,
kvflow/csrc/gemm_quant_wide.c) and the bf16 panel GEMM on the same shapes, each forced through
quant_linear's `wide_rows`; the three alternate inside each round and the medians are printed.
This is how kvflow/model/quant/qlinear.py's WIDE_ROWS was chosen.

    python benchmarks/quant_gemm_rows.py [--rows 1,8,32,128,512] [--rounds 9] [--threads 1]

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


def weight(kind: str, n: int, k: int, isa: str, rng) -> QuantizedWeight:
    d = (rng.random((n, k // 32)) * 0.01).astype(np.float32)
    if kind == "q4":
        return QuantizedWeight(kind, n, k, pack(kind, rng.integers(0, 16, (n, k)).astype(np.uint8), d, -8 * d),
                               isa, "Q4_1")
    return QuantizedWeight(kind, n, k, pack(kind, rng.integers(-127, 128, (n, k)).astype(np.int8), d), isa, "Q8_0")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,8,32,128,512")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    isa = best_isa(cpu_features())
    print(f"{os.uname().machine}, quantized path {isa}, bf16 panel GEMM: {panel_gemm_built()}, "
          f"{a.threads} thread(s), {a.rounds} rounds, load average {os.getloadavg()[0]:.1f}")
    print("| shape | kind | rows | int8 ms | widened ms | bf16 ms |\n|---|---|---|---|---|---|")
    rng = np.random.default_rng(0)
    for name, n, k, kind in SHAPES:
        w = weight(kind, n, k, isa, rng)
        panels = pack_panels(torch.randn(n, k).bfloat16()) if panel_gemm_built() else None
        for m in (int(r) for r in a.rows.split(",")):
            x = torch.randn(m, k).bfloat16()
            fns = [lambda: quant_linear(x, w, threads=a.threads, wide_rows=NEVER),
                   lambda: quant_linear(x, w, threads=a.threads, wide_rows=1)]
            if panels is not None:
                fns.append(lambda: panel_gemm(x, panels, n, None, a.threads))
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
