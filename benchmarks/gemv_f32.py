"""The fp32 decode GEMV (kvflow/csrc/gemv_f32.c) against oneDNN and against this CPU's
weight-streaming rate, over the default model's fp32 weights (every projection of every
layer and the LM head: what one decode step reads), and from the same weights stored in bf16
(`weight_dtype=bfloat16`: half the bytes, widened to fp32 in the kernel).

    .venv/bin/python benchmarks/gemv_f32.py [--rows 1,2,3,4,6,8] [--threads 1] [--rounds 5]
        [--weight-dtypes float32,bfloat16]

Prints, per row count M, the time of one pass over all the weights for: `F.linear` on the
plain weights, oneDNN's prepacked GEMM (what kvflow used before), and the GEMV on each
instruction set this CPU runs (AVX-512 and AVX2 on a Zen 4: the AVX2 row is then a proxy for
a Zen 3). The streaming rate is measured twice: `F.linear` at M = 1 (as the first single-stream target measured
it) and a plain C read loop summing the same bytes. Methods alternate inside each round;
medians of the rounds are quoted. The half-precision bytes' rate is a read loop over them
(integer loads, so no bit pattern can be a slow float)."""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

READ_LOOP = r"""
#include <immintrin.h>
#include <stdint.h>
/* sum of n floats with eight independent 8-wide accumulators: a plain sequential read */
float read_sum(const float *p, int64_t n) {
    __m256 a[8];
    for (int i = 0; i < 8; i++) a[i] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 64 <= n; k += 64)
        for (int i = 0; i < 8; i++) a[i] = _mm256_add_ps(a[i], _mm256_loadu_ps(p + k + 8 * i));
    for (int i = 1; i < 8; i++) a[0] = _mm256_add_ps(a[0], a[i]);
    float s[8], t = 0;
    _mm256_storeu_ps(s, a[0]);
    for (int i = 0; i < 8; i++) t += s[i];
    for (; k < n; k++) t += p[k];
    return t;
}
/* xor of n bytes (n a multiple of 256) with eight 32-byte accumulators: the same read, for
 * bytes that are not floats */
int64_t read_xor(const uint8_t *p, int64_t n) {
    __m256i a[8];
    for (int i = 0; i < 8; i++) a[i] = _mm256_setzero_si256();
    for (int64_t k = 0; k + 256 <= n; k += 256)
        for (int i = 0; i < 8; i++)
            a[i] = _mm256_xor_si256(a[i], _mm256_loadu_si256((const __m256i *)(p + k + 32 * i)));
    for (int i = 1; i < 8; i++) a[0] = _mm256_xor_si256(a[0], a[i]);
    return _mm256_extract_epi64(a[0], 0);
}
"""


