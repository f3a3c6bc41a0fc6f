"""Keep freed activation memory in the process instead of handing it back to the OS.

A forward allocates tens of MiB of activations and frees them again. glibc's malloc serves
such blocks with fresh mmaps (or trims them off its heap once freed), so every step gets
new pages and pays a page fault per 4 KiB when it first writes them: ~270-450k faults, ~10%
of a 2,048-token prefill step in fp32 on this machine. Pinning the mmap threshold and raising the
trim threshold makes malloc reuse its heap; the engine's memory then stays at its peak
working set (a few hundred MiB above the weights), which a server reaches anyway.

KVFLOW_MALLOC_TUNING=0 leaves malloc alone. Elsewhere than glibc this does nothing.

Loading is the opposite case: a model's float tensors are freed as their packed copies are
made, once, and what malloc keeps of them would stay resident for the engine's life, so the
loader hands the free heap back (`release_free_memory`) before the thresholds above are set."""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
from kvflow import envs

logger = logging.getLogger("kvflow")

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# glibc caps the mmap threshold at 32 MiB on 64-bit (HEAP_MAX_SIZE / 2): blocks above it
# (the KV cache, which is mapped separately anyway) still come straight from mmap.
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 1 << 30

_done = False


def retain_freed_memory() -> bool:
    """Tune glibc malloc once per process; True when the settings took effect."""
    global _done
    if _done:
        return True
    if not envs.KVFLOW_MALLOC_TUNING:
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    if not ok:
        logger.warning("kvflow: mallopt refused the thresholds; activations keep fresh pages")
    _done = ok
    return ok


def release_free_memory() -> bool:
    """Hand the free memory inside malloc's heaps back to the OS (glibc's malloc_trim): after
    a load that made and freed many large temporaries (one expert's codes and packing buffers
    at a time), the heap keeps their high-water mark otherwise. True where it ran."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):  # not glibc
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    trim(0)
    return True
