"""Pooling: how a prompt's final hidden states become one vector (vLLM's PoolerConfig, the
engine's default, and PoolingParams, what one request may ask)."""
from __future__ import annotations

from dataclasses import dataclass

POOLING_TYPES = ("LAST", "MEAN", "CLS")


@dataclass
class PoolerConfig:
    """The engine's pooling, with vLLM's keys: `pooling_type` LAST (the last prompt token's
    hidden state, the default for decoder LMs), MEAN (the average over the prompt) or CLS (the
    first token's); `normalize`: scale the vector to unit length (default true). The hidden
    states are the model's last, after the final norm."""

    pooling_type: str = "LAST"
    normalize: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.pooling_type, str) or self.pooling_type.upper() not in POOLING_TYPES:
            raise ValueError(f"pooler_config.pooling_type must be one of {', '.join(POOLING_TYPES)}, "
                             f"got {self.pooling_type!r}")
        self.pooling_type = self.pooling_type.upper()
        if not isinstance(self.normalize, bool):
            raise ValueError(f"pooler_config.normalize must be true or false, got {self.normalize!r}")


@dataclass
class PoolingParams:
    """One pooling request's options (vLLM's PoolingParams): `normalize` overrides the
    engine's; `dimensions` (a Matryoshka model's truncation) is refused, since no model served
    here was trained for it. The engine fills `pooling_type` and `normalize` from its
    PoolerConfig when the request leaves them out (`resolved`)."""

    normalize: bool | None = None
    dimensions: int | None = None
    pooling_type: str | None = None  # set by the engine: the request does not choose it

    def __post_init__(self) -> None:
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be true or false, got {self.normalize!r}")
        if self.dimensions is not None:
            raise ValueError("dimensions: this model does not support truncating its embeddings "
                             "(it is not a Matryoshka model); leave dimensions out")
        if self.pooling_type is not None and self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type must be one of {', '.join(POOLING_TYPES)}, got "
                             f"{self.pooling_type!r}")

    def resolved(self, config: PoolerConfig) -> PoolingParams:
        """These params with every field the engine decides filled in."""
        return PoolingParams(
            normalize=config.normalize if self.normalize is None else self.normalize,
            pooling_type=self.pooling_type or config.pooling_type)

    @property
    def needs_every_position(self) -> bool:
        """Whether the pooled vector reads the hidden state of every prompt position (MEAN)
        or the first (CLS): then no prompt position may be skipped as a prefix-cache hit."""
        return self.pooling_type != "LAST"
