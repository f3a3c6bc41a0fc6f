"""A step's attention metadata as device tensors, for the GPU attention kernels (kvflow/model/
triton/): the block tables, sequence lengths and query starts of kvflow/attention's
AttentionMetadata, one host-to-device copy per field, plus the decode split count and, under a
CUDA graph, the persistent buffers they live in. Built here without triton, so the runner and
its CPU tests do not import it."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

# keys a decode split should have before another split pays for its share of the merge
KEYS_PER_SPLIT = 256
MAX_SPLITS = 16


def num_decode_splits(max_seq_len: int) -> int:
    """Splits of the decode kernel for a batch whose longest sequence has `max_seq_len` keys:
    a power of two up to MAX_SPLITS, so a long context spreads over the GPU's cores."""
    want = max(1, -(-int(max_seq_len) // KEYS_PER_SPLIT))
    return min(MAX_SPLITS, 1 << (want - 1).bit_length())


@dataclass
class DeviceMetadata:
    """What the Triton attention reads. Row i of block_tables / seq_lens is sequence i of the
    step; query_start_loc [N + 1] its flat query rows. `workspace`: the decode kernel's
    split partials, preallocated under a CUDA graph (None: allocated per call)."""

    block_tables: torch.Tensor  # [N, max_blocks] int32
    seq_lens: torch.Tensor  # [N] int32
    query_start_loc: torch.Tensor  # [N + 1] int32
    max_query_len: int
    num_splits: int
    workspace: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def decode_only(self) -> bool:
        return self.max_query_len == 1


def device_metadata(block_tables: np.ndarray, seq_lens: np.ndarray, query_start_loc: np.ndarray,
                    device: torch.device | str) -> DeviceMetadata:
    """One step's arrays (kvflow/attention/metadata.py's AttentionMetadata fields) on `device`."""
    query_lens = np.diff(query_start_loc)

    def put(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int32)).to(device, non_blocking=True)

    return DeviceMetadata(put(block_tables), put(seq_lens), put(query_start_loc),
                          int(query_lens.max(initial=1)), num_decode_splits(seq_lens.max(initial=1)))
