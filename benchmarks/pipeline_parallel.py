"""Pipeline parallelism's throughput, 2 stages against 1, and what the link between stages
carries: W1 (random-token prompts, fixed output length, EOS ignored, greedy) through
`bench throughput`'s run_throughput, the variants alternated within each repeat so that a
neighbour's load hits them alike; medians are reported.

    python benchmarks/pipeline_parallel.py                      # the default model, fp32
    python benchmarks/pipeline_parallel.py --variants pp1,pp2,pp2-ray,tp3,tp3-ray --repeats 3

Variants: pp1 (one process, one thread), pp1-2t (one process, two threads), pp2 (two stages,
kvflow's processes), pp2-ray (two stages, Ray actors on a local cluster), tp3 / tp3-ray
(tensor parallel, 3 ranks: the step's channel on mp against Ray). Every rank has one compute
thread. The per-step bytes between stages are the executor's (pp_hidden_bytes_per_step:
[2, tokens, hidden] of the residual stream and the last MLP output, over every TP rank's link);
the table also gives what that costs on a link of 1 and 10 Gbit/s."""
from __future__ import annotations

import argparse
import json
import statistics
import time

from results_io import cpu_name  # beside this script
from kvflow.entrypoints.bench_throughput import run_throughput

VARIANTS = {
    "pp1": dict(num_threads=1),
    "pp1-2t": dict(num_threads=2),
    "pp2": dict(num_threads=1, pipeline_parallel_size=2),
    "pp2-ray": dict(num_threads=1, pipeline_parallel_size=2, distributed_executor_backend="ray"),
    "tp3": dict(num_threads=1, tensor_parallel_size=3),
    "tp3-ray": dict(num_threads=1, tensor_parallel_size=3, distributed_executor_backend="ray"),
}




def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    p.add_argument("--variants", default="pp1,pp1-2t,pp2,pp2-ray,tp3,tp3-ray")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--num-prompts", type=int, default=12)
    p.add_argument("--output-len", type=int, default=48)
    p.add_argument("--max-input-len", type=int, default=512)
    p.add_argument("--output-json", default=None)
    args = p.parse_args()
    names = args.variants.split(",")
    # float weights everywhere: the stages serve no quantized GEMM, so one process must not either
    base = dict(model=args.model, dtype="float32", quantization="none", max_model_len=1024)
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for rep in range(args.repeats):
        for name in names:
            r = run_throughput({**base, **VARIANTS[name]}, args.num_prompts, 32,
                               args.max_input_len, args.output_len)
            runs[name].append(r)
            print(f"repeat {rep} {name}: {r['total_tok_s']:.1f} tok/s, wall {r['wall_s']:.1f} s",
                  flush=True)
    first = names[0]
    base_tps = statistics.median(r["total_tok_s"] for r in runs[first])
    print(f"\n{cpu_name()}, {time.strftime('%Y-%m-%d')}, W1 {args.num_prompts} prompts "
          f"U[32,{args.max_input_len}], {args.output_len} output tokens, fp32, medians of "
          f"{args.repeats}:\n")
    print("| variant | total tok/s | output tok/s | vs " + first + " | steps | ms/step | driver in "
          "collectives | bytes/step between stages | at 1 Gbit/s | at 10 Gbit/s | driver waits "
          "for the last stage |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    summary = {}
    for name in names:
        rs = runs[name]
        tps = statistics.median(r["total_tok_s"] for r in rs)
        ops = statistics.median(r["output_tok_s"] for r in rs)
        row = {"total_tok_s": tps, "output_tok_s": ops, "runs": rs}
        hb = statistics.median(r.get("pp_hidden_bytes_per_step", 0.0) for r in rs)
        steps = statistics.median(r.get("tp_steps", r.get("pp_steps", 0)) for r in rs)
        wait = statistics.median(r.get("pp_driver_recv_wait_ms_per_step", 0.0) for r in rs)
        link = (f"{hb / 1e3:.1f} kB | {hb * 8 / 1e9 * 1e3:.2f} ms | {hb * 8 / 1e10 * 1e3:.3f} ms"
                if hb else "- | - | -")
        wall = statistics.median(r["wall_s"] for r in rs)
        comm = statistics.median(r.get("comm_ms_per_step", 0.0) for r in rs)
        print(f"| {name} | {tps:.1f} | {ops:.1f} | {tps / base_tps:.2f}x | {steps or '-'} | "
              + (f"{wall * 1e3 / steps:.1f} | " if steps else "- | ")
              + (f"{comm:.1f} ms | " if comm else "- | ") + f"{link} | "
              + (f"{wait:.1f} ms/step |" if wait else "- |"))
        summary[name] = row
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"cpu": cpu_name(), "args": vars(args), "variants": summary}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
