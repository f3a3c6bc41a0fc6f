"""The quantized GEMM alone over a whole model's projections, one thread, as a decode step (one
row) or a few rows streams them: the rate at which it reads the packed weights. What the
software prefetch in kvflow/csrc/gemm_quant.c's one-row loops was tuned with.

    python benchmarks/quant_gemv_stream.py [--model 8b|small] [--rows 1] [--isa vnni|avx2]
        [--avx2-build] [--hugepages] [--reps 6]

--model 8b: Llama-3-8B's projections as Q4_0 (qkv 6144x4096, o 4096x4096, gate_up 28672x4096,
down 4096x14336), --layers of them (4: 545 MB, well past the L3); small: SmolLM2-135M's 30
layers as Q4_1 plus its tied Q8_0 LM head (~84 MB). --avx2-build compiles gemm_quant.c as for
a Zen 3 (AVX-512 off), as tests/test_quantized_kernels.py does; --hugepages puts the weights on
2 MiB pages (kvflow/model/hugepages.py). Random weights: the time does not depend on them."""
from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import kvflow.csrc  # noqa: E402
from kvflow.csrc import library  # noqa: E402
from kvflow.model import hugepages  # noqa: E402

REC = {"q4": 320, "q8": 608}
SHAPES = {"8b": [(6144, 4096, "q4"), (4096, 4096, "q4"), (28672, 4096, "q4"), (4096, 14336, "q4")],
          "small": [(960, 576, "q4"), (576, 576, "q4"), (3072, 576, "q4"), (576, 1536, "q4")]}


def avx2_build(tmp: str) -> ctypes.CDLL:
    src = os.path.join(os.path.dirname(kvflow.csrc.__file__), "gemm_quant.c")
    so = os.path.join(tmp, "gemm_quant_avx2.so")
    subprocess.run(["cc", "-O3", "-march=x86-64-v3", "-mno-avx512f", "-shared", "-fPIC", "-std=c11",
                    src, "-o", so, "-lm"], check=True, capture_output=True)
    return ctypes.CDLL(so)


def packed_weight(n: int, k: int, kind: str, huge: bool, rng) -> np.ndarray:
    rec, nrec = REC[kind], (n // 16) * (k // 32)
    if huge:
        buf = hugepages.zeros(nrec * rec, hugepages.torch.uint8).numpy()
    else:
        buf = np.empty(nrec * rec, dtype=np.uint8)
    buf[:] = rng.integers(0, 256, buf.size, dtype=np.uint8)
    scales = buf.reshape(nrec, rec)[:, rec - (96 if kind == "q8" else 64):][:, :32 if kind == "q8" else 64]
    scales.view(np.uint16)[:] = 0x2000 + rng.integers(0, 1024, scales.view(np.uint16).shape, dtype=np.uint16)
    return buf


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=list(SHAPES), default="8b")
    p.add_argument("--layers", type=int, default=4, help="8b: how many layers' projections")
    p.add_argument("--rows", type=int, default=1)
    p.add_argument("--isa", choices=["vnni", "avx2"], default="vnni")
    p.add_argument("--avx2-build", action="store_true")
    p.add_argument("--hugepages", action="store_true")
    p.add_argument("--reps", type=int, default=6)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        lib = avx2_build(tmp) if a.avx2_build else library()
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        lib.gemm_quant_panels.argtypes = [ptr, ptr, ptr, i64, i64, ptr, i64, i64, ptr, ptr, i64, i64,
                                          i64, i64, i64]
        rng = np.random.default_rng(0)
        mats = SHAPES[a.model] * (a.layers if a.model == "8b" else 30)
        if a.model == "small":
            mats = mats + [(49152, 576, "q8")]
        weights = [packed_weight(n, k, kind, a.hugepages, rng) for n, k, kind in mats]
        kmax, nmax = max(k for _, k, _ in mats), max(n for n, _, _ in mats)
        qx = rng.integers(-127, 128, a.rows * kmax, dtype=np.int8)
        dx = np.full(a.rows * kmax // 32, 0.01, np.float32)
        dxs = np.full(a.rows * kmax // 32, 0.1, np.float32)
        out = np.empty(a.rows * nmax, np.uint16)
        isa = {"avx2": 1, "vnni": 2}[a.isa]
        times = []
        for _ in range(a.reps + 1):
            t0 = time.perf_counter()
            for (n, k, kind), w in zip(mats, weights):
                lib.gemm_quant_panels(qx.ctypes.data, dx.ctypes.data, dxs.ctypes.data, k // 32, a.rows,
                                      w.ctypes.data, int(kind == "q8"), isa, None, out.ctypes.data, n,
                                      n, 1, 0, n // 16)
            times.append(time.perf_counter() - t0)
        ms = statistics.median(times[1:]) * 1e3
        gb = sum(w.nbytes for w in weights) / 1e9
        print(f"{a.model} rows={a.rows} isa={a.isa}{' (AVX2-only build)' if a.avx2_build else ''}"
              f"{' hugepages' if a.hugepages else ''}: {ms:.2f} ms a pass over {gb * 1e3:.0f} MB, "
              f"{gb / ms * 1e3:.1f} GB/s (median of {a.reps}, load {os.getloadavg()[0]:.1f})")


if __name__ == "__main__":
    main()
