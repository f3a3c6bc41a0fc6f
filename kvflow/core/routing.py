"""Which replica takes a request: round robin, least load, power of two, or cache-aware.

Shared by `kvflow router` (replicas are URLs, the key is the prompt's text) and the
data-parallel front of `kvflow serve --data-parallel-size N` (replicas are engine cores, the key
is the prompt's token ids). A policy sees each candidate's load (requests in flight through the
caller) and, for `cache_aware`, keeps a PrefixTree of what it sent where.

`cache_aware` is SGLang router's policy: when the load is imbalanced (max - min above
`balance_abs_threshold` and max above `balance_rel_threshold` x min) the least loaded replica
wins; otherwise the replica holding the longest prefix of the key, if that match covers more
than `cache_threshold` of the key, else the replica whose tree is smallest (most room).

Given a BlockIndex (the replicas' KV events: kvflow/core/block_index.py) and a request's block
hashes, `cache_aware` and `least_load`'s ties score by the blocks each replica really holds
instead of the tree: the longest run of the prompt's leading blocks in its cache (reason
`kv_cache_hit`; any run, `cache_threshold` is the tree's), else the replica holding the fewest
blocks (`fewest_blocks`). A request without
hashes (none computed, or a prompt shorter than a block) is routed by the tree as before."""
from __future__ import annotations

import random
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from kvflow.core.block_index import BlockIndex
from kvflow.core.prefix_tree import PrefixTree

POLICIES = ("round_robin", "least_load", "power_of_two", "cache_aware")


@dataclass
class CacheAwareConfig:
    """SGLang router's knobs and names. Its defaults, but for two: an imbalance of more than 2
    requests in flight (SGLang: 32) sends a request to the least loaded replica, since a CPU
    replica's step time grows with every request in its batch (with 32, eight chat sessions
    sharing a system prompt all ran on one of two replicas: benchmarks/router_cache_aware.py);
    and the tree holds 2**20 elements per replica."""

    cache_threshold: float = 0.5
    balance_abs_threshold: int = 2
    balance_rel_threshold: float = 1.0001
    max_tree_size: int = 2**20

    def __post_init__(self) -> None:
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold must be in [0, 1], got {self.cache_threshold}")
        if self.balance_abs_threshold < 0:
            raise ValueError("balance_abs_threshold must be >= 0, got "
                             f"{self.balance_abs_threshold}")
        if self.balance_rel_threshold < 1.0:
            raise ValueError("balance_rel_threshold must be >= 1, got "
                             f"{self.balance_rel_threshold}")
        if self.max_tree_size < 1:
            raise ValueError(f"max_tree_size must be >= 1, got {self.max_tree_size}")


@dataclass(frozen=True)
class Choice:
    """The replica picked and why (`reason`: round_robin, least_load, power_of_two, balance,
    cache_hit, smallest_tree, kv_cache_hit, fewest_blocks), with the key's matched length on it
    (blocks where it scored by block hashes; 0 where not looked up)."""

    replica: Hashable
    reason: str
    matched: int = 0


class RoutingPolicy:
    """Picks among `candidates` (replica -> load; never empty) for a request with `key` and,
    where known, its prompt's block `hashes`. `routed` tells the policy where a request went
    (the tree learns it); `forget` drops a replica that left."""

    name = ""

    def choose(self, candidates: dict[Hashable, float], key: Sequence,
               hashes: Sequence[bytes] | None = None) -> Choice:
        raise NotImplementedError

    def routed(self, replica: Hashable, key: Sequence) -> None:
        pass

    def forget(self, replica: Hashable) -> None:
        pass


class RoundRobin(RoutingPolicy):
    name = "round_robin"

    def __init__(self) -> None:
        self.next = 0

    def choose(self, candidates, key, hashes=None):
        order = list(candidates)
        pick = order[self.next % len(order)]
        self.next += 1
        return Choice(pick, self.name)


class LeastLoad(RoutingPolicy):
    """The least loaded; among equals, the longest prefix match when a tree is kept
    (`tree=True`: the data-parallel front's default), else the first. With `blocks` and a
    request's hashes, among equals the one holding most of its leading blocks."""

    name = "least_load"

    def __init__(self, tree: bool = False, max_tree_size: int = 2**20,
                 blocks: BlockIndex | None = None) -> None:
        self.tree = PrefixTree() if tree else None
        self.max_tree_size = max_tree_size
        self.blocks = blocks

    def choose(self, candidates, key, hashes=None):
        low = min(candidates.values())
        tied = [r for r, load in candidates.items() if load == low]
        if len(tied) > 1 and self.blocks is not None and hashes:
            per = self.blocks.matched(tied, hashes)
            pick = max(tied, key=lambda r: (per[r], -self.blocks.size(r)))
            return Choice(pick, self.name, per[pick])
        if len(tied) == 1 or self.tree is None:
            return Choice(tied[0], self.name)
        _, per = self.tree.match(key)
        pick = max(tied, key=lambda r: (per.get(r, 0), -self.tree.size(r)))
        return Choice(pick, self.name, per.get(pick, 0))

    def routed(self, replica, key):
        if self.tree is not None:
            self.tree.insert(key, replica)
            bound_tree(self.tree, replica, self.max_tree_size)

    def forget(self, replica):
        if self.tree is not None:
            self.tree.remove_tenant(replica)
        if self.blocks is not None:
            self.blocks.cleared(replica)


