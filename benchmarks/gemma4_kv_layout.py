"""What Gemma 4's KV cache costs as the engine reports it at start-up, on Gemma 4 E2B's
attention shape: 35 layers (four sliding of head 256 then one full of head 512, repeated), 8
query heads and one kv head, the last 20 layers sharing the KV of earlier ones (15 own a
cache: 12 sliding, 3 full). The hidden and MLP widths and the vocabulary are shrunk (256, 512,
512 tokens): the KV cache's size does not depend on them, and the random folder stays small.

    .venv/bin/python benchmarks/gemma4_kv_layout.py [--kv-cache-memory 64MiB] [--out FILE]

Prints the engine's start-up line (KV bytes per token, blocks, tokens, groups) and writes it as
json with the bytes per token computed here from the config (each owning layer at its own
shape) beside it. Run it from another checkout (PYTHONPATH) to compare layouts."""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

import kvflow  # noqa: E402,F401 - first, as the other benchmarks
import torch  # noqa: E402


def e2b_shaped_folder(path: str) -> str:
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    types = (["sliding_attention"] * 4 + ["full_attention"]) * 7
    cfg = Gemma4TextConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=35,
                           num_attention_heads=8, num_key_value_heads=1, head_dim=256, global_head_dim=512,
                           sliding_window=512, layer_types=types, num_kv_shared_layers=20,
                           hidden_size_per_layer_input=16, vocab_size_per_layer_input=512,
                           use_double_wide_mlp=True, final_logit_softcapping=30.0,
                           max_position_embeddings=4096, tie_word_embeddings=True, pad_token_id=0,
                           bos_token_id=2, eos_token_id=1)
    cfg.architectures = ["Gemma4ForCausalLM"]
    torch.manual_seed(0)
    Gemma4ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
    from conftest_model_helpers import save_byte_tokenizer

    save_byte_tokenizer(path, 512)
    return path


def own_bytes_per_token(config: dict, dtype_bytes: int) -> int:
    """Each cache-owning layer's K and V at its own (kv heads, head size)."""
    n, shared = config["num_hidden_layers"], config.get("num_kv_shared_layers") or 0
    per_layer = {int(k): v for k, v in (config.get("per_layer_config") or {}).items()}  # "04", "34"
    total = 0
    for i in range(n - shared):
        own = per_layer.get(i, {})
        total += 2 * own.get("num_key_value_heads", config["num_key_value_heads"]) \
            * own.get("head_dim", config["head_dim"]) * dtype_bytes
    return total


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kv-cache-memory", default="64MiB")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from kvflow import LLM

    with tempfile.TemporaryDirectory() as tmp:
        path = e2b_shaped_folder(os.path.join(tmp, "e2b"))
        with open(os.path.join(path, "config.json")) as f:
            config = json.load(f)
        llm = LLM(path, dtype="bfloat16", kv_cache_memory=args.kv_cache_memory, max_model_len=4096,
                  warmup=False)
        core = llm.engine.core
        line = core.startup_report()
    print(line)
    result = {"checkout": os.path.dirname(os.path.dirname(os.path.abspath(kvflow.__file__))),
              "kv_cache_memory": args.kv_cache_memory,
              "reported_kv_bytes_per_token": int(re.search(r"(\d+) B/token", line).group(1)),
              "own_kv_bytes_per_token": own_bytes_per_token(config, 2),
              "num_blocks": core.cache_config.num_blocks, "startup_line": line}
    print(json.dumps({k: v for k, v in result.items() if k != "startup_line"}))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
