"""Tiny random Qwen3, Phi-3, OLMo 2, Granite 3, SmolLM3 and mixture-of-experts models (Qwen3-MoE, Mixtral,
Qwen2-MoE) saved as HF folders, and a GGUF writer that converts such a folder the way llama.cpp's
convert_hf_to_gguf.py does (its tensor names, metadata keys, q/k permutation for the "llama"
architecture and experts stacked into 3-D tensors), so the GGUF path is tested on files shaped
like the ones people download."""
from __future__ import annotations

import json
import os

import numpy as np
import torch

from conftest_model_helpers import _save_random, save_byte_tokenizer
from gguf_test_writer import add_hparams, head_dim, permute_rope_rows

VOCAB = 320
_BASE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=512,
             bos_token_id=1, eos_token_id=2)
# Each family's chat template and end-of-turn token (a special token, also a stop id in
# generation_config.json, as in the real models).
_CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
           "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
_PHI3 = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
         "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
_MISTRAL = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }}"
            " [/INST]{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}")
# SmolLM3's reasoning switch as its template has it: `/think` or `/no_think` in the system
# message, or `enable_thinking` from chat_template_kwargs; /no_think opens an empty think block
_SMOLLM3 = ("{%- set mode = '/think' -%}"
            "{%- if enable_thinking is defined and enable_thinking is false -%}{%- set mode = '/no_think' -%}{%- endif -%}"
            "{%- if messages[0]['role'] == 'system' -%}"
            "{%- if '/no_think' in messages[0]['content'] -%}{%- set mode = '/no_think' -%}"
            "{%- elif '/think' in messages[0]['content'] -%}{%- set mode = '/think' -%}{%- endif -%}"
            "{%- endif -%}"
            "<|im_start|>system\nReasoning Mode: {{ mode }}<|im_end|>\n"
            "{% for m in messages if m['role'] != 'system' %}"
            "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n"
            "{% if mode == '/no_think' %}<think>\n\n</think>\n{% endif %}{% endif %}")
_CHAT = {"qwen": (("<|im_end|>", "<|im_start|>"), _CHATML),
         "smollm3": (("<|im_end|>", "<|im_start|>", "<think>", "</think>"), _SMOLLM3),
         "phi3": (("<|end|>", "<|user|>", "<|assistant|>", "<|system|>"), _PHI3),
         "mistral": ((), _MISTRAL)}
END_OF_TURN = {"qwen": "<|im_end|>", "smollm3": "<|im_end|>", "phi3": "<|end|>", "mistral": None}
# Routers scaled up from the random init so that the top-k choice is decisive, not a near-tie
# that fp32 rounding could flip between two implementations.
_ROUTER_SCALE = 40.0


def save_qwen3(path: str) -> str:
    """Qwen3: QK-norm, head_dim 24 (not hidden/heads), tied embeddings."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(**_BASE, head_dim=24, tie_word_embeddings=True, rope_theta=1000000.0)
    return _finish(_save_random(Qwen3ForCausalLM, cfg, path, seed=1), "qwen")


ORIGINAL_CONTEXT = 128  # Phi-3's original_max_position_embeddings in the tiny model


def save_phi3(path: str) -> str:
    """Phi-3 with LongRoPE (short/long factors, attention factor from 512/128) and a partial
    rotary factor of 0.5; untied. The tests stay below position 128, where transformers and
    kvflow both use the short factors (past it transformers re-rotates the whole sequence with
    the long ones; tests/test_arch_equivalence.py checks kvflow's long-factor table alone)."""
    from transformers import Phi3Config, Phi3ForCausalLM

    half = 16 // 2 // 2  # head_dim 16, rotary dim 8: 4 frequencies
    rng = np.random.default_rng(5)
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
            "short_factor": (1 + rng.random(half)).round(3).tolist(),
            "long_factor": (2 + 4 * rng.random(half)).round(3).tolist(),
            "original_max_position_embeddings": ORIGINAL_CONTEXT}
    cfg = Phi3Config(**_BASE, tie_word_embeddings=False, pad_token_id=0, rope_parameters=rope,
                     original_max_position_embeddings=ORIGINAL_CONTEXT)
    return _finish(_save_random(Phi3ForCausalLM, cfg, path, seed=2), "phi3")


