"""W1 and single-stream decode of two (or more) kvflow checkouts, alternating round by round, on
the default model as it ships (the Q4_1 GGUF, `--dtype auto`) unless told otherwise: the check
that a change which should not move speed did not. Medians of the rounds, and each variant's
ratio to the first.

    .venv/bin/python benchmarks/checkout_ab.py --rounds 3 \
        --checkout before=/path/to/a/worktree --checkout after=. [--threads 1] [--dtype auto]

Each run is compare.py's worker (w1_workers.py) started from that checkout with PYTHONPATH set
to it, so each variant imports its own kvflow; the venv is this one."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from compare import MAIN_PY, run_worker, thread_env  # noqa: E402


def run(root: str, cfg: dict, threads: int) -> dict | str:
    cmd = [MAIN_PY, os.path.join(root, "benchmarks", "w1_workers.py"), "kvflow", json.dumps(cfg)]
    env = thread_env("kvflow", threads) | {"PYTHONPATH": root}
    out, err, error, code = run_worker(cmd, env, 1800)
    lines = [x for x in out.splitlines() if x.startswith("RESULT ")]
    return json.loads(lines[-1][7:]) if lines else f"failed ({error or code}): {(err or out)[-600:]}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkout", action="append", required=True, help="label=path")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--model", default=None, help="default: the default model")
    p.add_argument("--num-prompts", type=int, default=128)
    p.add_argument("--single-len", type=int, default=128)
    p.add_argument("--single-output-len", type=int, default=256)
    args = p.parse_args()
    checkouts = [(c.partition("=")[0], os.path.abspath(c.partition("=")[2])) for c in args.checkout]
    base = dict(model=args.model, threads=args.threads, dtype=args.dtype, seed=0)
    w1 = dict(base, num_prompts=args.num_prompts, min_len=32, max_len=512, output_len=128)
    single = dict(base, num_prompts=8, min_len=args.single_len, max_len=args.single_len,
                  output_len=args.single_output_len, single_stream=True)
    results: dict[str, dict[str, list[float]]] = {label: {"w1": [], "step": []} for label, _ in checkouts}
    for rnd in range(args.rounds):
        for label, root in checkouts:
            r = run(root, w1, args.threads)
            s = run(root, single, args.threads)
            for kind, res, key in (("w1", r, "output_tok_s"), ("step", s, "step_ms")):
                if isinstance(res, str):
                    print(f"[{rnd}] {label} {kind}: {res}", flush=True)
                else:
                    results[label][kind].append(res[key])
            print(f"[{rnd}] {label}: W1 {results[label]['w1'][-1:]} output tok/s, "
                  f"decode step {results[label]['step'][-1:]} ms, load {os.getloadavg()[0]:.2f}", flush=True)
    first = checkouts[0][0]
    med = {label: {k: statistics.median(v) if v else float("nan") for k, v in rs.items()}
           for label, rs in results.items()}
    print(f"\n| checkout | W1 output tok/s (median) | vs {first} | decode step ms (median) | vs {first} | runs |")
    print("|---|---|---|---|---|---|")
    for label, m in med.items():
        runs = "; ".join(f"{w:.1f} / {s:.2f}" for w, s in zip(results[label]["w1"], results[label]["step"]))
        print(f"| {label} | {m['w1']:.1f} | {m['w1'] / med[first]['w1']:.3f}x | {m['step']:.2f} | "
              f"{m['step'] / med[first]['step']:.3f}x | {runs} |")


if __name__ == "__main__":
    main()
