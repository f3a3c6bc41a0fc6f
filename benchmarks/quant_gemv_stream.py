"""The quantized GEMM alone over a whole model's projections, one thread, as a decode step (one
row) or a few rows streams them: the rate at which it reads the packed weights. What the
software prefetch in kvflow/csrc/gemm_quant.c's one-row loops was tuned with.

    python benchmarks/quant_gemv_stream.py [--model 8b|small] [--rows 1] [--isa vnni|avx2]
        [--avx2-build] [--hugepages] [--reps 6]
    python benchmarks/quant_gemv_stream.py --ab REF [--formats Q8_0,Q4_0,Q6_K,Q4_K] [--rows 1]
        [--out FILE]

--ab REF: --rows rows (1: decode) at Llama-3.2-1B's shapes (down 2048x8192, gate or up 8192x2048, the tied LM
head 128256x2048), this checkout's records against those of commit REF (its gemm_quant.c built
the same way, its record sizes), calls alternating, each over enough copies of the weight
(~600 MB) that it streams from DRAM: ms per call, bytes per call, GB/s (medians).

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

REC = {"q4": 320, "q8": 544}
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
    scales = buf.reshape(nrec, rec)[:, rec - (32 if kind == "q8" else 64):]
    scales.view(np.uint16)[:] = 0x2000 + rng.integers(0, 1024, scales.view(np.uint16).shape, dtype=np.uint16)
    return buf


# --ab: how each GGUF format was packed before (REF: the old records) and now
AB_SHAPES = [("down", 2048, 8192), ("gate/up", 8192, 2048), ("lm_head", 128256, 2048)]
AB_KINDS = {  # format -> (kind code, record bytes per block of 32 inputs, fp16 scales' offset)
    "old": {"Q8_0": (1, 608, 512), "Q4_0": (0, 320, 256), "Q6_K": (1, 608, 512), "Q4_K": (0, 320, 256)},
    "new": {"Q8_0": (1, 544, 512), "Q4_0": (3, 288, 256), "Q6_K": (4, 420, None), "Q4_K": (5, 288, None)},
}
SUPER = {4: (3360, 3072, 3328), 5: (2304, 2048, 2240)}  # q6, q4k: record, scales, fp16 d per 256
AB_COPY_BYTES = 600e6


def _ab_build(tmp: str, name: str, sources: list[str]) -> ctypes.CDLL:
    so = os.path.join(tmp, f"{name}.so")
    subprocess.run(["cc", "-O3", "-march=native", "-shared", "-fPIC", "-std=c11", *sources, "-o", so,
                    "-lm"], check=True, capture_output=True)
    lib = ctypes.CDLL(so)
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.gemm_quant_panels.argtypes = [ptr, ptr, ptr, i64, i64, ptr, i64, i64, ptr, ptr, i64, i64,
                                      i64, i64, i64]
    return lib


def _ab_weight(n: int, k: int, code: int, rec: int, d_off: int | None, rng) -> np.ndarray:
    """Random records with sane fp16 scales (q6, q4k: per 256 inputs; packing.py)."""
    if code in SUPER:
        size, _, d_at = SUPER[code]
        buf = rng.integers(0, 256, (n // 16) * (k // 256) * size, dtype=np.uint8)
        recs = buf.reshape(-1, size)
        recs[:, d_at:].view(np.uint16)[:] = 0x2000 + rng.integers(0, 1024, recs[:, d_at:].view(np.uint16).shape,
                                                                  dtype=np.uint16)
        return buf
    buf = rng.integers(0, 256, (n // 16) * (k // 32) * rec, dtype=np.uint8)
    recs = buf.reshape(-1, rec)
    recs[:, d_off:rec if rec != 608 else d_off + 32].view(np.uint16)[:] = \
        0x2000 + rng.integers(0, 1024, recs[:, d_off:rec if rec != 608 else d_off + 32].view(np.uint16).shape,
                              dtype=np.uint16)
    return buf


def ab(a) -> None:
    import json

    from results_io import cpu_info, git_commit, RESULTS

    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(here)
    csrc = os.path.join(root, "kvflow", "csrc")
    rng = np.random.default_rng(0)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        old_dir = os.path.join(tmp, "old")
        os.makedirs(old_dir)
        for f in ("gemm_quant.c", "kernels.h", "simd.h"):
            with open(os.path.join(old_dir, f), "wb") as out:
                out.write(subprocess.run(["git", "-C", root, "show", f"{a.ab}:kvflow/csrc/{f}"],
                                         check=True, capture_output=True).stdout)
        libs = {"old": _ab_build(tmp, "old", [os.path.join(old_dir, "gemm_quant.c")]),
                "new": _ab_build(tmp, "new", [os.path.join(csrc, f) for f in ("gemm_quant.c", "gemm_q6.c", "gemm_q4k.c")
                                              if os.path.exists(os.path.join(csrc, f))])}
        for fmt in a.formats.split(","):
            for shape, n, k in AB_SHAPES:
                rows_m = a.rows
                qx = rng.integers(-127, 128, rows_m * k, dtype=np.int8)
                dx = np.full(rows_m * k // 32, 0.01, np.float32)
                dxs = np.full(rows_m * k // 32, 0.1, np.float32)
                out = np.empty(rows_m * n, np.uint16)
                setups = {}
                for side in ("old", "new"):
                    code, rec, d_off = AB_KINDS[side][fmt]
                    nbytes = (n // 16) * (k // 32) * rec
                    copies = [_ab_weight(n, k, code, rec, d_off, rng) for _ in range(max(1, int(AB_COPY_BYTES // nbytes)))]
                    fn = {4: getattr(libs[side], "gemm_q6_panels", None), 5: getattr(libs[side], "gemm_q4k_panels", None)
                          }.get(code, libs[side].gemm_quant_panels)
                    i64, ptr = ctypes.c_int64, ctypes.c_void_p
                    if code == 4:
                        fn.argtypes = [ptr, ptr, i64, i64, ptr, i64, ptr, ptr, i64, i64, i64, i64, i64]
                    if code == 5:
                        fn.argtypes = [ptr, ptr, ptr, i64, i64, ptr, i64, ptr, ptr, i64, i64, i64, i64, i64]
                    setups[side] = (code, nbytes, copies, fn)
                times = {"old": [], "new": []}
                for i in range(a.reps + 1):
                    for side in ("old", "new") if i % 2 else ("new", "old"):
                        code, nbytes, copies, fn = setups[side]
                        w = copies[i % len(copies)]
                        t0 = time.thread_time()  # CPU time: the host is shared, its waits are not ours
                        if code == 4:
                            fn(qx.ctypes.data, dx.ctypes.data, k // 32, rows_m, w.ctypes.data, 2, None,
                               out.ctypes.data, n, n, 1, 0, n // 16)
                        elif code == 5:
                            fn(qx.ctypes.data, dx.ctypes.data, dxs.ctypes.data, k // 32, rows_m, w.ctypes.data,
                               2, None, out.ctypes.data, n, n, 1, 0, n // 16)
                        else:
                            fn(qx.ctypes.data, dx.ctypes.data, dxs.ctypes.data, k // 32, rows_m, w.ctypes.data,
                               code, 2, None, out.ctypes.data, n, n, 1, 0, n // 16)
                        if i:
                            times[side].append(time.thread_time() - t0)
                row = [fmt, shape, n, k]
                for side in ("old", "new"):
                    ms = statistics.median(times[side]) * 1e3
                    row += [setups[side][1], round(ms, 3), round(setups[side][1] / ms / 1e6, 1)]
                row.append(round(row[5] / row[8], 3))
                rows.append(row)
                print(f"{fmt:5} {shape:8} {n}x{k}: before {row[4] / 1e6:.1f} MB {row[5]:.2f} ms {row[6]} GB/s"
                      f" | after {row[7] / 1e6:.1f} MB {row[8]:.2f} ms {row[9]} GB/s | speedup {row[10]}x",
                      flush=True)
                del setups
    result = {"schema": "kvflow-bench/1", "kind": "table",
              "title": "batch-1 quantized GEMV at Llama-3.2-1B shapes: records before and after",
              "date": time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime()), "commit": git_commit(root),
              "baseline_commit": a.ab, "command": " ".join(["python"] + sys.argv), "cpu": cpu_info(),
              "notes": [f"one thread, AVX-512 VNNI path, M={a.rows} rows; median of {a.reps} calls per side,"
                        " alternating, each over copies of the weight totalling ~600 MB (DRAM); the thread's CPU"
                        " time (time.thread_time), not wall time;"
                        f" host load {os.getloadavg()[0]:.1f} at the end (2 vCPUs shared)"],
              "columns": ["format", "shape", "N", "K", "bytes_before", "ms_before", "GB_s_before",
                          "bytes_after", "ms_after", "GB_s_after", "speedup"],
              "rows": rows}
    path = a.out or os.path.join(RESULTS, time.strftime("%Y%m%d-%H%M-quant-gemv-bytes.json", time.gmtime()))
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print("wrote", path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=list(SHAPES), default="8b")
    p.add_argument("--layers", type=int, default=4, help="8b: how many layers' projections")
    p.add_argument("--rows", type=int, default=1)
    p.add_argument("--isa", choices=["vnni", "avx2"], default="vnni")
    p.add_argument("--avx2-build", action="store_true")
    p.add_argument("--hugepages", action="store_true")
    p.add_argument("--reps", type=int, default=6)
    p.add_argument("--ab", metavar="REF", help="this checkout's records against REF's at 1B shapes")
    p.add_argument("--formats", default="Q8_0,Q4_0,Q6_K,Q4_K")
    p.add_argument("--out")
    a = p.parse_args()
    if a.ab:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        return ab(a)
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
