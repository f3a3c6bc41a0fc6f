"""Offline throughput benchmark (W1): random-token prompts, fixed output length, ignore_eos."""
from __future__ import annotations

import json
import time

from kvflow.entrypoints.worker_node import worker_node_status
from kvflow.options import add_engine_args, engine_kwargs
from kvflow.utils.w1_prompts import make_w1


def run_throughput(engine_kwargs: dict, num_prompts: int = 128, min_len: int = 32,
                   max_len: int = 512, output_len: int = 128, seed: int = 0) -> dict:
    from kvflow.entrypoints.llm import LLM
    from kvflow.sampling_params import SamplingParams

    t0 = time.perf_counter()
    llm = LLM(**engine_kwargs)
    startup = time.perf_counter() - t0
    prompts = make_w1(num_prompts, min_len, max_len, llm.engine.core.arch.vocab_size, seed)
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    core = llm.engine.core  # warmed up at start-up (kvflow/engine/warmup.py)
    core.executor.reset_comm_stats()  # time the measured run's collectives only (TP)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - t0
    n_in = sum(len(p) for p in prompts)
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    result = {"engine": "kvflow", "num_prompts": num_prompts, "input_tokens": n_in,
              "output_tokens": n_out, "wall_s": wall, "output_tok_s": n_out / wall,
              "total_tok_s": (n_in + n_out) / wall, "startup_s": startup,
              "dtype": str(core.dtype).removeprefix("torch."), "threads": core.config.num_threads,
              "tensor_parallel_size": core.tp_size, "pipeline_parallel_size": core.pp_size,
              "distributed_executor_backend": core.config.parallel_config.distributed_executor_backend}
    result.update(core.executor.comm_summary())
    llm.engine.shutdown()
    return result


def cmd_throughput(args) -> int:
    status = worker_node_status(args)  # --node-rank K > 0: this node runs workers only
    if status is not None:
        return status
    result = run_throughput(engine_kwargs(args), args.num_prompts, args.min_input_len,
                            args.max_input_len, args.output_len, args.dataset_seed)
    print(json.dumps(result, indent=2))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


def register(bench_sub) -> None:
    p = bench_sub.add_parser("throughput", help="offline throughput on random-token prompts (W1)")
    add_engine_args(p)
    p.add_argument("--num-prompts", type=int, default=128)
    p.add_argument("--min-input-len", type=int, default=32)
    p.add_argument("--max-input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--dataset-seed", type=int, default=0)
    p.add_argument("--output-json", default=None)
    p.set_defaults(func=cmd_throughput)
