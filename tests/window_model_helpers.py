"""Tiny random sliding-window models (Gemma 3, Mistral with a window, Qwen2 with
use_sliding_window) saved as HF folders, a GGUF writer for them, and a driver that runs
kvflow's model step by step through the KV cache coordinator, as the runner does."""
from __future__ import annotations

import numpy as np
import torch

from conftest_model_helpers import TINY, _save_random
from gguf_test_writer import add_hparams, permute_rope_rows
from kvflow.core.kv_cache.coordinator import KVCacheCoordinator
from kvflow.core.kv_cache.groups import layer_slots, make_kv_cache_groups
from kvflow.attention.metadata import build_attention_metadata
from kvflow.model.kv_cache import allocate_kv_caches
from kvflow.request import Request
from kvflow.sampling_params import SamplingParams

WINDOW = 8  # smaller than every prompt the tests run


def save_tiny_gemma3(path: str, seed: int = 0, query_pre_attn_scalar: int = 24) -> str:
    """Gemma-3-shaped: local/global layers alternating, a local RoPE base, QK-norm, a query
    scale that is not head_dim's (GGUF has no key for that: pass 16), final logit
    soft-capping, tied embeddings."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(
        vocab_size=TINY["vocab_size"], hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        sliding_window=WINDOW, sliding_window_pattern=2, rope_theta=1_000_000.0,
        rope_local_base_freq=10_000.0, query_pre_attn_scalar=query_pre_attn_scalar, final_logit_softcapping=30.0,
        bos_token_id=1, eos_token_id=[2, 3], pad_token_id=0, architectures=["Gemma3ForCausalLM"])
    return _save_random(Gemma3ForCausalLM, config, path, seed)


def save_tiny_mistral_window(path: str, seed: int = 0) -> str:
    """Mistral with `sliding_window`: every layer attends through it."""
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(**TINY, sliding_window=WINDOW, tie_word_embeddings=False,
                           bos_token_id=1, eos_token_id=2)
    return _save_random(MistralForCausalLM, config, path, seed)


def save_tiny_qwen2_window(path: str, seed: int = 0) -> str:
    """Qwen2 with use_sliding_window: the first max_window_layers layers attend fully."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**TINY, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    return _save_random(Qwen2ForCausalLM, config, path, seed)


SAVERS = {"gemma3": save_tiny_gemma3, "mistral": save_tiny_mistral_window,
          "qwen2": save_tiny_qwen2_window}


_GGUF_ARCH = {"gemma3_text": "gemma3", "mistral": "llama", "qwen2": "qwen2"}


