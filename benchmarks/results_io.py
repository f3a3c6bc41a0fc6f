"""The benchmark results files (benchmarks/results/*.json): what they hold, how to read them.

Every measured run that the docs quote is one JSON file here, committed with the code:

    {"schema": "kvflow-bench/1",
     "kind": "compare" | "table",   # compare.py's W1/W2 run, or any other measured table
     "title": ..., "date": "2026-12-01T09:24Z", "end": ..., "commit": "efcdee8",
     "commit_note": only where the commit was not recorded by the run itself,
     "command": "make bench ...",
     "cpu": {"model": ..., "kind": "avx512-bf16", "flags": [...], "vcpus": 2},
     "host_check": {"before": ..., "after": ...}, "source": where the figures came from,
     "notes": [...],
     # kind "compare": "dtype", "partial" (not every engine / thread configuration),
     #   "engines" (engine -> the version that ran), "workload",
     #   "w1": [{"engine", "threads", "output_tok_s", "startup_s", "rounds", "runs": [...]}],
     #   "w2": {"rows": [{"engine", "request_rate", "output_tok_s", "ttft_p50_ms", ...}],
     #          "startup_s": {engine: s}, ...}
     # kind "table": "columns": [...], "rows": [[...], ...]
    }

Standard library only, so that any engine's virtualenv can import it.
"""
from __future__ import annotations

import glob
import json
import os
import subprocess

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
SCHEMA = "kvflow-bench/1"

# CPU kinds, in the order the docs list them: the key is decided by the CPU's flags
CPU_KINDS = {
    "avx512-bf16": "AMD EPYC Zen 4 (AVX-512, AVX512-BF16, VNNI)",
    "avx2": "AMD EPYC Zen 3 (AVX2 and FMA, no AVX-512)",
    "avx512-amx": "Intel Xeon, Sapphire Rapids class (AVX-512, AVX512-BF16, VNNI, AMX)",
}
FLAGS_REPORTED = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16",
                  "amx_bf16", "amx_int8", "amx_tile")

ENGINE_LABELS = {
    "kvflow": "kvflow",
    "kvflow-gguf": "kvflow, the default Q4_1 GGUF as stored (int8 activations per 32)",
    "vllm": "vLLM CPU 0.32.0",
    "llamacpp": "llama.cpp (llama-cpp-python 0.3.36, native build)",
    "hf-static": "HF `generate`, static batches of 16",
    "hf-batch": "HF `generate_batch`",
}


def cpu_kind(flags: set[str] | list[str]) -> str:
    flags = set(flags)
    if "amx_bf16" in flags:
        return "avx512-amx"
    if "avx512_bf16" in flags:
        return "avx512-bf16"
    return "avx2"


def read_cpuinfo() -> tuple[str, set[str]]:
    """(the CPU's model name, its flags) from /proc/cpuinfo ("?" and none where unreadable);
    kvflow's reading where kvflow imports (so KVFLOW_CPU_ISA's cap shows in results files)."""
    try:
        from kvflow.utils.cpuinfo import read_cpuinfo as kvflow_cpuinfo
    except ImportError:  # another engine's virtualenv
        pass
    else:
        info = kvflow_cpuinfo()
        return info.model_name, set(info.flags)
    model, flags = "?", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and model == "?":
                    model = line.split(":", 1)[1].strip()
                if line.startswith("flags") and not flags:
                    flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return model, flags


def cpu_name() -> str:
    return read_cpuinfo()[0]


def cpu_info() -> dict:
    """This machine's CPU as a results file records it."""
    model, flags = read_cpuinfo()
    return {"model": model, "kind": cpu_kind(flags), "vcpus": os.cpu_count(),
            "flags": [f for f in FLAGS_REPORTED if f in flags]}


def git_commit(root: str) -> str:
    """The checkout's short commit, with `+dirty` when tracked files differ from it."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, text=True,
                              capture_output=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               text=True, capture_output=True).stdout.strip()
        return head + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def load_all(folder: str = RESULTS) -> list[dict]:
    """Every results file, each with its file name under "file", oldest first."""
    out = []
    for path in sorted(glob.glob(os.path.join(folder, "*.json"))):
        with open(path) as f:
            data = json.load(f)
        if isinstance(data, dict) and data.get("schema") == SCHEMA:
            data["file"] = os.path.relpath(path, os.path.dirname(HERE))
            out.append(data)
    return sorted(out, key=lambda d: (d["date"], d["file"]))


def latest_per_kind(results: list[dict]) -> dict[str, dict | None]:
    """The newest complete compare run (every engine, both thread configurations) per CPU kind."""
    latest: dict[str, dict | None] = {k: None for k in CPU_KINDS}
    for r in results:
        if r["kind"] == "compare" and not r.get("partial") and r.get("w1"):
            latest[r["cpu"]["kind"]] = r  # sorted oldest first
    return latest
