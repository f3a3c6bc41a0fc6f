"""Which attention backend serves a model, and on which kernel entry points: chosen once, at
load or when the KV cache's dtype is settled, from the CPU's features, the activations' and
the cache's dtypes and the options. The result holds bound callables; a step's call chooses
nothing again (the kernels still check the tensors they get).

- the C kernels where they built and are on: the decode kernel of the cache's dtype (a
  one-byte fp8 or int8 cache on the widest path of paged_attention_quant.c this CPU has), the
  prompt kernel where the CPU has AVX512-BF16 (its tile products on AMX where the CPU, the
  build and Linux allow and the options do not turn it off), else prompt tokens as rows of the
  decode kernel; the C KV writer of the two dtypes;
- PyTorch's SDPA otherwise (no C kernels, or a cache dtype they do not read) and
  kv_layout.write_rows.

On an NVIDIA GPU the Triton set serves instead (kvflow/model/gpu_kernels.py)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from kvflow.attention.c_kernels import CAttention, q8_isas, reads
from kvflow.attention.kv_layout import FP8, is_quantized, write_rows
from kvflow.attention.kv_write import CKVWriter
from kvflow.attention.torch_sdpa import attention_with_sdpa
from kvflow.csrc import library


def best_q8_isa(features, kv_dtype: torch.dtype | None = None) -> str:
    """The widest one-byte-cache decode path both the build and the CPU (`features`, a
    CpuFeatures) have (for an fp8 cache, `kv_dtype` FP8, AVX512-BF16's)."""
    built = q8_isas()
    if (kv_dtype == FP8 and "avx512-bf16" in built
            and {"avx512f", "avx512bw", "f16c", "avx512_bf16"} <= features.flags):
        return "avx512-bf16"
    if "avx512" in built and {"avx512f", "avx512bw", "f16c"} <= features.flags:
        return "avx512"
    if "avx2" in built and {"avx2", "fma", "f16c"} <= features.flags:
        return "avx2"
    return "scalar"


@dataclass(frozen=True)
class AttentionBackend:
    """What serves a model's attention and KV write, with the names for the start-up line."""

    attention: Callable[..., torch.Tensor]  # (q, k_cache, v_cache, meta, scale, num_kv_heads, k, v, *, kv_scales, sinks)
    write_kv: Callable[..., None]  # (k_cache, v_cache, k, v, slot_mapping, kv_scales)
    name: str
    write_name: str


def select_attention(dtype: torch.dtype, kv_dtype: torch.dtype, features, *, c_kernels: bool,
                     amx_attention: bool = True) -> AttentionBackend:
    """The backend for activations in `dtype` over a CPU KV cache of `kv_dtype` on a CPU with
    `features` (a CpuFeatures); `c_kernels`: the C kernels built and are not turned off;
    `amx_attention`: the prompt kernel may take AMX (KVFLOW_NO_AMX_ATTENTION unset)."""
    if not c_kernels:
        return AttentionBackend(attention_with_sdpa, write_rows, "sdpa", "torch")
    write_kv = CKVWriter(dtype, kv_dtype)
    if not reads(kv_dtype):  # a cache the decode kernels do not read: SDPA over it
        return AttentionBackend(attention_with_sdpa, write_kv, "sdpa", "c")
    lib = library()
    # the prompt kernel's shape check answers 0 for every shape where it was not built
    prompt_kernel = features.avx512_bf16 and bool(lib.paged_prefill_bf16_supported(1, 1, 32, 16))
    # its tile products on AMX where the CPU has it, the build has it and Linux grants it
    prompt_amx = bool(prompt_kernel and amx_attention and features.amx_bf16
                      and lib.prefill_amx_available())
    prompt_name = "+c-prompt-amx" if prompt_amx else "+c-prompt"
    if is_quantized(kv_dtype):
        # one-byte caches: their own decode kernel (paged_attention_quant.c) on the widest path
        # this CPU has; prompts through the prompt kernel, which widens them as it gathers (on
        # AVX512-BF16), else as the decode kernel's rows
        q8_isa = best_q8_isa(features, kv_dtype)
        attend = CAttention(kv_dtype, prompt_kernel=prompt_kernel, prompt_amx=prompt_amx,
                            q8_isa=q8_isa)
        name = (f"c-decode-{'fp8' if kv_dtype != torch.int8 else 'int8'}-{q8_isa}"
                + (prompt_name if prompt_kernel else ""))
    else:
        # the bf16 decode row prefetches contiguous blocks too on a Xeon with AMX, where its
        # hardware prefetcher left them 1.46x slower; not on a Zen 4, where the prefetches
        # slowed it 1.3x
        attend = CAttention(kv_dtype, prompt_kernel=prompt_kernel, prompt_amx=prompt_amx,
                            prefetch_all=bool(features.amx_bf16))
        name = "c-decode" + (prompt_name if prompt_kernel and kv_dtype == torch.bfloat16 else "")
    return AttentionBackend(attend, write_kv, name, "c")
