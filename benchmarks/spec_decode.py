"""Speculative decoding on an input-grounded workload: prompts that ask the default model to
copy, fix or reformat a passage or some code given in the prompt, greedy, up to 256 output
tokens each (the answer ends at EOS, as a user's would: past its answer a model ignoring EOS
writes free text that no prompt grounds).

Measured, with speculation off and each mode on (n-gram; `--draft NAME` adds a layer-skip
self-draft of the default model, benchmarks/layer_skip_draft.py), each mode its own LLM in
this process, alternating round by round (medians):
- one stream: output tok/s (first request token to last), time per output token after the
  first (TPOT, the inter-token latency a reader sees, averaged over tokens), mean gap between
  streamed deltas (with speculation a delta may carry several tokens);
- 8 concurrent streams: output tok/s of the batch;
- acceptance: drafted and accepted tokens, acceptance rate, mean acceptance length; how many
  of the 8 greedy outputs equal those without speculation.
`--format` picks the dtype and weight format (fp32: the default GGUF dequantised,
`quantization="none", dtype="float32"`; fp32-bf16w: the same with `weight_dtype="bfloat16"`;
bf16: `quantization="none", dtype="bfloat16"`; q4_1: the default, the Q4_1 file as stored;
repeatable: each format's rows in turn, under "formats" in the JSON).
`--w1` also runs W1 (`kvflow bench throughput`, `--w1-prompts` random-token prompts, 128 by
default) off and n-gram on, each in its own process, alternating. `--llamacpp` runs llama.cpp's
`LlamaPromptLookupDecoding` (llama-cpp-python in benchmarks/.venv-llamacpp, on the default
model's file as stored, or `--llamacpp-gguf bf16`) on the same token ids, one stream, off and on.

    flock /tmp/kvflow-bench.lock .venv/bin/python benchmarks/spec_decode.py --rounds 3
    flock /tmp/kvflow-bench.lock .venv/bin/python benchmarks/spec_decode.py --format fp32 \
        --format fp32-bf16w --format bf16 --format q4_1 --w1 --w1-prompts 32
    flock /tmp/kvflow-bench.lock .venv/bin/python benchmarks/spec_decode.py --w1 --llamacpp
    flock /tmp/kvflow-bench.lock .venv/bin/python benchmarks/spec_decode.py --draft first4 --draft first8
"""
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

PASSAGE = (
    "Caching is one of the oldest ideas in computing. A cache keeps a copy of data close to "
    "where it is used, so that the next request for the same data is answered quickly instead "
    "of going back to the slower original source. Web browsers cache pages and images, "
    "processors cache memory in several levels, and databases cache query results. The hard "
    "part is deciding what to keep and when to throw it away: a cache that holds stale data "
    "gives wrong answers, and a cache that is too small evicts entries before they are reused.")
CODE = '''def parse_config(path):
    with open(path) as f:
        lines = f.readlines()
    config = {}
    for line in lines:
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, value = line.split("=", 1)
        config[key.strip()] = value.strip()
    return config


def load_users(path):
    with open(path) as f:
        rows = f.readlines()
    users = []
    for row in rows:
        name, email, age = row.strip().split(",")
        users.append({"name": name, "email": email, "age": int(age)})
    return users
'''
TASKS = [
    f"Copy the following text exactly, word for word:\n\n{PASSAGE}",
    f"Rewrite this Python code with type hints added to every function, keeping everything "
    f"else the same:\n\n{CODE}",
    f"Fix the spelling mistakes in this text and return the whole corrected text:\n\n"
    f"{PASSAGE.replace('computing', 'computnig').replace('quickly', 'quikly')}",
    f"Reformat this text as a bulleted list, one sentence per bullet:\n\n{PASSAGE}",
    f"Add a docstring to each function of this code and return the whole file:\n\n{CODE}",
    f"Repeat this code exactly, then say nothing else:\n\n{CODE}",
    f"Copy this paragraph twice, separated by a blank line:\n\n{PASSAGE}",
    f"Rename the variable `lines` to `text_lines` in this code and return all of it:\n\n{CODE}",
]
OUTPUT_LEN = 256
# --format: LLM keywords (and `kvflow bench throughput` flags) of each dtype and weight format
FORMATS = {"auto": {}, "q4_1": {"quantization": "gguf"},
           "fp32": {"quantization": "none", "dtype": "float32"},
           "fp32-bf16w": {"quantization": "none", "dtype": "float32", "weight_dtype": "bfloat16"},
           "bf16": {"quantization": "none", "dtype": "bfloat16"}}


