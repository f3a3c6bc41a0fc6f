"""Big, long-lived CPU buffers (the KV cache, packed weights) on 2 MiB pages where the kernel
grants them (transparent huge pages in "madvise" mode, as on most distributions).

Decode attention reads each request's KV blocks scattered over a cache of hundreds of MiB per
layer, and the projections stream every weight once per step: with 4 KiB pages both walk the
page tables on nearly every block. On 2 MiB pages the decode kernel ran a W1-sized step in
63 ms against 69 (benchmarks/decode_kernel.py). Memory is zero until first touched, as with
calloc. KVFLOW_HUGEPAGES=0 keeps ordinary pages."""
from __future__ import annotations

import mmap
import os

import numpy as np
import torch

HUGE_PAGE = 2 << 20


def zeros(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A zeroed 1-D CPU tensor, 2 MiB-aligned and advised onto huge pages."""
    nbytes = numel * dtype.itemsize
    if os.environ.get("KVFLOW_HUGEPAGES") == "0" or not hasattr(mmap, "MADV_HUGEPAGE") or nbytes == 0:
        return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype)
    # private anonymous memory: zero pages until written (mmap's default, a shared mapping,
    # is shmem, which THP's "madvise" mode does not cover)
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        region.madvise(mmap.MADV_HUGEPAGE)
    except OSError:
        pass  # THP off or unsupported: ordinary pages
    whole = np.frombuffer(region, dtype=np.uint8)  # keeps the mapping alive
    start = -whole.ctypes.data % HUGE_PAGE
    return torch.from_numpy(whole[start:start + nbytes]).view(dtype)


def copy_of(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of a CPU tensor in huge-page memory."""
    out = zeros(t.numel(), t.dtype).view(t.shape)
    out.copy_(t)
    return out
