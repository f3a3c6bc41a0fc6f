"""Tiny random hybrid models (layers that keep a state per request beside attention layers)
saved as HF folders: LFM2's gated short convolutions, Qwen3.5's (dense and MoE) and Qwen3-Next's
Gated DeltaNet, Granite 4.0-H's Mamba2; and the GGUF files llama.cpp's converter writes of them. Their weights are drawn wider than transformers' default init so that greedy tokens
vary from step to step (at the default, a tiny random LFM2 repeats one token)."""
from __future__ import annotations

import json
import os

import torch

from conftest_model_helpers import _save_random, save_byte_tokenizer
from tiny_arch_models import _ROUTER_SCALE, VOCAB, _finish


def save_lfm2(path: str) -> str:
    """Conv, attention, conv, conv, attention: two attention layers of five, GQA 4/2."""
    from transformers import Lfm2Config, Lfm2ForCausalLM

    cfg = Lfm2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=5,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                     layer_types=["conv", "full_attention", "conv", "conv", "full_attention"],
                     block_auto_adjust_ff_dim=False, initializer_range=0.1,
                     bos_token_id=1, eos_token_id=2, pad_token_id=0)
    path = _save_random(Lfm2ForCausalLM, cfg, path, seed=9)
    _finish(path, "qwen")  # the byte tokenizer with a ChatML template
    return path


_LAYER_TYPES = ["linear_attention", "full_attention", "linear_attention", "linear_attention", "full_attention"]


def _layer_types(full_attention_interval: int | None) -> list[str]:
    """The tiny models' irregular pattern, or four layers with every interval-th one attention
    (the pattern llama.cpp's files describe by their `full_attention_interval`)."""
    if full_attention_interval is None:
        return _LAYER_TYPES
    return ["linear_attention" if (i + 1) % full_attention_interval else "full_attention" for i in range(4)]


def _note_interval(path: str, full_attention_interval: int | None) -> None:
    """config.json keeps the interval beside layer_types, as Qwen's own configs do
    (transformers drops it when it saves)."""
    if full_attention_interval is None:
        return
    file = os.path.join(path, "config.json")
    with open(file) as f:
        cfg = json.load(f)
    with open(file, "w") as f:
        json.dump({**cfg, "full_attention_interval": full_attention_interval}, f, indent=2)


def save_qwen3_5(path: str, full_attention_interval: int | None = None) -> str:
    """Linear, full, linear, linear, full attention: GQA 4/2 with head_dim 16 (a quarter of it
    rotated); Gated DeltaNet with 2 key heads of 16 dims serving 4 value heads of 8, a 4-tap
    conv; tied embeddings."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    types = _layer_types(full_attention_interval)
    cfg = Qwen3_5TextConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=len(types),
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                            linear_value_head_dim=8, linear_conv_kernel_dim=4, max_position_embeddings=512,
                            layer_types=types,
                            tie_word_embeddings=True, initializer_range=0.1,
                            bos_token_id=1, eos_token_id=2, pad_token_id=0)
    path = _save_random(Qwen3_5ForCausalLM, cfg, path, seed=9)
    _note_interval(path, full_attention_interval)
    save_byte_tokenizer(path, VOCAB)
    return path


def save_qwen3_5_moe(path: str, full_attention_interval: int | None = None) -> str:
    """Qwen3.5's layer pattern and shapes with 4 experts (top-2) and a gated shared expert in
    every layer; untied. The routers are sharpened (top-2 never a near tie)."""
    from safetensors.torch import load_file, save_file
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    types = _layer_types(full_attention_interval)
    cfg = Qwen3_5MoeTextConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=len(types),
                               num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                               linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                               linear_value_head_dim=8, linear_conv_kernel_dim=4, max_position_embeddings=512,
                               layer_types=types,
                               num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                               shared_expert_intermediate_size=48, tie_word_embeddings=False,
                               initializer_range=0.1, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    path = _save_random(Qwen3_5MoeForCausalLM, cfg, path, seed=9)
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    for name, t in tensors.items():
        if name.endswith("mlp.gate.weight"):
            tensors[name] = t * _ROUTER_SCALE
    save_file(tensors, file, metadata={"format": "pt"})
    _note_interval(path, full_attention_interval)
    save_byte_tokenizer(path, VOCAB)
    return path


def save_qwen3_5_vl(path: str) -> str:
    """A Qwen3_5ForConditionalGeneration folder (text_config nested, the text model under
    model.language_model., a one-block vision tower beside it): three linear layers, then
    attention with half of head_dim 32 rotated in M-RoPE sections [3, 3, 2]; untied."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    text = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_key_heads=2,
                linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8,
                max_position_embeddings=512, initializer_range=0.1,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                 "mrope_section": [3, 3, 2], "mrope_interleaved": True},
                bos_token_id=1, eos_token_id=2, pad_token_id=0)
    vision = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=64,
                  patch_size=4, num_position_embeddings=16)
    cfg = Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=False)
    return _save_random(Qwen3_5ForConditionalGeneration, cfg, path, seed=5)


