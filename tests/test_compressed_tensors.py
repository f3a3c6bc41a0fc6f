"""compressed-tensors int8 W8A8 checkpoints: detected from config.json, served from their own
int8 values (nothing requantized), refused by name where the scheme or the setting is not one
kvflow runs; tiny Llama-3 (untied, float LM head) and Qwen2 (biases, tied) checkpoints written
the way llm-compressor writes them, against kvflow's float model on the dequantised weights."""
from __future__ import annotations

import copy
import json
import os

import numpy as np
import pytest
import torch

from kvflow.checkpoint.compressed_tensors import SUPPORTED, check_scheme, is_quantized
from kvflow.model.quant.compressed_tensors_export import quantization_config, quantize_channelwise
from kvflow.model.quant.load import resolve_quantization


def _folder(tmp_path, qc: dict | None, name: str = "m") -> str:
    path = tmp_path / name
    path.mkdir()
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}
    if qc is not None:
        config["quantization_config"] = qc
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def test_detected_from_config_json_and_conflicts_refused(tmp_path):
    ct = _folder(tmp_path, quantization_config(["lm_head"]), "ct")
    plain = _folder(tmp_path, None, "plain")
    assert resolve_quantization(None, ct) == "compressed-tensors"
    assert resolve_quantization("compressed-tensors", ct) == "compressed-tensors"
    for other in ("int8", "none", "gguf"):  # as vLLM: the checkpoint's method wins, or a refusal
        with pytest.raises(ValueError, match=r"model config \(compressed-tensors\) does not match"):
            resolve_quantization(other, ct)
    with pytest.raises(ValueError, match="needs an HF folder whose config.json"):
        resolve_quantization("compressed-tensors", plain)
    with pytest.raises(ValueError, match="tensor_parallel_size 1"):
        resolve_quantization(None, ct, tp_size=2)
    with pytest.raises(ValueError, match="CPU only"):
        resolve_quantization(None, ct, on_gpu=True)
    awq = _folder(tmp_path, {"quant_method": "awq", "bits": 4}, "awq")
    with pytest.raises(ValueError, match="quant_method 'awq' is not supported.*int8 W8A8 only"):
        resolve_quantization(None, awq)


def _group(qc: dict) -> dict:
    return qc["config_groups"]["group_0"]


def _weights(**kw):
    return lambda qc: _group(qc)["weights"].update(kw)


def _acts(**kw):
    return lambda qc: _group(qc)["input_activations"].update(kw)


