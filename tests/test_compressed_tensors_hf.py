"""kvflow's compressed-tensors int8 W8A8 path against Hugging Face's own reference: transformers
with the `compressed-tensors` package loads the folder that compressed_tensors_export.py writes
(a tiny random Llama-3, bf16 scales) and simulates W8A8 on floats (weights dequantised on the
first forward, each Linear's input quantized and dequantised per token on the fly). kvflow serves the same
folder from its int8 values through the int8 GEMM.

The two differ in one known place: the per-token activation scale. compressed-tensors takes
max|x| / 127.5 (half its 256-value range) and clamps to -128..127; kvflow's kernels take
max|x| / 127 and clamp to -127..127 (as vLLM's CPU W8A8 does). Each rounds an element to within
half its step of x, so the two quantized inputs differ by at most (m/127.5 + m/127) / 2 ~ m/127
an element: the same size as either's distance from x, and independent of it. So kvflow's
logits should sit from HF's W8A8 about sqrt(2) times as far as HF's W8A8 sits from the float
model (KL, which grows with the square of a logit error, about 2x); the bounds below allow twice
that (measured over four seeds: 1.04-1.40x in max |logit| difference, 1.6-2.0x in mean KL).
With kvflow's rule put into HF's modules instead, the two agree to fp32 summation order, except
where a one-ulp difference in a normed input moves an element across a rounding boundary."""
from __future__ import annotations

import numpy as np
import pytest
import torch

T = 48  # tokens per teacher-forced forward
PROJECTIONS = {"qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
               "o_proj": ("self_attn.o_proj",), "gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
               "down_proj": ("mlp.down_proj",)}


def _kvflow_activation_rule(module, args):
    """The input as kvflow's kernels quantize it (gemm_quant.c's quant_block_scalar, one scale
    per row): q = round-half-even(x * (127 / max|x|)) clamped to -127..127, times max|x| / 127."""
    x = args[0]
    amax = x.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    return (torch.round(x * inv).clamp(-127, 127) * (amax / 127.0),)


def _stats(ref: torch.Tensor, got: torch.Tensor) -> dict:
    p, q = torch.log_softmax(ref, -1), torch.log_softmax(got, -1)
    return {"max_diff": (ref - got).abs().max().item(),
            "row_diff": (ref - got).abs().amax(-1),
            "kl": (p.exp() * (p - q)).sum(-1).mean().item(),
            "agree": (ref.argmax(-1) == got.argmax(-1)).float().mean().item()}


@pytest.mark.slow
def test_w8a8_checkpoint_against_hugging_face_compressed_tensors(tmp_path):
    from compressed_tensors.quantization import disable_quantization
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp
    from conftest_model_helpers import save_tiny_llama3
    from test_quantized_model import _logits
    from transformers import AutoModelForCausalLM

    from kvflow.model.loader import load_model
    from kvflow.model.quant.compressed_tensors_export import export
    from kvflow.model.quant.packing import dequantize_rows
    from kvflow.model.quant.qlinear import NEVER, widen_from
    ct = export(save_tiny_llama3(str(tmp_path / "float")), str(tmp_path / "ct"), dtype=torch.bfloat16)
    hf = AutoModelForCausalLM.from_pretrained(ct, dtype=torch.float32).eval()
    model, _ = load_model(ct, torch.float32, quantization="compressed-tensors")
    qkv = model.layers[0].packed["qkv_proj"].quant  # fp32 rows are never widened to floats:
    assert widen_from(qkv.kind, qkv.k, qkv.isa, False) == NEVER  # all run as W8A8
    quantized = [m for m in hf.modules() if getattr(m, "quantization_scheme", None) is not None]
    assert len(quantized) == 3 * 7 and hf.lm_head not in quantized  # the LM head is ignored

    # the known difference, as compressed-tensors states it: per-token scale max|x| / 127.5
    x = torch.randn(1, 3, 64)  # [batch, tokens, hidden], as the Linear sees it
    args = quantized[0].quantization_scheme.input_activations
    scale, _ = compute_dynamic_scales_and_zp(x, args, quantized[0])
    assert torch.allclose(scale.flatten(), x.abs().amax(-1) / 127.5, rtol=1e-6)

    rng = np.random.default_rng(0)
    seqs = [[int(t) for t in rng.integers(0, 320, T)] for _ in range(4)]

    def hf_logits() -> torch.Tensor:
        with torch.no_grad():
            return torch.cat([hf(torch.tensor([s])).logits[0] for s in seqs])

    hf_w8a8 = hf_logits()
    # the weights HF dequantised on that first forward (scale * q, in fp32) are kvflow's panels' values bit for bit
    for i, layer in enumerate(model.layers):
        for name, parts in PROJECTIONS.items():
            w = layer.packed[name].quant
            got = dequantize_rows("q8", w.packed, w.kb * 32, torch.arange(w.n), torch.float32)[:, : w.k]
            want = torch.cat([hf.get_submodule(f"model.layers.{i}.{p}").weight.data for p in parts])
            assert want.dtype == torch.float32 and torch.equal(got, want), (i, name)

    for m in quantized:
        disable_quantization(m)
    hf_float = hf_logits()  # the float model on the dequantised weights
    hooks = [m.register_forward_pre_hook(_kvflow_activation_rule) for m in quantized]
    hf_kvflow_rule = hf_logits()
    for h in hooks:
        h.remove()
    ours = torch.cat([_logits(model, s) for s in seqs])

    # HF's modules with kvflow's rounding: the same numbers but for rare rounding-boundary flips
    same = _stats(hf_kvflow_rule, ours)
    ref = _stats(hf_w8a8, hf_float)  # what one activation rounding costs, HF's own
    vs_hf = _stats(hf_w8a8, ours)
    assert same["row_diff"].median().item() < 1e-5, same
    assert same["kl"] <= 0.1 * vs_hf["kl"], (same, vs_hf)
    # HF's W8A8 as it is: within the bounds the two rounding rules allow (module docstring)
    assert ref["max_diff"] > 0 and ref["kl"] > 0  # HF did quantize the activations
    assert vs_hf["max_diff"] <= 2 * ref["max_diff"], (vs_hf, ref)
    assert vs_hf["kl"] <= 4 * ref["kl"], (vs_hf, ref)
    assert vs_hf["agree"] >= 0.95, vs_hf
    top3 = hf_w8a8.topk(3, dim=-1).indices
    assert (top3 == ours.argmax(-1, keepdim=True)).any(-1).all()
