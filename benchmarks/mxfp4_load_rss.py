"""Peak RSS while loading a gpt-oss MXFP4 checkpoint, against its size: a random folder whose
experts dominate (tests/mxfp4_models.save_random_gpt_oss_mxfp4: hidden = expert width 1024, 32
experts, 4 layers: 214 MB of experts, 24 MB of bf16 floats) and llama.cpp's GGUF file of the
same model (its floats F32: 262 MB), each loaded in bf16 in a fresh process whose high-water
mark is reset after the runtime every load needs (torch, kvflow, the C kernels, torch's
meta-device ops). Each checkout given loads each in turn.

    .venv/bin/python benchmarks/mxfp4_load_rss.py [--checkout DIR ...] [--rounds 3] [--out FILE]

Writes the medians per checkout and format (bytes and ratios to the file's size) as json."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, ROOT)

from mxfp4_models import measure_load_rss, save_random_gpt_oss_mxfp4  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkout", action="append", default=None)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    checkouts = args.checkout or [ROOT]
    import torch

    from mxfp4_models import write_gpt_oss_gguf

    with tempfile.TemporaryDirectory() as tmp:
        os.environ["KVFLOW_CACHE_DIR"] = os.path.join(tmp, "cache")
        paths = {"hf": save_random_gpt_oss_mxfp4(os.path.join(tmp, "gpt-oss-mxfp4")),
                 "gguf": write_gpt_oss_gguf(save_random_gpt_oss_mxfp4(os.path.join(tmp, "fp32"),
                                                                      float_dtype=torch.float32),
                                            os.path.join(tmp, "gpt-oss-mxfp4.gguf"))}
        runs = {(c, fmt): [] for c in checkouts for fmt in paths}
        for _ in range(args.rounds):  # checkouts alternate within a round
            for (c, fmt) in runs:
                runs[c, fmt].append(measure_load_rss(paths[fmt], c))
    report = {"cpu": _cpu(), "rounds": args.rounds, "results": []}
    for (c, fmt), rs in runs.items():
        file_bytes = rs[0]["file_bytes"]
        peak = statistics.median(r["peak"] - r["before"] for r in rs)
        after = statistics.median(r["after"] - r["before"] for r in rs)
        row = {"checkout": c, "format": fmt, "file_bytes": file_bytes, "expert_bytes": rs[0]["expert_bytes"],
               "peak_over_start": int(peak), "after_over_start": int(after),
               "peak_ratio": round(peak / file_bytes, 3), "after_ratio": round(after / file_bytes, 3),
               "load_s": round(statistics.median(r["load_s"] for r in rs), 2)}
        report["results"].append(row)
        print(json.dumps(row))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown"


if __name__ == "__main__":
    main()
