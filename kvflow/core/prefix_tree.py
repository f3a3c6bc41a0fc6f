"""An approximate radix tree of what each replica has served, for cache-aware routing.

One tree over sequences (text characters in the router, which does not tokenize; token ids in
the data-parallel front) whose nodes record which replicas ("tenants") have been sent a
sequence through them, and when. It is approximate: a replica's real prefix cache evicts on its
own schedule, so the tree only says what the replica *probably* still holds. Its size is bounded
per tenant: past `capacity` elements, the tenant's least recently used leaves are dropped
(SGLang router's tree, in one thread and without its timer)."""
from __future__ import annotations

import heapq
import itertools
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field


@dataclass(eq=False, slots=True)
class _Node:
    key: Sequence  # the edge's elements from the parent to this node
    parent: _Node | None
    children: dict = field(default_factory=dict)  # first element -> child
    tenants: dict = field(default_factory=dict)  # tenant -> last access tick


def _common_prefix(a: Sequence, b: Sequence, start: int) -> int:
    """How many elements of `b` equal a[start:start + len(b)], from the beginning."""
    n = min(len(a) - start, len(b))
    i = 0
    while i < n and a[start + i] == b[i]:
        i += 1
    return i


class PrefixTree:
    """Insert a tenant's sequence, find each tenant's longest matched prefix, evict by LRU.

    A tenant on a node is on all of its ancestors, so a tenant's size (the elements it owns) is
    the sum of its nodes' key lengths, and its leaves are its nodes without a child it owns."""

    def __init__(self) -> None:
        self.root = _Node((), None)
        self.sizes: dict[Hashable, int] = {}  # tenant -> elements owned
        self._tick = itertools.count(1)

    def insert(self, seq: Sequence, tenant: Hashable) -> None:
        """Record that `tenant` was sent `seq` (its every prefix becomes the tenant's)."""
        now = next(self._tick)
        node, i = self.root, 0
        self._own(node, tenant, now)
        while i < len(seq):
            child = node.children.get(seq[i])
            if child is None:
                leaf = _Node(seq[i:], node)
                node.children[seq[i]] = leaf
                self._own(leaf, tenant, now)
                return
            n = _common_prefix(seq, child.key, i)
            if n < len(child.key):
                child = self._split(child, n)
            self._own(child, tenant, now)
            node, i = child, i + n

    def match(self, seq: Sequence) -> tuple[int, dict[Hashable, int]]:
        """(the longest match of `seq` over all tenants, each tenant's own longest match)."""
        best: dict[Hashable, int] = {}
        node, i = self.root, 0
        while i < len(seq):
            child = node.children.get(seq[i])
            if child is None:
                break
            n = _common_prefix(seq, child.key, i)
            i += n
            for t in child.tenants:
                best[t] = i
            if n < len(child.key):
                break
            node = child
        return (max(best.values()) if best else 0), best

    def evict(self, tenant: Hashable, capacity: int) -> int:
        """Drop `tenant`'s least recently used leaves until it owns at most `capacity`
        elements; the count dropped."""
        size = self.sizes.get(tenant, 0)
        if size <= capacity:
            return 0
        heap = [(n.tenants[tenant], id(n), n) for n in self._nodes_of(tenant)
                if not any(tenant in c.tenants for c in n.children.values())]
        heapq.heapify(heap)
        dropped = 0
        while heap and size - dropped > capacity:
            _, _, node = heapq.heappop(heap)
            dropped += len(node.key)
            parent = self._disown(node, tenant)
            if (parent is not None and parent is not self.root and tenant in parent.tenants
                    and not any(tenant in c.tenants for c in parent.children.values())):
                heapq.heappush(heap, (parent.tenants[tenant], id(parent), parent))
        self.sizes[tenant] = size - dropped
        return dropped

    def remove_tenant(self, tenant: Hashable) -> None:
        """Forget everything `tenant` was sent (it left, or its cache is gone)."""
        for node in reversed(list(self._nodes_of(tenant))):  # children before parents
            self._disown(node, tenant)
        self.sizes.pop(tenant, None)
        self.root.tenants.pop(tenant, None)

    def size(self, tenant: Hashable) -> int:
        return self.sizes.get(tenant, 0)

    # -- internals -------------------------------------------------------------------------
    def _own(self, node: _Node, tenant: Hashable, now: int) -> None:
        if tenant not in node.tenants:
            self.sizes[tenant] = self.sizes.get(tenant, 0) + len(node.key)
        node.tenants[tenant] = now

    def _split(self, child: _Node, n: int) -> _Node:
        """Cut `child`'s edge after `n` elements; the new middle node (same tenants)."""
        parent = child.parent
        mid = _Node(child.key[:n], parent, {child.key[n]: child}, dict(child.tenants))
        parent.children[child.key[0]] = mid
        child.key = child.key[n:]
        child.parent = mid
        return mid

    def _disown(self, node: _Node, tenant: Hashable) -> _Node | None:
        """Take `tenant` off `node` (a node nobody owns is unlinked); its parent."""
        node.tenants.pop(tenant, None)
        parent = node.parent
        if not node.tenants and not node.children and parent is not None:
            del parent.children[node.key[0]]
        return parent

    def _nodes_of(self, tenant: Hashable):
        """The tenant's nodes below the root, parents before children."""
        stack = [c for c in self.root.children.values() if tenant in c.tenants]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(c for c in node.children.values() if tenant in c.tenants)
