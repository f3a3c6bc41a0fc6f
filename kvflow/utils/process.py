"""Helper processes that must not outlive the process that started them: the engine core (child
of the frontend), the tensor-parallel workers (children of the engine or of a worker node) and
the tests' servers."""
from __future__ import annotations

import ctypes
import os
import signal

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Have the kernel send `sig` to this process when its parent dies (Linux's
    PR_SET_PDEATHSIG). Elsewhere nothing happens, so callers also check `parent_alive`. Usable
    as a subprocess `preexec_fn`."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, sig)
    except (OSError, AttributeError):
        pass  # not Linux (or no glibc)


def parent_alive(parent_pid: int) -> bool:
    """Whether `parent_pid` is still this process's parent (an orphan is adopted by another)."""
    return os.getppid() == parent_pid


def start_child_process(parent_pid: int | None) -> bool:
    """Set up a helper process started by `parent_pid`: Ctrl+C reaches the whole process group,
    so it is ignored here and the parent decides when this process stops; the process dies with
    its parent (when `parent_pid` is given). False when the parent is already gone, having died
    before the death signal was armed."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if parent_pid is None:
        return True
    die_with_parent()
    return parent_alive(parent_pid)


def pid_alive(pid: int | None) -> bool:
    """Whether a process `pid` exists on this machine (None: unknown, taken as alive)."""
    if pid is None:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