def read_loop():
    """The C read loop, compiled for this CPU (AVX2 loads: level with AVX-512 on a stream)."""
    d = tempfile.mkdtemp(prefix="kvflow-readloop-")
    src, so = os.path.join(d, "r.c"), os.path.join(d, "r.so")
    with open(src, "w") as f:
        f.write(READ_LOOP)
    subprocess.run(["cc", "-O3", "-mavx2", "-shared", "-fPIC", src, "-o", so], check=True)
    lib = ctypes.CDLL(so)
    lib.read_sum.restype, lib.read_sum.argtypes = ctypes.c_float, [ctypes.c_void_p, ctypes.c_int64]
    lib.read_xor.restype, lib.read_xor.argtypes = ctypes.c_int64, [ctypes.c_void_p, ctypes.c_int64]
    os.unlink(src)
    os.unlink(so)
    os.rmdir(d)
    return lib.read_sum, lib.read_xor


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rows", default="1,2,3,4,6,8")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--weight-dtypes", default="float32,bfloat16",
                   help="GEMV panel storage types to time (float32, bfloat16, float16)")
    args = p.parse_args()

    import kvflow  # noqa: F401  (first: it sets OMP_WAIT_POLICY=PASSIVE before torch loads)
    import torch
    import torch.nn.functional as F

    from kvflow.csrc.gemv import gemv_f32, gemv_isas, pack_gemv
    from kvflow.model.cpu_features import cpu_features
    from kvflow.model.loader import load_model
    from kvflow.model.packed_linear import PackedWeight, linear, pack_weight
    from kvflow.model_path import default_model_path

    torch.set_num_threads(args.threads)
    model, arch = load_model(default_model_path(), torch.float32)
    ws = [getattr(layer, name) for layer in model.layers
          for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")]
    ws.append(model.embed_tokens if model.lm_head is None else model.lm_head)
    for layer in model.layers:  # only this script's copies below
        layer.packed = {}
    model.packed_lm_head = None
    ws = [w.detach().contiguous() for w in ws]
    nbytes = sum(w.numel() * 4 for w in ws)
    onednn = [pack_weight(w, panels=False, onednn=True) for w in ws]
    f = cpu_features()
    isas = [i for i in ("avx512", "avx2") if i in gemv_isas()
            and (f.avx512 if i == "avx512" else {"avx2", "fma"} <= f.flags)]
    stored = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    wdts = [d for d in args.weight_dtypes.split(",") if d]
    gemv = {d: [PackedWeight(gemv=pack_gemv(w, stored[d])) for w in ws] for d in wdts}
    flat = torch.cat([w.reshape(-1) for w in ws])
    half = flat.to(torch.bfloat16)
    read_sum, read_xor = read_loop()
    half_bytes = half.numel() * 2 // 256 * 256
    threads = torch.get_num_threads()

    def pass_time(fn) -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    rows = [int(r) for r in args.rows.split(",")]
    xs = {m: [torch.randn(m, w.shape[1]) for w in ws] for m in rows}
    methods = {"read loop (C)": lambda m: read_sum(flat.data_ptr(), flat.numel()),
               "read loop (C, half bytes)": lambda m: read_xor(half.data_ptr(), half_bytes),
               "F.linear": lambda m: [F.linear(x, w) for x, w in zip(xs[m], ws)],
               "oneDNN prepacked": lambda m: [linear(x, w, pk) for x, w, pk in zip(xs[m], ws, onednn)]}
    short = {"float32": "", "bfloat16": " bf16", "float16": " fp16"}
    for isa in isas:
        for d in wdts:
            methods[f"gemv {isa}{short[d]}"] = (
                lambda i, g_: lambda m: [gemv_f32(x, g.gemv, w.shape[0], None, i, threads)
                                         for x, w, g in zip(xs[m], ws, g_)])(isa, gemv[d])
    results: dict[tuple[str, int], list[float]] = {}
    for _ in range(args.rounds):
        for m in rows:
            for name, fn in methods.items():
                if name.startswith("read loop") and m != rows[0]:
                    continue
                fn(m)  # warm (caches of small shapes, oneDNN primitives)
                results.setdefault((name, m), []).append(pass_time(lambda: fn(m)))
    from kvflow.utils.cpuinfo import read_cpuinfo

    cpu = read_cpuinfo().model_name
    print(f"CPU: {cpu}; "
          f"isa {f.isa}; threads {threads}; fp32 weights {nbytes / 1e6:.0f} MB "
          f"({len(ws)} matrices); medians of {args.rounds} rounds; load {os.getloadavg()[0]:.2f}")
    stream = statistics.median(results[("read loop (C)", rows[0])])
    print(f"read loop (C): {stream * 1e3:.1f} ms = {nbytes / stream / 1e9:.1f} GB/s")
    stream_half = statistics.median(results[("read loop (C, half bytes)", rows[0])])
    print(f"read loop (C) over the bf16 copy ({half_bytes / 1e6:.0f} MB): {stream_half * 1e3:.1f} ms "
          f"= {half_bytes / stream_half / 1e9:.1f} GB/s")
    print("GB/s below: the bytes each method reads (half for bf16/fp16 panels)")
    print("| M | " + " | ".join(n for n in methods if not n.startswith("read loop")) + " |")
    print("|---" * (len(methods) - 1) + "|")
    for m in rows:
        cells = []
        for name in methods:
            if name.startswith("read loop"):
                continue
            t = statistics.median(results[(name, m)])
            b = nbytes // 2 if name.endswith(("bf16", "fp16")) else nbytes
            cells.append(f"{t * 1e3:.1f} ms ({b / t / 1e9:.1f} GB/s)")
        print(f"| {m} | " + " | ".join(cells) + " |")
    med = {key: statistics.median(v) for key, v in results.items()}
    print("RESULT " + json.dumps({
        "weight_mb": nbytes / 1e6, "threads": threads, "read_loop_ms": 1e3 * stream,
        "read_loop_gb_s": nbytes / stream / 1e9, "f_linear_ms": 1e3 * med[("F.linear", rows[0])],
        "onednn_ms": 1e3 * med[("oneDNN prepacked", rows[0])], "rows": rows[0],
        "read_loop_half_ms": 1e3 * stream_half,
        "gemv_ms": 1e3 * med[(f"gemv {isas[0]}", rows[0])] if isas and "float32" in wdts else None,
        "gemv_bf16_ms": (1e3 * med[(f"gemv {isas[0]} bf16", rows[0])]
                         if isas and "bfloat16" in wdts else None)}))


if __name__ == "__main__":
    main()
