"""KV cache specs: what one kind of layer keeps across steps, as the scheduler sees it.

A model declares one spec per KV cache group (groups.py); the coordinator builds one manager
per spec and the scheduler never asks which kinds there are. Sizes in bytes per token or per
block are the engine's business (it owns the tensors); the core counts blocks and slots only,
so no torch here."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class KVCacheSpec:
    """The base of every spec: a layer kind whose memory outlives one step."""


@dataclass(frozen=True)
class AttentionSpec(KVCacheSpec):
    """Layers that keep K and V per token: `num_kv_heads` x `head_size` each (vLLM's names;
    0: the model's one shape). Layers of different shapes are different specs, so they form
    different KV cache groups, each with tensors of its own shape (groups.py)."""

    num_kv_heads: int = field(default=0, kw_only=True)
    head_size: int = field(default=0, kw_only=True)


@dataclass(frozen=True)
class FullAttentionSpec(AttentionSpec):
    """Layers that attend to the whole context: one block per `block_size` positions, held
    until the request ends, findable by the prefix cache."""


@dataclass(frozen=True)
class SlidingWindowSpec(AttentionSpec):
    """Layers that attend to the last `sliding_window` positions only: blocks wholly before the
    window go back to the pool while the request runs."""

    sliding_window: int

    def __post_init__(self) -> None:
        if self.sliding_window <= 0:
            raise ValueError(f"sliding_window must be positive, got {self.sliding_window}")


@dataclass(frozen=True)
class StateSpec(KVCacheSpec):
    """Layers that keep a fixed-size state per request, however long it is (Mamba2, Gated
    DeltaNet, short convolutions: a conv window plus a recurrent state): one slot of
    `bytes_per_request` from a state pool while the request runs. A state exists only at the
    request's latest position, so no prefix of it is ever found in the cache again."""

    bytes_per_request: int
    # the layers can keep a copy of a request's state at a block boundary for the prefix cache
    # (state.py's snapshots); False: such a model never gets a prefix-cache hit
    snapshots: bool = True

    def __post_init__(self) -> None:
        if self.bytes_per_request <= 0:
            raise ValueError(f"bytes_per_request must be positive, got {self.bytes_per_request}")
