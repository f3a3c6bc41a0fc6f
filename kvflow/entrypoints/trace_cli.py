"""`kvflow trace FILE.jsonl`: the step table of a recorded run, and its plot."""
from __future__ import annotations

import argparse
import sys


def register(sub) -> None:
    p = sub.add_parser("trace", help="print the step table of a trace (and plot it)",
                       description="Print the per-step table of a trace written by "
                                   "`kvflow generate --trace FILE` or LLM(trace=FILE).")
    p.add_argument("file", help="the JSONL step trace")
    p.add_argument("--requests", default=None, help="only these request ids, comma-separated")
    p.add_argument("--steps", default=None,
                   help="step range START:END (END exclusive, either may be omitted) or one step N")
    p.add_argument("--format", default="text", choices=["text", "markdown", "csv"])
    p.add_argument("--plot", default=None, metavar="OUT.png",
                   help="also draw the timeline / tokens / blocks figure to this file "
                        "(over the --steps range; --requests picks the lanes)")
    p.add_argument("--decode", action="store_true",
                   help="show sampled tokens as text (loads the tokenizer of --model)")
    p.add_argument("--model", default=None, help="model whose tokenizer --decode uses (default model)")
    p.set_defaults(func=cmd_trace)


def token_decoder(model: str | None):
    from kvflow.model_path import resolve_model_path
    from kvflow.tokenizer import get_tokenizer

    tok = get_tokenizer(resolve_model_path(model))
    return lambda t: tok.decode([t])


def cmd_trace(args: argparse.Namespace) -> int:
    from kvflow.trace.reader import load_trace, parse_step_range, select
    from kvflow.trace.table import render

    try:
        trace = load_trace(args.file)
        if not trace.steps:
            raise ValueError(f"{args.file} holds no steps")
        step_range = parse_step_range(args.steps)
        ids = [i.strip() for i in args.requests.split(",") if i.strip()] if args.requests else None
        unknown = [i for i in ids or () if i not in trace.request_ids]
        if unknown:
            raise ValueError(f"no request {', '.join(unknown)} in {args.file}; it has "
                             f"{', '.join(trace.request_ids[:20])}"
                             + (" ..." if len(trace.request_ids) > 20 else ""))
        steps = select(trace, ids, step_range)
        if not steps:
            raise ValueError(f"no steps match (the trace has steps {trace.steps[0].step}"
                             f"..{trace.steps[-1].step})")
        token_text = token_decoder(args.model) if args.decode else None
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    sys.stdout.write(render(steps, args.format, token_text))
    if args.plot:
        from kvflow.trace.plot import save_plot

        # Every step in range, so that (b) and (c) show the whole engine; lanes for the chosen ids.
        save_plot(select(trace, None, step_range), args.plot, ids)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


def add_explain_args(g: argparse.ArgumentParser) -> None:
    """`kvflow generate --explain` and its scenario options."""
    from kvflow.trace.explain import Scenario

    d = Scenario()
    g.add_argument("--explain", action="store_true",
                   help="run a small scripted scenario and explain each scheduler step "
                        "(no prompt needed)")
    g.add_argument("--explain-budget", type=int, default=d.budget, help="tokens per step")
    g.add_argument("--explain-block-size", type=int, default=d.block_size, help="tokens per KV block")
    g.add_argument("--explain-num-blocks", type=int, default=d.num_blocks, help="KV blocks in the pool")
    g.add_argument("--explain-prompts", default=",".join(map(str, d.prompts)),
                   help="prompt lengths in tokens, one per request (A, B, C, ...)")
    g.add_argument("--explain-arrivals", default=",".join(map(str, d.arrivals)),
                   help="the step at which each request arrives")
    g.add_argument("--explain-max-tokens", default=",".join(map(str, d.max_tokens)),
                   help="tokens each request generates (one value, or one per request)")


def cmd_explain(args: argparse.Namespace, engine_kwargs: dict) -> int:
    from kvflow.entrypoints.llm import LLM
    from kvflow.trace.explain import Scenario, explain, parse_ints

    def make_engine(**scenario_options):  # the scenario's options win over the command line's
        return LLM(**dict(engine_kwargs, **scenario_options)).engine

    try:
        sc = Scenario(args.explain_budget, args.explain_block_size, args.explain_num_blocks,
                      parse_ints(args.explain_prompts, "--explain-prompts"),
                      parse_ints(args.explain_arrivals, "--explain-arrivals"),
                      parse_ints(args.explain_max_tokens, "--explain-max-tokens"))
        text = explain(sc, make_engine, args.trace)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    sys.stdout.write(text)
    return 0
