"""Shared-memory staging for KV pulls between two instances on one host.

The producer copies a pull's blocks into a staging file in /dev/shm and names it in its answer;
the consumer copies them from its mapping of that file into its own cache, then says DONE, and
the file goes back to the producer's pool. Files are reused, not made per pull: a fresh tmpfs
page costs a fault and a zeroing on each side, which made a new file per pull slower than the
loopback socket. Names carry the producer's pid, so a later start removes what a killed one
left behind."""
from __future__ import annotations

import mmap
import os
import re
import uuid

import torch

from kvflow.utils.shm_files import SHM_DIR, sweep_dead_owners

_NAME = re.compile(r"^kvflow-kv-(\d+)-[0-9a-f]{32}$")
MAX_FILES = 32  # staging files per producer; more concurrent pulls go over the socket


def is_staging_path(path: str) -> bool:
    return os.path.dirname(path) == SHM_DIR and bool(_NAME.match(os.path.basename(path)))


def available() -> bool:
    return os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK)


def sweep_orphans() -> None:
    """Remove staging files of producers that are gone (killed before they could clean up)."""
    sweep_dead_owners(_NAME)


class Mapping:
    """One staging file mapped read-write, as a flat uint8 tensor."""

    def __init__(self, path: str, size: int | None = None) -> None:
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if size is not None else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if size is not None:
                os.ftruncate(fd, size)
            self.size = os.fstat(fd).st_size
            self.mm = mmap.mmap(fd, self.size)
        finally:
            os.close(fd)
        self.path = path
        self.tensor = torch.frombuffer(self.mm, dtype=torch.uint8)

    def close(self) -> None:
        del self.tensor
        try:
            self.mm.close()
        except BufferError:
            pass  # a view still lives; the mapping goes with it


class StagingPool:
    """The producer's staging files: one per pull in flight, reused after."""

    def __init__(self) -> None:
        sweep_orphans()
        self.free: list[Mapping] = []
        self.in_use: dict[str, Mapping] = {}  # transfer id -> its file

    def take(self, transfer_id: str, size: int) -> Mapping | None:
        fits = [mp for mp in self.free if mp.size >= size]
        if fits:
            mp = min(fits, key=lambda x: x.size)
            self.free.remove(mp)
        elif len(self.free) + len(self.in_use) < MAX_FILES:
            path = os.path.join(SHM_DIR, f"kvflow-kv-{os.getpid()}-{uuid.uuid4().hex}")
            mp = Mapping(path, max(size, 1 << 20))
        elif self.free:  # the largest free one is too small: grow it
            old = self.free.pop()
            old.close()
            os.unlink(old.path)
            mp = Mapping(old.path, size)
        else:
            return None
        self.in_use[transfer_id] = mp
        return mp

    def give_back(self, transfer_id: str) -> None:
        mp = self.in_use.pop(transfer_id, None)
        if mp is not None:
            self.free.append(mp)

    def close(self) -> None:
        for mp in self.free + list(self.in_use.values()):
            mp.close()
            try:
                os.unlink(mp.path)
            except OSError:
                pass
        self.free, self.in_use = [], {}


class MappingCache:
    """The consumer's mappings of producers' staging files, opened once each."""

    def __init__(self) -> None:
        self.maps: dict[str, Mapping] = {}

    def view(self, path: str, num_bytes: int) -> torch.Tensor:
        mp = self.maps.get(path)
        if mp is None or mp.size < num_bytes:  # new, or grown by the producer
            if mp is not None:
                mp.close()
            mp = self.maps[path] = Mapping(path)
        if mp.size < num_bytes:
            raise ValueError(f"staging file {path} holds {mp.size} bytes, the answer says {num_bytes}")
        return mp.tensor[:num_bytes]

    def close(self) -> None:
        for mp in self.maps.values():
            mp.close()
        self.maps = {}
