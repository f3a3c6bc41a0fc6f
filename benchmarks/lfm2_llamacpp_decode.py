"""LFM2's decode against llama.cpp on the same GGUF file: one request, a prompt of --context
tokens, then --steps single-token decode steps; the median step time and decode tok/s, per
thread count, each engine in turn (kvflow in this process, llama.cpp through llama-cpp-python in
benchmarks/.venv-llamacpp, in a subprocess).

The model: random weights of LFM2-350M's shape (hybrid_decode.py's folder: 16 layers, 10 gated
short convolutions + 6 attention layers, hidden 1024, MLP 4608, SmolLM2's vocabulary),
converted to a bf16 GGUF once by the convert_hf_to_gguf.py that the llama-cpp-python sdist
carries (export_model.py's).

    .venv/bin/python benchmarks/lfm2_llamacpp_decode.py [--threads 1 2] [--context 512]
        [--steps 64] [--out results/<date>-lfm2-llamacpp-decode.json]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

import hybrid_decode  # noqa: E402
from export_model import LLAMACPP_VENV, convert_script  # noqa: E402

FOLDER = os.path.join(HERE, "results", "random-lfm2-350m-shape")
GGUF = FOLDER + "-bf16.gguf"

# run by llama.cpp's venv: argv = gguf, threads, context, steps; prints the step times (s)
# (llama.cpp's eval computes each step's logits as kvflow's step does; kvflow also samples
# greedily, llama.cpp is fed the prompt's tokens again)
LLAMACPP = r"""
import json, sys, time
import numpy as np
import llama_cpp
path, threads, context, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
llm = llama_cpp.Llama(model_path=path, n_ctx=context + steps + 8, n_batch=512, n_threads=threads,
                      n_threads_batch=threads, verbose=False)
ids = np.random.default_rng(context).integers(100, 40000, context).tolist()
llm.eval(ids)
times = []
for i in range(steps):
    t0 = time.perf_counter()
    llm.eval([ids[i]])  # one token, its logits computed (which token does not move the time)
    times.append(time.perf_counter() - t0)
print(json.dumps({"times": times, "version": llama_cpp.__version__}))
"""


def gguf() -> str:
    """The bf16 GGUF of the random LFM2-350M-shaped folder, converted once."""
    if os.path.isfile(GGUF):
        return GGUF
    folder = hybrid_decode.build("lfm2", FOLDER)
    script = convert_script()
    if script is None:
        raise RuntimeError("convert_hf_to_gguf.py not found: run benchmarks/setup_anchors.sh llamacpp")
    env = dict(os.environ, PYTHONPATH=os.path.join(os.path.dirname(script), "gguf-py"))
    subprocess.run([os.path.join(LLAMACPP_VENV, "bin", "python"), script, folder, "--outtype", "bf16",
                    "--outfile", GGUF + ".tmp"], check=True, env=env, capture_output=True, text=True)
    os.replace(GGUF + ".tmp", GGUF)
    return GGUF


def llamacpp_steps(path: str, threads: int, context: int, steps: int) -> tuple[float, str]:
    out = subprocess.run([os.path.join(LLAMACPP_VENV, "bin", "python"), "-c", LLAMACPP, path,
                          str(threads), str(context), str(steps)], check=True, capture_output=True,
                         text=True, timeout=1800)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    times = sorted(got["times"])
    return 1000 * times[len(times) // 2], got["version"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    import torch

    from results_io import cpu_info, git_commit

    path = gguf()
    load_before = os.getloadavg()  # the host is shared: its load, for reading the numbers
    rows, version = [], None
    for threads in args.threads:
        torch.set_num_threads(threads)
        hybrid_decode.THREADS["num_threads"] = threads
        kv = hybrid_decode.decode_steps(path, args.context, "bfloat16", args.steps)
        lc, version = llamacpp_steps(path, threads, args.context, args.steps)
        for engine, ms in (("kvflow", kv), ("llama.cpp", lc)):
            rows.append([engine, threads, args.context, round(ms, 2), round(1000 / ms, 1)])
            print(rows[-1], flush=True)
    result = {"schema": "kvflow-bench/1", "kind": "table",
              "title": "LFM2-350M-shaped decode: kvflow against llama.cpp on one bf16 GGUF",
              "date": time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime()), "commit": git_commit(ROOT),
              "command": "benchmarks/lfm2_llamacpp_decode.py " + " ".join(sys.argv[1:]), "cpu": cpu_info(),
              "source": "benchmarks/lfm2_llamacpp_decode.py",
              "engines": {"kvflow": git_commit(ROOT), "llama.cpp": f"llama-cpp-python {version}"},
              "host_check": {"before": f"load average {load_before}", "after": f"load average {os.getloadavg()}"},
              "notes": [f"one request: a {args.context}-token prompt, then {args.steps} greedy decode "
                        "steps (kvflow greedy; llama.cpp fed tokens, its logits computed each step); the median step; random weights of LFM2-350M's shape in one bf16 GGUF "
                        "(llama.cpp's converter) that both engines load; the machine was shared with "
                        "other jobs (noisy)"],
              "columns": ["engine", "threads", "context", "decode step ms", "decode tok/s"], "rows": rows}
    out = args.out or os.path.join(HERE, "results", time.strftime("%Y%m%d-%H%M") + "-lfm2-llamacpp-decode.json")
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print("wrote", out)


if __name__ == "__main__":
    main()
