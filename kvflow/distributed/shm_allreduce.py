"""All-reduce through shared memory, for ranks on one machine (vLLM's CPU backend does the same).

Gloo's all-reduce goes through loopback TCP: a few round trips and wake-ups per call, about a
millisecond even when idle, and 61 calls per step for a 30-layer model. Here each rank copies
its partial sum into its own slot of a /dev/shm file, publishes a sequence number, waits until
every rank has published, and adds the slots up in rank order (so every rank gets bit-identical
sums). Slots alternate between two banks: a rank may overwrite a bank only after every rank has
published the next call, i.e. finished reading this one.

Waiting spins briefly, then yields the core (this machine may have fewer cores than ranks), and
every few milliseconds asks `abort_check` whether a rank has died, since a dead rank would
never publish."""
from __future__ import annotations

import mmap
import os
import platform
import re
import tempfile
import time
from collections.abc import Callable

import numpy as np
import torch

from kvflow import envs
from kvflow.utils.shm_files import SHM_DIR, sweep_dead_owners

_LINE = 64  # one sequence counter per cache line (no false sharing)
MAX_SLOT_BYTES = 8 << 20  # larger tensors (long prefill chunks) go through gloo
_CHECK_S = 0.01
_NAME = re.compile(r"^kvflow-tp-(\d+)-")


def shm_supported() -> bool:
    """x86's memory order keeps 'write the slot, then the counter' visible in that order."""
    return platform.machine().lower() in ("x86_64", "amd64") and os.path.isdir(SHM_DIR)


def create_segment(world_size: int, slot_bytes: int) -> str | None:
    """A zeroed shared file for `world_size` slots in two banks; its path, or None when /dev/shm
    has no room for it (the space is reserved now: a full tmpfs would otherwise SIGBUS later). Its
name carries this process's id: a start removes the segments of drivers killed before every
rank had mapped it (and it was unlinked)."""
    sweep_dead_owners(_NAME)
    fd, path = tempfile.mkstemp(prefix=f"kvflow-tp-{os.getpid()}-", dir=SHM_DIR)
    try:
        os.posix_fallocate(fd, 0, _size(world_size, slot_bytes))
    except OSError:
        os.unlink(path)
        return None
    finally:
        os.close(fd)
    return path


def _size(world_size: int, slot_bytes: int) -> int:
    return world_size * _LINE + 2 * world_size * slot_bytes


class ShmAllReduce:
    """Sum of a CPU tensor over the ranks of one machine (see the module docstring)."""

    def __init__(self, path: str, rank: int, world_size: int, slot_bytes: int,
                 abort_check: Callable[[], str | None]) -> None:
        self.rank, self.world_size, self.slot_bytes = rank, world_size, slot_bytes
        self.abort_check = abort_check
        with open(path, "r+b") as f:
            self._mmap = mmap.mmap(f.fileno(), _size(world_size, slot_bytes))
        buf = np.frombuffer(self._mmap, dtype=np.uint8)
        head = world_size * _LINE
        self._seq = buf[:head].view(np.int64)[::_LINE // 8]  # [world_size] counters
        self._data = torch.from_numpy(buf[head:]).view(2, world_size, slot_bytes)
        self._n = 0

    def fits(self, t: torch.Tensor) -> bool:
        return t.device.type == "cpu" and t.numel() * t.element_size() <= self.slot_bytes

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        """Sum `t` over the ranks, in place (all ranks call this with the same shape)."""
        self._n += 1
        n, nbytes = self._n, t.numel() * t.element_size()
        bank = self._data[n & 1]
        flat = t.view(-1) if t.is_contiguous() else t.reshape(-1)
        bank[self.rank, :nbytes].view(t.dtype).copy_(flat)
        self._seq[self.rank] = n
        self._wait(n)
        out = flat if flat.data_ptr() == t.data_ptr() else torch.empty_like(flat)
        out.copy_(bank[0, :nbytes].view(t.dtype))
        for r in range(1, self.world_size):
            out.add_(bank[r, :nbytes].view(t.dtype))
        if out is not flat:
            t.copy_(out.view(t.shape))
        return t

    def _wait(self, n: int) -> None:
        seq = self._seq
        max_spins, max_yields, sleep_s = envs.KVFLOW_SHM_SPINS, envs.KVFLOW_SHM_YIELDS, envs.KVFLOW_SHM_SLEEP
        spins = 0
        next_check = 0.0
        while seq.min() < n:
            spins += 1
            if spins < max_spins:
                continue
            if spins < max_yields:
                os.sched_yield()
            else:  # the peer is not running: give the core away for real
                time.sleep(sleep_s)
            now = time.monotonic()
            if now >= next_check:
                if next_check:
                    why = self.abort_check()
                    if why:
                        raise RuntimeError(why)
                next_check = now + _CHECK_S

    def close(self) -> None:
        self._seq = self._data = None
        try:
            self._mmap.close()
        except BufferError:
            pass  # a view is still alive somewhere; the mapping goes with the process
