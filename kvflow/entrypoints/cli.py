"""`kvflow` command line: generate, serve, bench, trace. Engine flags come from kvflow/options.py."""
from __future__ import annotations

import argparse
import logging
import sys

from kvflow.entrypoints import bench_cli, router, serve_cli, trace_cli
from kvflow.entrypoints.worker_node import worker_node_status
from kvflow.options import add_engine_args, engine_kwargs, expand_dotted_flags


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
        llm = LLM(**engine_kwargs(args))
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


def build_parser() -> argparse.ArgumentParser:
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
    g.set_defaults(func=cmd_generate)

    trace_cli.add_explain_args(g)
    trace_cli.register(sub)
    serve_cli.register(sub)
    router.register(sub)
    bench_cli.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    parser = build_parser()
    try:  # vLLM's dotted keys of a JSON option: --limit-mm-per-prompt.image 4
        argv = expand_dotted_flags(sys.argv[1:] if argv is None else argv)
    except ValueError as e:
        parser.error(str(e))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
