"""`kvflow serve [MODEL]`: the OpenAI-compatible server."""
from __future__ import annotations

import argparse
import asyncio
import os
import sys

from kvflow.config import EngineConfig
from kvflow.entrypoints.openai.server_settings import ServerSettings
from kvflow.entrypoints.worker_node import worker_node_status
from kvflow.options import add_engine_args, add_option_args, engine_config, engine_kwargs, fields_as_options

DEFAULT_SERVED_NAME = "SmolLM2-135M-Instruct"
SERVER_OPTIONS = fields_as_options(ServerSettings)


def served_name(model: str | None) -> str:
    """What clients pass as `model` by default: the model's folder or file name as given, or
    the default model's name."""
    if model is None:
        return DEFAULT_SERVED_NAME
    return os.path.basename(os.path.normpath(model)) if os.path.exists(model) else model


def server_settings(args: argparse.Namespace, config: EngineConfig) -> ServerSettings:
    """The server's options from its flags; the served names from the model options."""
    names = config.model_config.served_model_name or [served_name(config.model_config.model)]
    return ServerSettings(**{o.field: getattr(args, o.name) for o in SERVER_OPTIONS},
                          served_model_names=names, lora_modules=config.lora_config.modules())


def cmd_serve(args: argparse.Namespace) -> int:
    status = worker_node_status(args)  # --node-rank K > 0: this node runs workers, no server
    if status is not None:
        return status
    from kvflow.entrypoints.openai.api_server import run_server

    if args.model_pos is not None:
        if args.model is not None and args.model != args.model_pos:
            print("error: give the model once (positional or --model)", file=sys.stderr)
            return 2
        args.model = args.model_pos
    try:
        config = engine_config(**engine_kwargs(args))
        settings = server_settings(args, config)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(run_server(config, settings))
    except OSError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


# A served prompt's first token waits for the end of the step that finishes it: on one CPU
# core a 2,048-token step is ~2.5 s, a 1,024-token one ~1.3 s. Under load (W2 at 4 req/s)
# TTFT p50 was 3,973 ms against 4,736, at the same throughput (benchmarks/README.md).
SERVE_DEFAULTS = {"max_num_batched_tokens": 1024}


def register(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible server (HTTP SSE + WebSocket)")
    p.add_argument("model_pos", nargs="?", default=None, metavar="MODEL",
                   help="HF folder or .gguf file (default: SmolLM2-135M-Instruct)")
    add_engine_args(p, **SERVE_DEFAULTS)
    add_option_args(p.add_argument_group("server"), SERVER_OPTIONS)
    p.set_defaults(func=cmd_serve)
