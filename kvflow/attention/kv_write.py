"""The KV write: this step's K/V ([T, kv_heads, head_dim]) stored at their flat cache slots
(slot mapping) in the tiles of kv_layout.py, through the C writers (fused_ops.c,
paged_attention_quant.c) where they take the tensors, else kv_layout.write_rows.

`CKVWriter` is the writer chosen once for one activation dtype and one cache dtype
(selector.py); `write_kv_with_kernel` finds the writer from the tensors it is given, for tensors
the bound one was not chosen for, tests and tools."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvflow.attention.c_kernels import IO_DTYPES, Q8_KINDS, float_bits, other_cache_error
from kvflow.attention.kv_layout import UNIT_KV_SCALES, cache_geometry, write_rows
from kvflow.csrc import library

# fp32 activations into an fp32 or bf16 cache (a bf16 one gets each value rounded to nearest even)
_FP32_WRITERS = {torch.float32: "write_kv_f32", torch.bfloat16: "write_kv_bf16"}


def _writer(io_dtype: torch.dtype, kv_dtype: torch.dtype) -> str | None:
    """The C writer of `io_dtype` activations into a `kv_dtype` cache (None: write_rows)."""
    if kv_dtype in Q8_KINDS:
        return "write_kv_q8" if io_dtype in IO_DTYPES else None
    if io_dtype == torch.float32:
        return _FP32_WRITERS.get(kv_dtype)
    return "copy_kv_bf16" if io_dtype == torch.bfloat16 == kv_dtype else None


def _takes(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
           head_dim: int) -> bool:
    """The C writers' layout: a CPU cache, dense heads, K and V alike."""
    return (k_cache.device.type == "cpu" and k.stride()[1:] == (head_dim, 1)
            and v.stride() == k.stride() and k_cache.is_contiguous() and v_cache.is_contiguous())


def _run(writer: str, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor,
         v: torch.Tensor, slot_mapping: torch.Tensor, kv_scales: tuple[float, float]) -> None:
    bs, kvh, d = cache_geometry(k_cache)
    args = (k.data_ptr(), v.data_ptr(), k.stride(0), slot_mapping.data_ptr(), k_cache.data_ptr(),
            v_cache.data_ptr(), 0, k.shape[0], kvh, d, bs)
    if writer == "write_kv_q8":
        library().write_kv_q8(*args, Q8_KINDS[k_cache.dtype], int(k.dtype == torch.bfloat16),
                              *map(float_bits, kv_scales))
    else:
        getattr(library(), writer)(*args)


def write_kv_with_kernel(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor,
                         v: torch.Tensor, slot_mapping: torch.Tensor,
                         kv_scales: tuple[float, float] = UNIT_KV_SCALES) -> None:
    """Store this step's K/V at their flat cache slots through the C writer for these tensors'
    dtypes (a bf16 cache of fp32 activations gets each value rounded to nearest even; fp8 over
    the layer's `kv_scales`), or kv_layout.write_rows for tensors it does not take."""
    writer = _writer(k.dtype, k_cache.dtype) if v.dtype == k.dtype else None
    if writer is not None and _takes(k_cache, v_cache, k, v, cache_geometry(k_cache)[2]):
        _run(writer, k_cache, v_cache, k, v, slot_mapping, kv_scales)
    elif k_cache.dtype in Q8_KINDS:
        write_rows(k_cache, v_cache, k, v, slot_mapping, kv_scales)
    else:
        write_rows(k_cache, v_cache, k, v, slot_mapping)


@dataclass(frozen=True)
class CKVWriter:
    """write_kv for `io_dtype` activations into a `kv_dtype` cache, its C writer chosen once
    (selector.py). A call checks only that the tensors are the ones it was chosen for: a cache
    of another dtype is refused (the kernels were chosen for another cache), activations in
    another dtype or layout go through write_kv_with_kernel."""

    io_dtype: torch.dtype
    kv_dtype: torch.dtype
    writer: str | None = field(init=False)

    def __post_init__(self):
        object.__setattr__(self, "writer", _writer(self.io_dtype, self.kv_dtype))

    def __call__(self, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor, slot_mapping: torch.Tensor,
                 kv_scales: tuple[float, float] = UNIT_KV_SCALES) -> None:
        if k_cache.dtype != self.kv_dtype:
            raise other_cache_error(self.kv_dtype, k_cache.dtype)
        if (self.writer is not None and k.dtype == self.io_dtype == v.dtype
                and _takes(k_cache, v_cache, k, v, cache_geometry(k_cache)[2])):
            _run(self.writer, k_cache, v_cache, k, v, slot_mapping, kv_scales)
        else:
            write_kv_with_kernel(k_cache, v_cache, k, v, slot_mapping, kv_scales)
