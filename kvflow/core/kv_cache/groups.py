"""KV cache groups: how the layers of a model with sliding windows (or with layers of
different shapes) share one block pool.

Layers that attend alike (the whole context, or the same window) and keep K/V of one shape
(kv heads x head size) form groups, as in vLLM's hybrid allocator. A request holds one block
table per group; every group draws its blocks from the same pool, and a block id is one page
in each of the shared layer tensors (tensor j serves layer j of every group). So a block
costs the same wherever it is used, and blocks that fall out of a window go back to the pool
for any group to take.

Layers of different shapes keep one page size across groups as vLLM does, but by packing
instead of padding: a block's page in a shared tensor is the largest layer's page, and a group
of layers whose page is a k-th of it puts k of its layers in each tensor (its
`pages_per_slot`, each layer reads its k-th of every page: block b is page k * b + its place).
Groups are of equal size in tensors, so each kind of layer takes the tensors its pages fill.

A model of one shape without windows is one group of all its layers: exactly the single block
table of before. No torch here: the scheduler builds the groups from the per-layer windows
and shapes."""
from __future__ import annotations

from dataclasses import dataclass
from math import gcd

from kvflow.core.kv_cache.spec import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers that attend alike, keep K/V of one shape and share one block table per request."""

    layers: tuple[int, ...]
    sliding_window: int | None  # None: full attention
    # K (and V) of one token in each of its layers: kv heads x head size (0: the model's one)
    num_kv_heads: int = 0
    head_size: int = 0
    # how many of its layers share one tensor, each a 1/pages_per_slot of a block's page
    pages_per_slot: int = 1

    def __post_init__(self) -> None:
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"sliding_window must be positive, got {self.sliding_window}")
        if self.pages_per_slot < 1:
            raise ValueError(f"pages_per_slot must be positive, got {self.pages_per_slot}")

    @property
    def num_tensors(self) -> int:
        """The shared tensors its layers use."""
        return -(-len(self.layers) // self.pages_per_slot)

    @property
    def spec(self) -> KVCacheSpec:
        """What the scheduler's coordinator manages this group by."""
        shape = {"num_kv_heads": self.num_kv_heads, "head_size": self.head_size}
        if self.sliding_window is None:
            return FullAttentionSpec(**shape)
        return SlidingWindowSpec(self.sliding_window, **shape)


def make_kv_cache_groups(layer_windows: list[int | None] | tuple[int | None, ...],
                         layer_shapes: list | tuple | None = None) -> list[KVCacheGroup]:
    """Groups of equal size in shared tensors, full-attention groups first (so that group 0's
    table covers every position where there is one). `layer_shapes`: each layer's (kv heads,
    head size), None or empty for a model of one shape. A layer page that does not divide the
    largest one puts every layer at the widest shape (the model pads its heads to it)."""
    n = len(layer_windows)
    if not n:
        raise ValueError("a model has at least one layer")
    shapes = [tuple(s) for s in layer_shapes] if layer_shapes else [(0, 0)] * n
    if len(shapes) != n:
        raise ValueError(f"{len(shapes)} layer shapes for {n} layers")
    largest = max(kv * d for kv, d in shapes)
    if largest and any(largest % (kv * d) for kv, d in shapes):
        shapes = [(max(kv for kv, _ in shapes), max(d for _, d in shapes))] * n
        largest = shapes[0][0] * shapes[0][1]
    by_kind: dict[tuple, list[int]] = {}
    for i, (w, shape) in enumerate(zip(layer_windows, shapes)):
        by_kind.setdefault((w, *shape), []).append(i)
    per_slot = {kind: largest // (kind[1] * kind[2]) if largest else 1 for kind in by_kind}
    size = 0  # tensors per group: what every kind's tensor count is a multiple of
    for kind, layers in by_kind.items():
        size = gcd(size, -(-len(layers) // per_slot[kind]))
    order = sorted(by_kind, key=lambda k: (k[0] is not None, k[0] or 0, k[1], k[2]))
    return [KVCacheGroup(tuple(by_kind[k][j:j + size * per_slot[k]]), k[0], k[1], k[2], per_slot[k])
            for k in order for j in range(0, len(by_kind[k]), size * per_slot[k])]


def layer_slots(groups: list[KVCacheGroup], num_layers: int) -> tuple[list[int], list[int]]:
    """(group of each layer, its tensor index: its place within its group's tensors)."""
    group_of, tensor_of = [0] * num_layers, [0] * num_layers
    for g, group in enumerate(groups):
        for j, layer in enumerate(group.layers):
            group_of[layer], tensor_of[layer] = g, j // group.pages_per_slot
    return group_of, tensor_of


def layer_pages(groups: list[KVCacheGroup], num_layers: int) -> list[int]:
    """Each layer's place among its group's layers that share one tensor (0 where one layer
    fills a page): block b of its table is page pages_per_slot * b + this of its view."""
    page_of = [0] * num_layers
    for group in groups:
        for j, layer in enumerate(group.layers):
            page_of[layer] = j % group.pages_per_slot
    return page_of
