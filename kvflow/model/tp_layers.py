"""The two layers that change shape under tensor parallelism: the vocab-parallel embedding and
the vocab-parallel LM head. (Row-parallel O and down are plain matmuls plus `tp.all_reduce`.)

`tp` is anything with `rank`, `world_size`, `all_reduce(t)` and `gather_to_driver(t)`, such
as kvflow.distributed.parallel.TPGroup."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def vocab_parallel_embedding(input_ids: torch.Tensor, weight: torch.Tensor, tp) -> torch.Tensor:
    """Each rank looks up the ids in its own vocab rows (zeros elsewhere); the sum over ranks
    is the full embedding."""
    start = tp.rank * weight.shape[0]
    local = input_ids - start
    outside = (local < 0) | (local >= weight.shape[0])
    x = F.embedding(local.masked_fill(outside, 0), weight)
    x.masked_fill_(outside.unsqueeze(-1), 0)
    return tp.all_reduce(x)


def gather_vocab_logits(local_logits: torch.Tensor, vocab_size: int, tp) -> torch.Tensor | None:
    """Each rank's logits over its vocab rows -> the full [S, vocab] on the driver (padding
    dropped); None on the other ranks, which do not sample."""
    logits = tp.gather_to_driver(local_logits)
    return None if logits is None else logits[:, :vocab_size]
