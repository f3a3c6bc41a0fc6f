"""KV cache groups: how the layers of a model with sliding windows share one block pool.

Layers that attend alike (the whole context, or the same window) form groups of equal size,
as in vLLM's hybrid allocator. A request holds one block table per group; every group draws
its blocks from the same pool, and a block id is one page in each of the group size's layer
tensors (layer j of every group uses tensor j). So a block costs the same wherever it is used,
and blocks that fall out of a window go back to the pool for any group to take.

A model without windows is one group of all its layers: exactly the single block table of
before. No torch here: the scheduler builds the groups from the per-layer windows."""
from __future__ import annotations

from dataclasses import dataclass
from math import gcd

from kvflow.core.kv_cache.spec import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers that attend alike and share one block table per request."""

    layers: tuple[int, ...]
    sliding_window: int | None  # None: full attention

    def __post_init__(self) -> None:
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"sliding_window must be positive, got {self.sliding_window}")

    @property
    def spec(self) -> KVCacheSpec:
        """What the scheduler's coordinator manages this group by."""
        if self.sliding_window is None:
            return FullAttentionSpec()
        return SlidingWindowSpec(self.sliding_window)


def make_kv_cache_groups(layer_windows: list[int | None] | tuple[int | None, ...]) -> list[KVCacheGroup]:
    """Groups of equal size (the gcd of each attention kind's layer count): full-attention
    groups first, so that group 0's table covers every position where there is one."""
    if not layer_windows:
        raise ValueError("a model has at least one layer")
    by_window: dict[int | None, list[int]] = {}
    for i, w in enumerate(layer_windows):
        by_window.setdefault(w, []).append(i)
    size = 0
    for layers in by_window.values():
        size = gcd(size, len(layers))
    order = sorted(by_window, key=lambda w: (w is not None, w or 0))
    return [KVCacheGroup(tuple(by_window[w][j:j + size]), w)
            for w in order for j in range(0, len(by_window[w]), size)]


def layer_slots(groups: list[KVCacheGroup], num_layers: int) -> tuple[list[int], list[int]]:
    """(group of each layer, its tensor index: its place within its group)."""
    group_of, tensor_of = [0] * num_layers, [0] * num_layers
    for g, group in enumerate(groups):
        for j, layer in enumerate(group.layers):
            group_of[layer], tensor_of[layer] = g, j
    return group_of, tensor_of
