"""`--node-rank K > 0`: this machine runs tensor-parallel workers for node 0's engine."""
from __future__ import annotations

import argparse
import sys


def worker_node_status(args: argparse.Namespace) -> int | None:
    """On a node other than 0 of a tensor-parallel engine (--node-rank K), run this node's
    workers instead of an engine and return the exit status; None on node 0."""
    if args.node_rank == 0:
        return None
    from kvflow.config import ParallelConfig
    from kvflow.distributed.node import run_worker_node

    try:
        pc = ParallelConfig(args.tensor_parallel_size, args.distributed_init_method, args.nnodes,
                            args.node_rank)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return run_worker_node(pc)
