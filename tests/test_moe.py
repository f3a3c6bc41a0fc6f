"""The expert block's grouped forward (tokens sorted by expert, one GEMM per active expert,
index_add back) gives what routing each token through its experts one by one gives, through
the kernels chosen for the dtype with the experts prepacked, and its routing is transformers'."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from kvflow.model.arch import LlamaArchConfig
from kvflow.model.cpu_features import CpuFeatures
from kvflow.model.kernels import select_kernels
from kvflow.layers.moe import SparseMoeBlock, naive_moe_forward

ARCH = LlamaArchConfig(
    architecture="Qwen2MoeForCausalLM", vocab_size=64, hidden_size=64, intermediate_size=96,
    num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    rms_norm_eps=1e-6, rope_theta=10000.0, rope_scaling=None, max_position_embeddings=64,
    tie_word_embeddings=False, attention_bias=False, bos_token_id=None, eos_token_id=None,
    num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=False,
    shared_expert_intermediate_size=48)


def _block(arch: LlamaArchConfig, dtype: torch.dtype, seed: int = 0) -> SparseMoeBlock:
    torch.manual_seed(seed)
    block = SparseMoeBlock(arch, dtype)
    for p in block.parameters():
        p.data.copy_(torch.randn_like(p, dtype=torch.float32) * 0.2)
    return block


AVX2 = CpuFeatures.from_names("avx2", "fma", "f16c")  # a Zen 3: no panel GEMM, oneDNN for fp32 only


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 3, 37])
@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("cpu", ["this", "avx2"])
def test_grouped_forward_equals_token_by_token(dtype, tokens, shared, cpu):
    arch = ARCH if shared else dataclasses.replace(ARCH, shared_expert_intermediate_size=0,
                                                   norm_topk_prob=True)
    kernels = select_kernels(dtype, features=None if cpu == "this" else AVX2)
    block = _block(arch, dtype)
    if kernels.pack is not None:
        block.pack_weights(kernels.pack)
    h = torch.randn(tokens, arch.hidden_size).to(dtype)
    got = block(h, kernels)
    want = naive_moe_forward(block, h, kernels)
    assert got.shape == h.shape and got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    if tokens == 37:  # several experts got several tokens each, some maybe none
        _, experts = block.route(h, kernels)
        assert experts.unique().numel() > 2


@pytest.mark.slow  # imports the transformers modeling code (seconds)
def test_routing_is_transformers_softmax_then_top_k():
    """fp32 routing equals transformers' Qwen2-MoE router (softmax, top-k, renormalised or not)."""
    from transformers import Qwen2MoeConfig
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter

    kernels = select_kernels(torch.float32)
    for norm in (False, True):
        arch = dataclasses.replace(ARCH, norm_topk_prob=norm)
        block = _block(arch, torch.float32, seed=1)
        cfg = Qwen2MoeConfig(hidden_size=64, num_experts=8, num_experts_per_tok=2, norm_topk_prob=norm)
        router = Qwen2MoeTopKRouter(cfg)
        router.weight.data.copy_(block.router)
        h = torch.randn(20, 64)
        _, hf_weights, hf_experts = router(h)
        weights, experts = block.route(h, kernels)
        assert torch.equal(experts, hf_experts)
        torch.testing.assert_close(weights, hf_weights, atol=1e-6, rtol=1e-6)
        assert torch.allclose(weights.sum(-1), torch.ones(20)) == norm
