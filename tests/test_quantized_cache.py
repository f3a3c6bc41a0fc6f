"""The packed-weights cache (kvflow/model/quant/cache.py): a later start reads back exactly what
the first one packed, the panels into one buffer on 2 MiB pages (the decode stream's TLB), and
a tensor whose offset does not fit its type's alignment into its own buffer. No model: a few
hand-made tensors, so this runs in well under a second."""
from __future__ import annotations

import numpy as np
import torch

from kvflow.model import hugepages
from kvflow.model.quant.cache import cached_weights
from kvflow.model.quant.qlinear import QuantizedWeight


def _build(calls: list):
    def build():
        calls.append(1)
        rng = np.random.default_rng(0)
        plain = {"odd.bias": torch.randn(7).bfloat16(),  # 14 bytes: the next tensor is off 4-byte alignment
                 "norm.weight": torch.randn(64),
                 "layers.0.norm": torch.randn(96).bfloat16()}
        quant = {}
        for name, kind, rec in (("layers.0.q_proj", "q4", 320), ("layers.0.down_proj", "q8", 608)):
            packed = torch.from_numpy(rng.integers(0, 256, 2 * 3 * rec, dtype=np.uint8))
            quant[name] = QuantizedWeight(kind=kind, n=32, k=96, packed=packed, isa="scalar", source="Q8_0")
        quant["lm_head"] = quant["layers.0.down_proj"]  # tied: cached once
        return plain, quant
    return build


def test_a_later_start_reads_back_what_was_packed(tmp_path, monkeypatch):
    monkeypatch.setenv("KVFLOW_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF stand-in")
    calls = []
    plain, quant = cached_weights(str(path), "gguf", torch.bfloat16, "scalar", _build(calls))
    plain2, quant2 = cached_weights(str(path), "gguf", torch.bfloat16, "scalar", _build(calls))
    assert len(calls) == 1  # the second start read the cache
    assert plain2.keys() == plain.keys()
    for k in plain:
        assert plain2[k].dtype == plain[k].dtype and torch.equal(plain2[k], plain[k])
    assert quant2.keys() == quant.keys() and quant2["lm_head"] is quant2["layers.0.down_proj"]
    for k in quant:
        assert (quant2[k].kind, quant2[k].n, quant2[k].k) == (quant[k].kind, quant[k].n, quant[k].k)
        assert torch.equal(quant2[k].packed, quant[k].packed)
    # the panels share one buffer, 2 MiB-aligned where huge pages are on
    q4, q8 = quant2["layers.0.q_proj"].packed, quant2["layers.0.down_proj"].packed
    assert q4.untyped_storage().data_ptr() == q8.untyped_storage().data_ptr()
    if hugepages.envs.KVFLOW_HUGEPAGES:
        assert q4.untyped_storage().data_ptr() % hugepages.HUGE_PAGE == 0
