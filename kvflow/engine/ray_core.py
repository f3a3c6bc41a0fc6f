"""An engine core as a Ray actor: `kvflow serve --data-parallel-size N --data-parallel-backend
ray` places each replica's core in the Ray cluster (one CPU each) instead of starting it as a
child process, so that replicas can live on other nodes.

The actor runs the very loop of the process backend (core_proc.run_engine_core), connected to
the frontend's ZeroMQ sockets over TCP on the address Ray gives this node (not ipc: the actor
may be elsewhere). `RayEngineCore` has the face of the multiprocessing.Process it replaces
(`is_alive`, `join`, `terminate`, `kill`, `exitcode`), so EngineCoreClient watches and stops
it the same way. The actor is owned by the frontend: Ray kills it if the frontend dies. Ray is
imported only on this backend (`pip install kvflow[ray]`)."""
from __future__ import annotations

from kvflow.config import EngineConfig
from kvflow.distributed.ray_workers import _import_ray, connect


class EngineCoreActor:
    """The actor: where it runs, and the core's loop (blocks for the engine's life)."""

    def pid(self) -> int:
        import os
        return os.getpid()

    def run(self, config: EngineConfig, input_addr: str, output_addr: str) -> int:
        from kvflow.engine.core_proc import run_engine_core
        try:
            run_engine_core(config, input_addr, output_addr, parent_pid=None)
        except SystemExit as e:  # its failures were reported on the output socket
            return int(e.code or 0)
        return 0


def ray_host(config: EngineConfig) -> str:
    """Join (or start) the cluster: the address this node's sockets are reached at."""
    return connect(config.parallel_config.ray_address, config.parallel_config.data_parallel_size)[1]


class RayEngineCore:
    """One engine core actor (see the module docstring); started at construction."""

    def __init__(self, config: EngineConfig, input_addr: str, output_addr: str) -> None:
        ray = self._ray = _import_ray()
        self.actor = ray.remote(num_cpus=1)(EngineCoreActor).options(
            name=None, max_restarts=0).remote()
        self.pid = ray.get(self.actor.pid.remote())  # before `run`, which holds the actor
        self._run = self.actor.run.remote(config, input_addr, output_addr)
        self.exitcode: int | None = None

    def start(self) -> None:
        """Started at construction (Process's face)."""

    def _finished(self, timeout: float) -> bool:
        done, _ = self._ray.wait([self._run], timeout=timeout)
        if done and self.exitcode is None:
            try:
                self.exitcode = self._ray.get(self._run)
            except Exception:  # noqa: BLE001 - the actor died (killed, or its node is gone)
                self.exitcode = -9
        return bool(done)

    def is_alive(self) -> bool:
        return not self._finished(0)

    def join(self, timeout: float | None = None) -> None:
        self._finished(timeout if timeout is not None else 1e9)

    def kill(self) -> None:
        self._ray.kill(self.actor, no_restart=True)
        self._finished(5.0)

    terminate = kill
