"""The tiny gpt-oss (tiny_arch_models.save_gpt_oss) as gpt-oss is published: its experts
quantized to MXFP4 by the gguf package's quantizer and written in Hugging Face's layout
(`*_blocks` [E, rows, K/32, 16], element 2j in byte j's low nibble; `*_scales` e8m0 [E, rows,
K/32]; the gate_up rows interleaved as the float checkpoint's columns are), with a
quantization_config saying mxfp4; and the reference: transformers' GptOssForCausalLM in fp32
with the experts dequantised by transformers' own convert_moe_packed_tensors."""
from __future__ import annotations

import json
import os

import numpy as np
import torch

from tiny_arch_models import save_gpt_oss

QUANTIZATION_CONFIG = {"quant_method": "mxfp4", "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}


def mxfp4_blocks(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Float rows (N, K) -> HF's (blocks [N, K/32, 16], scales [N, K/32]) through gguf-py's
    MXFP4 quantizer, whose 17-byte blocks hold e8m0, then element j | element j + 16 << 4."""
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import quantize

    n, k = w.shape
    raw = quantize(np.ascontiguousarray(w, dtype=np.float32), GGMLQuantizationType.MXFP4)
    raw = raw.reshape(n, k // 32, 17)
    qs = raw[..., 1:]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=2)  # the 32 elements in order
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8), raw[..., 0].copy()


def save_gpt_oss_mxfp4(path: str) -> str:
    """The tiny gpt-oss folder at `path`, its experts rewritten as MXFP4 blocks and scales."""
    from safetensors.torch import load_file, save_file

    save_gpt_oss(path)
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        w = tensors.pop(name)  # [E, in, out]: the rows of a projection are its outputs
        pairs = [mxfp4_blocks(w[e].T.numpy()) for e in range(w.shape[0])]
        tensors[name + "_blocks"] = torch.from_numpy(np.stack([b for b, _ in pairs]))
        tensors[name + "_scales"] = torch.from_numpy(np.stack([s for _, s in pairs]))
    save_file(tensors, file, metadata={"format": "pt"})
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = QUANTIZATION_CONFIG
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    return path


def dequantised_hf_model(path: str):
    """transformers' fp32 gpt-oss with the folder's experts as transformers dequantises them."""
    from safetensors.torch import load_file
    from transformers import GptOssConfig, GptOssForCausalLM
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    with open(os.path.join(path, "config.json")) as f:
        cfg = {k: v for k, v in json.load(f).items() if k != "quantization_config"}
    model = GptOssForCausalLM(GptOssConfig(**cfg)).float()
    tensors = load_file(os.path.join(path, "model.safetensors"))
    for name in [n[: -len("_blocks")] for n in tensors if n.endswith("_blocks")]:
        tensors[name] = convert_moe_packed_tensors(tensors.pop(name + "_blocks"), tensors.pop(name + "_scales"),
                                                   dtype=torch.float32)
    model.load_state_dict({k: v.float() for k, v in tensors.items()}, strict=True)
    return model.eval()
