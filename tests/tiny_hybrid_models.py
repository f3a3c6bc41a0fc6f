"""Tiny random hybrid models (layers that keep a state per request beside attention layers)
saved as HF folders: LFM2's gated short convolutions. Their weights are drawn wider than
transformers' default init so that greedy tokens vary from step to step (at the default, a tiny
random LFM2 repeats one token)."""
from __future__ import annotations

from conftest_model_helpers import _save_random, save_byte_tokenizer
from tiny_arch_models import VOCAB


def save_lfm2(path: str) -> str:
    """Conv, attention, conv, conv, attention: two attention layers of five, GQA 4/2."""
    from transformers import Lfm2Config, Lfm2ForCausalLM

    cfg = Lfm2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=5,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                     layer_types=["conv", "full_attention", "conv", "conv", "full_attention"],
                     block_auto_adjust_ff_dim=False, initializer_range=0.1,
                     bos_token_id=1, eos_token_id=2, pad_token_id=0)
    path = _save_random(Lfm2ForCausalLM, cfg, path, seed=9)
    save_byte_tokenizer(path, VOCAB)
    return path


BUILDERS = {"lfm2": save_lfm2}
