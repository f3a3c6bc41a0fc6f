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
import threading
import weakref

import numpy as np
import torch

from kvflow.csrc import load_library
from kvflow import envs

HUGE_PAGE = 2 << 20


def zeros(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A zeroed 1-D CPU tensor, 2 MiB-aligned and advised onto huge pages."""
    nbytes = numel * dtype.itemsize
    if nbytes == 0:
        return torch.zeros(0, dtype=dtype)
    huge = envs.KVFLOW_HUGEPAGES and hasattr(mmap, "MADV_HUGEPAGE")
    if not huge:
        # its own mapping, advised off huge pages: a malloc'd buffer can sit in a heap region
        # that numpy (which advises its large buffers) or the THP "always" mode put on them
        region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if hasattr(mmap, "MADV_NOHUGEPAGE"):
            try:
                region.madvise(mmap.MADV_NOHUGEPAGE)
            except OSError:
                pass
        return torch.from_numpy(np.frombuffer(region, dtype=np.uint8)).view(dtype)
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


class Populator:
    """Faults in the pages of equally laid out buffers (the per-layer K and V caches) a little
    ahead of where they are written, from a daemon thread at idle priority, without changing
    what they hold.

    On the VMs kvflow is measured on, the first write to fresh memory costs ~1-5 ms per 2 MiB
    page (the host backs it on demand): W1 spent ~2.5 s of its KV writes in page faults, in
    the step's serial part. Here that work moves to whatever core time the steps leave idle.
    Only `lead` bytes past the furthest write are populated, so the resident size still
    follows use."""

    def __init__(self, buffers: list[torch.Tensor], lead: int = 8 * HUGE_PAGE) -> None:
        self._refs = [weakref.ref(b) for b in buffers]  # the engine owns them, not this thread
        self._size = max((b.numel() * b.element_size() for b in buffers), default=0)
        self._lead = lead
        self._target = lead
        self._cond = threading.Condition()
        lib = load_library()
        self.thread = threading.Thread(target=self._run, args=(lib,), name="kvflow-populate",
                                       daemon=True)
        if lib is not None and buffers:
            self.thread.start()

    def need(self, nbytes: int) -> None:
        """Each buffer's first `nbytes` are about to be written."""
        if nbytes + self._lead > self._target:
            with self._cond:
                self._target = nbytes + self._lead
                self._cond.notify()

    def _run(self, lib) -> None:
        try:  # this thread only: the OS runs it when a core has nothing else to do
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        except (AttributeError, OSError):
            pass
        offset = 0
        while offset < self._size:
            with self._cond:
                while self._target <= offset:
                    if not self._cond.wait(timeout=1.0) and any(r() is None for r in self._refs):
                        return
            if not self._populate(lib, offset):
                return
            offset += HUGE_PAGE

    def _populate(self, lib, offset: int) -> bool:
        """Fault in [offset, offset + 2 MiB) of every buffer; False if one was freed."""
        buffers = [r() for r in self._refs]  # held (so still mapped) while their pages are touched
        if any(b is None for b in buffers):
            return False
        for b in buffers:
            nbytes = b.numel() * b.element_size()
            if offset < nbytes:  # a ctypes call: the GIL is released while it faults
                lib.populate_pages(b.data_ptr() + offset, min(HUGE_PAGE, nbytes - offset), mmap.PAGESIZE)
        return True