def format_kwargs(args) -> dict:
    kw = dict(FORMATS[args.format])
    if args.dtype != "auto":
        kw["dtype"] = args.dtype
    return kw


def format_flags(args) -> list[str]:
    return [f"--{k.replace('_', '-')}={v}" for k, v in format_kwargs(args).items()]


def machine() -> str:
    from kvflow.utils.cpuinfo import read_cpuinfo

    return f"{os.cpu_count()} vCPU {read_cpuinfo().model_name}"


def prompt_ids(tokenizer) -> list[list[int]]:
    return [tokenizer.encode(tokenizer.apply_chat_template(
        [{"role": "user", "content": t}], add_generation_prompt=True, tokenize=False),
        add_special_tokens=False) for t in TASKS]


def one_stream(llm, ids: list[int], params) -> dict:
    from kvflow.engine.output_processor import OutputKind
    eng = llm.engine
    t0 = time.perf_counter()
    eng.add_request("s", ids, params, kind=OutputKind.DELTA)
    arrivals = []  # (time, tokens in the delta)
    while eng.has_unfinished_requests():
        for out in eng.step():
            n = len(out.outputs[0].token_ids) if out.outputs else 0
            if n:
                arrivals.append((time.perf_counter(), n))
    n_tok = sum(n for _, n in arrivals)
    first, last = arrivals[0][0], arrivals[-1][0]
    return {"tokens": n_tok, "ttft_s": first - t0, "tok_s": (n_tok - arrivals[0][1]) / (last - first),
            "tpot_ms": (last - first) / (n_tok - arrivals[0][1]) * 1e3,
            "delta_gap_ms": (last - first) / max(len(arrivals) - 1, 1) * 1e3}


def concurrent(llm, prompts: list[list[int]], params) -> dict:
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"tokens": n, "wall_s": wall, "tok_s": n / wall}


def spec_counts(llm) -> dict:
    s = llm.engine.core.scheduler.spec_stats
    return {"drafts": s.num_drafts, "draft_tokens": s.num_draft_tokens,
            "accepted": s.num_accepted_tokens}


def draft_spec(name: str, args) -> dict:
    """A layer-skip self-draft of the default model (benchmarks/layer_skip_draft.py):
    `first8` keeps its first 8 layers, `keep0-1_6-29` those layers."""
    sys.path.insert(0, HERE)
    from layer_skip_draft import write_layer_skip_draft
    path = (write_layer_skip_draft(int(name.removeprefix("first"))) if name.startswith("first")
            else write_layer_skip_draft(keep=name.removeprefix("keep").replace("_", ",")))
    return {"method": "draft_model", "model": path, "num_speculative_tokens": args.draft_k,
            "min_acceptance_rate": args.draft_min_acceptance}


