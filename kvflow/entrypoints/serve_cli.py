"""`kvflow serve [MODEL]`: the OpenAI-compatible server."""
from __future__ import annotations

import argparse
import asyncio
import os
import sys

from kvflow.config import engine_config, parse_memory
from kvflow import envs

DEFAULT_SERVED_NAME = "SmolLM2-135M-Instruct"


def served_name(args: argparse.Namespace) -> str:
    """What clients pass as `model`: the path as given, or the default model's name."""
    if args.model is None:
        return DEFAULT_SERVED_NAME
    return os.path.basename(os.path.normpath(args.model)) if os.path.exists(args.model) else args.model


def cmd_serve(args: argparse.Namespace, engine_kwargs) -> int:
    from kvflow.entrypoints.cli import worker_node_status

    status = worker_node_status(args)  # --node-rank K > 0: this node runs workers, no server
    if status is not None:
        return status
    from kvflow.entrypoints.openai.api_server import run_server
    from kvflow.entrypoints.openai.serving_engine import ServerSettings

    if args.model_pos is not None:
        if args.model is not None and args.model != args.model_pos:
            print("error: give the model once (positional or --model)", file=sys.stderr)
            return 2
        args.model = args.model_pos
    try:
        config = engine_config(trace=args.trace, **engine_kwargs(args))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    settings = ServerSettings(
        served_model_names=args.served_model_name or [served_name(args)],
        api_key=args.api_key or envs.KVFLOW_API_KEY or None,
        max_waiting_requests=args.max_waiting_requests,
        max_body_bytes=parse_memory(args.max_body_size))
    try:
        return asyncio.run(run_server(config, settings, args.host, args.port, args.access_log))
    except OSError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


SERVE_MAX_NUM_BATCHED_TOKENS = 1024


def register(sub, add_engine_args, engine_kwargs) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible server (HTTP SSE + WebSocket)")
    p.add_argument("model_pos", nargs="?", default=None, metavar="MODEL",
                   help="HF folder or .gguf file (default: SmolLM2-135M-Instruct)")
    # A served prompt's first token waits for the end of the step that finishes it: on one CPU
    # core a 2,048-token step is ~2.5 s, a 1,024-token one ~1.3 s. Under load (W2 at 4 req/s)
    # TTFT p50 was 3,973 ms against 4,736, at the same throughput (benchmarks/README.md).
    add_engine_args(p, max_num_batched_tokens=SERVE_MAX_NUM_BATCHED_TOKENS)
    p.add_argument("--host", default="127.0.0.1", help="bind address (0.0.0.0 to listen on all)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' (also from KVFLOW_API_KEY)")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="model name(s) clients use; the first is reported")
    p.add_argument("--max-waiting-requests", type=int, default=None,
                   help="answer 503 (retry later) when more requests than this would wait")
    p.add_argument("--max-body-size", default="8MiB", help="largest request body (413 above)")
    p.add_argument("--access-log", action="store_true", help="log every HTTP request")
    p.add_argument("--trace", default=None,
                   help="write the engine's per-step trace (JSONL) here (`kvflow trace FILE` reads it)")
    p.set_defaults(func=lambda a: cmd_serve(a, engine_kwargs))
