"""The cost of LoRA: W1 offline throughput (seeded random-token prompts of U[32, 512] tokens,
128 greedy output tokens, ignore_eos) of the default model alone, against the same prompts with
4 LoRA adapters (random PEFT adapters of ranks 8, 16, 8, 16 on all seven projections, built
here) mixed over them round-robin in one batch (`max_loras=4`), and with `enable_lora` on but
every request on the base model (what turning it on costs a server that serves the base too).
vLLM's CPU build (benchmarks/.venv-vllm) runs the same prompts and adapters, base and mixed,
on the HF folder of the same weights (benchmarks/export_model.py), in the same rounds.

Each run is its own process (thread settings in its environment before anything imports
torch, as compare.py does); variants alternate within a round, the order reversed every other
round; medians and ratios to each engine's base go to benchmarks/results/.

    flock /tmp/kvflow-bench.lock .venv/bin/python benchmarks/lora.py --rounds 2

The script does not take the lock itself: under flock(1) it would wait on its own lock.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)
import compare  # noqa: E402  (stdlib only at module level: run_worker, thread_env)
import results_io  # noqa: E402

RANKS = (8, 16, 8, 16)
KVFLOW_VARIANTS = ("base", "lora-mixed", "lora-enabled-base-only")
VLLM_VARIANTS = ("vllm-base", "vllm-lora-mixed")


def write_adapters(model_path: str, root: str, ranks=RANKS) -> list[str]:
    """One random PEFT-format adapter per rank (all seven projections) for the model: A is
    scaled to keep x @ A^T of unit size, B small, so outputs move off the base model's."""
    import torch
    from safetensors.torch import save_file

    from kvflow.model.arch import load_arch_config
    from kvflow.model.lora import TARGET_MODULES, module_shapes

    arch = load_arch_config(model_path)
    shapes = module_shapes(arch)
    paths = []
    for a, r in enumerate(ranks):
        path = os.path.join(root, f"adapter{a}-r{r}")
        paths.append(path)
        if os.path.isfile(os.path.join(path, "adapter_config.json")):
            continue  # seeded: the same adapter as last time
        g = torch.Generator().manual_seed(a)
        tensors = {}
        for i in range(arch.num_hidden_layers):
            for m in TARGET_MODULES:
                block = "mlp" if m in ("gate_proj", "up_proj", "down_proj") else "self_attn"
                key = f"base_model.model.model.layers.{i}.{block}.{m}"
                k, out = shapes[m]
                tensors[f"{key}.lora_A.weight"] = torch.randn(r, k, generator=g) / k ** 0.5
                tensors[f"{key}.lora_B.weight"] = torch.randn(out, r, generator=g) * 0.01
        os.makedirs(path, exist_ok=True)
        save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
        with open(os.path.join(path, "adapter_config.json"), "w") as f:
            json.dump({"peft_type": "LORA", "r": r, "lora_alpha": 2 * r,
                       "target_modules": list(TARGET_MODULES), "bias": "none"}, f)
    return paths


# -- workers: one variant in its own process ------------------------------------------------
def _result(variant: str, prompts, outs_ids: list[list[int]], wall: float, startup: float) -> dict:
    n_in = sum(len(p) for p in prompts)
    n_out = sum(len(o) for o in outs_ids)
    return {"variant": variant, "wall_s": wall, "output_tok_s": n_out / wall,
            "total_tok_s": (n_in + n_out) / wall, "input_tokens": n_in, "output_tokens": n_out,
            "startup_s": startup,
            # the first tokens of a few outputs: the adapters do change what is generated
            "first_tokens": [list(o[:4]) for o in outs_ids[:4]]}


def _round_robin(lora_request, adapters: list[str], n: int) -> tuple[list, list]:
    """One request object per adapter (either engine's LoRARequest class, the same fields) and
    the prompts' adapters, round-robin: (per prompt, the adapters for the warm-up)."""
    lrs = [lora_request(f"adapter{i}", i + 1, p) for i, p in enumerate(adapters)]
    return [lrs[i % len(lrs)] for i in range(n)], lrs


