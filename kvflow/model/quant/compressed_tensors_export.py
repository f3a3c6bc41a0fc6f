"""Write a float HF folder as a compressed-tensors int8 W8A8 checkpoint, laid out as
llm-compressor's W8A8 preset (round to nearest, min-max per channel) writes one: every Linear
but the LM head as `<module>.weight` int8 and `<module>.weight_scale` (N, 1) in the weights'
own dtype, scale = max|w| / 127.5 and q = clamp(round(w / scale), -128, 127) as
compressed-tensors computes them, and config.json's `quantization_config` block. For tests and
benchmarks (kvflow serves such folders, read by kvflow/checkpoint/compressed_tensors.py; vLLM
serves them too):

    python -m kvflow.model.quant.compressed_tensors_export SRC_FOLDER DST_FOLDER"""
from __future__ import annotations

import argparse
import json
import os
import shutil

import torch

from kvflow.checkpoint.compressed_tensors import read_raw


def quantization_config(ignore: list[str]) -> dict:
    """The block llm-compressor writes for its W8A8 (int8, dynamic per-token) preset."""
    def args(strategy: str, dynamic: bool, observer: str | None) -> dict:
        return {"num_bits": 8, "type": "int", "symmetric": True, "group_size": None,
                "strategy": strategy, "block_structure": None, "dynamic": dynamic,
                "actorder": None, "scale_dtype": None, "zp_dtype": None, "observer": observer,
                "observer_kwargs": {}}
    return {
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": args("channel", False, "minmax"),
            "input_activations": args("token", True, None),
            "output_activations": None,
            "format": None}},
        "quant_method": "compressed-tensors",
        "kv_cache_scheme": None,
        "format": "int-quantized",
        "quantization_status": "compressed",
        "global_compression_ratio": None,
        "ignore": ignore,
        "sparsity_config": {},
        "transform_config": {},
        "version": "0.17.0",
    }


def quantize_channelwise(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A float (N, K) weight -> (int8 q, scale (N, 1) in w's dtype), q rounded against the
    scale as stored."""
    scale = (w.abs().amax(dim=1, keepdim=True) / 127.5).to(w.dtype)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero row stays zero
    q = torch.round(w / safe).clamp(-128, 127).to(torch.int8)  # in w's dtype, as compressed-tensors
    return q, scale


def export(src: str, dst: str, ignore: tuple[str, ...] = ("lm_head",),
           dtype: torch.dtype | None = None) -> str:
    """SRC (a float HF folder, safetensors) -> DST as a W8A8 compressed-tensors folder; its
    float tensors (and so the scales) in `dtype` (default: as stored in SRC)."""
    tensors = read_raw(src)
    out = {}
    for name, t in tensors.items():
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        module = name.removesuffix(".weight")
        if (name.endswith(".weight") and t.dim() == 2 and t.is_floating_point()
                and not module.endswith("embed_tokens") and module not in ignore):
            out[name], out[module + ".weight_scale"] = quantize_channelwise(t)
        else:
            out[name] = t
    os.makedirs(dst, exist_ok=True)
    for f in os.listdir(src):  # tokenizer, generation config, chat template
        if not f.endswith((".safetensors", ".bin")) and not f.startswith(".") \
                and f not in ("config.json", "model.safetensors.index.json") \
                and os.path.isfile(os.path.join(src, f)):
            shutil.copy(os.path.join(src, f), os.path.join(dst, f))
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = quantization_config(list(ignore))
    if dtype is not None:
        config["dtype"] = config["torch_dtype"] = str(dtype).removeprefix("torch.")
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in out.items()}, os.path.join(dst, "model.safetensors"),
              metadata={"format": "pt"})
    return dst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("src")
    parser.add_argument("dst")
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"),
                        help="the float tensors' (and scales') dtype (default: as stored)")
    a = parser.parse_args()
    print(export(a.src, a.dst, dtype=None if a.dtype is None else getattr(torch, a.dtype)))


if __name__ == "__main__":
    main()
