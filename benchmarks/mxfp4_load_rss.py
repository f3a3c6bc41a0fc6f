"""Peak RSS while loading a gpt-oss MXFP4 folder, against the folder's size: a random folder
whose experts dominate (tests/mxfp4_models.save_random_gpt_oss_mxfp4: hidden = expert width
1024, 32 experts, 4 layers: 214 MB of experts, 24 MB of bf16 floats), loaded in bf16 in a fresh
process whose high-water mark is reset after the runtime every load needs (torch, kvflow, the
C kernels, torch's meta-device ops). Each checkout given loads it in turn.

    .venv/bin/python benchmarks/mxfp4_load_rss.py [--checkout DIR ...] [--rounds 3] [--out FILE]

Writes the medians per checkout (bytes and ratios to the file's size) as json."""
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
    with tempfile.TemporaryDirectory() as tmp:
        path = save_random_gpt_oss_mxfp4(os.path.join(tmp, "gpt-oss-mxfp4"))
        runs = {c: [] for c in checkouts}
        for _ in range(args.rounds):  # checkouts alternate within a round
            for c in checkouts:
                runs[c].append(measure_load_rss(path, c))
    report = {"cpu": _cpu(), "rounds": args.rounds, "results": []}
    for c, rs in runs.items():
        file_bytes = rs[0]["file_bytes"]
        peak = statistics.median(r["peak"] - r["before"] for r in rs)
        after = statistics.median(r["after"] - r["before"] for r in rs)
        row = {"checkout": c, "file_bytes": file_bytes, "expert_bytes": rs[0]["expert_bytes"],
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
