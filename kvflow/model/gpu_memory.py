"""How big the KV pool is on a GPU: vLLM's --gpu-memory-utilization. kvflow may use that
fraction of the device's memory in all; the weights, the peak of one step's activations
(measured by a profile run of the largest step the scheduler can form) and the memory the
process holds outside torch's allocator (cuBLAS workspaces, NCCL) come off it, and the rest
holds KV blocks. Other processes' memory does not count, but the fraction must be free at start.

`kv_cache_bytes` is the arithmetic (tested on CPU from given numbers); `profile_step_peak` and
`measure` take the numbers on a GPU."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvflow.attention.metadata import build_attention_metadata
from kvflow.model.kv_cache import allocate_kv_caches


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


@dataclass(frozen=True)
class GpuMemory:
    """What a start-up measured, in bytes."""

    total: int  # the device's memory
    free_at_start: int  # free before kvflow loaded anything (others' use and the CUDA context excluded)
    weights: int  # torch's allocations after the model loaded
    activation_peak: int  # one step's peak above the weights (profile run), its KV cache excluded
    non_torch: int  # the process's growth outside torch's allocator (cuBLAS, NCCL)


def kv_cache_bytes(mem: GpuMemory, utilization: float) -> int:
    """Bytes the KV pool may take; ValueError saying what to change when none are left."""
    if not 0.0 < utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
    requested = int(mem.total * utilization)
    if requested > mem.free_at_start:
        raise ValueError(
            f"--gpu-memory-utilization {utilization} asks for {_gib(requested)} of the GPU's "
            f"{_gib(mem.total)}, but only {_gib(mem.free_at_start)} was free at start (other "
            "processes hold the rest); lower it")
    kv = requested - mem.weights - mem.activation_peak - mem.non_torch
    if kv <= 0:
        raise ValueError(
            f"--gpu-memory-utilization {utilization} gives {_gib(requested)}; the weights take "
            f"{_gib(mem.weights)}, a step's activations {_gib(mem.activation_peak)} and the rest "
            f"{_gib(mem.non_torch)}, which leaves nothing for the KV cache: raise it, or lower "
            "--max-num-batched-tokens")
    return kv


def num_gpu_blocks(mem: GpuMemory, utilization: float, kv_bytes_per_token: int,
                   block_size: int) -> int:
    """KV blocks that fit the budget; ValueError when not one does."""
    kv = kv_cache_bytes(mem, utilization)
    blocks = kv // (kv_bytes_per_token * block_size)
    if blocks < 1:
        raise ValueError(f"{_gib(kv)} for the KV cache holds no block of {block_size} tokens "
                         f"({kv_bytes_per_token} B/token): raise --gpu-memory-utilization")
    return int(blocks)


def profile_batch(num_tokens: int, max_model_len: int, block_size: int):
    """The profile step's prompts: `num_tokens` in sequences of at most max_model_len (positions
    stay inside the model's RoPE table), each on its own blocks -> (lens, block tables, blocks)."""
    seq_len = min(num_tokens, max_model_len)
    lens = [seq_len] * (num_tokens // seq_len) + ([num_tokens % seq_len] if num_tokens % seq_len else [])
    tables, next_block = [], 0
    for n in lens:
        count = -(-n // block_size)
        tables.append(list(range(next_block, next_block + count)))
        next_block += count
    return np.array(lens), tables, next_block


@torch.inference_mode()
def run_profile_step(model, arch, kv_dtype: torch.dtype, block_size: int, num_tokens: int,
                     num_seqs: int, max_model_len: int, device: torch.device | str) -> int:
    """The largest step once: `num_tokens` prompt tokens on a throw-away cache of their own
    size, and fp32 logits with a softmax for `num_seqs` sampling rows. Returns the cache's
    bytes (what the profile does not count as activations)."""
    lens, tables, num_blocks = profile_batch(num_tokens, max_model_len, block_size)
    caches = allocate_kv_caches(arch, num_blocks, block_size, kv_dtype, device)
    cache_bytes = sum(t.numel() * t.element_size() for pair in caches for t in pair)
    meta = build_attention_metadata(lens, lens, tables, block_size, device)
    ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
    hidden = model(ids, meta.positions, caches, meta)
    rows = torch.arange(max(0, num_tokens - num_seqs), num_tokens, device=device)
    logits = model.compute_logits(hidden[rows], as_float=True)
    torch.softmax(logits, dim=-1)
    return cache_bytes


def profile_step_peak(model, arch, kv_dtype: torch.dtype, block_size: int, num_tokens: int,
                      num_seqs: int, max_model_len: int, device: torch.device) -> int:
    """Peak bytes above what is allocated now of the largest step (run_profile_step), its
    throw-away cache excluded."""
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    cache_bytes = run_profile_step(model, arch, kv_dtype, block_size, num_tokens, num_seqs,
                                   max_model_len, device)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base - cache_bytes
    torch.cuda.empty_cache()
    return max(0, int(peak))


def measure(model, arch, kv_dtype: torch.dtype, block_size: int, num_tokens: int, num_seqs: int,
            max_model_len: int, device: torch.device, free_at_start: int) -> GpuMemory:
    """The numbers on this GPU after the model loaded (`free_at_start` taken before)."""
    weights = torch.cuda.memory_allocated(device)
    peak = profile_step_peak(model, arch, kv_dtype, block_size, num_tokens, num_seqs,
                             max_model_len, device)
    free, total = torch.cuda.mem_get_info(device)
    non_torch = max(0, (free_at_start - free) - torch.cuda.memory_reserved(device))
    return GpuMemory(total=total, free_at_start=free_at_start, weights=weights,
                     activation_peak=peak, non_torch=non_torch)
