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
from core_helpers import FakeRunner, make_request, make_scheduler  # noqa: E402
from kvflow.engine.snapshot import StepTokens, build_snapshot  # noqa: E402


def main() -> None:
    sched = make_scheduler(num_blocks=5825, block_size=16, budget=2048, max_num_seqs=128,
                           max_model_len=8192)
    for i in range(160):
        sched.add_request(make_request(f"r{i}", 300 + i, max_tokens=400))
    runner = FakeRunner()
    for _ in range(30):
        out = sched.schedule()
        sched.update_from_output(out, runner.execute(out))
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
