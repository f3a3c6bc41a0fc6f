"""An empty, frozen weight of a given shape: what a module declares and a loader fills."""
from __future__ import annotations

import torch
from torch import nn


def weight(*shape: int, dtype: torch.dtype, device) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)
