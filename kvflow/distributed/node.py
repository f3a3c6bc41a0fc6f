"""A worker node (--node-rank K > 0 of a multi-machine tensor-parallel engine).

Node 0 runs the engine (scheduler, driver rank, and its share of the workers). Every other
node runs the same command with its own `--node-rank`: it starts this node's workers, which
meet the driver at `--distributed-init-method` and take what to load from it, and waits. It
ends when the engine shuts the group down (0), or as soon as one of its workers fails (1,
after killing the others)."""
from __future__ import annotations

import logging
import signal

from kvflow.config import ParallelConfig
from kvflow.distributed.parallel import parse_init_method
from kvflow.distributed.supervisor import WorkerSupervisor, spawn_worker

logger = logging.getLogger("kvflow.distributed")


def run_worker_node(pc: ParallelConfig) -> int:
    """Start and supervise the workers of node `pc.node_rank`; the exit status of the node."""
    host, port = parse_init_method(pc.distributed_init_method)
    per_node = pc.tensor_parallel_size // pc.nnodes
    ranks = range(pc.node_rank * per_node, (pc.node_rank + 1) * per_node)
    supervisor = WorkerSupervisor({r: spawn_worker(f"{host}:{port}", r, pc.tensor_parallel_size)
                                   for r in ranks})
    shown = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks[0]}-{ranks[-1]}"
    logger.info("kvflow: node %d of %d, tensor-parallel %s, joining %s:%d",
                pc.node_rank, pc.nnodes, shown, host, port)

    def stop(signum, frame):
        supervisor.stopping = True
        supervisor.kill()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    status = supervisor.wait()
    if supervisor.failure:
        logger.error("kvflow: %s; node %d stopped", supervisor.failure, pc.node_rank)
    elif supervisor.stopping:
        return 130
    else:
        logger.info("kvflow: the engine shut the group down; node %d done", pc.node_rank)
    return status
