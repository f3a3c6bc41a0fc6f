"""Single-stream decode of kvflow variants, A/B: each variant (a checkout, environment variables
and LLM arguments) runs compare.py's single-stream worker in its own process, the variants
alternating round by round; medians of the rounds are quoted, with each variant's step against
the time this CPU takes to stream the weights it reads (benchmarks/gemv_f32.py's read loop).

    .venv/bin/python benchmarks/single_stream_ab.py --rounds 3 \
        --variant 'fp32=' --variant 'bf16={"weight_dtype": "bfloat16"}' \
        --variant 'bf16 avx2=KVFLOW_GEMV_ISA=avx2 {"weight_dtype": "bfloat16"}' \
        [--variant 'main=@/path/to/main/checkout'] [--checkpoint-dtype bfloat16]

A variant is `label=[@checkout] [VAR=value ...] [json LLM args]`. The model is the default one
exported as an HF folder (bfloat16 by default: the shape of most HF checkpoints, so every
variant computes with the same weight values; compare.py --checkpoint-dtype)."""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from compare import MAIN_PY, ROOT, run_worker, thread_env, weight_stream  # noqa: E402
from export_model import export_hf_folder  # noqa: E402


def parse_variant(text: str) -> dict:
    label, _, rest = text.partition("=")
    root, env, args = ROOT, {}, {}
    rest = rest.strip()
    if rest.startswith("{"):
        args = json.loads(rest)
    else:
        head, brace, tail = rest.partition("{")
        args = json.loads(brace + tail) if brace else {}
        for word in shlex.split(head):
            if word.startswith("@"):
                root = word[1:]
            else:
                k, _, v = word.partition("=")
                env[k] = v
    return {"label": label, "root": root, "env": env, "args": args}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variant", action="append", required=True)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--checkpoint-dtype", default="bfloat16", choices=("float32", "bfloat16"))
    p.add_argument("--single-len", type=int, default=128)
    p.add_argument("--single-output-len", type=int, default=256)
    p.add_argument("--single-requests", type=int, default=3)
    args = p.parse_args()
    variants = [parse_variant(v) for v in args.variant]
    cfg = dict(model=export_hf_folder(dtype=args.checkpoint_dtype), threads=args.threads,
               dtype="float32", num_prompts=2 + 2 * args.single_requests, min_len=args.single_len,
               max_len=args.single_len, output_len=args.single_output_len, seed=0, single_stream=True)
    runs: dict[str, list[dict]] = {v["label"]: [] for v in variants}
    for rnd in range(args.rounds):
        for v in variants:
            cmd = [MAIN_PY, os.path.join(v["root"], "benchmarks", "w1_workers.py"), "kvflow",
                   json.dumps(dict(cfg, kvflow_args=v["args"]))]
            env = thread_env("kvflow", args.threads) | v["env"]
            env["PYTHONPATH"] = v["root"]
            out, err, error, code = run_worker(cmd, env, 900)
            lines = [x for x in out.splitlines() if x.startswith("RESULT ")]
            if not lines:
                print(f"[{rnd}] {v['label']}: failed ({error or code}): {(err or out)[-800:]}")
                continue
            r = json.loads(lines[-1][7:])
            runs[v["label"]].append(r)
            print(f"[{rnd}] {v['label']}: step {r['step_ms']:.1f} ms, TTFT {r['ttft_ms']:.0f} ms, "
                  f"load {os.getloadavg()[0]:.2f}", flush=True)
    stream = weight_stream(args.threads)
    full, half = stream.get("read_loop_ms"), stream.get("read_loop_half_ms")
    print(f"\nweight stream, {args.threads} thread(s): {stream.get('weight_mb', 0):.0f} MB of fp32 "
          f"weights in {full:.1f} ms (C read loop), their bf16 copy in {half:.1f} ms")
    print("| variant | decode step (median) | decode tok/s | step / fp32 stream | step / half stream "
          "| TTFT | runs (step ms) |")
    print("|---|---|---|---|---|---|---|")
    for label, rs in runs.items():
        if not rs:
            continue
        step = statistics.median(r["step_ms"] for r in rs)
        ttft = statistics.median(r["ttft_ms"] for r in rs)
        steps = ", ".join(f"{r['step_ms']:.1f}" for r in rs)
        print(f"| {label} | {step:.1f} ms | {1e3 / step:.1f} | {step / full:.2f}x | {step / half:.2f}x "
              f"| {ttft:.0f} ms | {steps} |")


if __name__ == "__main__":
    main()
