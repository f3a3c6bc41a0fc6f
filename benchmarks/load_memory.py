"""Where a loaded model's memory goes: peak and resident memory of an offline LLM after load,
against the bytes of the file it serves.

    .venv/bin/python benchmarks/load_memory.py WORKDIR [--types BF16 Q8_0 Q4_0] [--shape llama32-1b]

Builds once under WORKDIR (not the repository: the files are large) a GGUF file of Llama-3.2-1B's
shapes with random weights in each type (benchmarks/write_gguf.py; the vocabulary is the default
model's, SmolLM2's 49152 tokens, so that its tokenizer fits: 1.07B parameters, 2.15 GB in
BF16), then starts kvflow on each in a fresh process twice, with a small fixed KV cache (64
blocks of 16 tokens): the first start converts or packs into kvflow's cache (under WORKDIR),
the second reads the cache, which is what every later start does. Each start reports, from
/proc/self/status: the peak resident set (VmHWM), the resident set after load and after one
short generate (VmRSS), split into anonymous and file-backed pages (RssAnon, RssFile), each
over the file's bytes. The results go to benchmarks/results/<date>-load-memory-<label>.json."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
NUM_BLOCKS, BLOCK_SIZE = 64, 16

_CHILD = r"""
import json, sys, time
def mem():
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("VmHWM", "VmRSS", "RssAnon", "RssFile", "RssShmem"):
                out[k] = int(v.split()[0]) * 1024
    return out
path, num_blocks, block_size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
stages = {"start": mem()}
from kvflow import LLM, SamplingParams
import torch
stages["imported"] = mem()
t0 = time.perf_counter()
llm = LLM(model=path, num_blocks=num_blocks, block_size=block_size, max_model_len=num_blocks * block_size,
          max_num_seqs=4)
load_s = time.perf_counter() - t0
stages["loaded"] = mem()
llm.generate(["The capital of France is"], SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
stages["generated"] = mem()
core = llm.engine.core
print("RESULT " + json.dumps({"stages": stages, "load_s": load_s,
                               "kv_bytes": core.kv_bytes_per_token * num_blocks * block_size,
                               "startup": core.startup_report()}))
"""


def build(workdir: str, type_name: str, shape: str) -> str:
    """The model file of `type_name`, written once."""
    from kvflow.model_path import default_model_path

    path = os.path.join(workdir, f"{shape}-{type_name.lower()}.gguf")
    if not os.path.exists(path):
        tmp = path + ".tmp"
        subprocess.run([sys.executable, os.path.join(HERE, "write_gguf.py"), shape, tmp,
                        "--type", type_name, "--tokenizer-from", default_model_path()], check=True)
        os.replace(tmp, path)
    return path


def start(path: str, cache: str) -> dict:
    """One start of kvflow on `path` in a fresh process: its memory by stage."""
    env = dict(os.environ, KVFLOW_CACHE_DIR=cache, PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-c", _CHILD, path, str(NUM_BLOCKS), str(BLOCK_SIZE)],
                          env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"kvflow failed on {path}:\n{proc.stderr[-4000:]}")
    line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


def report(type_name: str, size: int, run: dict, which: str) -> None:
    s = run["stages"]
    gb = lambda b: f"{b / 1e9:.2f} GB"
    print(f"{type_name} ({gb(size)}) {which}: peak {gb(s['generated']['VmHWM'])} "
          f"({s['generated']['VmHWM'] / size:.2f}x); after load {gb(s['loaded']['VmRSS'])} "
          f"(anon {gb(s['loaded']['RssAnon'])}, file {gb(s['loaded']['RssFile'])}); "
          f"after generate {gb(s['generated']['VmRSS'])}; runtime before load "
          f"{gb(s['imported']['VmRSS'])}; KV {run['kv_bytes'] / 1e6:.1f} MB; load {run['load_s']:.1f} s",
          flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("workdir")
    p.add_argument("--types", nargs="+", default=["BF16", "Q8_0", "Q4_0"])
    p.add_argument("--shape", default="llama32-1b")
    p.add_argument("--label", default="", help="added to the result file's name (e.g. main)")
    p.add_argument("--delete", action="store_true", help="delete each file and its cache when done")
    a = p.parse_args()
    sys.path.insert(0, ROOT)
    sys.path.insert(0, HERE)
    os.makedirs(a.workdir, exist_ok=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    from results_io import cpu_info

    results = {"cpu": cpu_info(), "cores": os.cpu_count(), "commit": commit, "shape": a.shape,
               "num_blocks": NUM_BLOCKS, "block_size": BLOCK_SIZE, "runs": {}}
    for type_name in a.types:
        path = build(a.workdir, type_name, a.shape)
        cache = os.path.join(a.workdir, f"cache-{type_name.lower()}")
        subprocess.run(["rm", "-rf", cache], check=True)
        size = os.path.getsize(path)
        runs = {"file_bytes": size}
        for which in ("first", "cached"):
            runs[which] = start(path, cache)
            report(type_name, size, runs[which], which)
        results["runs"][type_name] = runs
        if a.delete:
            subprocess.run(["rm", "-rf", cache, path], check=True)
    stamp = time.strftime("%Y%m%d-%H%M", time.gmtime())
    out = os.path.join(HERE, "results", f"{stamp}-load-memory{'-' + a.label if a.label else ''}.json")
    with open(out, "w") as f:
        json.dump(results, f, indent=1)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