def run_kvflow(args) -> dict:
    """Off and each speculation mode, each its own LLM in this process, alternating round by
    round (the order reversed every other round); medians."""
    sys.path.insert(0, ROOT)
    from kvflow import LLM, SamplingParams
    specs = {"off": None}
    if not args.no_ngram:
        specs["on"] = json.loads(args.spec)
    for name in args.draft:
        specs[f"draft {name}"] = draft_spec(name, args)
    kw = dict(format_kwargs(args), num_blocks=args.num_blocks, max_model_len=2048)
    llms = {m: LLM(**kw, speculative_config=spec) for m, spec in specs.items()}
    prompts = prompt_ids(llms["off"].tokenizer)
    params = SamplingParams(temperature=0, max_tokens=OUTPUT_LEN)
    res = {m: {"single": [], "batch8": [], "acceptance_single": []} for m in llms}
    for r in range(args.rounds):
        for mode in (list(llms) if r % 2 == 0 else list(llms)[::-1]):
            llm = llms[mode]
            before = spec_counts(llm)
            singles = [one_stream(llm, p, params) for p in prompts[:args.single_prompts]]
            res[mode]["single"].append({
                "tok_s": statistics.mean(s["tok_s"] for s in singles),
                "tpot_ms": statistics.mean(s["tpot_ms"] for s in singles),
                "delta_gap_ms": statistics.mean(s["delta_gap_ms"] for s in singles),
                "per_prompt_tok_s": [round(s["tok_s"], 1) for s in singles]})
            after_single = spec_counts(llm)
            res[mode]["batch8"].append(concurrent(llm, prompts[:8], params))
            res[mode]["acceptance_single"].append({k: after_single[k] - before[k] for k in before})
    # outputs equal (greedy): one check on the batch
    want = llms["off"].generate(prompts[:8], params, use_tqdm=False)
    summary = {"machine": machine(), "load1": os.getloadavg()[0], "format": args.format,
               "llm_kwargs": format_kwargs(args),
               "served_as": {"dtype": str(llms["off"].engine.core.dtype),
                             "kernels": llms["off"].engine.core.executor.runner.model.kernels.describe()},
               "rounds": args.rounds}
    for mode, llm in llms.items():
        single, batch = res[mode]["single"], res[mode]["batch8"]
        m = summary[mode] = {
            "speculative_config": specs[mode],
            "single_tok_s": statistics.median(x["tok_s"] for x in single),
            "single_tpot_ms": statistics.median(x["tpot_ms"] for x in single),
            "single_delta_gap_ms": statistics.median(x["delta_gap_ms"] for x in single),
            "batch8_tok_s": statistics.median(x["tok_s"] for x in batch),
            "single_rounds": single, "batch8_rounds": batch}
        if mode == "off":
            continue
        got = llm.generate(prompts[:8], params, use_tqdm=False)
        m["outputs_equal_off"] = sum(x.outputs[0].token_ids == y.outputs[0].token_ids
                                     for x, y in zip(want, got))
        acc = res[mode]["acceptance_single"]
        d, t, a = (sum(x[k] for x in acc) for k in ("drafts", "draft_tokens", "accepted"))
        total = spec_counts(llm)
        m["acceptance_single_stream"] = {"rate": a / t if t else 0.0,
                                         "mean_acceptance_length": 1 + a / d if d else 0.0,
                                         "drafts": d, "draft_tokens": t, "accepted": a}
        m["acceptance_all"] = {
            "rate": total["accepted"] / max(total["draft_tokens"], 1),
            "mean_acceptance_length": 1 + total["accepted"] / max(total["drafts"], 1), **total}
        m["speedup_single"] = m["single_tok_s"] / summary["off"]["single_tok_s"]
        m["speedup_batch8"] = m["batch8_tok_s"] / summary["off"]["batch8_tok_s"]
    return summary


def run_acceptance(args) -> dict:
    """Each draft alone over the 8 prompts in one batch: acceptance, no timing."""
    sys.path.insert(0, ROOT)
    from kvflow import LLM, SamplingParams
    params = SamplingParams(temperature=0, max_tokens=OUTPUT_LEN)
    out = {}
    for name in args.draft:
        llm = LLM(**format_kwargs(args), num_blocks=args.num_blocks, max_model_len=2048,
                  speculative_config=draft_spec(name, args))
        try:
            llm.generate(prompt_ids(llm.tokenizer), params, use_tqdm=False)
            c = spec_counts(llm)
            out[name] = {"layers": llm.engine.core.spec.proposer.arch.num_hidden_layers,
                         "rate": c["accepted"] / max(c["draft_tokens"], 1),
                         "mean_acceptance_length": 1 + c["accepted"] / max(c["drafts"], 1), **c}
        finally:
            llm.engine.shutdown()
    return out


