"""`kvflow bench ...` subcommands."""
from __future__ import annotations


def register(sub) -> None:
    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    from kvflow.entrypoints import bench_serve, bench_throughput
    bench_throughput.register(bench_sub)
    bench_serve.register(bench_sub)
