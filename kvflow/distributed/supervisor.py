"""Starting tensor-parallel worker processes and watching them.

Workers are plain subprocesses (`python -m kvflow.distributed.worker`), not multiprocessing
children: they can be started from the daemonic engine-core process of `kvflow serve`, and a
remote node runs the very same command. Each worker gets PR_SET_PDEATHSIG, so it dies with the
process that started it; the supervisor's thread notices a worker that dies and kills the
others, so that no rank is left waiting in a collective and no process is left behind."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import kvflow
from kvflow.distributed.worker import EXIT_LOAD_FAILED, EXIT_PEER_LOST

POLL_S = 0.1


def spawn_worker(rendezvous: str, rank: int, world_size: int) -> subprocess.Popen:
    """Start the worker of `rank`; it imports the same kvflow as this process."""
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(kvflow.__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return subprocess.Popen(
        [sys.executable, "-m", "kvflow.distributed.worker", "--rendezvous", rendezvous,
         "--rank", str(rank), "--world-size", str(world_size), "--parent-pid", str(os.getpid())],
        env=env, stdin=subprocess.DEVNULL)


def describe_exit(rank: int, proc: subprocess.Popen) -> str:
    code = proc.returncode
    if code < 0:
        try:
            how = f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            how = f"was killed by signal {-code}"
    elif code == EXIT_PEER_LOST:
        how = "lost its connection to another rank"
    elif code == EXIT_LOAD_FAILED:
        how = "could not load its shard"
    else:
        how = f"exited with code {code}"
    return f"tensor-parallel worker rank {rank} (pid {proc.pid}) {how}"


class WorkerSupervisor:
    """Watches a set of worker processes from a thread. The first non-zero exit is recorded in
    `failure` (the root cause: a rank that merely lost its peers is blamed last) and every
    other worker is killed at once."""

    def __init__(self, workers: dict[int, subprocess.Popen]) -> None:
        self.workers = workers
        self.failure: str | None = None
        self.stopping = False
        self._thread = threading.Thread(target=self._watch, name="kvflow-tp-supervisor", daemon=True)
        self._thread.start()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.workers.values()]

    def _watch(self) -> None:
        while not self.stopping:
            dead = {r: p for r, p in self.workers.items() if p.poll() not in (None, 0)}
            if dead:
                if self.stopping:
                    return
                time.sleep(POLL_S)  # let a cascade of exits settle to find who went first
                dead = {r: p for r, p in self.workers.items() if p.poll() not in (None, 0)}
                rank = min(dead, key=lambda r: (dead[r].returncode == EXIT_PEER_LOST, r))
                self.failure = describe_exit(rank, dead[rank])
                self.kill()
                return
            if self.workers and all(p.poll() == 0 for p in self.workers.values()):
                return
            time.sleep(POLL_S)

    def wait_failure(self, timeout: float) -> str | None:
        """The recorded failure, waiting up to `timeout` s for the watcher to find one."""
        deadline = time.monotonic() + timeout
        while self.failure is None and self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(POLL_S / 2)
        return self.failure

    def kill(self) -> None:
        for p in self.workers.values():
            if p.poll() is None:
                p.kill()
        for p in self.workers.values():
            p.wait()

    def stop(self, timeout: float = 5.0) -> None:
        """Wait up to `timeout` s for the workers to exit by themselves, then kill the rest."""
        self.stopping = True
        deadline = time.monotonic() + timeout
        for p in self.workers.values():
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        self.kill()
        if self._thread is not threading.current_thread():
            self._thread.join()

    def wait(self) -> int:
        """Block until every worker has exited (a failure kills the rest): 0, or 1 on failure."""
        for p in self.workers.values():
            p.wait()
        self._thread.join()
        return 1 if self.failure else 0
