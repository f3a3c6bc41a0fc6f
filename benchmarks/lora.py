"""The cost of LoRA: W1-style offline throughput (seeded random-token prompts, fixed output
length, ignore_eos) of the default model alone, against the same prompts with 4 LoRA adapters
(rank 16 on all seven projections, random weights) mixed over them round-robin, in one batch
(`--max-loras 4`), and with --enable-lora but every request on the base model (what turning it
on costs a server that serves the base too). Variants alternate within each round; medians
and ratios over the rounds go to benchmarks/results/lora.{json,md}.

    flock /tmp/kvflow-bench.lock .venv/bin/python benchmarks/lora.py --rounds 3

(The script takes the lock itself as well, so two benchmarks never overlap.) vLLM's CPU build
is not installed here, so there is no vLLM figure to set beside these.
"""
from __future__ import annotations

import argparse
import datetime
import fcntl
import json
import os
import platform
import statistics
import sys
import tempfile
import time

LOCK = "/tmp/kvflow-bench.lock"
HERE = os.path.dirname(os.path.abspath(__file__))


def write_adapters(model_path: str, root: str, n: int, r: int) -> list[str]:
    """n random PEFT-format adapters (all seven projections, rank r) for the model."""
    import torch
    from safetensors.torch import save_file

    from kvflow.model.arch import load_arch_config
    from kvflow.model.lora import TARGET_MODULES, module_shapes

    arch = load_arch_config(model_path)
    shapes = module_shapes(arch)
    paths = []
    for a in range(n):
        g = torch.Generator().manual_seed(a)
        tensors = {}
        for i in range(arch.num_hidden_layers):
            for m in TARGET_MODULES:
                block = "mlp" if m in ("gate_proj", "up_proj", "down_proj") else "self_attn"
                key = f"base_model.model.model.layers.{i}.{block}.{m}"
                k, out = shapes[m]
                tensors[f"{key}.lora_A.weight"] = torch.randn(r, k, generator=g) / k ** 0.5
                tensors[f"{key}.lora_B.weight"] = torch.randn(out, r, generator=g) * 0.01
        path = os.path.join(root, f"adapter{a}")
        os.makedirs(path)
        save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
        with open(os.path.join(path, "adapter_config.json"), "w") as f:
            json.dump({"peft_type": "LORA", "r": r, "lora_alpha": 2 * r,
                       "target_modules": list(TARGET_MODULES), "bias": "none"}, f)
        paths.append(path)
    return paths


def run(variant: str, args, adapters: list[str]) -> dict:
    from kvflow import LLM, LoRARequest, SamplingParams
    from kvflow.utils.w1_prompts import make_w1

    kw = dict(dtype=args.dtype, num_threads=args.threads, max_model_len=1024)
    if variant != "base":
        kw.update(enable_lora=True, max_loras=len(adapters), max_lora_rank=args.rank)
    llm = LLM(**kw)
    prompts = make_w1(args.num_prompts, args.min_len, args.max_len, llm.engine.core.arch.vocab_size,
                      args.seed)
    loras = None
    if variant == "lora-mixed":
        lrs = [LoRARequest(f"adapter{i}", i + 1, p) for i, p in enumerate(adapters)]
        for lr in lrs:
            llm.engine.add_lora(lr)  # loaded before the clock starts
        loras = [lrs[i % len(lrs)] for i in range(len(prompts))]
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    report = llm.engine.core.startup_report()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    wall = time.perf_counter() - t0
    n_in = sum(len(p) for p in prompts)
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    llm.engine.shutdown()
    return {"variant": variant, "wall_s": wall, "output_tok_s": n_out / wall,
            "total_tok_s": (n_in + n_out) / wall, "input_tokens": n_in, "output_tokens": n_out,
            "startup_report": report}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--min-len", type=int, default=32)
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--variants", default="base,lora-mixed,lora-enabled-base-only")
    p.add_argument("--out", default=os.path.join(HERE, "results", "lora"))
    args = p.parse_args()

    from kvflow.model_path import default_model_path
    from kvflow.utils.cpuinfo import read_cpuinfo

    variants = args.variants.split(",")
    with open(LOCK, "w") as lock, tempfile.TemporaryDirectory() as root:
        fcntl.flock(lock, fcntl.LOCK_EX)
        adapters = write_adapters(default_model_path(), root, 4, args.rank)
        runs = []
        for r in range(args.rounds):
            order = variants if r % 2 == 0 else variants[::-1]  # alternate the order too
            for v in order:
                res = run(v, args, adapters)
                res["round"] = r
                runs.append(res)
                print(f"round {r} {v:>24}: {res['output_tok_s']:7.1f} output tok/s "
                      f"({res['wall_s']:.1f} s)", flush=True)
    medians = {v: statistics.median(x["output_tok_s"] for x in runs if x["variant"] == v)
               for v in variants}
    cpu = read_cpuinfo().model_name or platform.processor()
    result = {
        "date": datetime.date.today().isoformat(), "cpu": cpu, "cores": os.cpu_count(),
        "shared_machine": True, "threads": args.threads, "dtype": args.dtype,
        "workload": {"num_prompts": args.num_prompts, "input_len": [args.min_len, args.max_len],
                     "output_len": args.output_len, "seed": args.seed,
                     "adapters": 4, "rank": args.rank, "targets": "q,k,v,o,gate,up,down"},
        "median_output_tok_s": medians,
        "ratio_to_base": {v: medians[v] / medians["base"] for v in variants if "base" in medians},
        "vllm": "not measured: vLLM's CPU build is not installed here",
        "command": "flock /tmp/kvflow-bench.lock .venv/bin/python benchmarks/lora.py " + " ".join(sys.argv[1:]),
        "startup_report": next((x["startup_report"] for x in runs if x["variant"] == "lora-mixed"), ""),
        "runs": [{k: v for k, v in x.items() if k != "startup_report"} for x in runs],
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump(result, f, indent=2)
    lines = [f"# LoRA's cost on W1 ({result['date']})", "",
             f"CPU: {cpu} ({os.cpu_count()} cores, shared with other work: medians of "
             f"{args.rounds} alternating rounds), {args.threads} compute thread(s), dtype "
             f"{args.dtype}, the default model (SmolLM2-135M-Instruct, Q4_1 served as stored).",
             f"W1: {args.num_prompts} random-token prompts of {args.min_len}-{args.max_len} tokens, "
             f"{args.output_len} output tokens each, greedy, ignore_eos. Adapters: 4, rank "
             f"{args.rank}, all seven projections, round-robin over the prompts, --max-loras 4.",
             "", "| variant | output tok/s (median) | vs base |", "|---|---|---|"]
    for v in variants:
        lines.append(f"| {v} | {medians[v]:.1f} | {result['ratio_to_base'].get(v, 1.0):.3f} |")
    lines += ["", "vLLM: not measured (its CPU build is not installed here).", "",
              f"Command: `{result['command']}`", ""]
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
