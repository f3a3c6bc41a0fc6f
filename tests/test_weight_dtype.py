"""`weight_dtype`: an fp32 model on the CPU keeps its decode GEMV's weights in bf16 or fp16 and
computes exactly what the fp32 model computes on those weights; combinations that would lose
bits or mean nothing are refused."""
from __future__ import annotations

import pytest
import torch

from conftest_model_helpers import PagedDriver, hf_logits, save_tiny_llama3
from kvflow.config import ModelConfig
from kvflow.csrc import library
from kvflow.model.loader import load_model
from kvflow.model.weight_dtype import check_checkpoint, round_weights, storage_dtype

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16


def test_auto_and_float32_keep_fp32_panels():
    assert storage_dtype("auto", F32) is None
    assert storage_dtype("float32", F32) is None
    assert storage_dtype("bfloat16", F32) is BF16
    assert storage_dtype("float16", F32) is F16
    assert storage_dtype("bfloat16", BF16) is None  # a bf16 model stores bf16 already


@pytest.mark.parametrize("name,dtype,kwargs,match", [
    ("float16", BF16, {}, "fp32 model on the CPU"),
    ("float32", BF16, {}, "needs dtype float32"),
    ("bfloat16", F32, {"on_cpu": False}, "fp32 model on the CPU"),
    ("bfloat16", F32, {"quantization": "gguf"}, "quantization none"),
    ("float16", F32, {"tp_size": 2}, "tensor parallelism"),
])
def test_senseless_combinations_are_refused(name, dtype, kwargs, match):
    with pytest.raises(ValueError, match=match):
        storage_dtype(name, dtype, **kwargs)


def test_the_option_is_validated_where_it_is_declared():
    assert ModelConfig(weight_dtype="bfloat16").weight_dtype == "bfloat16"
    for name in ("bf8", "int8"):
        with pytest.raises(ValueError, match="weight_dtype must be one of"):
            ModelConfig(weight_dtype=name)


def test_rounding_changes_only_values_the_storage_cannot_hold():
    exact = torch.randn(8, 16).to(BF16).float()
    weights = {"w": exact.clone(), "norm": torch.randn(16), "x": torch.randn(4, 4)}
    norm = weights["norm"].clone()
    changed = round_weights(weights, BF16)
    assert torch.equal(weights["w"], exact)  # bf16 values: untouched
    assert torch.equal(weights["norm"], norm)  # 1-D norms stay fp32
    assert torch.equal(weights["x"], weights["x"].to(BF16).float())
    assert 0 < changed <= 16


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory):
    """A tiny Llama whose checkpoint is stored in bf16 (as most HF checkpoints are)."""
    from safetensors.torch import load_file, save_file

    path = save_tiny_llama3(str(tmp_path_factory.mktemp("bf16-llama")), seed=3)
    f = f"{path}/model.safetensors"
    save_file({k: v.to(BF16) for k, v in load_file(f).items()}, f, metadata={"format": "pt"})
    return path


def test_a_bf16_checkpoint_stored_as_fp16_is_refused(bf16_checkpoint):
    assert check_checkpoint(bf16_checkpoint, BF16)  # all bf16: nothing to round
    with pytest.raises(ValueError, match="lose bits of this bfloat16 checkpoint"):
        check_checkpoint(bf16_checkpoint, F16)


def _run(model, arch):
    """Logits of a prefill, then decode steps of 1, 3 and 8 rows (the GEMV), then a step of 12
    rows (oneDNN), through the paged cache."""
    driver = PagedDriver(model, arch, num_blocks=128, seed=1)
    ids = [[5 + 7 * i + j for j in range(9)] for i in range(12)]
    out = [driver.step([(f"s{i}", ids[i]) for i in range(12)])]
    for rows in (1, 3, 8, 12):
        out.append(driver.step([(f"s{i}", [11 + i]) for i in range(rows)]))
    return [torch.cat(list(step.values())) for step in out]


@pytest.mark.slow
@pytest.mark.skipif(library() is None, reason="no C compiler")
@pytest.mark.parametrize("isa", [None, "avx2"])
def test_bf16_storage_of_a_bf16_checkpoint_is_the_fp32_model_bit_for_bit(bf16_checkpoint, isa,
                                                                       monkeypatch):
    """Same weight values (a bf16 checkpoint's, widened exactly), same fp32 arithmetic in the
    same order: the logits are equal bit for bit at every batch size, on the widest GEMV path
    and with AVX2 forced. They also follow HF's fp32 forward of the same checkpoint."""
    if isa is not None:
        monkeypatch.setenv("KVFLOW_GEMV_ISA", isa)
    full, arch = load_model(bf16_checkpoint, F32)
    half, _ = load_model(bf16_checkpoint, F32, weight_dtype=BF16)
    assert "gemv" in full.kernels.names["linear"] and "-bf16" not in full.kernels.names["linear"]
    assert "-bf16" in half.kernels.names["linear"]
    if isa is not None:  # AVX2's GEMV serves every batch (no "+onednn" after it)
        assert half.kernels.names["linear"] == "gemv-avx2-bf16"
    packed = half.layers[0].packed["qkv_proj"]
    assert packed.gemv.dtype == BF16 and full.layers[0].packed["qkv_proj"].gemv.dtype == F32
    for a, b in zip(_run(full, arch), _run(half, arch)):
        assert torch.equal(a, b)
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(bf16_checkpoint, dtype=F32)
    driver = PagedDriver(half, arch, seed=2)
    tokens = [3, 14, 15, 92, 65, 35]
    got = driver.step([("a", tokens)])["a"]
    torch.testing.assert_close(got, hf_logits(hf, tokens), rtol=1e-4, atol=1e-4)
