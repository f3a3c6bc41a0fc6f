"""gpt-oss with float weights, beyond the shared equivalence tests (test_arch_equivalence.py runs
the tiny model through the HF logits, the engine's greedy tokens, bf16, preemption and a prefix
hit): its expert block against transformers' GptOssMLP, the checkpoint's interleaved gate/up
columns, the features of the tiny model, the published gpt-oss-20b config read as transformers
reads it, and what the family refuses by name. Its MXFP4 checkpoints: test_gpt_oss_mxfp4.py."""
from __future__ import annotations

import json
import logging

import pytest
import torch

from tiny_arch_models import BUILDERS, YARN_ORIGINAL_CONTEXT, hf_model
from kvflow.layers.moe import naive_moe_forward
from kvflow.model.arch import load_arch_config
from kvflow.model.loader import load_model

pytestmark = pytest.mark.slow  # loads models (make test-fast leaves it out)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(HF folder, HF model, kvflow model, arch) of the tiny gpt-oss."""
    path = BUILDERS["gpt_oss"](str(tmp_path_factory.mktemp("gpt_oss") / "hf"))
    model, arch = load_model(path, torch.float32)
    return path, hf_model(path), model, arch


def test_tiny_model_has_yarn_sinks_windows_and_a_clamp_its_experts_reach(tiny):
    """Each feature the equivalence tests rely on is switched on: YaRN with a factor past one,
    sinks away from zero (fp32), sliding and full layers, a SwiGLU clamp that the experts'
    activations reach on both of its sides."""
    path, _, model, arch = tiny
    assert arch.rope_scaling["rope_type"] == "yarn" and arch.rope_scaling["factor"] > 1
    assert arch.rope_scaling["original_max_position_embeddings"] == YARN_ORIGINAL_CONTEXT
    assert arch.layer_windows() == [8, None, 8, None]
    assert all(layer.attn.sinks.abs().min() > 0.01 and layer.attn.sinks.dtype == torch.float32
               for layer in model.layers)
    moe = model.layers[0].moe
    h = torch.randn(64, arch.hidden_size, generator=torch.Generator().manual_seed(0))
    gate, up = torch.nn.functional.linear(h, moe.gate_up[0], moe.gate_up_bias[0]).chunk(2, dim=-1)
    assert (gate > arch.swiglu_limit).float().mean() > 0.05
    assert (up.abs() > arch.swiglu_limit).float().mean() > 0.05 and (up.abs() < arch.swiglu_limit).any()


def test_expert_block_matches_transformers_gpt_oss_mlp(tiny):
    """Router bias, softmax over the top-k logits, the biased experts and the clamped SwiGLU:
    the grouped forward (and the token-by-token one) give transformers' GptOssMLP output, and
    the checkpoint's interleaved gate/up columns land as [gate; up] rows."""
    _, hf, model, arch = tiny
    h = torch.randn(50, arch.hidden_size, generator=torch.Generator().manual_seed(1))
    for i in range(arch.num_hidden_layers):
        theirs, ours = hf.model.layers[i].mlp, model.layers[i].moe
        inter = arch.moe_intermediate_size
        assert torch.equal(ours.gate_up[:, :inter], theirs.experts.gate_up_proj[..., 0::2].transpose(1, 2))
        assert torch.equal(ours.gate_up[:, inter:], theirs.experts.gate_up_proj[..., 1::2].transpose(1, 2))
        with torch.no_grad():
            want = theirs(h[None])[0][0]
        torch.testing.assert_close(ours(h, model.kernels), want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(naive_moe_forward(ours, h, model.kernels), want, atol=1e-5, rtol=1e-5)


def test_what_gpt_oss_is_not_tested_with_is_refused_by_name(tiny, caplog):
    """Tensor and pipeline parallelism and LoRA are refused naming the family; quantized
    projections fall back to floats with a warning; decode steps run layer by layer (the one-
    call C step has no sinks or expert biases)."""
    from kvflow import LLM

    path, _, model, _ = tiny
    assert model.decode_step_rows() == 0
    with pytest.raises(ValueError, match="gpt-oss does not run tensor-parallel"):
        LLM(path, dtype="float32", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="gpt-oss does not run pipeline-parallel"):
        LLM(path, dtype="float32", pipeline_parallel_size=2)
    with pytest.raises(ValueError, match="gpt-oss does not take LoRA"):
        LLM(path, dtype="float32", enable_lora=True, max_model_len=64, num_blocks=32)
    with caplog.at_level(logging.WARNING, logger="kvflow"):
        quantized, _ = load_model(path, torch.float32, quantization="int8")
    assert "does not serve gpt-oss" in caplog.text
    assert all(p is None or p.quant is None for layer in quantized.layers for p in layer.packed.values())


# gpt-oss-20b's config.json as published (less its MXFP4 quantization_config, as the bf16
# copies people convert it to), in transformers 4.x's spelling: rope_theta beside rope_scaling
GPT_OSS_20B = {
    "architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0,
    "eos_token_id": 200002, "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu",
    "hidden_size": 2880, "initial_context_length": 4096, "initializer_range": 0.02,
    "intermediate_size": 2880, "layer_types": ["sliding_attention", "full_attention"] * 12,
    "max_position_embeddings": 131072, "model_type": "gpt_oss", "num_attention_heads": 64,
    "num_experts_per_tok": 4, "num_hidden_layers": 24, "num_key_value_heads": 8,
    "num_local_experts": 32, "output_router_logits": False, "pad_token_id": 199999,
    "rms_norm_eps": 1e-05, "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                                            "original_max_position_embeddings": 4096,
                                            "rope_type": "yarn", "truncate": False},
    "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
    "tie_word_embeddings": False, "use_cache": True, "vocab_size": 201088}


def test_published_gpt_oss_20b_config_reads_as_transformers_builds_it(tmp_path):
    """The real config: its shapes, windows, YaRN and expert constants, and a parameter count
    equal to transformers' model built from it (on the meta device)."""
    from transformers import GptOssConfig, GptOssForCausalLM

    with open(tmp_path / "config.json", "w") as f:
        json.dump(GPT_OSS_20B, f)
    arch = load_arch_config(str(tmp_path))
    assert (arch.num_experts, arch.num_experts_per_tok, arch.moe_intermediate_size) == (32, 4, 2880)
    assert arch.layer_windows()[:2] == [128, None] and arch.attention_bias
    assert (arch.swiglu_alpha, arch.swiglu_limit, arch.rms_norm_eps) == (1.702, 7.0, 1e-5)
    assert arch.rope_theta == 150000 and arch.rope_scaling["factor"] == 32.0
    assert arch.rope_scaling["truncate"] is False
    with torch.device("meta"):
        hf = GptOssForCausalLM(GptOssConfig.from_pretrained(tmp_path))
    assert arch.num_parameters() == sum(p.numel() for p in hf.parameters())
    assert round(arch.num_parameters() / 1e9, 1) == 20.9
    # without layer_types and a window: transformers' defaults (the even layers slide over 128)
    with open(tmp_path / "config.json", "w") as f:
        json.dump({k: v for k, v in GPT_OSS_20B.items() if k not in ("layer_types", "sliding_window")}, f)
    assert load_arch_config(str(tmp_path)).layer_windows() == [128, None] * 12
