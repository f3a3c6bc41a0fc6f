"""Speed of quantized serving: batch-1 decode tok/s, time to first token and a W1
run's output tok/s (and RSS), for kvflow's native GGUF Q4_1 / Q8_0 and int8 W8A8, kvflow fp32 / bf16
(`--quantization none`), and llama.cpp (llama-cpp-python, benchmarks/.venv-llamacpp) on the
same GGUF files; and kvflow against vLLM's CPU build (benchmarks/.venv-vllm) on one
compressed-tensors int8 W8A8 checkpoint of the model (benchmarks/export_model.py --w8a8). Each engine and mode runs in its own process, the configurations in turn,
round after round; the medians are reported, with the machine's load.

    python benchmarks/quantized.py --q8 Q8_0.gguf [--rounds 3] [--threads 1]
    python benchmarks/quantized.py --model BIG.gguf --only b1 --modes gguf,llamacpp   # the 8B file
    python benchmarks/quantized.py --modes ct,vllm,bf16   # a W8A8 checkpoint: kvflow vs vLLM CPU

Batch-1: one 64-token prompt of random ids, 128 greedy tokens (EOS ignored); decode tok/s is
128 over the time past the first token (the run with 129 tokens minus the run with 1), TTFT the
1-token run. W1 (by default scaled down to --w1-prompts prompts of U[32, 256] tokens, 64
output tokens, to fit a shared 2-core machine): W1's seeded random prompts, greedy. RSS: the
process's resident set after the batch-1 runs (VmRSS)."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from compare import (VENV_PY, fmt_check, host_sharing_check, machine_summary, run_worker,  # noqa: E402
                     thread_env)

PROMPT_LEN, NEW_TOKENS = 64, 128


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _prompt(vocab: int) -> list[int]:
    import random

    rng = random.Random(0)
    return [rng.randrange(100, min(vocab, 49152) - 100) for _ in range(PROMPT_LEN)]


def worker_b1(cfg: dict) -> dict:
    """Batch-1 decode in this interpreter (kvflow's or llama.cpp's venv)."""
    t_start = time.perf_counter()
    if cfg["engine"] == "llamacpp":
        from llamacpp_batch import LlamaCppBatch

        eng = LlamaCppBatch(cfg["model"], n_threads=cfg["threads"], n_seq_max=1, n_ctx=512, n_batch=512)
        prompt = _prompt(eng.vocab_size)

        def run(n: int) -> None:
            eng.generate([prompt], n)
    elif cfg["engine"] == "vllm":
        llm, generate = _vllm(cfg, 512)
        prompt = _prompt(llm.llm_engine.model_config.get_vocab_size())

        def run(n: int) -> None:
            generate([prompt], n)
    else:
        from kvflow.entrypoints.llm import LLM
        from kvflow.sampling_params import SamplingParams

        llm = LLM(cfg["model"], dtype=cfg["dtype"], quantization=cfg["quantization"],
                  max_model_len=512, num_threads=cfg["threads"], num_blocks=64)
        prompt = _prompt(llm.engine.core.arch.vocab_size)

        def run(n: int) -> None:
            llm.generate([prompt], SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True),
                         use_tqdm=False)
    run(4)  # warm-up
    ready = time.perf_counter() - t_start
    ttft, full = [], []
    for _ in range(cfg["repeats"]):
        t0 = time.perf_counter()
        run(1)
        t1 = time.perf_counter()
        run(NEW_TOKENS + 1)
        t2 = time.perf_counter()
        ttft.append(t1 - t0)
        full.append(t2 - t1)
    first, whole = statistics.median(ttft), statistics.median(full)
    return {"ttft_ms": first * 1e3, "decode_tok_s": NEW_TOKENS / max(whole - first, 1e-9),
            "rss_mb": _rss_mb(), "ready_s": ready}


def w1_prompts(cfg: dict, vocab: int) -> list[list[int]]:
    """W1's prompts (kvflow/utils/w1_prompts.py: standard library only, so llama.cpp's and
    vLLM's venvs import it too)."""
    sys.path.insert(0, ROOT)
    from kvflow.utils.w1_prompts import make_w1

    return make_w1(cfg["num_prompts"], cfg["min_len"], cfg["max_len"], vocab, cfg["seed"])


