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
    # transformers reads this model type's tokenizer as Qwen3_5Tokenizer, which adds a pad
    # token past the vocabulary unless one is named
    file = os.path.join(path, "tokenizer_config.json")
    with open(file) as f:
        tok = json.load(f)
    with open(file, "w") as f:
        json.dump({**tok, "pad_token": tok["unk_token"]}, f, indent=2)
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


def save_qwen3_next(path: str, full_attention_interval: int | None = None, mlp_only_layers=(2,)) -> str:
    """Qwen3.5's layer pattern and shapes with 4 experts (top-2, renormalised) and a gated
    shared expert, the third layer dense by default (`mlp_only_layers`); untied."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    types = _layer_types(full_attention_interval)
    cfg = Qwen3NextConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=len(types),
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                          linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                          linear_value_head_dim=8, linear_conv_kernel_dim=4, max_position_embeddings=512,
                          layer_types=types,
                          num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                          shared_expert_intermediate_size=48, mlp_only_layers=list(mlp_only_layers), norm_topk_prob=True,
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


_QWEN_GGUF = {"Qwen3_5ForCausalLM": "qwen35", "Qwen3_5MoeForCausalLM": "qwen35moe", "Qwen3NextForCausalLM": "qwen3next"}


def _tile_value_heads(a, axis: int, nk: int, r: int, d: int):
    """llama.cpp's reorder of Qwen3.5's value heads from grouped by key head to tiled."""
    import numpy as np

    shape = a.shape
    grouped = a.reshape(*shape[:axis], nk, r, d, *shape[axis + 1:])
    return np.ascontiguousarray(np.swapaxes(grouped, axis, axis + 1)).reshape(shape)


def write_qwen3_5_gguf(hf_dir: str, out_path: str) -> str:
    """A tiny Qwen3.5, Qwen3.5 MoE or Qwen3-Next folder as llama.cpp's converter writes a
    `qwen35`, `qwen35moe` or `qwen3next` file: TextModel's keys, the experts' sizes, the Gated
    DeltaNet's in `ssm.*` (state_size = key head dims, group_count = key heads, time_step_rank =
    value heads, inner_size = value dims), `full_attention_interval`, a quarter of head_dim
    rotated, Qwen3.5's M-RoPE sections; every norm but the Gated DeltaNet's stored as 1 + w,
    A_log as -exp(A_log), dt_bias as `ssm_dt.bias`, the conv weight squeezed to [channels, taps];
    Qwen3-Next's in_proj_qkvz split into [q; k; v] over all heads (`attn_qkv`) and z
    (`attn_gate`), its in_proj_ba kept; Qwen3.5's value heads reordered from grouped to tiled
    (in in_proj_qkv's v rows, in_proj_z, in_proj_b/a, A_log, dt_bias, the conv's v channels and
    out_proj's columns); experts stacked per projection; the byte tokenizer and f32 weights."""
    import gguf
    import numpy as np
    from safetensors.numpy import load_file

    from tiny_arch_models import _add_tokenizer

    with open(os.path.join(hf_dir, "config.json")) as f:
        cfg = json.load(f)
    t = load_file(os.path.join(hf_dir, "model.safetensors"))
    arch_name = _QWEN_GGUF[cfg["architectures"][0]]
    arch = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[arch_name]
    n = cfg["num_hidden_layers"]
    w = gguf.GGUFWriter(out_path, arch_name)
    rope = cfg.get("rope_parameters") or {}
    w.add_block_count(n)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    if "intermediate_size" in cfg:
        w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    if "mrope_section" in rope:
        w.add_rope_dimension_sections((rope["mrope_section"] + [0] * 4)[:4])
    w.add_rope_freq_base(rope.get("rope_theta", 10000.0))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    if "num_experts" in cfg:
        w.add_expert_count(cfg["num_experts"])
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    nk, nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv, h = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"], cfg["hidden_size"]
    w.add_ssm_conv_kernel(cfg["linear_conv_kernel_dim"])
    w.add_ssm_state_size(dk)
    w.add_ssm_group_count(nk)
    w.add_ssm_time_step_rank(nv)
    w.add_ssm_inner_size(dv * nv)
    w.add_full_attention_interval(cfg.get("full_attention_interval", 4))
    w.add_rope_dimension_count(int(cfg["head_dim"] * cfg.get("partial_rotary_factor", 0.25)))
    if arch_name != "qwen3next" and "mrope_section" not in rope:
        w.add_rope_dimension_sections([11, 11, 10, 0])
    _add_tokenizer(w, hf_dir)
    names = gguf.get_tensor_name_map(arch, n)

    def add(name: str, a: np.ndarray) -> None:
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, name
        w.add_tensor(gguf_name, np.ascontiguousarray(a, dtype=np.float32))

    r, qk = nv // nk, 2 * nk * dk
    for name, a in t.items():
        if arch_name != "qwen3next" and nk != nv and "linear_attn." in name:
            tile = lambda x, axis, d: _tile_value_heads(x, axis, nk, r, d)  # noqa: E731
            if ".in_proj_qkv." in name:
                a = np.concatenate([a[:qk], tile(a[qk:], 0, dv)])
            elif ".in_proj_z." in name:
                a = tile(a, 0, dv)
            elif ".in_proj_b." in name or ".in_proj_a." in name or ".A_log" in name or ".dt_bias" in name:
                a = tile(a, 0, 1)
            elif ".conv1d" in name:
                a = a.squeeze()
                a = np.concatenate([a[:qk], tile(a[qk:], 0, dv)])
            elif ".out_proj." in name:
                a = tile(a, 1, dv)
        if name.endswith(".A_log"):
            a = -np.exp(a)
        elif name.endswith(".dt_bias"):
            name = name[:-len(".dt_bias")] + ".dt_proj.bias"
        elif "conv1d" in name:
            a = a.squeeze()
        elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            a = a + 1
        if "in_proj_qkvz.weight" in name:  # [q, k, v, z] per key head -> [q; k; v] and z over all heads
            per_head = a.T.reshape(h, nk, 2 * dk + 2 * r * dv)
            q, k, v, z = np.split(per_head, np.cumsum([dk, dk, r * dv])[:3], axis=-1)
            add(name.replace("in_proj_qkvz", "in_proj_qkv"),
                np.concatenate([x.reshape(h, -1) for x in (q, k, v)], axis=-1).T)
            add(name.replace("in_proj_qkvz", "in_proj_z"), z.reshape(h, -1).T)
            continue
        if ".mlp.experts." in name:
            layer, rest = name.split(".mlp.experts.")
            expert, proj = rest.split(".", 1)
            if expert != "0":
                continue
            proj = proj.removesuffix(".weight")
            stacked = np.stack([t[f"{layer}.mlp.experts.{e}.{proj}.weight"] for e in range(cfg["num_experts"])])
            add(f"{layer}.mlp.experts.{proj}.weight", stacked)
            continue
        add(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out_path


def write_granite4h_gguf(hf_dir: str, out_path: str) -> str:
    """The tiny Granite 4.0-H folder as llama.cpp's converter writes a `granitehybrid` file:
    Llama's keys (head_dim left out, rope dims = hidden / heads, feed_forward_length = the
    experts' width), Granite's four scales, the shared MLP's width, Mamba2's sizes in `ssm.*`
    (time_step_rank = heads, inner_size = heads x head dims), head_count_kv per layer (0 for a
    Mamba2 layer), `rope.scaling.finetuned` false and a 2**20 context (no RoPE); the attention
    layers' q/k rows permuted as Llama's; the experts' and shared MLP's [gate; up] split; each
    Mamba2 layer's conv weight squeezed, A_log as -exp(A_log) and D as [heads, 1], dt_bias as
    `ssm_dt.bias`, the gated norm as [groups, inner / groups]; the byte tokenizer, f32 weights."""
    import gguf
    import numpy as np
    from safetensors.numpy import load_file

    from gguf_test_writer import permute_rope_rows
    from tiny_arch_models import _add_tokenizer

    with open(os.path.join(hf_dir, "config.json")) as f:
        cfg = json.load(f)
    t = load_file(os.path.join(hf_dir, "model.safetensors"))
    # IBM's configs say "mamba" / "attention"; transformers saves them as these
    types = ["mamba" if k in ("mamba", "linear_attention") else "attention" for k in cfg["layer_types"]]
    n = cfg["num_hidden_layers"]
    heads, kv_heads, hidden = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["hidden_size"]
    d_inner = cfg["mamba_n_heads"] * cfg["mamba_d_head"]
    ng = cfg["mamba_n_groups"]
    w = gguf.GGUFWriter(out_path, "granitehybrid")
    w.add_block_count(n)
    w.add_context_length(2 ** 20)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv([kv_heads if k == "attention" else 0 for k in types])
    w.add_rope_freq_base((cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_expert_count(cfg["num_local_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_vocab_size(cfg["vocab_size"])
    w.add_rope_dimension_count(hidden // heads)
    w.add_attention_scale(cfg["attention_multiplier"])
    w.add_embedding_scale(cfg["embedding_multiplier"])
    w.add_residual_scale(cfg["residual_multiplier"])
    w.add_logit_scale(cfg["logits_scaling"])
    w.add_expert_shared_feed_forward_length(cfg["shared_intermediate_size"])
    w.add_ssm_conv_kernel(cfg["mamba_d_conv"])
    w.add_ssm_state_size(cfg["mamba_d_state"])
    w.add_ssm_group_count(ng)
    w.add_ssm_inner_size(d_inner)
    w.add_ssm_time_step_rank(cfg["mamba_n_heads"])
    w.add_rope_scaling_finetuned(False)
    _add_tokenizer(w, hf_dir)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GRANITE_HYBRID, n)

    def add(name: str, a: np.ndarray) -> None:
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, name
        w.add_tensor(gguf_name, np.ascontiguousarray(a, dtype=np.float32))

    def add_as(bid: int, kind: str, a: np.ndarray) -> None:
        w.add_tensor(f"blk.{bid}.{kind}.weight", np.ascontiguousarray(a, dtype=np.float32))

    for name, a in t.items():
        if ".layers." not in name:
            add(name, a)
            continue
        bid = int(name.split(".layers.")[1].split(".")[0])
        if name.endswith("block_sparse_moe.input_linear.weight"):
            gate, up = np.split(a, 2, axis=-2)
            add_as(bid, "ffn_gate_exps", gate)
            add_as(bid, "ffn_up_exps", up)
        elif name.endswith("shared_mlp.input_linear.weight"):
            gate, up = np.split(a, 2, axis=-2)
            add_as(bid, "ffn_gate_shexp", gate)
            add_as(bid, "ffn_up_shexp", up)
        elif types[bid] == "mamba" and ".mamba." in name:
            if name.endswith(".dt_bias"):
                name = name[:-len(".dt_bias")] + ".dt_proj.bias"
            if "conv1d" in name:
                a = a.squeeze()
            elif name.endswith((".A_log", ".D")):
                a = a.reshape(-1, 1)
            elif name.endswith("mamba.norm.weight"):
                a = a.reshape(ng, d_inner // ng)
            if name.endswith(".A_log"):
                a = -np.exp(a)
            add(name, a)
        else:
            if name.endswith("q_proj.weight"):
                a = permute_rope_rows(a, heads)
            elif name.endswith("k_proj.weight"):
                a = permute_rope_rows(a, kv_heads)
            add(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out_path
