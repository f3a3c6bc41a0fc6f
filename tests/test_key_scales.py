"""An fp8 cache's key scales (kvflow/model/key_scales.py): keys stored as k * s and queries read
as q / s, s a power of two per kv head and channel. Every score stays as it was (bit for bit on
a float cache, on the per-layer path and in the one-call decode step), and where queries and
keys put their energy in different channels, e4m3 rounds the scores less."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kvflow.attention.metadata import build_attention_metadata
from kvflow.model.kv_cache import allocate_kv_caches
from kvflow.model.key_scales import (apply_key_scales, calibrate_key_scales, key_scales_digest,
                                     power_of_two_scales, qk_scale_vector, set_key_scales)
from kvflow.attention.kv_layout import FP8
from kvflow.models.llama import LlamaForCausalLM
from test_decode_graph import (ARCH, Q8_BLOCK, Q8_PATHS, Driver, count_graph_steps,
                               on_one_byte_cache, tiny_model)

SKEWED = [*range(0, 8), *range(32, 40)]  # whole RoPE pairs, split halves and adjacent both


def test_scales_are_powers_of_two_toward_the_channels_queries_weigh():
    q = torch.tensor([[256.0, 1, 1, 1], [1, 1, 1, 1]])
    k = torch.tensor([[1.0, 1, 1, 1], [1, 1, 1, 1]])
    s = power_of_two_scales(q, k)
    assert torch.equal(torch.exp2(torch.log2(s).round()), s)
    assert s[0, 0] / s[0, 1] == 4  # (256 / 1) ** (1/4)
    assert torch.equal(s[1], torch.ones(4))  # matched energies: nothing to move
    # per kv head the keys keep about their energy (within a power of two's rounding)
    kept = (s * s * k).sum(-1) / k.sum(-1)
    assert ((kept > 0.5) & (kept < 2)).all()
    assert power_of_two_scales(torch.tensor([[1e30, 1.0]]), torch.tensor([[1e-30, 1.0]])).max() <= 16


def test_the_row_multiplier_divides_each_query_head_by_its_kv_heads_scales():
    s = torch.tensor([[2.0, 4.0], [0.5, 1.0]])  # 2 kv heads, D 2
    v = qk_scale_vector(s, num_heads=4)
    assert v.tolist() == [0.5, 0.25, 0.5, 0.25, 2, 1, 2, 1, 2, 4, 0.5, 1]


def _random_scales(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.exp2(torch.randint(-3, 4, (ARCH.num_key_value_heads, ARCH.head_dim), generator=g).float())
            for _ in range(ARCH.num_hidden_layers)]


def _prompts_then_decodes(model, kv_dtype, block_size, steps=5):
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, ARCH.vocab_size, n).tolist() for n in (3, 17, 40)]
    d = Driver(model, kv_dtype, block_size=block_size)
    outs = [d.step(list(enumerate(prompts)))]
    for s in range(steps):
        outs.append(d.step([(i, [(7 * i + s) % ARCH.vocab_size]) for i in range(len(prompts))]))
    return outs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("graph", [False, True], ids=["per-layer", "one-call"])
def test_scores_keep_their_bits_on_a_float_cache(dtype, graph):
    plain, scaled = tiny_model("Q8_0", dtype, "scalar"), tiny_model("Q8_0", dtype, "scalar")
    apply_key_scales(scaled, _random_scales())
    taken = {}
    for name, m in (("plain", plain), ("scaled", scaled)):
        if graph:  # built after the scales: its layer records carry the multipliers
            taken[name] = count_graph_steps(m)
        else:
            m._decode_graph = (m.kernels, None)
    got, want = (_prompts_then_decodes(m, dtype, 4) for m in (scaled, plain))
    if graph:
        assert taken == {"plain": [True] * 5, "scaled": [True] * 5}
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    apply_key_scales(scaled, None)
    assert all(layer.attn.qk_scale is None for layer in scaled.layers)


@pytest.mark.parametrize("q8_isa", Q8_PATHS)
def test_one_call_step_applies_them_as_the_layers_do(q8_isa):
    models = [tiny_model("Q4_1", torch.bfloat16, "scalar") for _ in range(2)]
    for m in models:
        on_one_byte_cache(m, FP8, q8_isa)
        apply_key_scales(m, _random_scales(1))
    taken = count_graph_steps(models[0])
    models[1]._decode_graph = (models[1].kernels, None)
    got, want = (_prompts_then_decodes(m, FP8, Q8_BLOCK) for m in models)
    assert taken == [True] * 5
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def _model(skew: float) -> LlamaForCausalLM:
    """A random fp32 Llama whose queries are `skew` times larger and keys `skew` times smaller in
    a quarter of each head's channels than the plain weights give: the same scores, keys that
    fp8 rounds worse."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(ARCH, torch.float32).eval()
    d, q_size = ARCH.head_dim, ARCH.num_attention_heads * ARCH.head_dim
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.05 * torch.randn_like(p))
        for layer in model.layers:
            rows = layer.qkv_proj.view(-1, d, layer.qkv_proj.shape[1])  # [heads + 2 kv, D, hidden]
            rows[:ARCH.num_attention_heads, SKEWED] *= skew
            rows[q_size // d:q_size // d + ARCH.num_key_value_heads, SKEWED] /= skew
    model.pack_weights()
    return model


def _last_hidden(model, kv_dtype, ids):
    n, bs = len(ids), 16
    blocks = list(range(-(-n // bs)))
    caches = allocate_kv_caches(ARCH, len(blocks), bs, kv_dtype)
    meta = build_attention_metadata(np.array([n]), np.array([n]), [blocks], bs)
    model.kernels = model.kernels.with_kv_dtype(kv_dtype)  # as the runner chooses them
    with torch.no_grad():
        return model(torch.tensor(ids), torch.arange(n), caches, meta)


def test_calibrated_scales_undo_skewed_channels_and_cut_fp8_error():
    ids = np.random.default_rng(0).integers(0, ARCH.vocab_size, 200).tolist()
    exact = _last_hidden(_model(1), torch.float32, ids)
    floor = (_last_hidden(_model(1), FP8, ids) - exact).norm()  # fp8's error on the plain weights
    model = _model(16)
    assert torch.allclose(_last_hidden(model, torch.float32, ids), exact, rtol=1e-4, atol=1e-4)
    skewed = (_last_hidden(model, FP8, ids) - exact).norm()
    scales = calibrate_key_scales(model, ARCH)
    others = [c for c in range(ARCH.head_dim) if c not in SKEWED]
    for s in scales:
        assert (s[:, SKEWED].min(1).values >= 8 * s[:, others].max(1).values).all()
    apply_key_scales(model, scales)
    scaled = (_last_hidden(model, FP8, ids) - exact).norm()
    assert skewed > 1.25 * floor and scaled < 1.05 * floor, (floor, skewed, scaled)


def test_served_for_an_fp8_cache_only():
    model = tiny_model("Q8_0", torch.float32, "scalar")
    assert set_key_scales(model, ARCH, FP8)
    assert all(layer.attn.qk_scale is not None and layer.attn.qk_scale.shape == (
        (ARCH.num_attention_heads + ARCH.num_key_value_heads) * ARCH.head_dim,) for layer in model.layers)
    for kv_dtype in (torch.bfloat16, torch.int8):
        assert not set_key_scales(model, ARCH, kv_dtype)
        assert all(layer.attn.qk_scale is None for layer in model.layers)


def test_a_kv_transfer_compares_the_scales_its_blocks_were_stored_under():
    a, b = tiny_model("Q8_0", torch.float32, "scalar"), tiny_model("Q8_0", torch.float32, "scalar")
    assert key_scales_digest(a) == "none"
    set_key_scales(a, ARCH, FP8)
    set_key_scales(b, ARCH, FP8)
    assert key_scales_digest(a) == key_scales_digest(b) != "none"  # same weights, same scales
    apply_key_scales(b, _random_scales())
    assert key_scales_digest(b) not in (key_scales_digest(a), "none")


def test_gemma3_local_and_global_layers_keep_their_bits_too(tmp_path):
    """Gemma 3 (QK-norm, sliding-window and global layers) through an fp8-cache engine: every
    layer gets its scales; on a float cache, scales change no output bit."""
    from conftest_model_helpers import save_byte_tokenizer
    from window_model_helpers import save_tiny_gemma3

    from kvflow import LLM
    from kvflow.model.loader import load_model

    path = str(tmp_path)
    save_tiny_gemma3(path)
    save_byte_tokenizer(path)
    llm = LLM(path, dtype="float32", kv_cache_dtype="fp8", max_model_len=128, num_blocks=64,
              block_size=4, warmup=False)
    model = llm.engine.core.executor.runner.model
    assert type(model).__name__ == "Gemma3ForCausalLM"
    assert all(layer.attn.qk_scale is not None for layer in model.layers)
    plain, arch = load_model(path, torch.float32)
    scaled, _ = load_model(path, torch.float32)
    g = torch.Generator().manual_seed(3)
    apply_key_scales(scaled, [torch.exp2(torch.randint(-3, 4, (arch.num_key_value_heads, arch.head_dim),
                                                      generator=g).float())
                              for _ in range(arch.num_hidden_layers)])
    ids = list(range(5, 45))
    n, bs = len(ids), 4
    blocks = list(range(n // bs))
    outs = []
    for m in (plain, scaled):
        caches = allocate_kv_caches(arch, len(blocks), bs, torch.float32)
        meta = build_attention_metadata(np.array([n]), np.array([n]), [blocks], bs)
        with torch.no_grad():
            outs.append(m(torch.tensor(ids), torch.arange(n), caches, meta))
    assert torch.equal(outs[0], outs[1])
