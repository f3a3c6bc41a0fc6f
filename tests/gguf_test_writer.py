"""What every test GGUF writer shares: the header keys llama.cpp's converter writes for a
transformers config, and its permutation of q/k rows for the `llama` architecture."""
from __future__ import annotations

import numpy as np


def permute_rope_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute: HF's half-split RoPE rows -> interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def head_dim(cfg: dict) -> int:
    return cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]


def add_hparams(w, cfg: dict) -> None:
    """Context, widths, heads, norm epsilon, vocabulary and the (global) RoPE base."""
    rope = cfg.get("rope_parameters") or {}
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(head_dim(cfg))
    w.add_value_length(head_dim(cfg))
    w.add_rope_freq_base(float((rope.get("full_attention") or rope).get("rope_theta", 10000.0)))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
