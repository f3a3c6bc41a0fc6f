"""What one dashboard snapshot costs at the default pool size: 128 running requests over
5,825 blocks (the default 4 GiB pool of the default model). Target: well under 2.5 ms, i.e.
< 1% of the loop at 4 snapshots a second.

    .venv/bin/python benchmarks/snapshot_cost.py
"""
from __future__ import annotations

import os
import statistics
import sys
import time

import msgspec

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from core_helpers import default_pool_scheduler  # noqa: E402
from kvflow.engine.snapshot import StepTokens, build_snapshot  # noqa: E402


def main() -> None:
    sched = default_pool_scheduler()
    steps = [StepTokens(i, 1900, 128) for i in range(120)]
    costs = []
    for _ in range(50):
        t0 = time.perf_counter()
        msgspec.msgpack.encode(build_snapshot(sched, steps))
        costs.append(time.perf_counter() - t0)
    print(f"snapshot + encode: median {statistics.median(costs) * 1e3:.2f} ms, "
          f"max {max(costs) * 1e3:.2f} ms over {len(costs)} (running {len(sched.running)})")


if __name__ == "__main__":
    main()
