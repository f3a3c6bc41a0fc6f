"""Start a real `kvflow serve` subprocess on a free port, wait for /health, stop it, and check
that no process is left behind."""
from __future__ import annotations

import functools
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx
import psutil

from kvflow.utils.process import die_with_parent

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STARTUP_TIMEOUT_S = 240


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`python -m kvflow.entrypoints.cli serve ARGS` with its output in a log file."""

    def __init__(self, *args: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="kvflow-serve-", suffix=".log", delete=False)
        env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", KVFLOW_NUM_THREADS="1",
                   PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvflow.entrypoints.cli", "serve", "--port", str(self.port), *args],
            cwd=REPO, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
            # a killed test run leaves no server behind: SIGTERM it when the test process dies
            preexec_fn=functools.partial(die_with_parent, signal.SIGTERM))
        self.ps = psutil.Process(self.proc.pid)
        self._wait_ready()
        self.children = self.ps.children(recursive=True)

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvflow serve exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.kill()
        raise RuntimeError(f"kvflow serve not ready after {STARTUP_TIMEOUT_S}s:\n{self.output()}")

    def output(self) -> str:
        with open(self.log.name) as f:
            return f.read()

    @property
    def engine_pid(self) -> int:
        """The engine-core process (the multiprocessing spawn child, not the resource tracker)."""
        for child in self.children:
            if "spawn_main" in " ".join(child.cmdline()):
                return child.pid
        raise RuntimeError("no engine-core child process found")

    def leftover_children(self, timeout: float = 10.0) -> list[int]:
        _, alive = psutil.wait_procs(self.children, timeout=timeout)
        return [p.pid for p in alive]

    def terminate(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        """Send `sig` and wait for the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout)

    def kill(self) -> None:
        """Teardown of last resort: the whole process group."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(10)
        for child in self.children:
            if child.is_running():
                child.kill()

    def close(self) -> None:
        try:
            self.terminate(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        self.kill()
        self.log.close()
        os.unlink(self.log.name)


def metric_value(url: str, name: str) -> float:
    """One gauge or counter of the server's /metrics (the first series of that name)."""
    import re

    text = httpx.get(f"{url}/metrics", timeout=30).text
    m = re.search(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$", text, re.M)
    assert m, f"{name} missing from /metrics"
    return float(m.group(1))


def assert_server_clean(srv: ServerProcess, timeout: float = 60.0, headers: dict | None = None) -> None:
    """After a hostile or faulty request: the server is healthy, nothing is left waiting or
    running, every KV block is free again, and an ordinary completion still works."""
    deadline = time.monotonic() + timeout  # a hang guard: the core reports after its next step
    while True:
        health = httpx.get(f"{srv.url}/health", timeout=30).status_code
        waiting = metric_value(srv.url, "kvflow:num_requests_waiting")
        running = metric_value(srv.url, "kvflow:num_requests_running")
        free = metric_value(srv.url, "kvflow:num_free_blocks")
        total = metric_value(srv.url, "kvflow:num_total_blocks")
        if health == 200 and waiting == running == 0 and free == total:
            break
        assert time.monotonic() < deadline, (
            f"server not clean: health {health}, waiting {waiting}, running {running}, "
            f"free blocks {free} of {total}")
        time.sleep(0.1)
    resp = httpx.post(f"{srv.url}/v1/completions", headers=headers or {}, timeout=120,
                      json={"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0})
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["text"]
