"""Where a batch-1 decode step of the default (quantized) model goes with the decoder layers in
one C call (kvflow/model/decode_graph.py): the engine step, the one call, the LM head, and the
quantized projections alone (the same C calls on the model's weights, from a ctypes loop, ~1 us
of call each), medians over the decode steps of one 64-token prompt and 128 greedy tokens.

    .venv/bin/python benchmarks/decode_graph_profile.py [--threads 1] [--rounds 3]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def projections_ms(model, threads: int, reps: int = 50) -> float:
    """The 30 layers' four quantized projections at one row, as decode_step.c calls them."""
    import torch

    from kvflow.csrc import library
    from kvflow.model.quant.qlinear import ISA_CODES, KIND_CODES, NEVER

    lib, dtype = library(), model.dtype
    bf16 = int(dtype == torch.bfloat16)
    h = model.arch.hidden_size
    x = torch.randn(1, h).to(dtype)
    calls = []
    for layer in model.layers:
        for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            w = layer.packed[name].quant
            n_out = w.n // 2 if name == "gate_up_proj" else w.n
            inp, out = torch.randn(1, w.k).to(dtype), torch.empty(1, n_out, dtype=dtype)
            common = (w.kb, bf16, int(w.per_row), w.packed.data_ptr(), KIND_CODES[w.kind],
                      ISA_CODES[w.isa], None, out.data_ptr(), w.n, bf16, 1, threads,
                      w.wide_rows if bf16 else NEVER, int(name == "gate_up_proj"))
            if name in ("qkv_proj", "gate_up_proj"):
                norm = layer.input_layernorm if name == "qkv_proj" else layer.post_attention_layernorm
                calls.append((lib.quant_linear_normed, (x.data_ptr(), None, norm.data_ptr(), layer.eps,
                                                        w.k) + common, (x, inp, out)))
            else:
                calls.append((lib.quant_linear, (inp.data_ptr(), w.k, w.k) + common, (inp, out)))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for fn, args, _keep in calls:
            fn(*args)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    import torch

    from kvflow import LLM, SamplingParams

    llm = LLM(max_model_len=512, num_blocks=64, num_threads=a.threads)
    core = llm.engine.core
    model = core.executor.runner.model
    timers = {"step": [], "layers (one C call)": [], "LM head": []}

    def timed(name, fn):
        def wrapper(*args, **kw):
            t0 = time.perf_counter()
            out = fn(*args, **kw)
            timers[name].append(time.perf_counter() - t0)
            return out
        return wrapper

    prompt = [list(range(200, 264))]
    params = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)
    llm.generate(prompt, params, use_tqdm=False)  # warm-up: builds the graph
    graph = model._decode_graph[1]
    assert graph is not None, "the default model did not take the one-call step"
    graph.run = timed("layers (one C call)", graph.run)
    model.compute_logits = timed("LM head", model.compute_logits)
    core.step = timed("step", core.step)
    for rnd in range(a.rounds):
        for t in timers.values():
            t.clear()
        llm.generate(prompt, params, use_tqdm=False)
        # the decode steps only: the first step is the prompt's
        med = {k: statistics.median(v[1:]) * 1e3 for k, v in timers.items()}
        proj = projections_ms(model, a.threads)
        rest = med["layers (one C call)"] - proj
        print(f"round {rnd + 1}: step {med['step']:.2f} ms = layers {med['layers (one C call)']:.2f} "
              f"(projections alone {proj:.2f}, the rest of the layers {rest:.2f}) + LM head "
              f"{med['LM head']:.2f} + outside {med['step'] - med['layers (one C call)'] - med['LM head']:.2f}"
              f" (embedding, final norm, sampling, scheduler, detokenizer); {1e3 / med['step']:.0f} steps/s")
    print(f"threads {a.threads}, torch {torch.__version__}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