def run_w1(args) -> dict:
    out = {"off": [], "on": []}
    for r in range(args.w1_rounds):
        for mode in (("off", "on") if r % 2 == 0 else ("on", "off")):
            cmd = [sys.executable, "-m", "kvflow.entrypoints.cli", "bench", "throughput",
                   "--num-prompts", str(args.w1_prompts), *format_flags(args)]
            if mode == "on":
                cmd += ["--speculative-config", args.spec]
            p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                               env=dict(os.environ, PYTHONPATH=ROOT))
            if p.returncode:
                raise RuntimeError(p.stderr[-2000:])
            text = p.stdout
            out[mode].append(json.loads(text[text.index("{"):])["output_tok_s"])
    off, on = statistics.median(out["off"]), statistics.median(out["on"])
    return {"format": args.format, "num_prompts": args.w1_prompts, "off_tok_s": off,
            "on_tok_s": on, "ratio": on / off, "rounds": out, "load1": os.getloadavg()[0]}


LLAMACPP_WORKER = r'''
import json, sys, time
from llama_cpp import Llama
from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
cfg = json.loads(sys.argv[1])
res = {}
llms = {"off": Llama(cfg["gguf"], n_ctx=2048, n_threads=cfg["threads"], n_batch=512, verbose=False),
        "on": Llama(cfg["gguf"], n_ctx=2048, n_threads=cfg["threads"], n_batch=512, verbose=False,
                    draft_model=LlamaPromptLookupDecoding(num_pred_tokens=cfg["k"],
                                                          max_ngram_size=cfg["max_n"]))}
for r in range(cfg["rounds"]):
    for mode in (("off", "on") if r % 2 == 0 else ("on", "off")):
        llm = llms[mode]
        rates = []
        for ids in cfg["prompts"]:
            llm.reset()
            t0 = time.perf_counter(); first = None; n = 0
            for tok in llm.generate(ids, temp=0.0, top_k=1, reset=True):
                if tok == llm.token_eos():
                    break
                n += 1
                if first is None:
                    first = time.perf_counter()
                if n >= cfg["max_tokens"]:
                    break
            last = time.perf_counter()
            rates.append((n - 1) / (last - first))
        res.setdefault(mode, []).append(sum(rates) / len(rates))
print(json.dumps(res))
'''


