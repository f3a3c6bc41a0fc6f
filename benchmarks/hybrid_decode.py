"""A hybrid model against an attention model of the same size: decode step time as the context
grows, and a small batch's throughput against Hugging Face transformers.

Random weights with real shapes (timing does not depend on the values): LFM2-350M's (16 layers,
10 gated short convolutions + 6 attention layers, hidden 1024, 16 heads / 8 KV heads, MLP 4608)
and a Llama of the same widths with 16 attention layers, both with SmolLM2's tokenizer and
vocabulary (49,152), in bf16 safetensors. For each context length, one request's prompt of
that many tokens, then 16 decode steps: the median step time. Then W1-shaped: 16 prompts of
256 tokens, 64 output tokens each, kvflow (continuous batching) against transformers'
generate (one padded batch), output tokens per second.

    .venv/bin/python benchmarks/hybrid_decode.py [--contexts 512 1024 2048 4096 8192]
        [--threads 2] [--dtype bfloat16] [--skip-hf]

Writes benchmarks/results/<date>-<time>-hybrid-decode.json (results_io's "table" kind)."""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

SHAPE = dict(vocab_size=49152, hidden_size=1024, num_hidden_layers=16, num_attention_heads=16,
             num_key_value_heads=8, max_position_embeddings=16384, bos_token_id=1, eos_token_id=2,
             pad_token_id=0, tie_word_embeddings=True)
LFM2_TYPES = ["conv", "conv", "full_attention", "conv", "conv", "full_attention", "conv", "conv",
              "full_attention", "conv", "full_attention", "conv", "full_attention", "conv",
              "full_attention", "conv"]  # LFM2-350M's: 10 conv, 6 attention
MLP = 4608
THREADS = {"num_threads": 2}  # set from --threads


def build(kind: str, out: str) -> str:
    """A random `kind` ("lfm2" or "llama") folder of SHAPE with SmolLM2's tokenizer."""
    if os.path.isfile(os.path.join(out, ".complete")):
        return out
    import torch
    from transformers import Lfm2Config, Lfm2ForCausalLM, LlamaConfig, LlamaForCausalLM

    from export_model import export_hf_folder

    torch.manual_seed(0)
    if kind == "lfm2":
        cfg = Lfm2Config(**SHAPE, intermediate_size=MLP, block_auto_adjust_ff_dim=False,
                         layer_types=LFM2_TYPES, initializer_range=0.05)
        model = Lfm2ForCausalLM(cfg)
    else:
        cfg = LlamaConfig(**SHAPE, intermediate_size=MLP, initializer_range=0.05)
        model = LlamaForCausalLM(cfg)
    model.to(torch.bfloat16).save_pretrained(out)
    tok_dir = export_hf_folder()
    for f in os.listdir(tok_dir):
        if "token" in f or f in ("special_tokens_map.json", "generation_config.json"):
            shutil.copy(os.path.join(tok_dir, f), out)
    open(os.path.join(out, ".complete"), "w").close()
    return out


def decode_steps(path: str, context: int, dtype: str, steps: int = 16) -> float:
    """Median decode step time (ms) of one request after a prompt of `context` tokens."""
    import numpy as np

    from kvflow import LLM, SamplingParams

    llm = LLM(path, dtype=dtype, max_model_len=context + steps + 8, max_num_seqs=4,
              max_num_batched_tokens=2048, **THREADS)
    engine = llm.engine
    ids = np.random.default_rng(context).integers(100, 40000, context).tolist()
    engine.add_request("r", ids, SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True))
    times = []
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    times = times[(context + 2047) // 2048:]  # after the prompt's chunks (2,048 tokens a step)
    engine.shutdown()
    return 1000 * statistics.median(times)


def kvflow_throughput(path: str, dtype: str, prompts: list[list[int]], max_tokens: int) -> float:
    from kvflow import LLM, SamplingParams

    llm = LLM(path, dtype=dtype, max_model_len=1024, max_num_seqs=len(prompts), **THREADS)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)  # warm
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    dt = time.perf_counter() - t0
    llm.engine.shutdown()
    return sum(len(o.outputs[0].token_ids) for o in outs) / dt


def hf_throughput(path: str, dtype: str, prompts: list[list[int]], max_tokens: int) -> float:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        model.generate(ids[:2, -8:], attention_mask=mask[:2, -8:], max_new_tokens=4, do_sample=False)
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                             do_sample=False, pad_token_id=0)
        dt = time.perf_counter() - t0
    return (out.shape[1] - width) * len(prompts) / dt


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--skip-hf", action="store_true")
    args = p.parse_args()
    import torch

    from results_io import cpu_info, git_commit

    torch.set_num_threads(args.threads)
    THREADS["num_threads"] = args.threads
    load_before = os.getloadavg()  # the host is shared: its load, for reading the numbers
    folders = {k: build(k, os.path.join(HERE, "results", f"random-{k}-350m-shape")) for k in ("lfm2", "llama")}
    rows = []
    for context in args.contexts:
        row = [context] + [round(decode_steps(folders[k], context, args.dtype), 2) for k in ("lfm2", "llama")]
        rows.append(row)
        print("context", row, flush=True)
    import numpy as np

    rng = np.random.default_rng(0)
    prompts = [rng.integers(100, 40000, 256).tolist() for _ in range(16)]
    w1 = {k: round(kvflow_throughput(f, args.dtype, prompts, 64), 1) for k, f in folders.items()}
    if not args.skip_hf:
        w1["hf_lfm2"] = round(hf_throughput(folders["lfm2"], args.dtype, prompts, 64), 1)
    print("w1", w1, flush=True)
    stamp = time.strftime("%Y%m%d-%H%M", time.gmtime())
    result = {"schema": "kvflow-bench/1", "kind": "table", "title": "hybrid vs attention: decode step by context; W1-shaped",
              "date": time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime()), "commit": git_commit(ROOT),
              "command": "benchmarks/hybrid_decode.py " + " ".join(sys.argv[1:]), "cpu": cpu_info(),
              "source": "benchmarks/hybrid_decode.py",
              "host_check": {"before": f"load average {load_before}", "after": f"load average {os.getloadavg()}"},
              "notes": [f"threads {args.threads}, dtype {args.dtype}, random weights of LFM2-350M's shape "
                        "and a same-width 16-layer Llama; W1-shaped: 16 prompts x 256 tokens, 64 out",
                        f"w1 output tok/s: {json.dumps(w1)}"],
              "columns": ["context", "lfm2 decode step ms", "llama decode step ms"], "rows": rows}
    out = os.path.join(HERE, "results", f"{stamp}-hybrid-decode.json")
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print("wrote", out)


if __name__ == "__main__":
    main()
