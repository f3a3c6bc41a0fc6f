"""The paged KV cache's memory: one (k_cache, v_cache) pair of tensors per layer, in the tiles
of kvflow/attention/kv_layout.py, sized from the model's shape, or from each layer's own
where the layers differ (Gemma 4: its KV cache groups' shared tensors, each layer a view)."""
from __future__ import annotations

import numpy as np
import torch

from kvflow.attention.kv_layout import cache_shape, token_bytes
from kvflow.core.kv_cache.groups import KVCacheGroup, layer_slots, make_kv_cache_groups
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


def kv_cache_groups(arch: LlamaArchConfig, kv_dtype: torch.dtype,
                    windows: list | tuple | None = None) -> list[KVCacheGroup]:
    """The model's KV cache groups (core/kv_cache/groups.py) for a cache of `kv_dtype`: by
    window and by each cache-owning layer's own (kv heads, head dim). `windows`: the whole
    model's, for a pipeline stage (default: the arch's)."""
    shapes = kv_layer_shapes(arch, kv_dtype)
    if windows is None:
        windows = arch.kv_layer_windows()
    elif len(windows) != len(shapes):  # a pipeline stage's arch holds its own layers only
        if len(set(shapes)) > 1:
            raise ValueError("a pipeline stage of a model whose layers differ in KV shape is not supported")
        shapes = shapes[:1] * len(windows)
    return make_kv_cache_groups(windows, shapes)


def kv_layer_shapes(arch: LlamaArchConfig, kv_dtype: torch.dtype) -> tuple[tuple[int, int], ...]:
    """Each cache-owning layer's (kv heads, head dim) in the cache. An int8 cache's scales
    after each tile make pages of different head sizes no multiples of each other, so there
    every layer takes the widest shape (the model pads its heads to it)."""
    shapes = tuple(arch.kv_layer_shapes())
    if kv_dtype == torch.int8 and len(set(shapes)) > 1:
        return ((arch.num_key_value_heads, arch.head_dim),) * len(shapes)
    return shapes


def kv_bytes_per_token(groups: list[KVCacheGroup], dtype: torch.dtype) -> tuple[int, int]:
    """(KV bytes one token takes in every layer, each at its own shape; bytes one token of a
    block takes: the groups' shared tensors, each a page of the largest layer's)."""
    per_token = sum(len(g.layers) * 2 * g.num_kv_heads * token_bytes(dtype, g.head_size) for g in groups)
    page = max(g.num_kv_heads * token_bytes(dtype, g.head_size) * g.pages_per_slot for g in groups)
    return per_token, 2 * groups[0].num_tensors * page


def allocate_group_kv_caches(groups: list[KVCacheGroup], layers: list[int], num_blocks: int,
                             block_size: int, dtype: torch.dtype,
                             device: torch.device | str | None = None,
                             zeros=None) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list]:
    """The (k_cache, v_cache) of each of `layers` (indices into the groups' layers: a pipeline
    stage's share) over the shared tensors they use: each tensor holds num_blocks pages of the
    largest layer page, and a layer whose page is a k-th of it views it as num_blocks * k pages
    of its own shape [num_blocks * k, kv_heads, block_size, head_dim] (its block b is page
    k * b + its place, core/kv_cache/groups.py). Returns (the views, in `layers` order; the
    shared tensors, as (k, v) pairs)."""
    group_of, tensor_of = layer_slots(groups, max(max(g.layers) for g in groups) + 1)
    used = sorted({tensor_of[i] for i in layers})
    page = max(int(np.prod(cache_shape(1, block_size, g.num_kv_heads, g.head_size, dtype)))
               * g.pages_per_slot for g in groups)
    n = num_blocks * page
    on_gpu = device is not None and torch.device(device).type != "cpu"
    zeros = (lambda numel, dt: torch.zeros(numel, dtype=dt, device=device)) if on_gpu else (zeros or hugepages.zeros)
    tensors = [(zeros(n, dtype), zeros(n, dtype)) for _ in used]
    views: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}  # layers of one shape: one pair
    keys = []
    for i in layers:
        g = groups[group_of[i]]
        shape = cache_shape(num_blocks * g.pages_per_slot, block_size, g.num_kv_heads, g.head_size, dtype)
        assert int(np.prod(shape)) == n, "a layer's pages fill its tensor's"
        keys.append((tensor_of[i], shape))
        if keys[-1] not in views:
            k, v = tensors[used.index(tensor_of[i])]
            views[keys[-1]] = k.view(shape), v.view(shape)
    return [views[key] for key in keys], tensors