def _vllm(cfg: dict, max_model_len: int):
    """vLLM's offline LLM on the checkpoint (its CPU backend; threads from the environment,
    compare.thread_env) and a greedy generate(prompts, n) -> token lists, EOS ignored."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=cfg["model"], max_model_len=max_model_len, seed=0)

    def generate(prompts: list[list[int]], n: int) -> list:
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]
    return llm, generate


def worker_w1(cfg: dict) -> dict:
    """One W1 run (greedy, EOS ignored) in this interpreter."""
    if cfg["engine"] == "llamacpp":
        from llamacpp_batch import LlamaCppBatch

        eng = LlamaCppBatch(cfg["model"], n_threads=cfg["threads"], n_seq_max=cfg["num_prompts"],
                            n_ctx=cfg["num_prompts"] * (cfg["max_len"] + cfg["output_len"] + 8))
        prompts = w1_prompts(cfg, eng.vocab_size)
        eng.generate(prompts[:2], 4)
        t0 = time.perf_counter()
        n_out = sum(len(o) for o in eng.generate(prompts, cfg["output_len"]))
    elif cfg["engine"] == "vllm":
        llm, generate = _vllm(cfg, 1024)
        prompts = w1_prompts(cfg, llm.llm_engine.model_config.get_vocab_size())
        generate(prompts[:2], 4)
        t0 = time.perf_counter()
        n_out = sum(len(o) for o in generate(prompts, cfg["output_len"]))
    else:
        from kvflow.entrypoints.llm import LLM
        from kvflow.sampling_params import SamplingParams

        llm = LLM(cfg["model"], dtype=cfg["dtype"], quantization=cfg["quantization"],
                  max_model_len=1024, num_threads=cfg["threads"])
        prompts = w1_prompts(cfg, llm.engine.core.arch.vocab_size)
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        llm.generate(prompts[:2], params, use_tqdm=False)
        t0 = time.perf_counter()
        params = SamplingParams(max_tokens=cfg["output_len"], temperature=0.0, ignore_eos=True)
        n_out = sum(len(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False))
    out = {"w1_output_tok_s": n_out / (time.perf_counter() - t0)}
    if cfg["engine"] == "vllm":  # what vLLM made of the checkpoint
        out["vllm_quantization"] = llm.llm_engine.model_config.quantization
    return out


def _run(py: str, args: list[str], env: dict, timeout: float) -> dict:
    """One worker to its end (compare.run_worker: its own process group, output in files)."""
    stdout, stderr, error, _ = run_worker([py, *args], env, timeout)
    lines = [x for x in stdout.splitlines() if x.startswith("RESULT ")]
    if not lines:
        return {"error": error or (stderr or stdout)[-800:]}
    return json.loads(lines[-1][7:])


def run_config(c: dict, what: str, a) -> dict:
    engine = c["engine"] if c["engine"] in ("llamacpp", "vllm") else "kvflow"
    py = VENV_PY.get(engine, sys.executable)
    env = thread_env(engine, a.threads)
    env["PYTHONPATH"] = ROOT
    cfg = {**c, "what": what, "threads": a.threads, "repeats": a.repeats, "num_prompts": a.w1_prompts,
           "min_len": 32, "max_len": a.w1_max_len, "output_len": a.w1_output, "seed": 0}
    return _run(py, [__file__, "--worker", json.dumps(cfg)], env, a.timeout)


def configs(a) -> list[dict]:
    from kvflow.model_path import default_model_path

    q41 = a.model or default_model_path()
    out = []
    wanted = set(a.modes.split(","))
    if "gguf" in wanted:
        out.append({"label": f"kvflow gguf {a.label or 'Q4_1'}", "engine": "kvflow", "model": q41,
                    "dtype": "auto", "quantization": "gguf"})
        if a.q8:
            out.append({"label": "kvflow gguf Q8_0", "engine": "kvflow", "model": a.q8, "dtype": "auto",
                        "quantization": "gguf"})
    if "int8" in wanted:
        out.append({"label": "kvflow int8 W8A8", "engine": "kvflow", "model": q41, "dtype": "auto",
                    "quantization": "int8"})
    if wanted & {"ct", "vllm"}:  # one compressed-tensors W8A8 checkpoint for both engines
        from export_model import export_w8a8

        w8a8 = a.w8a8 or export_w8a8()
        if "ct" in wanted:
            out.append({"label": "kvflow compressed-tensors W8A8", "engine": "kvflow", "model": w8a8,
                        "dtype": "auto", "quantization": "compressed-tensors"})
        if "vllm" in wanted:
            out.append({"label": "vLLM CPU compressed-tensors W8A8", "engine": "vllm", "model": w8a8})
    if "fp32" in wanted:
        out.append({"label": "kvflow fp32", "engine": "kvflow", "model": q41, "dtype": "float32",
                    "quantization": "none"})
    if "bf16" in wanted:
        out.append({"label": "kvflow bf16", "engine": "kvflow", "model": q41, "dtype": "bfloat16",
                    "quantization": "none"})
    if "llamacpp" in wanted:
        out.append({"label": f"llama.cpp {a.label or 'Q4_1'}", "engine": "llamacpp", "model": q41})
        if a.q8:
            out.append({"label": "llama.cpp Q8_0", "engine": "llamacpp", "model": a.q8})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="the quantized GGUF (default: kvflow's default Q4_1 model)")
    p.add_argument("--label", help="its type, for the table (default Q4_1)")
    p.add_argument("--q8", help="a Q8_0 GGUF of the same model")
    p.add_argument("--modes", default="gguf,int8,fp32,bf16,llamacpp",
                   help="of gguf, int8, ct (kvflow on the W8A8 checkpoint), vllm (vLLM on it), "
                   "fp32, bf16, llamacpp")
    p.add_argument("--w8a8", help="the compressed-tensors W8A8 folder for ct and vllm (default: "
                   "benchmarks/export_model.py's, written on first use)")
    p.add_argument("--only", choices=["b1", "w1"], help="one of the two measurements")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3, help="batch-1 repeats inside a process")
    p.add_argument("--w1-prompts", type=int, default=32)
    p.add_argument("--w1-max-len", type=int, default=256)
    p.add_argument("--w1-output", type=int, default=64)
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        cfg = json.loads(a.worker)
        print("RESULT " + json.dumps((worker_b1 if cfg["what"] == "b1" else worker_w1)(cfg)), flush=True)
        os._exit(0)
    sys.path.insert(0, ROOT)
    cfgs = configs(a)
    load0, sharing0 = os.getloadavg(), host_sharing_check()
    results: dict[str, list[dict]] = {c["label"]: [] for c in cfgs}
    for rnd in range(a.rounds):
        for c in cfgs:
            r = {}
            for what in ("b1", "w1"):
                if a.only in (None, what):
                    r.update(run_config(c, what, a))
            results[c["label"]].append(r)
            print(f"round {rnd + 1} {c['label']}: {r}", file=sys.stderr, flush=True)
    load1, sharing1 = os.getloadavg(), host_sharing_check()

    def med(label: str, key: str):
        vals = [r[key] for r in results[label] if r.get(key) is not None]
        return statistics.median(vals) if vals else None

    print(f"\n{machine_summary()}; {a.threads} thread(s); {a.rounds} rounds, medians; "
          f"load average {load0[0]:.1f} -> {load1[0]:.1f}; before: {fmt_check(sharing0)}; after: {fmt_check(sharing1)}\n")
    print("| engine / weights | batch-1 decode tok/s | TTFT ms | RSS MB | W1 output tok/s |")
    print("|---|---|---|---|---|")
    for c in cfgs:
        lab = c["label"]
        cells = [med(lab, k) for k in ("decode_tok_s", "ttft_ms", "rss_mb", "w1_output_tok_s")]
        print(f"| {lab} | " + " | ".join("-" if v is None else f"{v:.1f}" for v in cells) + " |")
    errors = [(lab, r["error"]) for lab, rs in results.items() for r in rs if "error" in r]
    for lab, e in errors[:4]:
        print(f"\n{lab}: {e}")


if __name__ == "__main__":
    main()