class PowerOfTwo(RoutingPolicy):
    """Two candidates at random, the less loaded of them."""

    name = "power_of_two"

    def __init__(self, seed: int | None = None) -> None:
        self.rng = random.Random(seed)

    def choose(self, candidates, key, hashes=None):
        order = list(candidates)
        if len(order) == 1:
            return Choice(order[0], self.name)
        a, b = self.rng.sample(order, 2)
        return Choice(a if candidates[a] <= candidates[b] else b, self.name)


class CacheAware(RoutingPolicy):
    name = "cache_aware"

    def __init__(self, config: CacheAwareConfig | None = None,
                 blocks: BlockIndex | None = None) -> None:
        self.config = config or CacheAwareConfig()
        self.tree = PrefixTree()
        self.blocks = blocks

    def choose(self, candidates, key, hashes=None):
        cfg = self.config
        loads = candidates.values()
        high, low = max(loads), min(loads)
        if high - low > cfg.balance_abs_threshold and high > cfg.balance_rel_threshold * low:
            pick = min(candidates, key=candidates.__getitem__)
            return Choice(pick, "balance")
        if self.blocks is not None and hashes:
            return self._by_blocks(candidates, hashes)
        _, per = self.tree.match(key)
        per = {r: n for r, n in per.items() if r in candidates}
        if per:
            pick = max(per, key=lambda r: (per[r], -candidates[r]))
            if len(key) and per[pick] / len(key) > cfg.cache_threshold:
                return Choice(pick, "cache_hit", per[pick])
        pick = min(candidates, key=lambda r: (self.tree.size(r), candidates[r]))
        return Choice(pick, "smallest_tree", per.get(pick, 0))

    def _by_blocks(self, candidates, hashes):
        """The replica holding the longest run of the prompt's leading blocks (the less loaded
        among equals); where none holds even the first, the one holding the fewest blocks.
        No `cache_threshold` here: the tree's guess needs one, while a block a replica reports
        is a block it will not compute again (measured: with the threshold, sessions whose
        replica kept under half of their prompt moved to one that held none of it, and hit
        less, benchmarks/router_cache_aware.py under cache pressure)."""
        per = self.blocks.matched(list(candidates), hashes)
        pick = max(per, key=lambda r: (per[r], -candidates[r]))
        if per[pick]:
            return Choice(pick, "kv_cache_hit", per[pick])
        pick = min(candidates, key=lambda r: (self.blocks.size(r), candidates[r]))
        return Choice(pick, "fewest_blocks", 0)

    def routed(self, replica, key):
        self.tree.insert(key, replica)
        bound_tree(self.tree, replica, self.config.max_tree_size)

    def forget(self, replica):
        self.tree.remove_tenant(replica)
        if self.blocks is not None:
            self.blocks.cleared(replica)


def bound_tree(tree: PrefixTree, replica: Hashable, capacity: int) -> None:
    """Past `capacity`, evict down to 90% of it (so that eviction, which walks the replica's
    nodes, runs once per tenth of the capacity rather than on every insert)."""
    if tree.size(replica) > capacity:
        tree.evict(replica, capacity * 9 // 10)


def make_policy(name: str, config: CacheAwareConfig | None = None, tree_ties: bool = False,
                seed: int | None = None, blocks: BlockIndex | None = None) -> RoutingPolicy:
    """The policy called `name` (one of POLICIES); `tree_ties`: least_load breaks ties by the
    longest prefix match; `blocks`: the replicas' KV events, for cache_aware and least_load."""
    if name == "round_robin":
        return RoundRobin()
    if name == "least_load":
        size = (config or CacheAwareConfig()).max_tree_size
        return LeastLoad(tree=tree_ties, max_tree_size=size, blocks=blocks)
    if name == "power_of_two":
        return PowerOfTwo(seed)
    if name == "cache_aware":
        return CacheAware(config, blocks)
    raise ValueError(f"routing policy must be one of {', '.join(POLICIES)}, got {name!r}")