def worker_kvflow(variant: str, cfg: dict) -> dict:
    from kvflow import LLM, LoRARequest, SamplingParams
    from kvflow.utils.w1_prompts import make_w1

    t_start = time.perf_counter()
    kw = dict(dtype=cfg["dtype"], num_threads=cfg["threads"], max_model_len=1024)
    if variant != "base":
        kw.update(enable_lora=True, max_loras=len(cfg["adapters"]), max_lora_rank=max(cfg["ranks"]))
    llm = LLM(**kw)
    prompts = make_w1(cfg["num_prompts"], cfg["min_len"], cfg["max_len"],
                      llm.engine.core.arch.vocab_size, cfg["seed"])
    loras, warm_loras = (_round_robin(LoRARequest, cfg["adapters"], len(prompts))
                         if variant == "lora-mixed" else (None, None))
    # warm-up: kernels loaded, every adapter registered and in its slot before the clock
    n_warm = len(warm_loras) if warm_loras else 2
    warm = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    llm.generate([p[:16] for p in prompts[:n_warm]], warm, use_tqdm=False, lora_request=warm_loras)
    startup = time.perf_counter() - t_start
    params = SamplingParams(max_tokens=cfg["output_len"], temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    wall = time.perf_counter() - t0
    res = _result(variant, prompts, [o.outputs[0].token_ids for o in outs], wall, startup)
    res["startup_report"] = llm.engine.core.startup_report()
    llm.engine.shutdown()
    return res


def worker_vllm(variant: str, cfg: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    from kvflow.utils.w1_prompts import make_w1

    t_start = time.perf_counter()
    kw = {}
    if variant == "vllm-lora-mixed":
        kw.update(enable_lora=True, max_loras=len(cfg["adapters"]), max_lora_rank=max(cfg["ranks"]))
    llm = LLM(model=cfg["hf_model"], dtype=cfg["dtype"], max_model_len=1024, seed=0, **kw)
    prompts = make_w1(cfg["num_prompts"], cfg["min_len"], cfg["max_len"],
                      llm.llm_engine.model_config.get_vocab_size(), cfg["seed"])
    loras, warm_loras = (_round_robin(LoRARequest, cfg["adapters"], len(prompts))
                         if variant == "vllm-lora-mixed" else (None, None))
    n_warm = len(warm_loras) if warm_loras else 2
    warm = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    llm.generate([TokensPrompt(prompt_token_ids=p[:16]) for p in prompts[:n_warm]], warm,
                 use_tqdm=False, lora_request=warm_loras)
    startup = time.perf_counter() - t_start
    params = SamplingParams(max_tokens=cfg["output_len"], temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                        use_tqdm=False, lora_request=loras)
    wall = time.perf_counter() - t0
    return _result(variant, prompts, [list(o.outputs[0].token_ids) for o in outs], wall, startup)


def worker_main(variant: str, cfg: dict) -> None:
    fn = worker_vllm if variant.startswith("vllm") else worker_kvflow
    print("RESULT " + json.dumps(fn(variant, cfg)), flush=True)
    try:  # vLLM's engine-core and worker processes busy-poll behind an os._exit
        import psutil
        for child in psutil.Process().children(recursive=True):
            child.kill()
    except Exception:  # psutil missing, or a child already gone: the parent ends the group
        pass
    os._exit(0)


# -- the driver ------------------------------------------------------------------------------
def run_variant(variant: str, cfg: dict, timeout: float) -> dict:
    engine = "vllm" if variant.startswith("vllm") else "kvflow"
    py = cfg["vllm_python"] if engine == "vllm" else sys.executable
    cmd = [py, os.path.abspath(__file__), "--worker", variant, json.dumps(cfg)]
    env = compare.thread_env(engine, cfg["threads"])
    env["PYTHONPATH"] = ROOT  # this checkout's kvflow, in either interpreter
    t0 = time.perf_counter()
    stdout, stderr, error, rc = compare.run_worker(cmd, env, timeout)
    lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    if not lines:
        tail = (stderr or stdout)[-2000:].strip()
        return {"variant": variant, "error": error or f"exit {rc}: {tail}"}
    res = json.loads(lines[-1][7:])
    res["process_s"] = time.perf_counter() - t0
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", nargs=2, metavar=("VARIANT", "CFG"), help=argparse.SUPPRESS)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--vllm-rounds", type=int, default=1)
    p.add_argument("--num-prompts", type=int, default=128)
    p.add_argument("--min-len", type=int, default=32)
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--variants", default=",".join(KVFLOW_VARIANTS + VLLM_VARIANTS))
    p.add_argument("--vllm-python", default=compare.VENV_PY["vllm"], help="vLLM's interpreter")
    p.add_argument("--hf-model", default=None, help="vLLM's HF folder of the default model "
                   "(default: benchmarks/export_model.py's, built once)")
    p.add_argument("--adapters-dir", default=os.path.join(ROOT, ".cache", "lora-adapters"),
                   help="where the random adapters are written (kept: seeded, reused)")
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--out", default=None, help="results path without extension")
    args = p.parse_args()
    if args.worker:
        worker_main(args.worker[0], json.loads(args.worker[1]))
        return

    from kvflow.model_path import default_model_path

    variants = args.variants.split(",")
    started = datetime.datetime.now(datetime.timezone.utc)
    adapters = write_adapters(default_model_path(), args.adapters_dir)
    cfg = {"num_prompts": args.num_prompts, "min_len": args.min_len, "max_len": args.max_len,
           "output_len": args.output_len, "seed": args.seed, "threads": args.threads,
           "dtype": args.dtype, "adapters": adapters, "ranks": list(RANKS)}
    if any(v.startswith("vllm") for v in variants):
        import export_model
        cfg["vllm_python"] = args.vllm_python
        cfg["hf_model"] = args.hf_model or export_model.export_hf_folder()
    # kvflow's rounds first, then vLLM's (each engine is compared with its own base; vLLM's
    # CPU LoRA is slow enough that it gets fewer rounds, and a cut run keeps kvflow's)
    plan = []
    for group, rounds in (([v for v in variants if not v.startswith("vllm")], args.rounds),
                          ([v for v in variants if v.startswith("vllm")], args.vllm_rounds)):
        for r in range(rounds if group else 0):
            plan += [(r, v) for v in (group if r % 2 == 0 else group[::-1])]  # alternate the order
    runs = []
    for r, v in plan:
        res = run_variant(v, cfg, args.timeout)
        res["round"] = r
        runs.append(res)
        if "error" in res:
            print(f"round {r} {v:>24}: ERROR {res['error'][-600:]}", flush=True)
        else:
            print(f"round {r} {v:>24}: {res['output_tok_s']:7.1f} output tok/s "
                  f"({res['wall_s']:.1f} s, start-up {res['startup_s']:.0f} s)", flush=True)
        write_results(args, variants, runs, started, quiet=True)  # kept if a later run is cut
    write_results(args, variants, runs, started)


def write_results(args, variants: list[str], runs: list[dict], started, quiet: bool = False) -> None:
    ok = {v: [x["output_tok_s"] for x in runs if x["variant"] == v and "error" not in x] for v in variants}
    medians = {v: statistics.median(xs) for v, xs in ok.items() if xs}
    errors = {x["variant"]: x["error"] for x in runs if "error" in x}

    def base_of(v: str) -> str:
        return "vllm-base" if v.startswith("vllm") else "base"

    ratio = {v: medians[v] / medians[base_of(v)] for v in medians if base_of(v) in medians}
    cpu = results_io.cpu_info()
    stamp = started.strftime("%Y%m%d-%H%M")
    out = args.out or os.path.join(HERE, "results", f"{stamp}-lora-w1-t{args.threads}")
    command = ("flock /tmp/kvflow-bench.lock .venv/bin/python benchmarks/lora.py "
               + " ".join(a for a in sys.argv[1:]))
    workload = (f"W1: {args.num_prompts} prompts of random token ids, U[{args.min_len}, "
                f"{args.max_len}] tokens, {args.output_len} greedy output tokens, ignore_eos; "
                f"4 random PEFT adapters of ranks {'/'.join(map(str, RANKS))} on q,k,v,o,gate,up,"
                "down, round-robin over the prompts, max_loras 4, max_lora_rank 16")
    weights = ("kvflow: the default model (SmolLM2-135M-Instruct GGUF Q4_1, served as stored: "
               f"Q4_1 GEMMs, {args.dtype} activations); vLLM: the same weights dequantised to an "
               f"HF folder (exact), {args.dtype}")
    rows = [[v, len(ok[v]), round(medians[v], 1) if v in medians else None,
             round(ratio[v], 3) if v in ratio else None,
             [round(x, 1) for x in ok[v]]] for v in variants]
    result = {
        "schema": results_io.SCHEMA, "kind": "table",
        "title": f"The cost of LoRA on W1, {args.threads} compute thread(s)",
        "date": started.strftime("%Y-%m-%dT%H:%MZ"),
        "end": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%MZ"),
        "commit": results_io.git_commit(ROOT), "command": command, "cpu": cpu,
        "source": "benchmarks/lora.py",
        "notes": ["shared 2-vCPU machine: medians of rounds that alternate the variants",
                  workload, weights],
        "threads": args.threads,
        "columns": ["variant", "runs", "median output tok/s", "vs its engine's base", "each run"],
        "rows": rows, "errors": errors,
        "startup_report": next((x.get("startup_report") for x in runs
                                if x["variant"] == "lora-mixed" and "error" not in x), ""),
        "runs": [{k: v for k, v in x.items() if k != "startup_report"} for x in runs],
    }
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out + ".json", "w") as f:
        json.dump(result, f, indent=2)
    lines = [f"# {result['title']} ({result['date']})", "",
             f"CPU: {cpu['model']} ({cpu['kind']}: {', '.join(cpu['flags'])}; {cpu['vcpus']} vCPUs, "
             f"shared with other work: medians of {args.rounds} alternating rounds, vLLM's "
             f"{args.vllm_rounds}). "
             f"Commit {result['commit']}.", "", workload + ".", "", weights + ".", "",
             "| variant | runs | output tok/s (median) | vs its engine's base | each run |",
             "|---|---|---|---|---|"]
    for v, n, med, rat, each in rows:
        lines.append(f"| {v} | {n} | {med if med is not None else '-'} | "
                     f"{rat if rat is not None else '-'} | {', '.join(map(str, each))} |")
    for v, e in errors.items():
        lines += ["", f"{v} failed: `{e.strip().splitlines()[-1][:400] if e.strip() else e}`"]
    lines += ["", f"Command: `{command}`", ""]
    with open(out + ".md", "w") as f:
        f.write("\n".join(lines))
    if not quiet:
        print("\n".join(lines))


if __name__ == "__main__":
    main()
