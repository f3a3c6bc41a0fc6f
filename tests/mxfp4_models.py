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


def dequantised_hf_model(path: str, **overrides):
    """transformers' fp32 gpt-oss with the folder's experts as transformers dequantises them;
    `overrides`: config fields changed (a GGUF file's: llama.cpp's fixed SwiGLU limit)."""
    from safetensors.torch import load_file
    from transformers import GptOssConfig, GptOssForCausalLM
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    with open(os.path.join(path, "config.json")) as f:
        cfg = {**{k: v for k, v in json.load(f).items() if k != "quantization_config"}, **overrides}
    model = GptOssForCausalLM(GptOssConfig(**cfg)).float()
    tensors = load_file(os.path.join(path, "model.safetensors"))
    for name in [n[: -len("_blocks")] for n in tensors if n.endswith("_blocks")]:
        tensors[name] = convert_moe_packed_tensors(tensors.pop(name + "_blocks"), tensors.pop(name + "_scales"),
                                                   dtype=torch.float32)
    model.load_state_dict({k: v.float() for k, v in tensors.items()}, strict=True)
    return model.eval()


def write_gpt_oss_gguf(hf_dir: str, out_path: str) -> str:
    """The MXFP4 folder converted as llama.cpp's convert_hf_to_gguf.py converts gpt-oss: arch
    `gpt-oss`; the experts' blocks repacked as stored into GGUF's MXFP4 blocks (e8m0, then 16
    bytes of element j | element j + 16 << 4), gate and up rows apart (`ffn_gate_exps`,
    `ffn_up_exps`) and their biases split likewise; `attn_sinks.weight`, `post_attention_norm`,
    the router as `ffn_gate_inp`; YaRN as rope.scaling keys and the window as
    attention.sliding_window; the other tensors F32."""
    import gguf
    from safetensors.numpy import load_file

    from gguf_test_writer import add_hparams
    from tiny_arch_models import _add_tokenizer

    with open(os.path.join(hf_dir, "config.json")) as f:
        cfg = json.load(f)
    t = load_file(os.path.join(hf_dir, "model.safetensors"))
    rope = cfg["rope_parameters"]
    w = gguf.GGUFWriter(out_path, "gpt-oss")
    add_hparams(w, cfg)
    _add_tokenizer(w, hf_dir)
    w.add_expert_count(cfg["num_local_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_expert_feed_forward_length(cfg["intermediate_size"])
    w.add_sliding_window(cfg["sliding_window"])
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(rope["factor"])
    w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])

    def add(name: str, a: np.ndarray) -> None:
        w.add_tensor(name, np.ascontiguousarray(a, dtype=np.float32))

    def add_mxfp4(name: str, blocks: np.ndarray, scales: np.ndarray) -> None:
        codes = np.empty((*blocks.shape[:-1], 32), dtype=np.uint8)
        codes[..., 0::2], codes[..., 1::2] = blocks & 0x0F, blocks >> 4  # HF: element 2j | 2j + 1 << 4
        qs = codes[..., :16] | (codes[..., 16:] << 4)
        data = np.concatenate([scales[..., None], qs], axis=-1)  # [E, rows, K/32, 17]
        w.add_tensor(name, np.ascontiguousarray(data.reshape(*data.shape[:2], -1)),
                     raw_dtype=gguf.GGMLQuantizationType.MXFP4)

    add("token_embd.weight", t["model.embed_tokens.weight"])
    add("output_norm.weight", t["model.norm.weight"])
    add("output.weight", t["lm_head.weight"])
    for i in range(cfg["num_hidden_layers"]):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        add(b + "attn_norm.weight", t[p + "input_layernorm.weight"])
        add(b + "post_attention_norm.weight", t[p + "post_attention_layernorm.weight"])
        for x, name in (("q", "attn_q"), ("k", "attn_k"), ("v", "attn_v"), ("o", "attn_output")):
            add(b + name + ".weight", t[p + f"self_attn.{x}_proj.weight"])
            add(b + name + ".bias", t[p + f"self_attn.{x}_proj.bias"])
        add(b + "attn_sinks.weight", t[p + "self_attn.sinks"])
        add(b + "ffn_gate_inp.weight", t[p + "mlp.router.weight"])
        add(b + "ffn_gate_inp.bias", t[p + "mlp.router.bias"])
        e = p + "mlp.experts."
        gu_b, gu_s, gu_bias = t[e + "gate_up_proj_blocks"], t[e + "gate_up_proj_scales"], t[e + "gate_up_proj_bias"]
        add_mxfp4(b + "ffn_gate_exps.weight", gu_b[:, 0::2], gu_s[:, 0::2])
        add_mxfp4(b + "ffn_up_exps.weight", gu_b[:, 1::2], gu_s[:, 1::2])
        add_mxfp4(b + "ffn_down_exps.weight", t[e + "down_proj_blocks"], t[e + "down_proj_scales"])
        add(b + "ffn_gate_exps.bias", gu_bias[:, 0::2])
        add(b + "ffn_up_exps.bias", gu_bias[:, 1::2])
        add(b + "ffn_down_exps.bias", t[e + "down_proj_bias"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out_path


def save_random_gpt_oss_mxfp4(path: str, hidden: int = 1024, experts: int = 32, layers: int = 4,
                              vocab: int = 512, seed: int = 0, float_dtype: torch.dtype = torch.bfloat16) -> str:
    """A gpt-oss MXFP4 folder big enough that its experts dominate (hidden = expert width, so
    3 * hidden^2 * 17/32 bytes an expert: 214 MB of experts at the defaults against ~20 MB of
    bf16 floats), written straight from random bytes (no float model is built): random e2m1
    codes, exponents near gpt-oss's. For measuring a load, not for comparing logits."""
    from safetensors.torch import save_file
    from transformers import GptOssConfig, GptOssForCausalLM

    cfg = GptOssConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden,
                       num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=4,
                       head_dim=64, num_local_experts=experts, num_experts_per_tok=4,
                       sliding_window=128, layer_types=["sliding_attention", "full_attention"] * (layers // 2),
                       max_position_embeddings=4096, tie_word_embeddings=False, pad_token_id=0,
                       architectures=["GptOssForCausalLM"])
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in GptOssForCausalLM(cfg).state_dict().items()}
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in shapes.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            e, k, n = shape  # [E, in, out]: n rows of k inputs
            tensors[name + "_blocks"] = torch.randint(0, 256, (e, n, k // 32, 16), dtype=torch.uint8, generator=g)
            tensors[name + "_scales"] = torch.randint(118, 122, (e, n, k // 32), dtype=torch.uint8, generator=g)
        else:  # bf16 as published (fp32 for write_gpt_oss_gguf, which reads them with numpy)
            tensors[name] = (torch.randn(shape, generator=g) * 0.02).to(float_dtype)
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    cfg_dict = cfg.to_dict()
    cfg_dict["quantization_config"] = QUANTIZATION_CONFIG
    cfg_dict["torch_dtype"] = str(float_dtype).removeprefix("torch.")
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg_dict, f, indent=2)
    from conftest_model_helpers import save_byte_tokenizer

    save_byte_tokenizer(path, vocab)
    return path


# A fresh process loads `path` and reports its RSS: the high-water mark is reset after the
# runtime every load needs whatever its size (torch, kvflow, the C kernels, torch's meta-device
# ops, which import torch._dynamo and triton: ~150 MB), so `peak - before` is the load's own.
_LOAD_RSS_CHILD = r"""
import json, os, sys, time
import torch
from kvflow.csrc import library
from kvflow.model.loader import load_model

def status():
    out = {}
    for line in open("/proc/self/status"):
        key, _, value = line.partition(":")
        if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
            out[key] = int(value.split()[0]) * 1024
    return out

torch.set_num_threads(1)
library()
torch.cat([torch.empty(2, 2, device="meta")] * 2)
before = status()["VmRSS"]
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # resets VmHWM to the current RSS
t0 = time.perf_counter()
model, arch = load_model(sys.argv[1], torch.bfloat16, quantization=sys.argv[2])
seconds = time.perf_counter() - t0
after = status()
print(json.dumps({"before": before, "peak": after["VmHWM"], "after": after["VmRSS"], "load_s": seconds, "expert_bytes": model.quant_report["expert_bytes"],
                  "weight_bytes": model.quant_report["weight_bytes"]}))
"""


def measure_load_rss(path: str, root: str | None = None) -> dict:
    """Load the MXFP4 folder or llama.cpp gpt-oss file `path` (bf16) in a fresh process: its
    RSS before the load, the peak during it and after it (bytes), the load's seconds, the
    experts' and all weights' bytes in memory, and the checkpoint's file bytes. `root`: the
    kvflow checkout that loads it (default: this one)."""
    import subprocess
    import sys

    root = root or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root}
    gguf = path.endswith(".gguf")
    out = subprocess.run([sys.executable, "-c", _LOAD_RSS_CHILD, path, "gguf" if gguf else "mxfp4"],
                         env=env, cwd=root, capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result["file_bytes"] = os.path.getsize(path) if gguf else sum(
        os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors"))
    return result
