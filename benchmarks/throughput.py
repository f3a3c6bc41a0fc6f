"""W1 offline throughput: kvflow vs Hugging Face `generate` (static left-padded batches),
same weights, same prompts, one run. Each engine runs in its own subprocess, one after the other.

    .venv/bin/python benchmarks/throughput.py [--num-prompts 128] [--threads 1] [--dtype auto]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time


def run_kvflow(args) -> dict:
    from kvflow.entrypoints.bench_throughput import run_throughput
    kw = dict(dtype=args.dtype, num_threads=args.threads, max_model_len=1024)
    return run_throughput(kw, args.num_prompts, args.min_len, args.max_len, args.output_len, args.seed)


def run_hf(args) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from kvflow.model.loader import resolve_dtype
    from kvflow.utils.w1_prompts import make_w1
    from kvflow.model_path import default_model_path

    torch.set_num_threads(args.threads)
    dtype = resolve_dtype(args.dtype)
    t0 = time.perf_counter()
    folder, fname = os.path.split(default_model_path())
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=fname, dtype=dtype).eval()
    startup = time.perf_counter() - t0
    prompts = make_w1(args.num_prompts, args.min_len, args.max_len, model.config.vocab_size, args.seed)
    pad = 2
    t0 = time.perf_counter()
    n_out = 0
    with torch.inference_mode():
        for i in range(0, len(prompts), args.hf_batch):
            batch = prompts[i:i + args.hf_batch]
            width = max(len(p) for p in batch)
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
            out = model.generate(ids, attention_mask=mask, max_new_tokens=args.output_len,
                                 min_new_tokens=args.output_len, do_sample=False, pad_token_id=pad)
            n_out += (out.shape[1] - width) * len(batch)
    wall = time.perf_counter() - t0
    n_in = sum(len(p) for p in prompts)
    return {"engine": f"hf-generate-static-{args.hf_batch}", "num_prompts": len(prompts),
            "input_tokens": n_in, "output_tokens": n_out, "wall_s": wall,
            "output_tok_s": n_out / wall, "total_tok_s": (n_in + n_out) / wall,
            "startup_s": startup, "dtype": str(dtype).removeprefix("torch."), "threads": args.threads}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--engines", default="kvflow,hf")
    p.add_argument("--only", default=None, help=argparse.SUPPRESS)
    p.add_argument("--num-prompts", type=int, default=128)
    p.add_argument("--min-len", type=int, default=32)
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--hf-batch", type=int, default=16)
    p.add_argument("--save-json", default=None)
    args = p.parse_args()

    if args.only:
        result = {"kvflow": run_kvflow, "hf": run_hf}[args.only](args)
        print("RESULT " + json.dumps(result))
        return

    results = []
    for engine in args.engines.split(","):
        cmd = [sys.executable, __file__, "--only", engine] + [
            a for a in sys.argv[1:] if not a.startswith("--engines")]
        env = dict(os.environ, OMP_WAIT_POLICY=os.environ.get("OMP_WAIT_POLICY", "PASSIVE"))
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        line = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
        if not line:
            print(f"{engine}: failed\n{proc.stderr[-2000:]}", file=sys.stderr)
            continue
        results.append(json.loads(line[-1][7:]))
    base = next((r for r in results if r["engine"].startswith("hf")), None)
    print(f"\nW1: {args.num_prompts} prompts, input U[{args.min_len},{args.max_len}], "
          f"output {args.output_len}, greedy, ignore_eos, threads={args.threads}")
    print(f"{'engine':28s} {'dtype':9s} {'out tok/s':>10s} {'total tok/s':>12s} {'wall s':>8s} "
          f"{'startup s':>10s} {'vs HF':>7s}")
    for r in results:
        ratio = r["output_tok_s"] / base["output_tok_s"] if base else float("nan")
        print(f"{r['engine']:28s} {r['dtype']:9s} {r['output_tok_s']:10.1f} {r['total_tok_s']:12.1f} "
              f"{r['wall_s']:8.1f} {r['startup_s']:10.1f} {ratio:7.2f}x")
    if args.save_json:
        with open(args.save_json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