REFUSED = {
    "static activation scales": (_acts(dynamic=False, strategy="tensor"), "dynamic False"),
    "asymmetric weights": (_weights(symmetric=False), "symmetric False"),
    "group strategy": (_weights(strategy="group", group_size=128), "strategy 'group'"),
    "block strategy": (_weights(strategy="block", block_structure=[128, 128]), "strategy 'block'"),
    "4-bit weights": (_weights(num_bits=4), "num_bits 4"),
    "fp8": (lambda qc: (_weights(type="float")(qc), _acts(type="float")(qc)), "type 'float'"),
    "packed 4-bit format": (lambda qc: qc.update(format="pack-quantized"), "format 'pack-quantized'"),
    "fp8 format": (lambda qc: qc.update(format="float-quantized"), "format 'float-quantized'"),
    "sparse": (lambda qc: qc.update(sparsity_config={"format": "sparse-24-bitmask"}), "sparsity_config"),
    "weight-only": (lambda qc: _group(qc).update(input_activations=None), "weight-only"),
    "kv cache": (lambda qc: qc.update(kv_cache_scheme={"num_bits": 8}), "kv_cache_scheme"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_schemes_kvflow_does_not_run_are_refused_by_name(tmp_path, case):
    change, says = REFUSED[case]
    qc = copy.deepcopy(quantization_config(["lm_head"]))
    check_scheme(qc)  # the W8A8 preset itself runs
    change(qc)
    with pytest.raises(ValueError, match="is not supported") as e:
        check_scheme(qc)
    assert says in str(e.value) and SUPPORTED in str(e.value)
    # and the engine refuses it before loading anything
    with pytest.raises(ValueError, match=says.replace("(", r"\(").replace(")", r"\)")):
        resolve_quantization(None, _folder(tmp_path, qc))


def test_targets_and_ignore_follow_compressed_tensors_matching():
    qc = quantization_config(["lm_head", "re:.*layers\\.1\\..*", "model.layers.0.mlp.down_proj"])
    assert is_quantized("model.layers.0.self_attn.q_proj", qc)
    assert not is_quantized("model.layers.0.mlp.down_proj", qc)
    assert not is_quantized("model.layers.1.self_attn.q_proj", qc)
    assert not is_quantized("lm_head", qc)
    qc["config_groups"]["group_0"]["targets"] = ["re:.*self_attn.*"]
    assert is_quantized("model.layers.0.self_attn.o_proj", qc)
    assert not is_quantized("model.layers.0.mlp.up_proj", qc)


def test_channelwise_quantization_as_compressed_tensors_rounds():
    w = torch.tensor([[0.5, -1.0, 0.25, 0.0], [0.0, 0.0, 0.0, 0.0], [2.0, -2.0, 1.0, 0.01]])
    q, scale = quantize_channelwise(w)
    assert q.dtype == torch.int8 and scale.shape == (3, 1)
    assert torch.equal(scale[:, 0], torch.tensor([1.0, 0.0, 2.0]) / 127.5)
    # the largest magnitude lands near +-127.5: -127 or -128, 127 (128 clamped); compressed-
    # tensors 0.17 gives these bytes for this tensor (and the same as kvflow's on random
    # fp32/bf16/fp16 weights, checked once by hand)
    assert q[0].tolist() == [64, -127, 32, 0] and q[1].tolist() == [0, 0, 0, 0]
    assert q[2].tolist() == [127, -127, 64, 1]
    g = torch.Generator().manual_seed(0)
    q, _ = quantize_channelwise(torch.randn(64, 96, generator=g))
    assert int(q.min()) == -128 and int(q.max()) == 127 and (q.abs() == 128).sum() < 64


def _dequantised_folder(ct: str, dst: str) -> str:
    """The checkpoint's weights as floats (scale * q), as a plain HF folder."""
    from safetensors.torch import save_file

    from kvflow.checkpoint.compressed_tensors import dequantized, read_raw

    os.makedirs(dst)
    with open(os.path.join(ct, "config.json")) as f:
        config = json.load(f)
    del config["quantization_config"]
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f)
    save_file(dequantized(read_raw(ct), torch.float32), os.path.join(dst, "model.safetensors"))
    return dst


@pytest.mark.slow
@pytest.mark.parametrize("arch,dtype", [("llama3", torch.bfloat16), ("qwen2", torch.float32)])
def test_checkpoint_served_from_its_own_int8_values(tmp_path, arch, dtype):
    """bf16 scales (what llm-compressor writes for a bf16 model) are held exactly; fp32 ones
    to fp16's 11 bits."""
    import conftest_model_helpers as helpers
    from test_quantized_model import _agreement_and_kl, _logits

    from kvflow.model.loader import load_model
    from kvflow.checkpoint.compressed_tensors import read_raw
    from kvflow.model.quant.compressed_tensors_export import export
    from kvflow.model.quant.packing import dequantize_rows

    src = getattr(helpers, f"save_tiny_{arch}")(str(tmp_path / "float"))
    ct = export(src, str(tmp_path / "ct"), dtype=dtype)
    raw = read_raw(ct)
    assert raw["model.layers.0.self_attn.q_proj.weight"].dtype == torch.int8
    assert "lm_head.weight_scale" not in raw
    with pytest.raises(ValueError, match="does not match"):  # never read as floats by mistake
        load_model(ct, torch.float32)
    model, _ = load_model(ct, torch.float32, quantization="compressed-tensors")
    # the panels hold the checkpoint's values: [q; k; v] rows are scale * q exactly
    qkv = model.layers[1].packed["qkv_proj"].quant
    assert qkv.source == "compressed-tensors" and qkv.per_row
    p = "model.layers.1.self_attn."
    want = torch.cat([raw[p + f"{x}_proj.weight"].float() * raw[p + f"{x}_proj.weight_scale"].float()
                      for x in "qkv"])
    got = dequantize_rows("q8", qkv.packed, qkv.kb * 32, torch.arange(qkv.n), torch.float32)[:, :qkv.k]
    if dtype == torch.bfloat16:
        assert torch.equal(got, want)
    else:
        assert ((got - want).abs() <= want.abs() * 2.0**-11).all()
    assert (want.abs() > 0).any() and int(raw[p + "q_proj.weight"].min()) == -128
    # the LM head is ignored in the checkpoint: float, as stored; the embedding is never int8
    assert model.packed_lm_head is None or model.packed_lm_head.quant is None
    assert model.quantized_embedding is None
    # against the float model on the dequantised weights (the difference: int8 activations)
    ref, _ = load_model(_dequantised_folder(ct, str(tmp_path / "deq")), torch.float32)
    ids = list(np.random.default_rng(1).integers(0, 320, 64))
    agree, kl = _agreement_and_kl(_logits(ref, ids), _logits(model, ids))
    assert agree >= 0.9 and kl < 0.01, (agree, kl)


@pytest.mark.slow
def test_llm_detects_the_checkpoint_and_generates(tmp_path):
    """Through the engine: the default quantization is the checkpoint's, an explicit other one
    is refused, and each greedy token is within the top 3 of the float model on the
    dequantised weights (teacher-forced on the generated sequence)."""
    from conftest_model_helpers import save_byte_tokenizer, save_tiny_llama3
    from test_quantized_model import _logits

    from kvflow import LLM, SamplingParams
    from kvflow.model.loader import load_model
    from kvflow.model.quant.compressed_tensors_export import export

    src = save_tiny_llama3(str(tmp_path / "float"))
    save_byte_tokenizer(src)
    ct = export(src, str(tmp_path / "ct"))
    with pytest.raises(ValueError, match="does not match"):
        LLM(model=ct, quantization="int8", num_blocks=16)
    llm = LLM(model=ct, max_num_seqs=2, num_blocks=16, dtype="float32")
    model = llm.engine.core.executor.runner.model
    assert model.layers[0].packed["o_proj"].quant.source == "compressed-tensors"
    assert "linear=quant-" in llm.engine.core.startup_report()
    out = llm.generate(["hello world"], SamplingParams(max_tokens=8, temperature=0.0),
                       use_tqdm=False)[0]
    tokens = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
    assert len(out.outputs[0].token_ids) == 8
    ref, _ = load_model(_dequantised_folder(ct, str(tmp_path / "deq")), torch.float32)
    logits = _logits(ref, tokens)
    n = len(out.prompt_token_ids)
    for i, t in enumerate(out.outputs[0].token_ids):
        assert t in logits[n - 1 + i].topk(3).indices.tolist(), (i, t)
