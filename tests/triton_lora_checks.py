"""The Triton LoRA shrink/expand (kvflow/model/triton/lora.py) against the PyTorch reference of
kvflow/csrc/lora.py. Run as its own pytest process (tests/test_triton_lora.py): on CPU through
Triton's interpreter, which must be on before triton is first imported; with
KERNEL_CHECKS_DEVICE=cuda the same checks run compiled on a GPU."""
from __future__ import annotations

import os
import sys

DEVICE = os.environ.get("KERNEL_CHECKS_DEVICE", "cpu")
if DEVICE == "cpu":
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("triton was imported without TRITON_INTERPRET=1; run this file in "
                           "its own process (tests/test_triton_lora.py does)")
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from kvflow.csrc.lora import lora_add_torch  # noqa: E402


@pytest.mark.parametrize("k,widths,r,dtype", [
    (37, [20, 9, 9], 8, torch.float32),     # ragged K, three slices (q|k|v)
    (64, [40, 40], 4, torch.float32),       # two slices (gate|up)
    (200, [130], 16, torch.bfloat16),       # one slice, bf16 activations, N past one block
])
def test_triton_lora_matches_reference(k, widths, r, dtype):
    from kvflow.model.triton.lora import lora_add
    if DEVICE == "cpu":
        from triton.runtime.interpreter import InterpretedFunction
        from kvflow.model.triton import lora as mod
        assert isinstance(mod._shrink_kernel, InterpretedFunction)
    g = torch.Generator().manual_seed(k)
    bounds = [0]
    for w in widths:
        bounds.append(bounds[-1] + w)
    a = torch.randn(3, len(widths) * r, k, generator=g) / k ** 0.5
    bt = torch.randn(3, r, bounds[-1], generator=g)
    ranks = torch.tensor([r, max(1, r // 2), 0])
    slots = torch.tensor([0, 0, -1, 1, 1, 2, 0, -1], dtype=torch.int64)
    x = torch.randn(len(slots), k, generator=g).to(dtype)
    y = torch.randn(len(slots), bounds[-1], generator=g).to(dtype)
    starts = torch.tensor(bounds)
    want = y.clone()
    lora_add_torch(want, x, a, bt, ranks, starts, slots)
    dev = [t.to(DEVICE) for t in (y.clone(), x, a, bt, ranks, starts, slots)]
    lora_add(*dev, bounds)
    got = dev[0].cpu()
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=8e-3, atol=1e-2)
    torch.testing.assert_close(got.float(), want.float(), **tol)
    for t in (2, 5, 7):  # base rows and the rank-0 slot: untouched
        assert torch.equal(got[t], y[t])
