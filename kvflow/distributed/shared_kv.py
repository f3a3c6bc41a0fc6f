"""A tensor-parallel rank's KV cache in a shared file, so that the driver can reach it.

KV transfer between instances (kvflow/kv_transfer) runs in the driver's process, but under
tensor parallelism each rank holds only its KV heads' share of every block. When the engine
lends or pulls blocks, the driver creates one file per other rank in /dev/shm, each rank lays
its cache out in its file (the same tensors, in the same order, as anonymous memory would
hold), and the driver maps the same files: it reads and writes every rank's share directly,
between steps, with no collective and no change to the step. The files are unlinked once
every rank has them mapped; their names carry the driver's pid, so that a start removes what
a driver killed before that point left behind (sweep_orphans). One machine only."""
from __future__ import annotations

import mmap
import os
import re
import tempfile

import numpy as np
import torch

from kvflow.utils.shm_files import SHM_DIR, sweep_dead_owners

_ALIGN = 4096  # each tensor starts on its own page
_NAME = re.compile(r"^kvflow-tpkv-(\d+)-")


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def kv_segment_bytes(num_layers: int, tensor_numel: int, dtype: torch.dtype) -> int:
    """Bytes of one rank's file: K and V of every layer, `tensor_numel` elements each."""
    return 2 * num_layers * _aligned(tensor_numel * dtype.itemsize)


def create_kv_segment(nbytes: int) -> str:
    """A zeroed shared file of `nbytes`, its space reserved now (a full tmpfs would otherwise
    kill a rank with SIGBUS at its first write); OSError naming the size if there is no room."""
    fd, path = tempfile.mkstemp(prefix=f"kvflow-tpkv-{os.getpid()}-", dir=SHM_DIR)
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as e:
        os.unlink(path)
        raise OSError(f"KV transfer under tensor parallelism keeps each rank's KV cache in "
                      f"/dev/shm; {nbytes / 2**20:.0f} MiB do not fit there ({e})") from None
    finally:
        os.close(fd)
    return path


def sweep_orphans() -> None:
    """Remove segments of drivers that are gone (killed between creating and unlinking them)."""
    sweep_dead_owners(_NAME)


class SharedKVMemory:
    """A mapped segment handed out front to back: `zeros` has allocate_kv_caches's signature,
    so the rank that owns the cache and the driver that maps it see the same tensors."""

    def __init__(self, path: str) -> None:
        with open(path, "r+b") as f:
            self._mm = mmap.mmap(f.fileno(), 0)
        self._buf = np.frombuffer(self._mm, dtype=np.uint8)
        self._at = 0

    def zeros(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        nbytes = numel * dtype.itemsize
        if self._at + nbytes > self._buf.size:
            raise ValueError(f"the shared KV segment holds {self._buf.size} bytes; "
                             f"{self._at + nbytes} asked")
        out = torch.from_numpy(self._buf[self._at:self._at + nbytes]).view(dtype)
        self._at += _aligned(nbytes)
        return out
