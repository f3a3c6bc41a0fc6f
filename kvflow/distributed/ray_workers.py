"""The `ray` executor backend: the workers (ranks 1..N-1) as Ray actors in a placement group.

The engine joins a Ray cluster (`ray_address`, else RAY_ADDRESS, else a local one-machine
cluster started for it on the loopback interface only), reserves one bundle per worker
(`{"CPU": 1}`, or a GPU) with the chosen strategy (PACK / SPREAD / STRICT_*), and starts one
actor per bundle. Each actor runs the very worker code of the `mp` backend
(kvflow.distributed.worker.run_worker): it meets the driver at the TCPStore rendezvous and
takes part in the torch.distributed collectives (gloo on CPU), so a step costs the same as on
the `mp` backend; Ray only places, starts and watches the processes.

`RayWorkers` has the face of supervisor.WorkerSupervisor: a thread waits on the actors' `run`
calls; the first one that ends badly (its actor died, or its worker exited non-zero) is
recorded in `failure`, and every actor is killed and the placement group removed at once, so
that no rank waits in a collective and nothing is left in the cluster. Ray is imported here
only, and only on this backend (`pip install kvflow[ray]`)."""
from __future__ import annotations

import logging
import os
import threading
import time

import kvflow
from kvflow.distributed.worker import EXIT_LOAD_FAILED, EXIT_PEER_LOST

logger = logging.getLogger("kvflow.distributed")
POLL_S = 0.1
PLACEMENT_TIMEOUT_S = 120.0


def _import_ray():
    try:
        import ray
    except ImportError:
        raise ImportError("distributed_executor_backend ray needs Ray: pip install 'kvflow[ray]'") from None
    return ray


class RankWorker:
    """The actor: where it runs, and the worker's loop (blocks for the engine's life)."""

    def where(self) -> tuple[str, int, str]:
        import ray
        return ray.get_runtime_context().get_node_id(), os.getpid(), ray.util.get_node_ip_address()

    def run(self, rendezvous: str, rank: int, world_size: int) -> int:
        from kvflow.distributed.worker import run_worker
        logging.basicConfig(level=logging.INFO, format="%(message)s")
        return run_worker(rendezvous, rank, world_size, parent_pid=None)


def connect(address: str | None, num_ranks: int) -> tuple[bool, str]:
    """Join (or start) the cluster; (whether this process started it, the driver's address as
    the workers should reach it)."""
    ray = _import_ray()
    if ray.is_initialized():
        return False, ray.util.get_node_ip_address()
    address = address or os.environ.get("RAY_ADDRESS")  # Ray's own variable, as `ray` reads it
    if address:
        ray.init(address=address, logging_level=logging.WARNING)
        return False, ray.util.get_node_ip_address()
    root = os.path.dirname(os.path.dirname(os.path.abspath(kvflow.__file__)))
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    # one machine: loopback only, no dashboard, a CPU per rank even on a small machine
    ray.init(address="local", _node_ip_address="127.0.0.1", include_dashboard=False,
             num_cpus=max(num_ranks, os.cpu_count() or 1), logging_level=logging.WARNING,
             runtime_env={"env_vars": {"PYTHONPATH": path}})
    return True, "127.0.0.1"