def run_llamacpp(args, prompts: list[list[int]], spec: dict) -> dict:
    if args.llamacpp_gguf == "default":  # the file kvflow serves by default, as it is stored
        from kvflow.model_path import default_model_path
        gguf = default_model_path()
    else:
        sys.path.insert(0, HERE)
        from export_model import export_gguf, export_hf_folder
        gguf = export_gguf("bf16", export_hf_folder())
    cfg = {"gguf": gguf, "threads": 1, "k": spec.get("num_speculative_tokens", 4),
           "max_n": spec.get("prompt_lookup_max", 5), "rounds": args.rounds,
           "prompts": prompts[:args.single_prompts], "max_tokens": OUTPUT_LEN}
    p = subprocess.run([LLAMACPP_PY, "-c", LLAMACPP_WORKER, json.dumps(cfg)], capture_output=True,
                       text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    if p.returncode:
        raise RuntimeError(p.stderr[-2000:])
    res = json.loads(p.stdout.strip().splitlines()[-1])
    off, on = statistics.median(res["off"]), statistics.median(res["on"])
    return {"engine": f"llama-cpp-python 0.3.36 ({os.path.basename(gguf)}, 1 thread)", "off_tok_s": off,
            "on_tok_s": on, "speedup": on / off, "rounds": res}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--single-prompts", type=int, default=4,
                   help="prompts run one at a time per round (of the 8)")
    p.add_argument("--dtype", default="auto", help="overrides the format's dtype")
    p.add_argument("--format", action="append", choices=list(FORMATS),
                   help="dtype and weight format (default: auto, the engine's default); repeatable")
    p.add_argument("--spec", default='{"method": "ngram", "num_speculative_tokens": 4, '
                                     '"prompt_lookup_min": 2, "prompt_lookup_max": 5}')
    p.add_argument("--no-ngram", action="store_true", help="no n-gram mode (drafts only)")
    p.add_argument("--draft", action="append", default=[],
                   help="also a layer-skip self-draft of the default model, e.g. first8 (its "
                        "first 8 layers) or keep0-1_6-29 (those layers); repeatable")
    p.add_argument("--draft-k", type=int, default=3, help="num_speculative_tokens of the drafts")
    p.add_argument("--draft-min-acceptance", type=float, default=0.0,
                   help="min_acceptance_rate of the drafts (0: they never stop, so that their "
                        "own speed is measured; the engine's default is 0.2)")
    p.add_argument("--num-blocks", type=int, default=512)
    p.add_argument("--acceptance-only", action="store_true",
                   help="each --draft over the 8 prompts at once: acceptance only, no timing")
    p.add_argument("--w1", action="store_true", help="also W1 off and on (minutes)")
    p.add_argument("--w1-rounds", type=int, default=2)
    p.add_argument("--w1-prompts", type=int, default=128)
    p.add_argument("--only-w1", action="store_true", help="W1 off and on, nothing else")
    p.add_argument("--llamacpp", action="store_true",
                   help="also llama.cpp's LlamaPromptLookupDecoding, one stream")
    p.add_argument("--llamacpp-gguf", choices=("default", "bf16"), default="default",
                   help="llama.cpp's weights: the default model's file as stored (Q4_1, what "
                        "kvflow serves by default) or a bf16 GGUF of the same weights")
    p.add_argument("--only-llamacpp", action="store_true", help="llama.cpp alone")
    p.add_argument("--output-json")
    args = p.parse_args()
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    formats = args.format or ["auto"]
    if len(formats) > 1:  # each format's run in turn, one JSON
        result = {"machine": machine(), "formats": {}}
        for f in formats:
            args.format = f
            result["formats"][f] = run_w1(args) if args.only_w1 else run_kvflow(args)
            if args.w1 and not args.only_w1:
                result["formats"][f]["w1"] = run_w1(args)
            print(json.dumps({f: result["formats"][f]}, indent=2), flush=True)
        text = json.dumps(result, indent=2)
        print(text)
        if args.output_json:
            with open(args.output_json, "w") as f:
                f.write(text)
        return
    args.format = formats[0]
    if args.acceptance_only or args.only_w1:
        result = ({"machine": machine(), "acceptance": run_acceptance(args)} if args.acceptance_only
                  else {"machine": machine(), "w1": run_w1(args)})
        print(json.dumps(result, indent=2))
        if args.output_json:
            with open(args.output_json, "w") as f:
                f.write(json.dumps(result, indent=2))
        return
    result = {"machine": machine()} if args.only_llamacpp else run_kvflow(args)
    print(json.dumps(result, indent=2), flush=True)  # kept if an anchor below fails
    args.llamacpp = args.llamacpp or args.only_llamacpp
    if args.llamacpp:
        sys.path.insert(0, ROOT)
        from kvflow.tokenizer import get_tokenizer
        from kvflow.model_path import default_model_path
        prompts = prompt_ids(get_tokenizer(default_model_path()))
        result["llamacpp"] = run_llamacpp(args, prompts, json.loads(args.spec))
    if args.w1:
        result["w1"] = run_w1(args)
    text = json.dumps(result, indent=2)
    print(text)
    if args.output_json:
        with open(args.output_json, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
