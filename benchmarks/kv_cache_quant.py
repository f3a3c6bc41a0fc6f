"""The one-byte KV caches (`--kv-cache-dtype fp8 | int8`) against bf16's, on the default model:

1. accuracy: next-token agreement and mean KL against the bf16 cache over the fixed corpus of
   benchmarks/quant_accuracy.py (benchmarks/data/quant_corpus.txt, windows of 512, every
   position scored), with the same weights and activations (the default: Q4_1 GGUF, bf16 where
   the CPU has native bf16; `--dtype float32` for the other CPU kind's); a float32 cache's row
   shows what the cache's numerics alone move, fp8 is served with its key scales
   (kvflow/model/key_scales.py) and measured without them too;
2. capacity under load: W2-shaped requests (256 random prompt tokens, 128 output tokens,
   ignore_eos) all arriving at once (rate inf), offline, with a `--kv-cache-memory` that makes
   bf16 preempt: blocks, preemptions (from the engine's per-step stats), throughput;
3. decode attention alone: one call per layer of the decode kernel over a decode step's batch
   whose blocks are scattered, per cache dtype (bf16: the engine's bf16-q row; fp8/int8:
   paged_attention_quant.c on each of its paths).

    flock /tmp/kvflow-bench.lock .venv/bin/python benchmarks/kv_cache_quant.py \
        [--threads 2] [--w2-prompts 48] [--kv-cache-memory 96MiB] [--reps 3]

Writes benchmarks/results/kv_cache_quant.json and .md (the report). Variants alternate within
each repetition and medians are quoted; on a shared machine the timings move run to run.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

import kvflow  # noqa: E402,F401 - first, so OMP_WAIT_POLICY applies before torch loads
import numpy as np  # noqa: E402
import torch  # noqa: E402

CACHES = ("bfloat16", "fp8", "int8")  # the serving part's default; --caches adds float32
ACCURACY_ROWS = {"fp8": "fp8 (key scales, as served)", "fp8-unscaled": "fp8 without key scales"}


def cpu_name() -> str:
    from kvflow.model.cpu_features import cpu_features
    from kvflow.utils.cpuinfo import read_cpuinfo
    f = cpu_features()
    extra = ", AMX" if "amx_bf16" in f.flags else ""
    return f"{read_cpuinfo().model_name or platform.processor()} ({f.isa}{extra})"


def accuracy(threads: int, dtype: str = "auto") -> list[dict]:
    from quant_accuracy import CORPUS, compare, windows

    from kvflow.attention.metadata import build_attention_metadata
    from kvflow.model.kv_cache import allocate_kv_caches
    from kvflow.model.key_scales import apply_key_scales, set_key_scales
    from kvflow.attention.kv_layout import resolve_kv_dtype
    from kvflow.model.loader import load_model, resolve_dtype
    from kvflow.model_path import default_model_path
    from kvflow.tokenizer import get_tokenizer

    torch.set_num_threads(threads)
    path = default_model_path()
    ids = get_tokenizer(path).encode(open(CORPUS).read())
    model, arch = load_model(path, resolve_dtype(dtype), quantization="gguf")
    base = model.kernels
    bs = 16

    def logits(cache: str, key_scales: bool = True):
        kv_dtype = resolve_kv_dtype({"fp8": "fp8_e4m3"}.get(cache, cache))
        model.kernels = base
        # as the runner serves this cache (fp8: key scales calibrated, model/key_scales.py)
        if key_scales:
            set_key_scales(model, arch, kv_dtype)
        else:
            apply_key_scales(model, None)
        model.kernels = base.with_kv_dtype(kv_dtype)
        caches = allocate_kv_caches(arch, 512 // bs + 1, bs, kv_dtype)
        rows = []
        for w in windows(ids):
            meta = build_attention_metadata(np.array([len(w)]), np.array([len(w)]),
                                            [list(range(-(-len(w) // bs)))], bs)
            with torch.no_grad():
                hidden = model(torch.tensor(w), torch.arange(len(w)), caches, meta)
                rows.append(model.compute_logits(hidden).float())
        return torch.cat(rows)

    ref = logits("bfloat16")
    ref32 = logits("float32")
    out = []
    for cache in ("float32", "fp8", "fp8-unscaled", "int8"):
        name = cache.removesuffix("-unscaled")
        # the float32 row is ref32 (already computed); fp8-unscaled: without the key scales
        got = ref32 if cache == "float32" else logits(name, key_scales=name == cache)
        model.kernels = base.with_kv_dtype(resolve_kv_dtype({"fp8": "fp8_e4m3"}.get(name, name)))
        vs32 = compare(ref32, got)
        out.append({"cache": cache, "model_dtype": str(model.dtype).removeprefix("torch."),
                    "attention": model.kernels.names["attention"], **compare(ref, got),
                    "vs_float32_cache": {k: vs32[k] for k in ("agreement", "mean_kl", "p99_kl")}})
    return out


def serve_w2(cache: str, num_prompts: int, memory: str, threads: int, seed: int = 0,
             model: str | None = None, dtype: str = "auto") -> dict:
    from kvflow import LLM, SamplingParams

    llm = LLM(model=model, dtype=dtype, kv_cache_dtype=cache, kv_cache_memory=memory,
              num_threads=threads)
    eng = llm.engine
    core = eng.core
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(100, core.arch.vocab_size - 100, 256).tolist() for _ in range(num_prompts)]
    params = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        eng.add_request(str(i), p, params)
    preemptions = steps = out_tokens = 0
    t0 = time.perf_counter()
    while eng.has_unfinished_requests():
        core_out = core.step()
        steps += 1
        if core_out.scheduler_stats is not None:
            preemptions += core_out.scheduler_stats.num_preemptions
        out_tokens += sum(len(o.new_token_ids) for o in core_out.outputs)
        eng.output_processor.process_outputs(core_out.outputs)
    wall = time.perf_counter() - t0
    result = {"cache": cache, "kv_cache_memory": memory, "num_blocks": core.cache_config.num_blocks,
              "kv_bytes_per_token": core.kv_bytes_per_token,
              "tokens_in_pool": core.cache_config.num_blocks * core.cache_config.block_size,
              "preemptions": preemptions, "steps": steps, "output_tokens": out_tokens,
              "wall_s": wall, "output_tok_s": out_tokens / wall,
              "total_tok_s": (out_tokens + 256 * num_prompts) / wall,
              "attention": core.executor.runner.model.kernels.names["attention"],
              "model": os.path.relpath(core.model_path, ROOT) if model else "default (Q4_1 GGUF)",
              "linear": core.executor.runner.model.kernels.names["linear"]}
    eng.shutdown()
    return result


def kernel_times(reps: int, batch: int = 32, context: int = 340, layers: int = 30) -> list[dict]:
    from kvflow.csrc import load_library
    from kvflow import attention as A
    from kvflow.attention.kv_layout import FP8, cache_shape, write_rows

    if load_library() is None:
        return []
    torch.set_num_threads(1)
    h, kvh, d, bs = 9, 3, 64, 16  # SmolLM2-135M's attention
    per_req = -(-context // bs)
    rng = np.random.default_rng(0)
    nb = batch * per_req
    tables = [rng.permutation(nb)[:per_req].tolist() for _ in range(batch)]
    meta = A.build_attention_metadata(np.ones(batch, dtype=np.int64), np.full(batch, context),
                                      tables, bs)
    slots = torch.arange(nb * bs)
    from kvflow.model.cpu_features import cpu_features
    native_bf16 = cpu_features().avx512_bf16  # the model runs bf16 there, fp32 elsewhere
    # bf16 with bf16 q: the AVX512-BF16 row; with fp32 q: the AVX2 row (what an AVX2-only CPU
    # runs for a bf16 cache, beside its fp32 one)
    variants = [("bfloat16", torch.bfloat16, "avx2-fp32q")]
    variants = ([("bfloat16", torch.bfloat16, None)] + variants if native_bf16
                else [("float32", torch.float32, "avx2-fp32q")] + variants)
    for name, dt in (("fp8", FP8), ("int8", torch.int8)):
        # scalar: a reference; avx512-bf16 reads fp8 only (int8 runs AVX-512's row there)
        variants += [(name, dt, isa) for isa in A.q8_isas()
                     if isa != "scalar" and not (isa == "avx512-bf16" and dt == torch.int8)]
    caches = {}
    for name, dt, _ in variants:
        if name in caches:
            continue
        layers_kv = []
        for _ in range(layers):
            kc = torch.zeros(cache_shape(nb, bs, kvh, d, dt), dtype=dt)
            vc = torch.zeros_like(kc)
            write_rows(kc, vc, torch.randn(nb * bs, kvh, d), torch.randn(nb * bs, kvh, d), slots)
            layers_kv.append((kc, vc))
        caches[name] = layers_kv
    # q and out in the activations' dtype, as the engine passes them
    q = torch.randn(batch, h, d).to(torch.bfloat16 if native_bf16 else torch.float32)
    out = torch.empty(batch, h, d, dtype=q.dtype)
    times = {v: [] for v in variants}

    q32, out32 = q.float(), out.float()

    def step(name, isa):
        t0 = time.perf_counter()
        for kc, vc in caches[name]:
            if isa == "avx2-fp32q":
                A.decode_with_kernel(q32, kc, vc, meta, d ** -0.5, out32)
            else:
                A.decode_with_kernel(q, kc, vc, meta, d ** -0.5, out, q8_isa=isa)
        return time.perf_counter() - t0

    for v in variants:
        step(v[0], v[2])
    for _ in range(reps * 3):  # alternate the variants, take medians
        for v in variants:
            times[v].append(step(v[0], v[2]))
    rows = []
    for (name, dt, isa), ts in times.items():
        kv_bytes = sum(t.numel() * t.element_size() for t in caches[name][0]) * layers
        read = kv_bytes * context * batch / (nb * bs)
        path = {None: "avx512-bf16 (vdpbf16ps)", "avx2-fp32q": "avx2 (fp32 q/out)"}.get(isa, isa)
        if isa not in (None, "avx2-fp32q"):
            path += f" ({str(q.dtype).removeprefix('torch.')} q/out)"
        rows.append({"cache": name, "path": path,
                     "ms_per_step": statistics.median(ts) * 1e3, "min_ms": min(ts) * 1e3,
                     "kv_read_mb": read / 1e6,
                     "shape": f"{layers} layers x {batch} requests x {context} tokens, "
                              f"{h} heads / {kvh} kv heads x {d}, one thread"})
    return rows


def conditions(res: dict) -> str:
    """What else ran: the 1-minute load averages at the start and end of the run."""
    if "conditions" in res:
        return res["conditions"]
    if "load" not in res:
        return "load not recorded"
    lo, hi = min(res["load"]), max(res["load"])
    return f"load {lo:.1f}-{hi:.1f} (1-minute averages at the start and end; above ~{res['threads']} other jobs shared the cores)"


def report(res: dict) -> str:
    lines = [f"# One-byte KV caches (fp8, int8) against bf16", "",
             f"CPU: {res['cpu']} ({res['cores']} cores visible; {conditions(res)}; timings are "
             f"medians of alternating runs), {res['date']}; "
             + "; ".join(f"`{c}`" for c in res["commands"]) + ".", ""]
    if res.get("accuracy"):
        a = res["accuracy"]
        lines += ["## Accuracy against the bf16 cache",
                  "", f"Corpus benchmarks/data/quant_corpus.txt, windows of 512 (every position "
                  f"scored, {a[0]['positions']} positions); default model (Q4_1 GGUF), "
                  f"{a[0]['model_dtype']} activations; the reference is the same model on a bf16 "
                  "cache (what `auto` is where activations are bf16; float32 where they are "
                  "fp32); the last three columns take the float32 cache "
                  "as the reference instead (the cache's numerics alone).", "",
                  "| cache | attention | agreement vs bf16 | mean KL | p99 KL | agreement vs fp32 cache | mean KL | p99 KL |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in a:
            f = r["vs_float32_cache"]
            label = ACCURACY_ROWS.get(r["cache"], r["cache"])
            lines.append(f"| {label} | {r['attention']} | {r['agreement'] * 100:.1f}% | "
                         f"{r['mean_kl']:.4f} | {r['p99_kl']:.3f} | {f['agreement'] * 100:.1f}% | "
                         f"{f['mean_kl']:.4f} | {f['p99_kl']:.3f} |")
        lines.append("")
    for key in ("serving", "serving_unlocked"):
        if not res.get(key):
            continue
        s = res[key]
        lines += ["## W2-shaped load at rate inf, one memory budget"
                  + (" (not under the benchmark lock)" if key == "serving_unlocked" else ""),
                  "", f"{s[0]['n']} requests of 256 random prompt tokens + 128 output tokens "
                  f"(ignore_eos), all queued at once, offline engine, model "
                  f"{s[0].get('model', 'default (Q4_1 GGUF)')} (linear {s[0].get('linear', '?')}), `--kv-cache-memory "
                  f"{s[0]['kv_cache_memory']}`, {res['threads']} threads; medians of "
                  f"{len(s[0]['runs'])} alternating runs.", ""]
        if key == "serving_unlocked":
            lines += [res.get("serving_unlocked_note", ""), ""]
        lines += ["| cache | B/token | blocks | tokens in pool | preemptions | steps | output tok/s | total tok/s |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in s:
            lines.append(f"| {r['cache']} | {r['kv_bytes_per_token']} | {r['num_blocks']} | "
                         f"{r['tokens_in_pool']} | {r['preemptions']} | {r['steps']} | "
                         f"{r['output_tok_s']:.1f} | {r['total_tok_s']:.1f} |")
        lines.append("")
    if res.get("kernel"):
        k = res["kernel"]
        lines += ["## Decode attention alone, per step", "", f"{k[0]['shape']}, blocks scattered, "
                  "q and out in the dtype the row names (bf16 unnamed: as the engine passes "
                  "them with bf16 activations).", "",
                  "| cache | path | ms / step (median) | min | K/V bytes read (MB) |", "|---|---|---|---|---|"]
        for r in k:
            lines.append(f"| {r['cache']} | {r['path']} | {r['ms_per_step']:.1f} | {r['min_ms']:.1f} | "
                         f"{r['kv_read_mb']:.0f} |")
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--w2-prompts", type=int, default=48)
    p.add_argument("--kv-cache-memory", default="96MiB")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--model", default=None, help="the serving part's model (default: the default "
                   "Q4_1 GGUF; benchmarks/export_model.py writes its bf16 HF folder)")
    p.add_argument("--dtype", default="auto", help="the activations of the accuracy and serving "
                   "parts (float32: the default where the CPU has no native bf16)")
    p.add_argument("--caches", nargs="+", default=list(CACHES),
                   choices=["float32", "bfloat16", "fp8", "int8"],
                   help="the serving part's caches (float32: what `auto` is where fp32 runs)")
    p.add_argument("--skip", nargs="*", default=[], choices=["accuracy", "serving", "kernel"])
    p.add_argument("--out", default=os.path.join(HERE, "results", "kv_cache_quant"))
    a = p.parse_args()
    res = {}
    if a.skip and os.path.exists(a.out + ".json"):  # a skipped part keeps its last results
        with open(a.out + ".json") as f:
            res = {k: v for k, v in json.load(f).items()
                   if k in a.skip or k in ("commands", "serving_unlocked", "serving_unlocked_note")}
    commands = res.get("commands", [])
    res.update({"cpu": cpu_name(), "cores": os.cpu_count(), "threads": a.threads,
                "date": time.strftime("%Y-%m-%d", time.gmtime()),
                "commands": commands + ["python benchmarks/kv_cache_quant.py " + " ".join(sys.argv[1:])]})
    res["load"] = [os.getloadavg()[0]]
    res.pop("conditions", None)
    os.makedirs(os.path.dirname(a.out), exist_ok=True)

    def save():  # after each part: a run cut short keeps what it measured
        res["load"] = res["load"][:1] + [os.getloadavg()[0]]
        with open(a.out + ".json", "w") as f:
            json.dump(res, f, indent=1)
        with open(a.out + ".md", "w") as f:
            f.write(report(res) + "\n")

    if "accuracy" not in a.skip:
        res["accuracy"] = accuracy(a.threads, a.dtype)
        save()
    if "kernel" not in a.skip:
        res["kernel"] = kernel_times(a.reps)
        save()
    if "serving" not in a.skip:
        runs = {c: [] for c in a.caches}
        for _ in range(a.reps):
            for c in a.caches:
                runs[c].append(serve_w2(c, a.w2_prompts, a.kv_cache_memory, a.threads,
                                        model=a.model, dtype=a.dtype))
                print(json.dumps(runs[c][-1]), flush=True)
        res["serving"] = []
        for c in a.caches:
            rs = runs[c]
            med = sorted(rs, key=lambda r: r["wall_s"])[len(rs) // 2]
            res["serving"].append({**med, "n": a.w2_prompts, "runs": rs,
                                   "output_tok_s": statistics.median(r["output_tok_s"] for r in rs),
                                   "total_tok_s": statistics.median(r["total_tok_s"] for r in rs)})
        save()
    print(report(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