def save_qwen3_moe(path: str) -> str:
    """Qwen3-MoE: 6 experts, top-2 renormalised, layer 1 dense (mlp_only_layers)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(**_BASE, head_dim=16, moe_intermediate_size=32, num_experts=6,
                         num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1],
                         tie_word_embeddings=False)
    return _finish(_save_random(Qwen3MoeForCausalLM, cfg, path, seed=3), "qwen")


def save_mixtral(path: str) -> str:
    """Mixtral: 4 experts, top-2, GQA 4/2 (its GGUF permutes q/k like Llama's)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(**_BASE, num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False)
    return _finish(_save_random(MixtralForCausalLM, cfg, path, seed=4), "mistral")


def save_qwen2_moe(path: str) -> str:
    """Qwen2-MoE: q/k/v biases, 4 experts, top-2 not renormalised, a shared expert with its
    sigmoid gate."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    cfg = Qwen2MoeConfig(**_BASE, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                         num_experts=4, num_experts_per_tok=2, norm_topk_prob=False,
                         tie_word_embeddings=False)
    return _finish(_save_random(Qwen2MoeForCausalLM, cfg, path, seed=5), "qwen")


def save_olmo2(path: str) -> str:
    """OLMo 2: norms after each sublayer, QK-norm over the whole q and k projections, GQA 4/2;
    its norm weights drawn away from one so that a norm applied in the wrong place shows."""
    from transformers import Olmo2Config, Olmo2ForCausalLM

    cfg = Olmo2Config(**_BASE, tie_word_embeddings=False, rope_theta=500000.0, pad_token_id=0)
    path = _save_random(Olmo2ForCausalLM, cfg, path, seed=6)
    _perturb_norms(path, seed=6)
    return _finish(path, "qwen")


def save_granite(path: str) -> str:
    """Granite 3: the four multipliers far from one (embeddings x12, residual branches x0.22,
    attention scale 1/64 instead of 1/sqrt(16), logits / 8), tied embeddings."""
    from transformers import GraniteConfig, GraniteForCausalLM

    cfg = GraniteConfig(**_BASE, tie_word_embeddings=True, embedding_multiplier=12.0,
                        residual_multiplier=0.22, attention_multiplier=0.015625, logits_scaling=8.0,
                        pad_token_id=0)
    return _finish(_save_random(GraniteForCausalLM, cfg, path, seed=7), "qwen")


def save_smollm3(path: str) -> str:
    """SmolLM3: four layers, the fourth without RoPE (the default interval, which llama.cpp's
    smollm3 files assume), a large RoPE base, tied embeddings."""
    from transformers import SmolLM3Config, SmolLM3ForCausalLM

    cfg = SmolLM3Config(**{**_BASE, "num_hidden_layers": 4}, tie_word_embeddings=True,
                        rope_theta=5_000_000.0, pad_token_id=0)
    assert cfg.no_rope_layers == [1, 1, 1, 0]
    return _finish(_save_random(SmolLM3ForCausalLM, cfg, path, seed=8), "smollm3")


YARN_ORIGINAL_CONTEXT = 64  # gpt-oss's original_max_position_embeddings in the tiny model
GPT_OSS_SWIGLU_LIMIT = 0.2


def save_gpt_oss(path: str) -> str:
    """gpt-oss: four layers alternating a sliding window of 8 and the whole context, GQA 4/2,
    4 experts top-2 with the clamped SwiGLU (a limit small enough that the tiny model's
    activations reach it), YaRN over a 64-position original context (factor 8, untruncated
    as the real models), biases everywhere and the attention sinks drawn away from zero."""
    from transformers import GptOssConfig, GptOssForCausalLM

    rope = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0,
            "truncate": False, "original_max_position_embeddings": YARN_ORIGINAL_CONTEXT}
    cfg = GptOssConfig(**{**_BASE, "num_hidden_layers": 4}, head_dim=16, num_local_experts=4,
                       num_experts_per_tok=2, sliding_window=8,
                       layer_types=["sliding_attention", "full_attention"] * 2, rope_parameters=rope,
                       swiglu_limit=GPT_OSS_SWIGLU_LIMIT, tie_word_embeddings=False, pad_token_id=0)
    path = _save_random(GptOssForCausalLM, cfg, path, seed=9)
    from safetensors.torch import load_file, save_file

    file = os.path.join(path, "model.safetensors")
    tensors, g = load_file(file), torch.Generator().manual_seed(9)
    for name, t in tensors.items():
        if name.endswith("sinks"):  # a real share of each head's softmax
            tensors[name] = torch.randn(t.shape, generator=g)
    save_file(tensors, file, metadata={"format": "pt"})
    return _finish(path, "qwen")


def _perturb_norms(path: str, seed: int) -> None:
    from safetensors.torch import load_file, save_file

    file = os.path.join(path, "model.safetensors")
    tensors, g = load_file(file), torch.Generator().manual_seed(seed)
    for name, t in tensors.items():
        if name.endswith("norm.weight"):
            tensors[name] = t + 0.3 * torch.randn(t.shape, generator=g)
    save_file(tensors, file, metadata={"format": "pt"})


BUILDERS = {"qwen3": save_qwen3, "phi3": save_phi3, "qwen3_moe": save_qwen3_moe,
            "mixtral": save_mixtral, "qwen2_moe": save_qwen2_moe, "olmo2": save_olmo2,
            "granite": save_granite, "smollm3": save_smollm3, "gpt_oss": save_gpt_oss}
# Families whose GGUF conversion the writer below does not make yet, and why.
NO_GGUF = {"gpt_oss": "llama.cpp converts gpt-oss from its MXFP4 checkpoints: test_gpt_oss_mxfp4.py writes and "
                      "tests that file"}


def family(path: str) -> str:
    """The chat family ("qwen", "phi3", "mistral") a folder was saved with."""
    with open(os.path.join(path, "kvflow_test_family")) as f:
        return f.read()


def _finish(path: str, family: str) -> str:
    """Sharpen the routers, add a tokenizer with the family's chat template, and a
    generation_config listing its end-of-turn token as a second stop id."""
    from transformers import AutoTokenizer

    from safetensors.torch import load_file, save_file

    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    for name in tensors:
        if name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight", "mlp.router.weight",
                          "mlp.router.bias")):
            tensors[name] = tensors[name] * _ROUTER_SCALE
    save_file(tensors, file, metadata={"format": "pt"})
    extra, template = _CHAT[family]
    save_byte_tokenizer(path, VOCAB, ("<unk>", "<s>", "</s>") + extra)
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = template
    tok.save_pretrained(path)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": 1, "eos_token_id": [2, 3] if extra else 2}, f)
    with open(os.path.join(path, "kvflow_test_family"), "w") as f:
        f.write(family)
    return path


# -- GGUF, the way convert_hf_to_gguf.py writes these models -----------------------------------
_GGUF_ARCH = {"LlamaForCausalLM": "llama", "Qwen3ForCausalLM": "qwen3", "Phi3ForCausalLM": "phi3", "Qwen3MoeForCausalLM": "qwen3moe",
              "MixtralForCausalLM": "llama", "Qwen2MoeForCausalLM": "qwen2moe", "Olmo2ForCausalLM": "olmo2",
              "GraniteForCausalLM": "granite", "SmolLM3ForCausalLM": "smollm3"}


def write_gguf(hf_dir: str, out_path: str, quant: str = "F32", legacy_experts: bool = False) -> str:
    """Convert the tiny HF folder to a GGUF file; `quant` "F32", or "Q8_0", "Q4_0" or "Q4_1"
    (the 2-D and 3-D projections quantised, norms and small tensors kept in F32, as llama.cpp
    does), or a K-quant ("Q4_K", "Q6_K", or "Q4_K_M": Q4_K with attn_v, ffn_down, output and
    token_embd in Q6_K; gguf has no quantizer for them, so matrices 256 wide get random blocks
    with sane scales, seeded: a file that loads, not the folder's weights).
    `legacy_experts`: Mixtral's experts one tensor each (`blk.N.ffn_gate.E.weight`), as
    llama.cpp wrote them before it stacked them."""
    import gguf
    from safetensors.numpy import load_file

    with open(os.path.join(hf_dir, "config.json")) as f:
        cfg = json.load(f)
    hf_arch = cfg["architectures"][0]
    arch = _GGUF_ARCH[hf_arch]
    t = load_file(os.path.join(hf_dir, "model.safetensors"))
    n_layer, n_head, n_kv = cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    rope = cfg.get("rope_parameters") or {}
    w = gguf.GGUFWriter(out_path, arch)
    add_hparams(w, cfg)
    _add_tokenizer(w, hf_dir)
    experts = cfg.get("num_experts") or cfg.get("num_local_experts") or 0
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        if "moe_intermediate_size" in cfg:
            w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        if cfg.get("shared_expert_intermediate_size"):
            w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])

    def add(name: str, a: np.ndarray) -> None:
        a = np.ascontiguousarray(a, dtype=np.float32)
        kq = quant
        if quant == "Q4_K_M":  # llama.cpp's mix: attn_v, ffn_down and the output/embedding Q6_K
            kq = "Q6_K" if any(s in name for s in ("attn_v", "ffn_down", "output.", "token_embd")) else "Q4_K"
        if kq.endswith("_K") and a.ndim == 2 and a.shape[-1] % 256 == 0:
            q = random_kquant_blocks(kq, *a.shape, seed=len(name))
            w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType[kq])
        elif quant != "F32" and not quant.endswith("_K") and a.ndim >= 2 and a.shape[-1] % 32 == 0:
            qtype = gguf.GGMLQuantizationType[quant]
            q = gguf.quants.quantize(a, qtype)
            w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=qtype)
        else:
            w.add_tensor(name, a)

    add("token_embd.weight", t["model.embed_tokens.weight"])
    add("output_norm.weight", t["model.norm.weight"])
    if "lm_head.weight" in t:
        add("output.weight", t["lm_head.weight"])
    if arch == "phi3":
        rot = int(head_dim(cfg) * rope.get("partial_rotary_factor", 1.0))
        w.add_rope_dimension_count(rot)
        if rope.get("rope_type") == "longrope":
            orig = rope["original_max_position_embeddings"]
            scale = cfg["max_position_embeddings"] / orig
            w.add_rope_scaling_orig_ctx_len(orig)
            w.add_rope_scaling_attn_factors(np.sqrt(1 + np.log(scale) / np.log(orig)) if scale > 1 else 1.0)
            add("rope_factors_long.weight", np.array(rope["long_factor"]))
            add("rope_factors_short.weight", np.array(rope["short_factor"]))
    if arch == "granite":  # llama.cpp's names for the four multipliers
        w.add_embedding_scale(cfg["embedding_multiplier"])
        w.add_residual_scale(cfg["residual_multiplier"])
        w.add_attention_scale(cfg["attention_multiplier"])
        w.add_logit_scale(cfg["logits_scaling"])
    for i in range(n_layer):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        a = p + "self_attn."
        if arch == "olmo2":  # norms after attention and the MLP only
            add(b + "post_attention_norm.weight", t[p + "post_attention_layernorm.weight"])
            add(b + "post_ffw_norm.weight", t[p + "post_feedforward_layernorm.weight"])
        else:
            add(b + "attn_norm.weight", t[p + "input_layernorm.weight"])
            add(b + "ffn_norm.weight", t[p + "post_attention_layernorm.weight"])
        add(b + "attn_output.weight", t[a + "o_proj.weight"])
        if arch == "phi3":
            add(b + "attn_qkv.weight", t[a + "qkv_proj.weight"])
        else:
            q, k = t[a + "q_proj.weight"], t[a + "k_proj.weight"]
            if arch in ("llama", "granite", "smollm3"):  # converted by llama.cpp's LlamaModel
                q, k = permute_rope_rows(q, n_head), permute_rope_rows(k, n_kv)
            add(b + "attn_q.weight", q)
            add(b + "attn_k.weight", k)
            add(b + "attn_v.weight", t[a + "v_proj.weight"])
            for x in "qkv":
                if a + f"{x}_proj.bias" in t:
                    add(b + f"attn_{x}.bias", t[a + f"{x}_proj.bias"])
        if a + "q_norm.weight" in t:
            add(b + "attn_q_norm.weight", t[a + "q_norm.weight"])
            add(b + "attn_k_norm.weight", t[a + "k_norm.weight"])
        m = p + "mlp."
        if arch == "phi3":
            add(b + "ffn_up.weight", t[m + "gate_up_proj.weight"])  # [gate; up], as Phi-3 ships it
            add(b + "ffn_down.weight", t[m + "down_proj.weight"])
        elif arch == "llama" and experts:  # Mixtral
            e = p + "block_sparse_moe."
            add(b + "ffn_gate_inp.weight", t[e + "gate.weight"])
            for kind, hf in (("gate", "w1"), ("up", "w3"), ("down", "w2")):
                if legacy_experts:
                    for x in range(experts):
                        add(b + f"ffn_{kind}.{x}.weight", t[e + f"experts.{x}.{hf}.weight"])
                    continue
                add(b + f"ffn_{kind}_exps.weight",
                    np.stack([t[e + f"experts.{x}.{hf}.weight"] for x in range(experts)]))
        elif m + "gate.weight" in t:  # Qwen-MoE sparse layer
            add(b + "ffn_gate_inp.weight", t[m + "gate.weight"])
            for kind in ("gate", "up", "down"):
                add(b + f"ffn_{kind}_exps.weight",
                    np.stack([t[m + f"experts.{x}.{kind}_proj.weight"] for x in range(experts)]))
            if m + "shared_expert_gate.weight" in t:
                add(b + "ffn_gate_inp_shexp.weight", t[m + "shared_expert_gate.weight"][0])
                for kind in ("gate", "up", "down"):
                    add(b + f"ffn_{kind}_shexp.weight", t[m + f"shared_expert.{kind}_proj.weight"])
        else:
            for kind in ("gate", "up", "down"):
                add(b + f"ffn_{kind}.weight", t[m + f"{kind}_proj.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out_path


def random_kquant_blocks(type_name: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """n rows of k values in random Q4_K / Q5_K / Q6_K blocks with small fp16 scales (every
    bit pattern of the rest is valid), as bytes [n, row bytes]."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    rng = np.random.default_rng(seed)
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    raw = rng.integers(0, 256, (n * k // block, size), dtype=np.uint8)
    d = (rng.uniform(0.5, 1.5, len(raw)) * 1e-3).astype(np.float16).view(np.uint8).reshape(-1, 2)
    if type_name == "Q6_K":
        raw[:, -2:] = d
    else:  # d then dmin
        raw[:, 0:2] = d
        raw[:, 2:4] = (rng.uniform(0.5, 1.5, len(raw)) * 5e-4).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return raw.reshape(n, -1)


def _add_tokenizer(w, hf_dir: str) -> None:
    """The folder's byte-level BPE tokenizer and chat template as llama.cpp's "gpt2" vocab."""
    import gguf
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(hf_dir)
    vocab = tok.get_vocab()
    tokens = sorted(vocab, key=vocab.get)
    special = set(tok.all_special_ids)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL
                       for i in range(len(tokens))])
    w.add_token_scores([0.0] * len(tokens))  # (no merges: single bytes; readers derive none)
    w.add_bos_token_id(tok.bos_token_id)
    w.add_eos_token_id(tok.eos_token_id)
    w.add_pad_token_id(0)
    if tok.chat_template:  # (the converter writes one only where the folder has it)
        w.add_chat_template(tok.chat_template)


def hf_model(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


# -- Gemma 4 (its chat template is not available offline: the folders carry none) ----------------
GEMMA4_WINDOW = 8


def _gemma4_config(**overrides):
    from transformers import Gemma4TextConfig

    cfg = dict(_BASE, head_dim=16, global_head_dim=32, sliding_window=GEMMA4_WINDOW,
               final_logit_softcapping=30.0, pad_token_id=0, tie_word_embeddings=True,
               rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                                "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                                   "rope_theta": 1_000_000.0}})
    cfg.update(overrides)
    return Gemma4TextConfig(**cfg)


def _perturb_gemma4(path: str, seed: int) -> None:
    """Move what transformers initialises to one (layer scalars, router and expert scales) and
    sharpen the routers, so that each of them matters and no top-k choice is a near-tie."""
    from safetensors.torch import load_file, save_file

    file = os.path.join(path, "model.safetensors")
    tensors, g = load_file(file), torch.Generator().manual_seed(seed)
    for name, t in tensors.items():
        if name.endswith(("layer_scalar", "router.scale", "router.per_expert_scale")):
            tensors[name] = t + 0.3 * torch.rand(t.shape, generator=g)
        elif name.endswith("router.proj.weight"):
            tensors[name] = t * _ROUTER_SCALE
    save_file(tensors, file, metadata={"format": "pt"})


def save_gemma4(path: str) -> str:
    """Gemma 4 with per-layer embeddings (P=8) and the last two of six layers sharing KV
    (a sliding one with layer 2, a full one with layer 3); sliding (head 16, GQA 4/2, window
    8) and full layers (head 32, k = v, one kv head), proportional RoPE on the full layers,
    the double-wide MLP on the shared layers, final logit soft-capping."""
    from transformers import Gemma4ForCausalLM

    cfg = _gemma4_config(num_hidden_layers=6, layer_types=["sliding_attention", "full_attention"] * 3,
                         num_kv_shared_layers=2, hidden_size_per_layer_input=8,
                         vocab_size_per_layer_input=VOCAB, attention_k_eq_v=True,
                         num_global_key_value_heads=1, use_double_wide_mlp=True)
    path = _save_random(Gemma4ForCausalLM, cfg, path, seed=10)
    _perturb_gemma4(path, 10)
    save_byte_tokenizer(path, VOCAB)
    return path


def save_gemma4_moe(path: str) -> str:
    """The Gemma 4 mixture of experts: a dense MLP and 4 experts top-2 beside it in each of
    four layers (sliding, full, sliding, full), no per-layer embeddings, no shared KV; the full
    layers keep twice the sliding ones' K/V per token (head 32 vs 16, two kv heads each), so
    the KV cache packs both sliding layers into one full layer's page."""
    from transformers import Gemma4ForCausalLM

    cfg = _gemma4_config(num_hidden_layers=4, layer_types=["sliding_attention", "full_attention"] * 2,
                         hidden_size_per_layer_input=0, enable_moe_block=True, num_experts=4,
                         top_k_experts=2, moe_intermediate_size=32, attention_k_eq_v=True,
                         num_global_key_value_heads=2, tie_word_embeddings=False)
    path = _save_random(Gemma4ForCausalLM, cfg, path, seed=11)
    _perturb_gemma4(path, 11)
    save_byte_tokenizer(path, VOCAB)
    return path


GEMMA4_BUILDERS = {"gemma4": save_gemma4, "gemma4_moe": save_gemma4_moe}


def write_gemma4_gguf(hf_dir: str, out_path: str, dtype: str = "F32") -> str:
    """Convert a tiny Gemma 4 folder the way llama.cpp's Gemma4Model does: the gguf package's
    tensor names, the norms as they are, `layer_scalar` and the stacked experts named `.weight`,
    the router's scale and the experts' scales as `ffn_gate_inp.scale` and `ffn_down_exps.scale`,
    each layer type's head size, kv heads and MLP widths in their keys, and `rope_freqs` (1 for
    the dim pairs the full layers' proportional RoPE turns, 1e30 for the still ones). `dtype`
    "F32", or "F16" for the matrices (vectors stay F32, as the converter keeps them)."""
    import gguf
    from safetensors.numpy import load_file

    with open(os.path.join(hf_dir, "config.json")) as f:
        cfg = json.load(f)
    t = load_file(os.path.join(hf_dir, "model.safetensors"))
    n, types = cfg["num_hidden_layers"], cfg["layer_types"]
    swa = [x == "sliding_attention" for x in types]
    shared = cfg.get("num_kv_shared_layers") or 0
    rope = cfg["rope_parameters"]
    # the full layers' head size and kv heads (global_head_dim and num_global_key_value_heads,
    # which this transformers saves as per_layer_config)
    full = (cfg.get("per_layer_config") or {}).get(str(types.index("full_attention"))) or {}
    full_d = full.get("head_dim") or cfg["global_head_dim"]
    kv_full = full.get("num_key_value_heads") or cfg.get("num_global_key_value_heads")
    w = gguf.GGUFWriter(out_path, "gemma4")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(n)
    ffn = cfg["intermediate_size"]
    w.add_feed_forward_length([ffn * (2 if i >= n - shared else 1) for i in range(n)]
                              if cfg.get("use_double_wide_mlp") else ffn)
    w.add_head_count(cfg["num_attention_heads"])
    kv = cfg["num_key_value_heads"]
    w.add_head_count_kv([kv if s else kv_full for s in swa] if kv_full is not None else kv)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_key_length(full_d)
    w.add_value_length(full_d)
    w.add_key_length_swa(cfg["head_dim"])
    w.add_value_length_swa(cfg["head_dim"])
    w.add_rope_freq_base(rope["full_attention"]["rope_theta"])
    w.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
    w.add_rope_dimension_count(full_d)
    w.add_rope_dimension_count_swa(cfg["head_dim"])
    w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    w.add_sliding_window(cfg["sliding_window"])
    w.add_shared_kv_layers(shared)
    w.add_embedding_length_per_layer_input(cfg.get("hidden_size_per_layer_input") or 0)
    w.add_sliding_window_pattern(swa)
    if cfg.get("enable_moe_block"):
        w.add_expert_count(cfg["num_experts"])
        w.add_expert_used_count(cfg["top_k_experts"])
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    _add_tokenizer(w, hf_dir)
    turning = int(full_d * rope["full_attention"]["partial_rotary_factor"] / 2)
    w.add_tensor("rope_freqs.weight", np.array([1.0] * turning + [1e30] * (full_d // 2 - turning), dtype=np.float32))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA4, n)
    for name, a in t.items():
        a = np.ascontiguousarray(a, dtype=np.float32)
        if name.endswith("router.scale"):
            new = names.get_name(name.replace("router.scale", "router.proj")) + ".scale"
        elif name.endswith("router.per_expert_scale"):
            new = names.get_name(name.replace("router.per_expert_scale", "experts.down_proj")) + ".scale"
        elif name.endswith(("layer_scalar", "experts.gate_up_proj", "experts.down_proj")):
            new = names.get_name(name) + ".weight"
        else:
            new = names.get_name(name, try_suffixes=(".weight",))
        assert new, name
        w.add_tensor(new, a.astype(np.float16) if dtype == "F16" and a.ndim >= 2 else a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out_path
