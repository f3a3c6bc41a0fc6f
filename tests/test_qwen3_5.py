"""Qwen3.5 beyond the hybrid tests every state family gets (tests/test_hybrid_models.py): the
Gated DeltaNet's chunked form against its recurrence, and a vision-language folder's text part
against Hugging Face's Qwen3_5ForConditionalGeneration on text (its M-RoPE sections)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest_model_helpers import PagedDriver
from tiny_hybrid_models import save_qwen3_5_vl
from kvflow.layers.gated_deltanet import chunk_gated_delta_rule, l2norm, recurrent_gated_delta_rule


def test_the_chunked_form_equals_the_recurrence_across_chunks_and_calls():
    """150 tokens (two full chunks and a padded one) from a nonzero state, split over two calls
    as a chunked prefill splits a prompt, equal token-by-token updates."""
    torch.manual_seed(0)
    h, n, dk, dv = 3, 150, 8, 5
    q = l2norm(torch.randn(h, n, dk)) * dk ** -0.5
    k = l2norm(torch.randn(h, n, dk))
    v = torch.randn(h, n, dv)
    g = -F.softplus(torch.randn(h, n))
    beta = torch.rand(h, n)
    state0 = torch.randn(h, dk, dv)
    out_a, mid = chunk_gated_delta_rule(q[:, :70], k[:, :70], v[:, :70], g[:, :70], beta[:, :70], state0)
    out_b, end = chunk_gated_delta_rule(q[:, 70:], k[:, 70:], v[:, 70:], g[:, 70:], beta[:, 70:], mid)
    state, ref = state0[None].clone(), []
    for t in range(n):
        o = recurrent_gated_delta_rule(q[None, :, t], k[None, :, t], v[None, :, t], g[None, :, t],
                                       beta[None, :, t], state)
        ref.append(o[0])
    torch.testing.assert_close(torch.cat((out_a, out_b), 1), torch.stack(ref, 1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(end, state[0], atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_a_vision_language_folder_serves_its_text_part(tmp_path):
    from transformers import AutoModelForImageTextToText

    from kvflow.model.loader import load_model

    path = save_qwen3_5_vl(str(tmp_path / "vl"))
    hf = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    model, arch = load_model(path, torch.float32)
    assert arch.architecture == "Qwen3_5ForCausalLM" and arch.rope_dim == 16
    assert arch.linear_layers == [0, 1, 2] and arch.attention_layers() == [3]
    ids = np.random.default_rng(2).integers(4, 320, 20).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    driver = PagedDriver(model, arch, seed=3)
    got = torch.cat([driver.step([("a", ids[:13])])["a"], driver.step([("a", ids[13:19])])["a"],
                     driver.step([("a", ids[19:])])["a"]])
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_qwen3_5_moe_experts_stacked_in_the_checkpoint_load_as_per_expert_ones(tmp_path):
    """Qwen3.5 MoE checkpoints may keep each layer's experts stacked (`experts.gate_up_proj`
    [experts, 2 * inter, hidden], `experts.down_proj`): the same model as one tensor per expert."""
    import os

    from safetensors.torch import load_file, save_file

    from kvflow.model.loader import load_model
    from tiny_hybrid_models import save_qwen3_5_moe

    path = save_qwen3_5_moe(str(tmp_path / "moe"))
    per_expert = load_model(path, torch.float32)[0].state_dict()
    file = os.path.join(path, "model.safetensors")
    t = load_file(file)
    for i in range(5):
        p = f"model.layers.{i}.mlp.experts."
        gate_up = [torch.cat([t.pop(p + f"{e}.gate_proj.weight"), t.pop(p + f"{e}.up_proj.weight")]) for e in range(4)]
        t[p + "gate_up_proj"] = torch.stack(gate_up)
        t[p + "down_proj"] = torch.stack([t.pop(p + f"{e}.down_proj.weight") for e in range(4)])
    save_file(t, file, metadata={"format": "pt"})
    stacked = load_model(path, torch.float32)[0].state_dict()
    assert stacked.keys() == per_expert.keys()
    for name, w in per_expert.items():
        torch.testing.assert_close(stacked[name], w, atol=0, rtol=0)
