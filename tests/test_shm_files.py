"""Shared-memory files named after their maker: a start removes those of dead makers only."""
import os
import subprocess

from kvflow.distributed import shm_allreduce
from kvflow.utils.shm_files import SHM_DIR


def test_a_new_all_reduce_segment_sweeps_those_of_killed_drivers():
    gone = subprocess.Popen(["true"])
    gone.wait()
    orphan = os.path.join(SHM_DIR, f"kvflow-tp-{gone.pid}-leftover")
    open(orphan, "w").close()
    made = []
    try:
        made.append(shm_allreduce.create_segment(2, 4096))
        made.append(shm_allreduce.create_segment(2, 4096))  # the first one's maker still runs
        assert not os.path.exists(orphan)
        assert all(p is not None and os.path.basename(p).startswith(f"kvflow-tp-{os.getpid()}-")
                   for p in made)
        assert all(os.path.getsize(p) == 2 * 64 + 2 * 2 * 4096 for p in made)
    finally:
        for p in [orphan, *made]:
            if p is not None and os.path.exists(p):
                os.unlink(p)
