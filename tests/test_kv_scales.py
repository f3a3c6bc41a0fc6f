"""An fp8 KV cache at a checkpoint's per-layer scales (model/kv_scales.py): the tensor names read
(llm-compressor's, ModelOpt's, AutoFP8's, the old kv_scale), what is refused, every C kernel
path at a scale other than 1.0 against PyTorch, and the engine: a model whose K/V are 2^-10 the
size, with scales 2^-10 in its checkpoint, stores the bytes the unshrunk model stores at scale 1.0
and so serves its exact tokens; without the scales its fp8 cache loses the keys and values."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from kvflow.csrc import library
from kvflow import attention as A
from kvflow.attention import c_kernels
from kvflow.model.cpu_features import cpu_features
from kvflow.attention.kv_layout import FP8, cache_shape, read_rows, write_rows
from kvflow.model.kv_scales import read_kv_scales, scale_tensor_layer

SCALES = (0.0123, 0.0071)  # not powers of two: the divisions and products round


@pytest.mark.parametrize("name,want", [
    ("model.layers.3.self_attn.k_scale", (3, "k")),             # llm-compressor, ModelOpt
    ("model.layers.0.self_attn.v_scale", (0, "v")),
    ("model.layers.12.self_attn.kv_scale", (12, "kv")),         # one scale for both (older)
    ("model.layers.2.self_attn.k_proj.output_scale", (2, "k")),  # AutoFP8, Quark
    ("model.layers.2.self_attn.v_proj.v_scale", (2, "v")),       # ModelOpt
    ("model.layers.1.self_attn.attn.k_scale", (1, "k")),
    ("model.language_model.layers.4.self_attn.v_scale", (4, "v")),
    ("model.layers.1.self_attn.q_scale", None), ("model.layers.1.self_attn.k_proj.weight_scale", None),
    ("model.layers.1.mlp.down_proj.output_scale", None), ("lm_head.k_scale", None),
])
def test_scale_tensor_names(name, want):
    assert scale_tensor_layer(name) == want


def test_scales_per_layer_per_head_and_missing():
    t = torch.tensor
    got = read_kv_scales({"model.layers.0.self_attn.k_scale": t(0.5),
                          "model.layers.0.self_attn.v_scale": t([0.25]),
                          "model.layers.1.self_attn.kv_scale": t(2.0),
                          # per kv head: served at the largest
                          "model.layers.2.self_attn.k_proj.output_scale": t([0.1, 0.3]),
                          "model.layers.2.self_attn.v_proj.output_scale": t([0.2, 0.05]),
                          "model.layers.0.self_attn.q_proj.weight": torch.ones(4, 4)},
                         num_layers=4, num_kv_heads=2)
    assert got == [(0.5, 0.25), (2.0, 2.0), (pytest.approx(0.3), pytest.approx(0.2)), (1.0, 1.0)]
    assert read_kv_scales({"model.layers.0.mlp.up_proj.weight": t(1.0)}, 2, 2) is None


@pytest.mark.parametrize("tensor,message", [
    (torch.tensor([0.1, 0.2, 0.3]), "one per tensor or one per kv head"),
    (torch.tensor(0.0), "finite and > 0"), (torch.tensor(-1.0), "finite and > 0"),
    (torch.tensor(float("nan")), "finite and > 0"), (torch.tensor(float("inf")), "finite and > 0"),
])
def test_a_bad_scale_is_refused_by_name(tensor, message):
    with pytest.raises(ValueError, match=message) as e:
        read_kv_scales({"model.layers.1.self_attn.k_scale": tensor}, 2, 2)
    assert "model.layers.1.self_attn.k_scale" in str(e.value)
    with pytest.raises(ValueError, match="has 2 layers"):
        read_kv_scales({"model.layers.2.self_attn.k_scale": torch.tensor(1.0)}, 2, 2)


def test_compressed_tensors_kv_cache_scheme():
    from kvflow.checkpoint.compressed_tensors import check_kv_cache_scheme
    check_kv_cache_scheme({"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False,
                           "strategy": "tensor"})
    check_kv_cache_scheme({"num_bits": 8, "type": "float", "strategy": "attn_head"})
    for bad, what in (({"num_bits": 8, "type": "int"}, "type 'int'"),
                      ({"num_bits": 4, "type": "float"}, "num_bits 4"),
                      ({"num_bits": 8, "type": "float", "dynamic": True}, "dynamic"),
                      ({"num_bits": 8, "type": "float", "strategy": "channel"}, "strategy"),
                      ({"num_bits": 8, "type": "float", "symmetric": False}, "asymmetric")):
        with pytest.raises(ValueError, match=what):
            check_kv_cache_scheme(bad)


# -- the C kernels at scales other than 1.0 -------------------------------------------------
pytest_c = pytest.mark.skipif(library() is None, reason="no C compiler")


def _cache(tables, seq_lens, kv_heads=2, head_dim=64, bs=16, nb=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    caches = [torch.zeros(cache_shape(nb, bs, kv_heads, head_dim, FP8), dtype=FP8) for _ in range(2)]
    slots = torch.tensor([t[i // bs] * bs + i % bs for t, n in zip(tables, seq_lens) for i in range(n)])
    # values of ~0.01-0.05: at scale 1.0 e4m3 would hold many as subnormals
    k = torch.randn(len(slots), kv_heads, head_dim, generator=g) * 0.05
    v = torch.randn(len(slots), kv_heads, head_dim, generator=g) * 0.02
    write_rows(*caches, k, v, slots, SCALES)
    return caches, slots


@pytest_c
@pytest.mark.parametrize("src", [torch.float32, torch.bfloat16])
def test_c_writer_stores_what_write_rows_stores_at_the_scales(src):
    t, kvh, d, bs = 9, 2, 64, 16
    x = (torch.randn(t, 2, kvh, d) * 0.05).to(src)
    x[0, 0, 0, :4] = torch.tensor([0.0, 1e-5, 7.0, -6.0])  # zero, a subnormal, saturation both ways
    slots = torch.from_numpy(np.random.default_rng(1).permutation(4 * bs)[:t].copy())
    got = [torch.zeros(cache_shape(4, bs, kvh, d, FP8), dtype=FP8) for _ in range(2)]
    want = [torch.zeros_like(got[0]) for _ in range(2)]
    A.write_kv_with_kernel(*got, x[:, 0], x[:, 1], slots, SCALES)
    write_rows(*want, x[:, 0], x[:, 1], slots, SCALES)
    for g, w in zip(got, want):
        assert torch.equal(g.view(torch.uint8), w.view(torch.uint8))
    # the scales are used: at 1.0 the bytes differ
    A.write_kv_with_kernel(*got, x[:, 0], x[:, 1], slots)
    assert not torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8))


@pytest_c
def test_decode_kernel_reads_at_the_scales_on_every_path(monkeypatch):
    from test_kv_cache_quant import _isas_here
    monkeypatch.setattr(c_kernels, "MIN_PARALLEL_HEAD_KEYS", 0)
    seq_lens, tables = [1, 17, 40], [[4, 0], [7, 2], [1, 9, 5]]
    (kc, vc), _ = _cache(tables, seq_lens)
    meta = A.build_attention_metadata(np.ones(3, dtype=np.int64), np.array(seq_lens), tables, 16)
    q = torch.randn(3, 6, 64) * 8
    want = torch.empty(q.shape)
    for i, n in enumerate(seq_lens):
        slots = torch.tensor([tables[i][t // 16] * 16 + t % 16 for t in range(n)])
        k, v = (x.repeat_interleave(3, 1) for x in read_rows(kc, vc, slots, SCALES))
        p = torch.einsum("hd,thd->ht", q[i], k).mul(0.125).softmax(-1)
        want[i] = torch.einsum("ht,thd->hd", p, v)
    for isa in _isas_here():
        got = torch.full(q.shape, float("nan"))
        assert A.decode_with_kernel(q, kc, vc, meta, 0.125, got, q8_isa=isa, kv_scales=SCALES)
        if isa == "avx512-bf16":  # the query and the weights rounded to bf16 (2^-9)
            err = (got - want).abs() / want.abs().amax()
            assert err.max() < 5e-3 and err.mean() < 5e-4, (float(err.max()), float(err.mean()))
            continue
        torch.testing.assert_close(got, want, atol=2e-6, rtol=2e-5, msg=isa)


@pytest_c
@pytest.mark.parametrize("amx", [False, True], ids=["avx512-bf16", "amx"])
def test_prompt_kernel_widens_at_the_scales(amx):
    """The prompt kernel over the fp8 cache gives what it gives over a bf16 cache holding the
    values read_rows dequantizes at the same scales (K's and V's differ)."""
    lib = library()
    if not lib.paged_prefill_bf16_supported(6, 2, 64, 16):
        pytest.skip("the prompt kernel needs AVX512-BF16")
    if amx and not lib.prefill_amx_available():
        pytest.skip("no AMX here (or Linux did not grant its tiles)")
    query_lens, seq_lens, tables = np.array([40, 9]), [40, 50], [[3, 0, 5], [1, 6, 2, 4]]
    (kc, vc), slots = _cache(tables, seq_lens, seed=5)
    wide = [torch.zeros(cache_shape(12, 16, 2, 64, torch.bfloat16), dtype=torch.bfloat16)
            for _ in range(2)]
    write_rows(*wide, *read_rows(kc, vc, slots, SCALES), slots)
    meta = A.build_attention_metadata(query_lens, np.array(seq_lens), tables, 16)
    q = (torch.randn(int(query_lens.sum()), 6, 64) * 8).bfloat16()
    got, want = torch.empty(q.shape), torch.empty(q.shape)
    assert A.prefill_with_kernel(q, kc, vc, meta, 0.125, got, amx=amx, kv_scales=SCALES)
    assert A.prefill_with_kernel(q, *wide, meta, 0.125, want, amx=amx)
    assert torch.equal(got, want)


@pytest_c
def test_mixed_step_through_the_kernels_matches_the_torch_path_at_the_scales():
    query_lens, seq_lens = np.array([20, 7, 1]), np.array([20, 40, 33])
    tables = [[0, 1], [2, 3, 4], [6, 7, 8]]
    ctx_lens = [int(n - q) for n, q in zip(seq_lens, query_lens)]
    (kc, vc), _ = _cache(tables, ctx_lens)
    meta = A.build_attention_metadata(query_lens, seq_lens, tables, 16)
    k, v = torch.randn(28, 2, 64) * 0.05, torch.randn(28, 2, 64) * 0.02
    A.write_kv_with_kernel(kc, vc, k, v, meta.slot_mapping, SCALES)
    q = torch.randn(28, 6, 64) * 8
    want = A.attention_with_sdpa(q, kc, vc, meta, 0.125, 2, kv_scales=SCALES)
    here = A.best_q8_isa(cpu_features(), FP8)
    got = A.attention_with_kernels(q, kc, vc, meta, 0.125, 2, k, v, prompt_kernel=False,
                                   q8_isa=here, kv_scales=SCALES)
    if here == "avx512-bf16":  # bf16 query and weights (2^-9)
        err = (got - want).abs() / want.abs().amax()
        assert err.max() < 5e-3 and err.mean() < 5e-4, (float(err.max()), float(err.mean()))
    else:
        torch.testing.assert_close(got, want, atol=2e-6, rtol=2e-5)
    # and the scales matter: read at 1.0 the output is another
    other = A.attention_with_sdpa(q, kc, vc, meta, 0.125, 2)
    assert not torch.allclose(other, want, atol=1e-3)


# -- the engine -----------------------------------------------------------------------------
SHRINK = 2.0 ** -10


def _tiny_llama(path: str, shrink: float | None, scales: bool) -> str:
    """The tiny Llama; with `shrink`, k_proj and v_proj times it and q_proj and o_proj over it
    (exact in fp32: the same model, its K/V 2^-10 the size), and, with `scales`, k_scale and
    v_scale = shrink per layer (llm-compressor's names) and a compressed-tensors KV-only
    quantization_config, as such a checkpoint has."""
    from safetensors.torch import load_file, save_file

    from conftest_model_helpers import save_byte_tokenizer, save_tiny_llama3

    save_tiny_llama3(path)
    save_byte_tokenizer(path)
    if shrink is None:
        return path
    file = os.path.join(path, "model.safetensors")
    w = load_file(file)
    for name in list(w):
        if name.endswith(("k_proj.weight", "v_proj.weight")):
            w[name] = w[name] * shrink
        elif name.endswith(("q_proj.weight", "o_proj.weight")):
            w[name] = w[name] / shrink
    if scales:
        for i in range(3):
            w[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(shrink)
            w[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(shrink)
        with open(os.path.join(path, "config.json")) as f:
            config = json.load(f)
        config["quantization_config"] = {
            "quant_method": "compressed-tensors", "format": "dense", "config_groups": {},
            "kv_cache_scheme": {"num_bits": 8, "type": "float", "symmetric": True,
                                "dynamic": False, "strategy": "tensor"}}
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(config, f)
    save_file(w, file, metadata={"format": "pt"})
    return path


@pytest.mark.parametrize("kernels", ["c", "torch"])
def test_checkpoint_scales_serve_the_unshrunk_models_tokens(tmp_path, kernels, monkeypatch):
    from kvflow import LLM, SamplingParams

    if kernels == "torch":
        monkeypatch.setenv("KVFLOW_NO_KERNELS", "1")
    elif library() is None:
        pytest.skip("no C compiler")
    prompts = [[5 + (i * 37 + n) % 290 for i in range(n)] for n in (9, 21, 40)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=1)
    outs = {}
    for label, shrink, scales in (("plain", None, False), ("scaled", SHRINK, True),
                                  ("no-scales", SHRINK, False)):
        path = _tiny_llama(str(tmp_path / label), shrink, scales)
        llm = LLM(path, dtype="float32", kv_cache_dtype="fp8", max_model_len=128, num_blocks=64,
                  block_size=16, max_num_batched_tokens=16, warmup=False)
        layers = llm.engine.core.executor.runner.model.layers
        assert [layer.attn.kv_scales for layer in layers] == [(shrink, shrink) if scales else (1.0, 1.0)] * 3
        outs[label] = llm.generate(prompts, params, use_tqdm=False)
        llm.engine.shutdown()

    def tokens(label):
        return [o.outputs[0].token_ids for o in outs[label]]

    def logprobs(label):
        return np.array([[lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]
                         for o in outs[label]])

    assert tokens("scaled") == tokens("plain")
    np.testing.assert_allclose(logprobs("scaled"), logprobs("plain"), atol=1e-4)
    # at scale 1.0 the shrunk K/V fall into e4m3's subnormals and below: another model
    assert tokens("no-scales") != tokens("plain")


@pytest.mark.skipif(library() is None, reason="no C compiler")
def test_w8a8_checkpoint_with_an_fp8_kv_cache_scheme(tmp_path):
    """llm-compressor's W8A8 + fp8 KV recipe: int8 weights served from their own values and the
    layers' k_scale / v_scale read, per kv head here (served at each layer's largest)."""
    from safetensors.torch import load_file, save_file

    from conftest_model_helpers import save_tiny_llama3
    from kvflow.model.loader import load_model
    from kvflow.model.quant.compressed_tensors_export import export

    ct = export(save_tiny_llama3(str(tmp_path / "float")), str(tmp_path / "ct"))
    with open(os.path.join(ct, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"]["kv_cache_scheme"] = {
        "num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "strategy": "attn_head"}
    with open(os.path.join(ct, "config.json"), "w") as f:
        json.dump(config, f)
    file = os.path.join(ct, "model.safetensors")
    w = load_file(file)
    for i in range(3):
        w[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor([0.01, 0.02 * (i + 1)])
        w[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor([0.003, 0.001])
    save_file(w, file, metadata={"format": "pt"})
    model, _ = load_model(ct, torch.float32, quantization="compressed-tensors")
    assert model.layers[0].packed["qkv_proj"].quant.source == "compressed-tensors"
    assert [layer.attn.kv_scales for layer in model.layers] == [
        (pytest.approx(0.02 * (i + 1)), pytest.approx(0.003)) for i in range(3)]
    config["quantization_config"]["kv_cache_scheme"]["type"] = "int"
    with open(os.path.join(ct, "config.json"), "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match="kv_cache_scheme"):
        load_model(ct, torch.float32, quantization="compressed-tensors")