class RayWorkers:
    """The actors of `ranks` (see the module docstring). `bundle` is each worker's resources."""

    def __init__(self, ranks: list[int], strategy: str, bundle: dict[str, float],
                 started_cluster: bool) -> None:
        ray = _import_ray()
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.ranks = ranks
        self.started_cluster = started_cluster
        self.failure: str | None = None
        self.stopping = False
        self._killed = False
        self._lock = threading.Lock()
        self._refs: dict = {}
        self._thread: threading.Thread | None = None
        self.actors: dict[int, object] = {}
        self.pg = placement_group([dict(bundle) for _ in ranks], strategy=strategy,
                                  name=f"kvflow-{os.getpid()}-{id(self):x}")
        try:
            ready, _ = ray.wait([self.pg.ready()], timeout=PLACEMENT_TIMEOUT_S)
            if not ready:
                raise RuntimeError(
                    f"Ray could not place {len(ranks)} workers of {bundle} ({strategy}) within "
                    f"{PLACEMENT_TIMEOUT_S:.0f}s; the cluster has {ray.available_resources()} "
                    "free: add nodes or lower tensor/pipeline_parallel_size")
            actor_class = ray.remote(RankWorker)
            num_gpus = bundle.get("GPU", 0)
            for i, r in enumerate(ranks):
                self.actors[r] = actor_class.options(
                    num_cpus=bundle.get("CPU", 0), num_gpus=num_gpus, max_restarts=0,
                    name=f"kvflow-rank-{r}-{os.getpid()}",
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        self.pg, placement_group_bundle_index=i)).remote()
            # node id, pid and address of each: the driver decides shared memory from them
            self.where = dict(zip(ranks, ray.get([self.actors[r].where.remote() for r in ranks],
                                                 timeout=PLACEMENT_TIMEOUT_S)))
        except BaseException:
            self.kill()
            raise

    @property
    def pids(self) -> list[int]:
        return [w[1] for w in self.where.values()]

    def start(self, rendezvous: str, world_size: int) -> None:
        """Every actor joins the rendezvous; a thread watches their `run` calls."""
        self._refs = {self.actors[r].run.remote(rendezvous, r, world_size): r for r in self.ranks}
        self._thread = threading.Thread(target=self._watch, name="kvflow-ray-supervisor",
                                        daemon=True)
        self._thread.start()

    def _outcome(self, ref) -> tuple[int | None, str]:
        """(exit code or None if the actor died, how it ended)."""
        ray = _import_ray()
        rank = self._refs[ref]
        node, pid, ip = self.where[rank]
        who = f"tensor-parallel worker rank {rank} (Ray actor, pid {pid} on {ip})"
        try:
            code = ray.get(ref)
        except ray.exceptions.RayActorError as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            return None, f"{who} died ({type(e).__name__}: {first[:200]})"
        except ray.exceptions.RayError as e:
            return None, f"{who} failed ({type(e).__name__})"
        how = {EXIT_PEER_LOST: "lost its connection to another rank",
               EXIT_LOAD_FAILED: "could not load its shard"}.get(code, f"exited with code {code}")
        return code, f"{who} {how}"

    def _watch(self) -> None:
        ray = _import_ray()
        pending = list(self._refs)
        while pending and not self.stopping:
            done, pending = ray.wait(pending, num_returns=1, timeout=POLL_S)
            if not done:
                continue
            bad = [(ref, *self._outcome(ref)) for ref in done]
            bad = [b for b in bad if b[1] != 0]
            if not bad:
                continue  # a clean exit (the engine stopped the group)
            if self.stopping:
                return
            time.sleep(POLL_S)  # let a cascade of exits settle to find who went first
            more, pending = ray.wait(pending, num_returns=len(pending), timeout=0)
            bad += [b for b in ((ref, *self._outcome(ref)) for ref in more) if b[1] != 0]
            # the root cause: an actor that died, then a worker error; one that merely lost
            # its peers last
            _, code, why = min(bad, key=lambda b: (b[1] == EXIT_PEER_LOST, b[1] is not None,
                                                    self._refs[b[0]]))
            self.failure = why
            self.kill()
            return

    def wait_failure(self, timeout: float) -> str | None:
        deadline = time.monotonic() + timeout
        while (self.failure is None and self._thread is not None and self._thread.is_alive()
               and time.monotonic() < deadline):
            time.sleep(POLL_S / 2)
        return self.failure

    def kill(self) -> None:
        """Kill every actor and remove the placement group (once; safe from any thread)."""
        with self._lock:
            if self._killed:
                return
            self._killed = True
        ray = _import_ray()
        if not ray.is_initialized():
            return
        from ray.util.placement_group import remove_placement_group
        for actor in self.actors.values():
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - gone already
                pass
        try:
            remove_placement_group(self.pg)
        except Exception:  # noqa: BLE001
            pass

    def stop(self, timeout: float = 5.0) -> None:
        """Wait up to `timeout` s for the workers to return by themselves, then kill the rest;
        a cluster started for this engine is shut down."""
        self.stopping = True
        ray = _import_ray()
        if self._refs and ray.is_initialized():
            ray.wait(list(self._refs), num_returns=len(self._refs), timeout=timeout)
        self.kill()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        if self.started_cluster and ray.is_initialized():
            ray.shutdown()


def node_id() -> str:
    """This process's Ray node."""
    return _import_ray().get_runtime_context().get_node_id()
