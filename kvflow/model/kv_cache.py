"""The paged KV cache's memory: one (k_cache, v_cache) pair of tensors per layer, in the tiles
of kvflow/attention/kv_layout.py, sized from the model's shape."""
from __future__ import annotations

import numpy as np
import torch

from kvflow.attention.kv_layout import cache_shape
from kvflow.model import hugepages
from kvflow.model.arch import LlamaArchConfig


def allocate_kv_caches(arch: LlamaArchConfig, num_blocks: int, block_size: int,
                       dtype: torch.dtype, device: torch.device | str | None = None,
                       num_layers: int | None = None,
                       zeros=None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One (k_cache, v_cache) pair per layer (or per `num_layers`: the tensors that KV cache
    groups share), each [num_blocks, kv_heads, block_size, head_dim] in tiles (kv_layout.py).
    On the CPU, `zeros(numel, dtype)` gives each tensor's memory (default: anonymous memory on
    huge pages; a shared file when another process must reach the cache)."""
    num_layers = arch.num_hidden_layers if num_layers is None else num_layers
    shape = cache_shape(num_blocks, block_size, arch.num_key_value_heads, arch.head_dim, dtype)
    if device is not None and torch.device(device).type != "cpu":
        return [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
                for _ in range(num_layers)]
    # Zeroed (unwritten slots may be read under a mask, and 0 * NaN would poison the sum), but
    # as anonymous memory: the OS hands out zero pages on first touch instead of a multi-GiB
    # memset at start-up; on huge pages where granted (kvflow/model/hugepages.py).
    n = int(np.prod(shape))
    zeros = zeros or hugepages.zeros
    return [(zeros(n, dtype).view(shape), zeros(n, dtype).view(shape))
            for _ in range(num_layers)]
