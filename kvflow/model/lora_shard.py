"""LoRA adapters under tensor and pipeline parallelism: each rank keeps the part of an adapter
that its shard of the model uses, cut as the projection it modifies is cut (vLLM's
column- and row-parallel LoRA layers; kvflow/model/sharding.py cuts the base weights).

- Column-parallel projections (q|k|v, gate|up: a rank computes some heads, some MLP rows):
  A [r, in] whole, B [out, r] cut to the rank's output rows, per slice of the fused projection
  (a KV head replicated over ranks when there are fewer KV heads than ranks: its B rows too).
- Row-parallel projections (o, down: a rank holds some input columns): A cut to the rank's
  input columns, B whole. Each rank adds B A_r x_r to its partial sum before the all-reduce,
  which then sums to B (sum_r A_r x_r) = B A x.
- Pipeline parallelism: a stage keeps its own layers' weights only, numbered from its first.

The whole adapter is read and checked against the whole model on every rank (the same errors
everywhere), then cut; only the rank's part stays in host memory."""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from kvflow.model.sharding import ShardLayout, shard_layout

COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW_PARALLEL = ("o_proj", "down_proj")


@dataclass(frozen=True)
class LoRAShard:
    """Which part of every adapter a rank keeps: `layout` its heads and MLP rows (None: all of
    them), `layers` its stage's decoder layers (global indices)."""

    layout: ShardLayout | None
    layers: range


def lora_shard_of(model, first_layer: int = 0) -> LoRAShard | None:
    """The part of each adapter `model` (a rank's shard, holding `model.layers` from
    `first_layer` on) uses; None for the whole model in one process."""
    arch, tp = model.arch, model.tp
    layers = range(first_layer, first_layer + len(model.layers))
    if tp is None and layers == range(arch.num_hidden_layers):
        return None
    layout = shard_layout(arch, tp.rank, tp.world_size) if tp is not None else None
    return LoRAShard(layout, layers)


def _rows(module: str, layout: ShardLayout, head_dim: int) -> slice:
    """The rank's output rows of a column-parallel module (its input columns of a row-parallel
    one): the same indices the base weight is cut at."""
    if module in ("q_proj", "o_proj"):
        return slice(layout.q_head_start * head_dim, (layout.q_head_start + layout.num_heads) * head_dim)
    if module in ("k_proj", "v_proj"):
        return slice(layout.kv_head_start * head_dim,
                     (layout.kv_head_start + layout.num_kv_heads) * head_dim)
    return slice(layout.inter_start, layout.inter_start + layout.intermediate_size)


def slice_lora_a(module: str, a: torch.Tensor, layout: ShardLayout, head_dim: int) -> torch.Tensor:
    """A [r, in]: cut by input columns for a row-parallel module, whole otherwise."""
    return a[:, _rows(module, layout, head_dim)] if module in ROW_PARALLEL else a


def slice_lora_b(module: str, b: torch.Tensor, layout: ShardLayout, head_dim: int) -> torch.Tensor:
    """B [out, r]: cut by output rows for a column-parallel module, whole otherwise."""
    return b[_rows(module, layout, head_dim)] if module in COLUMN_PARALLEL else b


def shard_adapter(adapter, shard: LoRAShard, head_dim: int):
    """The rank's part of a LoRAAdapter (model/lora.py): its layers (renumbered from the
    stage's first) and, under tensor parallelism, its slices of A and B."""
    weights = {}
    for (layer, module), (a, b) in adapter.weights.items():
        if layer not in shard.layers:
            continue
        if shard.layout is not None:
            a = slice_lora_a(module, a, shard.layout, head_dim).contiguous()
            b = slice_lora_b(module, b, shard.layout, head_dim).contiguous()
        weights[(layer - shard.layers.start, module)] = (a, b)
    return replace(adapter, weights=weights)
