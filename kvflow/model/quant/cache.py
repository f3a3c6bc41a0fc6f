"""Quantized weights of a GGUF file, cached once packed: the panels, the float norms and
biases and what each weight is, in one safetensors file beside the float conversion cache
(kvflow/checkpoint/conversion_cache.py), written under the same lock, fsynced and renamed into place and
checked on load the same way. A later start reads it instead of parsing the GGUF file and
repacking every tensor (~10 s for the default model on a loaded 2-core machine)."""
from __future__ import annotations

import json
import os
import tempfile
from typing import Callable

import torch

from kvflow.checkpoint.conversion_cache import _conversion_lock, cache_file_is_complete, dtype_name
from kvflow.model import hugepages
from kvflow.model.quant.qlinear import QuantizedWeight
from kvflow.model_path import cache_dir_for
from kvflow.utils.files import publish

_META_KEY = "kvflow_quantized"
# the panel layout's version (packing.py, gemm_quant.c): a file packed for another layout is
# never read as this one
LAYOUT_VERSION = 2
_COUNT_KEY = "kvflow_num_tensors"


def cache_file(path: str, mode: str, dtype: torch.dtype) -> str:
    return os.path.join(cache_dir_for(path),
                        f"quantized.v{LAYOUT_VERSION}.{mode}.{dtype_name(dtype)}.safetensors")


def cached_weights(path: str, mode: str, dtype: torch.dtype, isa: str,
                   build: Callable[[], tuple[dict, dict]]
                   ) -> tuple[dict[str, torch.Tensor], dict[str, QuantizedWeight]]:
    """(plain, quant) from the cache file, or from `build()` (then cached)."""
    cached = cache_file(path, mode, dtype)
    if not cache_file_is_complete(cached):
        with _conversion_lock(cached):
            if not cache_file_is_complete(cached):
                plain, quant = build()
                _save(cached, plain, quant)
                return plain, quant
    return _load(cached, isa)


_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.uint8: "U8"}


def _save_file(tensors: dict[str, torch.Tensor], path: str, metadata: dict[str, str]) -> None:
    """The safetensors format, written one tensor at a time (safetensors' own save_file copies
    every tensor to bytes first: twice an 8B model's memory)."""
    header, offset = {"__metadata__": metadata}, 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        header[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(len(blob).to_bytes(8, "little"))
        f.write(blob)
        for t in tensors.values():
            f.write(memoryview(t.contiguous().view(torch.uint8).numpy()))


def _save(cached: str, plain: dict, quant: dict) -> None:
    tensors = {f"plain/{k}": v.contiguous() for k, v in plain.items()}
    meta, first = {}, {}
    for name, w in quant.items():
        if id(w) in first:  # a tied LM head is the embedding's table
            meta[name] = {"same_as": first[id(w)]}
            continue
        first[id(w)] = name
        tensors[f"quant/{name}"] = w.packed
        meta[name] = {"kind": w.kind, "n": w.n, "k": w.k, "source": w.source, "per_row": w.per_row}
    os.makedirs(os.path.dirname(cached), exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix="quantized.", suffix=".tmp", dir=os.path.dirname(cached))
    os.close(fd)
    try:
        _save_file(tensors, tmp, {_META_KEY: json.dumps(meta), _COUNT_KEY: str(len(tensors))})
        publish(tmp, cached)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


_TORCH_DTYPES = {v: k for k, v in _DTYPES.items()}


def _load(cached: str, isa: str) -> tuple[dict[str, torch.Tensor], dict[str, QuantizedWeight]]:
    """Read with plain reads into fresh tensors, not through a mapping of the file: a mapped
    file's pages count in RSS beside any copy of them, and under memory pressure the kernel
    drops and refaults them (a mapped 8B cache read 3x slower and showed 10 GB of RSS).

    The tensors are views of one buffer on 2 MiB pages where the OS grants them: a decode step
    streams every panel once, and on 4 KiB pages the 8B shapes' one-row GEMM read ~10% slower
    (benchmarks/quant_gemv_stream.py --hugepages). One buffer, not one per tensor: a model's
    hundreds of small tensors would each round up to a huge page."""
    with open(cached, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
        base = 8 + n
        meta = json.loads(header.pop("__metadata__")[_META_KEY])
        arena = hugepages.zeros(max((i["data_offsets"][1] for i in header.values()), default=0), torch.uint8)
        tensors = {}
        for name, info in header.items():
            begin, end = info["data_offsets"]
            aligned = begin % _TORCH_DTYPES[info["dtype"]].itemsize == 0
            t = arena[begin:end] if aligned else torch.empty(end - begin, dtype=torch.uint8)
            f.seek(base + begin)
            f.readinto(memoryview(t.numpy()))
            tensors[name] = t.view(_TORCH_DTYPES[info["dtype"]]).reshape(info["shape"])
    plain = {k.removeprefix("plain/"): v for k, v in tensors.items() if k.startswith("plain/")}
    quant = {}
    for name, m in meta.items():
        if "same_as" not in m:
            quant[name] = QuantizedWeight(kind=m["kind"], n=m["n"], k=m["k"],
                                          packed=tensors[f"quant/{name}"], isa=isa,
                                          source=m["source"], per_row=m["per_row"])
    for name, m in meta.items():
        if "same_as" in m:
            quant[name] = quant[m["same_as"]]
    return plain, quant
