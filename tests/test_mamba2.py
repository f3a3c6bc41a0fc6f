"""Mamba2 (Granite 4.0-H) beyond the hybrid tests every state family gets
(tests/test_hybrid_models.py): the SSD's chunked form against its recurrence and against
Hugging Face's chunk scan, a Granite 4.0-H without experts (the shared MLP alone) and with
RoPE against Hugging Face, and IBM's config.json as it ships."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest_model_helpers import PagedDriver, _save_random, hf_logits
from tiny_arch_models import VOCAB, hf_model
from kvflow.layers.mamba2 import chunk_scan, recurrent_scan
from kvflow.model.arch import load_arch_config


def _inputs(h: int, n: int, p: int, s: int):
    torch.manual_seed(0)
    x = torch.randn(h, n, p)
    dt = F.softplus(torch.randn(h, n))
    a = -torch.arange(1, h + 1, dtype=torch.float32) * 0.5
    b, c = torch.randn(h, n, s), torch.randn(h, n, s)
    return x, dt, a, b, c, torch.randn(h, p, s)


def test_the_chunked_form_equals_the_recurrence_across_chunks_and_calls():
    """150 tokens (two full chunks and a padded one) from a nonzero state, split over two calls
    as a chunked prefill splits a prompt, equal token-by-token updates."""
    h, n, p, s = 3, 150, 8, 5
    x, dt, a, b, c, state0 = _inputs(h, n, p, s)
    out_a, mid = chunk_scan(x[:, :70], dt[:, :70], a, b[:, :70], c[:, :70], state0)
    out_b, end = chunk_scan(x[:, 70:], dt[:, 70:], a, b[:, 70:], c[:, 70:], mid)
    state, ref = state0[None].clone(), []
    for t in range(n):
        ref.append(recurrent_scan(x[None, :, t], dt[None, :, t], a, b[None, :, t], c[None, :, t], state)[0])
    torch.testing.assert_close(torch.cat((out_a, out_b), 1), torch.stack(ref, 1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(end, state[0], atol=1e-5, rtol=1e-5)


def test_the_chunked_form_equals_hfs_chunk_scan():
    """HF's mamba2_chunk_scan (chunks of 16, dt from softplus(dt + dt_bias), the D skip) from
    the same initial state: the same outputs and final state."""
    from transformers.models.granitemoehybrid.modeling_granitemoehybrid import mamba2_chunk_scan

    h, n, p, s = 4, 100, 8, 6
    x, _, a, b, c, state0 = _inputs(h, n, p, s)
    raw_dt, dt_bias, d = torch.randn(h, n), torch.randn(h), torch.randn(h)
    dt = F.softplus(raw_dt + dt_bias[:, None])
    out, end = chunk_scan(x, dt, a, b, c, state0)
    ref, ref_end = mamba2_chunk_scan(x.transpose(0, 1)[None], raw_dt.T[None], a, b.transpose(0, 1)[None],
                                     c.transpose(0, 1)[None], chunk_size=16, D=d, dt_bias=dt_bias,
                                     initial_states=state0[None], dt_softplus=True, return_final_states=True)
    torch.testing.assert_close(out + d[:, None, None] * x, ref[0].transpose(0, 1), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(end, ref_end[0], atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_a_dense_granite4h_with_rope_matches_hf_over_chunks(tmp_path):
    """No experts (each layer's MLP is the shared MLP alone), RoPE on the attention layers,
    one Mamba2 group, untied: HF's logits over a prompt in three chunks beside a decode."""
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    from kvflow.model.loader import load_model

    cfg = GraniteMoeHybridConfig(vocab_size=VOCAB, hidden_size=64, shared_intermediate_size=48,
                                 num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                                 layer_types=["attention", "mamba", "mamba"], mamba_n_heads=4, mamba_d_head=32,
                                 mamba_d_state=8, mamba_n_groups=1, mamba_d_conv=3, mamba_chunk_size=4,
                                 num_local_experts=0, position_embedding_type="rope", embedding_multiplier=3.0,
                                 residual_multiplier=0.5, attention_multiplier=0.3, logits_scaling=2.0,
                                 initializer_range=0.1, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    path = _save_random(GraniteMoeHybridForCausalLM, cfg, str(tmp_path / "hf"), seed=2)
    hf = hf_model(path)
    model, arch = load_model(path, torch.float32)
    assert arch.attention_layers() == [0] and arch.use_rope and arch.num_experts == 0
    assert arch.num_parameters() == sum(p.numel() for p in hf.parameters())
    rng = np.random.default_rng(0)
    a, b = rng.integers(0, VOCAB, 19).tolist(), rng.integers(0, VOCAB, 6).tolist()
    ref_a, ref_b = hf_logits(hf, a), hf_logits(hf, b)
    driver = PagedDriver(model, arch, seed=1)
    got_a, got_b = [], []
    for step in ([("a", a[:7]), ("b", b[:5])], [("b", b[5:6]), ("a", a[7:18])], [("a", a[18:])]):
        out = driver.step(step)
        got_a.append(out["a"])
        got_b += [out["b"]] if "b" in out else []
    torch.testing.assert_close(torch.cat(got_a), ref_a, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(torch.cat(got_b), ref_b, atol=1e-4, rtol=1e-4)


def test_a_config_as_ibm_ships_it_is_read(tmp_path):
    """Granite 4.0-H's config.json names the layers "mamba" / "attention" (transformers 5
    writes "linear_attention" / "full_attention"), leaves mamba_d_head at "auto" and the
    time-step limit out; the state per request counts the conv window in the model dtype and
    the SSM state in fp32."""
    cfg = {"architectures": ["GraniteMoeHybridForCausalLM"], "model_type": "granitemoehybrid",
           "vocab_size": 100, "hidden_size": 64, "intermediate_size": 32, "shared_intermediate_size": 96,
           "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
           "layer_types": ["mamba", "mamba", "attention", "mamba"], "mamba_n_heads": 4, "mamba_d_head": "auto",
           "mamba_expand": 2, "mamba_d_state": 16, "mamba_n_groups": 1, "mamba_d_conv": 4,
           "num_local_experts": 8, "num_experts_per_tok": 2, "position_embedding_type": "nope",
           "embedding_multiplier": 12.0, "residual_multiplier": 0.22, "attention_multiplier": 0.0078125,
           "logits_scaling": 8.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
           "bos_token_id": 1, "eos_token_id": 2}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    arch = load_arch_config(str(tmp_path))
    assert arch.mamba_layers == [0, 1, 3] and arch.attention_layers() == [2]
    assert (arch.mamba_d_head, arch.num_experts, arch.moe_intermediate_size, arch.intermediate_size) == (32, 8, 32, 96)
    assert not arch.use_rope and (arch.time_step_min, arch.time_step_max) == (0.0, math.inf)
    assert (arch.embedding_multiplier, arch.logits_scaling) == (12.0, 8.0)
    conv_dim = 4 * 32 + 2 * 16
    assert arch.state_bytes_per_request(2) == 3 * (3 * conv_dim * 2 + 4 * 32 * 16 * 4)
