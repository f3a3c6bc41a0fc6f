"""Encoder outputs kept across steps and requests (vLLM's encoder cache): an image's output is
looked up by its content hash, so two requests with the same image (or one recomputed after
preemption) encode it once. The encoder's output depends only on the image's pixel values and
the weights, so a hit is exactly what the encoder would compute again."""
from __future__ import annotations

from collections import OrderedDict

import torch


class EncoderCache:
    """Up to `capacity` image tokens of encoder outputs, least recently used out first (0: keep
    none). Every rank of a parallel engine sees the same steps in the same order, so each
    keeps the same entries and they run the encoder (and its collectives) together."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.outputs: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.num_tokens = 0

    def get(self, identifier: str) -> torch.Tensor | None:
        out = self.outputs.get(identifier)
        if out is not None:
            self.outputs.move_to_end(identifier)
        return out

    def put(self, identifier: str, output: torch.Tensor) -> None:
        """Keep one image's output [tokens, hidden] (a copy: not a view of the step's batch)."""
        n = output.shape[0]
        if n > self.capacity or identifier in self.outputs:
            return
        while self.num_tokens + n > self.capacity:
            _, old = self.outputs.popitem(last=False)
            self.num_tokens -= old.shape[0]
        self.outputs[identifier] = output.clone()
        self.num_tokens += n
