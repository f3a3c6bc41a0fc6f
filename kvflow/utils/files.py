"""Durable cache files: a lock that makes concurrent starts convert once, and fsync before the
rename that publishes a file or folder, so that a crash never leaves a torn one in place."""
from __future__ import annotations

import contextlib
import fcntl
import os


@contextlib.contextmanager
def file_lock(path: str):
    """An exclusive advisory lock on `path` (created if missing), held for the `with` block;
    released by the kernel if the process dies."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def fsync_path(path: str) -> None:
    """Flush a file, or a folder's entries, to disk."""
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if os.path.isdir(path) else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(tmp: str, target: str) -> None:
    """Make the finished file or folder `tmp` appear at `target` atomically and durably: its
    data (each file of a folder) first, then the rename, then the parent folder's entry."""
    if os.path.isdir(tmp):
        for name in os.listdir(tmp):
            fsync_path(os.path.join(tmp, name))
    fsync_path(tmp)
    os.replace(tmp, target)
    fsync_path(os.path.dirname(target) or ".")