def save_tiny_gguf(hf_path: str, out_file: str, quant: str = "F32") -> str:
    """The HF folder's model as a GGUF file the way llama.cpp's converter writes it: its
    tensor and metadata names, q/k rows permuted for `llama`, Gemma's norms stored as 1 + w,
    the window and which layers use it; `quant` "Q8_0": the matrices quantised, the rest F32."""
    import json
    import os

    from gguf import GGMLQuantizationType, GGUFWriter, quants
    from safetensors.torch import load_file

    with open(os.path.join(hf_path, "config.json")) as f:
        cfg = json.load(f)
    hf = {k: v.float().numpy() for k, v in load_file(os.path.join(hf_path, "model.safetensors")).items()}
    arch = _GGUF_ARCH[cfg["model_type"]]
    gemma = arch == "gemma3"
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    rope = cfg.get("rope_parameters") or {}
    w = GGUFWriter(out_file, arch)
    add_hparams(w, cfg)
    if cfg.get("sliding_window"):
        w.add_sliding_window(cfg["sliding_window"])
        w.add_sliding_window_pattern([t == "sliding_attention" for t in cfg["layer_types"]]
                                     if cfg.get("layer_types") else [True] * cfg["num_hidden_layers"])
    if gemma:
        w.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
        if cfg.get("final_logit_softcapping"):
            w.add_float32("gemma3.final_logit_softcapping", cfg["final_logit_softcapping"])

    def norm(x: np.ndarray) -> np.ndarray:
        return x + 1.0 if gemma else x

    def add(name: str, x: np.ndarray) -> None:
        if quant == "F32" or x.ndim != 2:
            return w.add_tensor(name, x)
        qtype = GGMLQuantizationType[quant]
        q = quants.quantize(np.ascontiguousarray(x), qtype)
        w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=qtype)

    add("token_embd.weight", hf["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", norm(hf["model.norm.weight"]))
    if "lm_head.weight" in hf and not cfg.get("tie_word_embeddings"):
        add("output.weight", hf["lm_head.weight"])
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm"}
    names.update({"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
                  "post_feedforward_layernorm": "post_ffw_norm", "self_attn.q_norm": "attn_q_norm",
                  "self_attn.k_norm": "attn_k_norm"} if gemma else {"post_attention_layernorm": "ffn_norm"})
    for i in range(cfg["num_hidden_layers"]):
        for hf_part, part in names.items():
            for kind in ("weight", "bias"):
                x = hf.get(f"model.layers.{i}.{hf_part}.{kind}")
                if x is None:
                    continue
                if arch == "llama" and part in ("attn_q", "attn_k"):
                    x = permute_rope_rows(x, heads if part == "attn_q" else kv_heads)
                add(f"blk.{i}.{part}.{kind}", norm(x) if "norm" in part else x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out_file


class WindowedPagedDriver:
    """Feeds kvflow's model one flat batch per step through a KVCacheCoordinator: each
    request gets one block table per KV cache group, and blocks its windows leave behind go
    back to the pool as it advances (`free_history` records the pool after every step)."""

    def __init__(self, model, arch, num_blocks: int = 96, block_size: int = 4):
        self.model, self.block_size = model, block_size
        self.groups = make_kv_cache_groups(arch.layer_windows())
        self.layer_group, tensor_of = layer_slots(self.groups, arch.num_hidden_layers)
        tensors = allocate_kv_caches(arch, num_blocks, block_size, model.dtype,
                                     num_layers=len(self.groups[0].layers))
        self.kv_caches = [tensors[j] for j in tensor_of]
        self.kv = KVCacheCoordinator([g.spec for g in self.groups], num_blocks, block_size,
                                     enable_caching=False)
        self.requests: dict[str, Request] = {}
        self.free_history: list[int] = []

    def step(self, plan: list[tuple[str, list[int]]]) -> dict[str, torch.Tensor]:
        """plan: (sequence id, this step's new tokens) in batch order -> logits per sequence."""
        query_lens, seq_lens, ids = [], [], []
        for sid, tokens in plan:
            req = self.requests.get(sid)
            if req is None:
                req = self.requests[sid] = Request(sid, list(tokens), SamplingParams(max_tokens=64))
            else:  # later tokens arrive as outputs, as decodes feed back sampled tokens
                for t in tokens[req.num_tokens - req.num_computed_tokens:]:
                    req.append_output_token(t)
            assert self.kv.allocate_slots(req, len(tokens)) is not None, "the test pool is too small"
            query_lens.append(len(tokens))
            seq_lens.append(req.num_computed_tokens + len(tokens))
            ids += tokens
        metas = [build_attention_metadata(np.array(query_lens), np.array(seq_lens),
                                          [self.kv.get_group_block_ids(sid)[g] for sid, _ in plan],
                                          self.block_size, sliding_window=group.sliding_window)
                 for g, group in enumerate(self.groups)]
        with torch.no_grad():
            hidden = self.model(torch.tensor(ids), metas[0].positions, self.kv_caches,
                                [metas[g] for g in self.layer_group])
            logits = self.model.compute_logits(hidden)
        for (sid, tokens) in plan:
            self.requests[sid].num_computed_tokens += len(tokens)
        self.kv.check_invariants()
        self.free_history.append(self.kv.num_free_blocks)
        out, offset = {}, 0
        for sid, tokens in plan:
            out[sid] = logits[offset: offset + len(tokens)]
            offset += len(tokens)
        return out


def generate_counting_preemptions(model: str, prompts: list[list[int]], params, check=None,
                                  **engine) -> tuple[list[list[int]], int]:
    """Each prompt's tokens from a fresh `LLM(model, **engine)` (shut down afterwards), and how
    many preemptions its scheduler made; `check(core)` looks at the engine before it runs."""
    from kvflow.entrypoints.llm import LLM

    llm = LLM(model, **engine)
    core = llm.engine.core
    preempted = [0]
    schedule = core.scheduler.schedule

    def watched():
        out = schedule()
        preempted[0] += len(out.preempted_req_ids)
        return out

    core.scheduler.schedule = watched
    try:
        if check is not None:
            check(core)
        outs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.engine.shutdown()
    return [list(o.outputs[0].token_ids) for o in outs], preempted[0]
