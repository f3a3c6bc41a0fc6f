"""Accuracy of quantized serving: next-token agreement and mean KL divergence
against the fp32 model, over the fixed corpus benchmarks/data/quant_corpus.txt (~2,800 tokens
in windows of 512, every position scored), for kvflow's quantized modes and llama.cpp's own
on the same files.

The fp32 reference is the GGUF file's weights dequantised (`--quantization none --dtype
float32`): the Q4_1 file's weights themselves, so what is measured is what serving them
quantized adds (int8 activations; for int8 W8A8 also the weights' requantization).

    python benchmarks/quant_accuracy.py [--q8 Q8_0.gguf] [--llamacpp]
        --q8: also a Q8_0 file of the model (benchmarks/write_gguf.py requant ... --type Q8_0)
        --llamacpp: also llama.cpp (llama-cpp-python in benchmarks/.venv-llamacpp) on each file
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
CORPUS = os.path.join(HERE, "data", "quant_corpus.txt")
WINDOW = 512


def windows(ids: list[int]) -> list[list[int]]:
    return [ids[i:i + WINDOW] for i in range(0, len(ids), WINDOW) if len(ids[i:i + WINDOW]) > 1]


def llamacpp_worker(gguf: str, ids_file: str, out_file: str, threads: int) -> None:
    """In llama.cpp's venv: the logits at every position of every window, as float16 rows."""
    import numpy as np
    from llama_cpp import Llama

    ids = json.load(open(ids_file))
    llm = Llama(gguf, n_ctx=WINDOW, n_batch=WINDOW, logits_all=True, n_threads=threads, verbose=False)
    rows = []
    for w in windows(ids):
        llm.reset()
        llm.eval(w)
        rows.append(np.asarray(llm.scores[:len(w)], dtype=np.float16))
    np.save(out_file, np.concatenate(rows))


def kvflow_logits(path: str, dtype: str, quantization: str, ids: list[int]):
    import numpy as np
    import torch

    from kvflow.attention.metadata import build_attention_metadata
    from kvflow.model.kv_cache import allocate_kv_caches
    from kvflow.model.loader import load_model, resolve_dtype

    model, arch = load_model(path, resolve_dtype(dtype), quantization=quantization)
    bs = 16
    caches = allocate_kv_caches(arch, WINDOW // bs + 1, bs, model.dtype)
    rows = []
    for w in windows(ids):
        meta = build_attention_metadata(np.array([len(w)]), np.array([len(w)]),
                                        [list(range(-(-len(w) // bs)))], bs)
        with torch.no_grad():
            hidden = model(torch.tensor(w), torch.arange(len(w)), caches, meta)
            rows.append(model.compute_logits(hidden).float())
    return torch.cat(rows)


def compare(ref, logits) -> dict:
    import torch

    logits = torch.as_tensor(logits).float()
    p_log = torch.log_softmax(ref, -1)
    q_log = torch.log_softmax(logits, -1)
    kl = (p_log.exp() * (p_log - q_log)).sum(-1)
    agree = (ref.argmax(-1) == logits.argmax(-1)).float()
    return {"agreement": agree.mean().item(), "mean_kl": kl.mean().item(),
            "p99_kl": kl.quantile(0.99).item(), "positions": len(kl)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="the Q4_1 GGUF (default: kvflow's default model)")
    p.add_argument("--q8", default=None, help="a Q8_0 GGUF of the same model")
    p.add_argument("--llamacpp", action="store_true")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--worker", nargs=3, metavar=("GGUF", "IDS", "OUT"), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        return llamacpp_worker(*a.worker, a.threads)
    sys.path.insert(0, ROOT)
    import torch

    from kvflow.model_path import default_model_path
    from kvflow.tokenizer import get_tokenizer

    torch.set_num_threads(a.threads)
    model = a.model or default_model_path()
    ids = get_tokenizer(model).encode(open(CORPUS).read())
    ref = kvflow_logits(model, "float32", "none", ids)
    rows = []
    files = [("Q4_1", model)] + ([("Q8_0", a.q8)] if a.q8 else [])
    for label, path in files:
        for dtype in ("float32", "bfloat16"):
            rows.append({"engine": "kvflow", "file": label, "mode": "gguf", "activations": dtype,
                         **compare(ref, kvflow_logits(path, dtype, "gguf", ids))})
    for dtype in ("float32", "bfloat16"):
        rows.append({"engine": "kvflow", "file": "Q4_1 (dequantised)", "mode": "int8 W8A8",
                     "activations": dtype, **compare(ref, kvflow_logits(model, dtype, "int8", ids))})
    rows.append({"engine": "kvflow", "file": "Q4_1 (dequantised)", "mode": "none", "activations": "bfloat16",
                 **compare(ref, kvflow_logits(model, "bfloat16", "none", ids))})
    if a.llamacpp:
        import numpy as np

        py = os.path.join(HERE, ".venv-llamacpp", "bin", "python")
        with tempfile.TemporaryDirectory() as tmp:
            ids_file = os.path.join(tmp, "ids.json")
            json.dump(ids, open(ids_file, "w"))
            for label, path in files:
                out = os.path.join(tmp, "logits.npy")
                subprocess.run([py, __file__, "--threads", str(a.threads), "--worker", path, ids_file, out],
                               check=True)
                rows.append({"engine": "llama.cpp", "file": label, "mode": "native",
                             "activations": "q8 (llama.cpp)", **compare(ref, np.load(out))})
    print(f"corpus: {len(ids)} tokens, windows of {WINDOW}; reference: fp32 on the dequantised Q4_1 weights\n")
    print("| engine | file | mode | activations | next-token agreement | mean KL | p99 KL |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['engine']} | {r['file']} | {r['mode']} | {r['activations']} | {r['agreement'] * 100:.1f}% "
              f"| {r['mean_kl']:.4f} | {r['p99_kl']:.3f} |")


if __name__ == "__main__":
    main()