def save_qwen3_next(path: str, full_attention_interval: int | None = None) -> str:
    """Qwen3.5's layer pattern and shapes with 4 experts (top-2, renormalised) and a gated
    shared expert, the third layer dense (`mlp_only_layers`); untied."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    types = _layer_types(full_attention_interval)
    cfg = Qwen3NextConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=len(types),
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                          linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                          linear_value_head_dim=8, linear_conv_kernel_dim=4, max_position_embeddings=512,
                          layer_types=types,
                          num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                          shared_expert_intermediate_size=48, mlp_only_layers=[2], norm_topk_prob=True,
                          initializer_range=0.1, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    path = _save_random(Qwen3NextForCausalLM, cfg, path, seed=9)
    _note_interval(path, full_attention_interval)
    save_byte_tokenizer(path, VOCAB)
    return path


def save_granite4h(path: str) -> str:
    """Mamba2, attention (no position embedding, as Granite 4.0-H), Mamba2, Mamba2, attention:
    GQA 4/2; Mamba2 with 8 heads of 16 dims in 2 groups, a 16-wide state, a 4-tap conv and
    HF's chunks of 8 tokens (so HF's own scan crosses chunks); 4 experts (top-2) beside a
    shared MLP; Granite's four multipliers; tied embeddings. The routers are sharpened (top-2
    never a near tie) and D drawn around 1."""
    from safetensors.torch import load_file, save_file
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    cfg = GraniteMoeHybridConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=32, shared_intermediate_size=48,
                                 num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=2,
                                 layer_types=["mamba", "attention", "mamba", "mamba", "attention"],
                                 mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, mamba_n_groups=2,
                                 mamba_d_conv=4, mamba_chunk_size=8, num_local_experts=4, num_experts_per_tok=2,
                                 position_embedding_type="nope", embedding_multiplier=2.0, residual_multiplier=0.7,
                                 attention_multiplier=0.2, logits_scaling=1.5, max_position_embeddings=512,
                                 tie_word_embeddings=True, initializer_range=0.1,
                                 bos_token_id=1, eos_token_id=2, pad_token_id=0)
    path = _save_random(GraniteMoeHybridForCausalLM, cfg, path, seed=9)
    file = os.path.join(path, "model.safetensors")
    tensors, g = load_file(file), torch.Generator().manual_seed(4)
    for name, t in tensors.items():
        if name.endswith("router.layer.weight"):
            tensors[name] = t * _ROUTER_SCALE
        elif name.endswith("mamba.D"):
            tensors[name] = t + 0.3 * torch.randn(t.shape, generator=g)
    save_file(tensors, file, metadata={"format": "pt"})
    save_byte_tokenizer(path, VOCAB)
    return path


BUILDERS = {"lfm2": save_lfm2, "qwen3_5": save_qwen3_5, "qwen3_5_moe": save_qwen3_5_moe,
            "qwen3_next": save_qwen3_next, "granite4h": save_granite4h}


def write_lfm2_gguf(hf_dir: str, out_path: str) -> str:
    """The tiny LFM2 folder as llama.cpp's converter writes an `lfm2` file: head_count_kv per
    layer (0 for a conv layer), `shortconv.l_cache`, the conv weight squeezed to [hidden, taps],
    the final norm as `token_embd_norm`, q/k not permuted; the byte tokenizer and f32 weights."""
    import json
    import os

    import gguf
    import numpy as np
    from safetensors.numpy import load_file

    from gguf_test_writer import add_hparams
    from tiny_arch_models import _add_tokenizer

    with open(os.path.join(hf_dir, "config.json")) as f:
        cfg = json.load(f)
    t = load_file(os.path.join(hf_dir, "model.safetensors"))
    types = cfg["layer_types"]
    w = gguf.GGUFWriter(out_path, "lfm2")
    add_hparams(w, {**cfg, "rms_norm_eps": cfg["norm_eps"]})
    w.add_head_count_kv([cfg["num_key_value_heads"] if k != "conv" else 0 for k in types])
    w.add_shortconv_l_cache(cfg["conv_L_cache"])
    _add_tokenizer(w, hf_dir)

    def add(name: str, a: np.ndarray) -> None:
        w.add_tensor(name, np.ascontiguousarray(a, dtype=np.float32))

    add("token_embd.weight", t["model.embed_tokens.weight"])
    add("token_embd_norm.weight", t["model.embedding_norm.weight"])
    for i, kind in enumerate(types):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        add(b + "attn_norm.weight", t[p + "operator_norm.weight"])
        add(b + "ffn_norm.weight", t[p + "ffn_norm.weight"])
        for ours, theirs in (("gate", "w1"), ("up", "w3"), ("down", "w2")):
            add(b + f"ffn_{ours}.weight", t[p + f"feed_forward.{theirs}.weight"])
        if kind == "conv":
            add(b + "shortconv.conv.weight", t[p + "conv.conv.weight"].squeeze(1))
            add(b + "shortconv.in_proj.weight", t[p + "conv.in_proj.weight"])
            add(b + "shortconv.out_proj.weight", t[p + "conv.out_proj.weight"])
            continue
        a = p + "self_attn."
        for x in "qkv":
            add(b + f"attn_{x}.weight", t[a + f"{x}_proj.weight"])
        add(b + "attn_output.weight", t[a + "out_proj.weight"])
        add(b + "attn_q_norm.weight", t[a + "q_layernorm.weight"])
        add(b + "attn_k_norm.weight", t[a + "k_layernorm.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out_path
