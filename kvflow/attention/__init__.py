"""Attention over the paged KV cache, its backends chosen once at load.

- kv_layout.py: how K/V sit in the cache's tiles (the kernels' and PyTorch's shared contract)
- metadata.py:  one step's AttentionMetadata (slot mapping, block tables, decode and prompt rows)
- kv_write.py:  this step's K/V into the cache (the C writers, else kv_layout.write_rows)
- c_kernels.py: the C backend (decode, prompt and one-byte-cache kernels of kvflow/csrc)
- torch_sdpa.py: the PyTorch backend (SDPA), also the kernels' reference
- selector.py:  which backend and entry points serve, from the CPU, the dtypes and the options

The GPU's Triton backend is kvflow/model/triton. The cache's memory is allocated by
kvflow/model/kv_cache.py (it needs the model's shape)."""
from kvflow.attention.c_kernels import (Q8_ISAS, Q8_KINDS, VECTOR_HEAD_DIMS, CAttention,
                                        attention_with_kernels, decode_with_kernel,
                                        prefill_with_kernel, q8_isas)
from kvflow.attention.kv_write import CKVWriter, write_kv_with_kernel
from kvflow.attention.metadata import AttentionMetadata, PrefillSeq, build_attention_metadata
from kvflow.attention.selector import AttentionBackend, best_q8_isa, select_attention
from kvflow.attention.torch_sdpa import attention_with_sdpa, decode_with_torch

__all__ = ["AttentionBackend", "AttentionMetadata", "CAttention", "CKVWriter", "PrefillSeq",
           "Q8_ISAS", "Q8_KINDS", "VECTOR_HEAD_DIMS", "attention_with_kernels",
           "attention_with_sdpa", "best_q8_isa", "build_attention_metadata",
           "decode_with_kernel", "decode_with_torch", "prefill_with_kernel", "q8_isas",
           "select_attention", "write_kv_with_kernel"]
