"""The KV cache's memory: zeroed, 2 MiB-aligned, on huge pages where THP allows it, and
faulted in ahead of the writes by the populator thread."""
import ctypes
import gc
import mmap
import time

import pytest
import torch

from kvflow.csrc import load_library
from kvflow.model import hugepages


def _thp_mode() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return "never"


def _smaps_field(addr: int, field: str) -> list[str]:
    """The values of `field` (e.g. "AnonHugePages:", "VmFlags:") for the mapping that holds
    `addr`, from /proc/self/smaps ([] where there is none)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == field:
                return line.split()[1:]
    return []


def _anon_huge_kib(addr: int) -> int:
    """AnonHugePages of the mapping that holds `addr`."""
    values = _smaps_field(addr, "AnonHugePages:")
    return int(values[0]) if values else 0


def test_zeros_are_zero_aligned_and_writable():
    t = hugepages.zeros(3 * (1 << 20) + 5, torch.bfloat16)
    assert t.dtype == torch.bfloat16 and t.numel() == 3 * (1 << 20) + 5
    assert t.data_ptr() % hugepages.HUGE_PAGE == 0
    assert not t.any()
    t[-1] = 1.5
    assert t[-1].item() == 1.5 and t.sum().item() == 1.5


def test_touched_memory_lands_on_huge_pages_where_thp_allows():
    t = hugepages.zeros(8 << 20, torch.uint8)
    t.fill_(1)
    huge = _anon_huge_kib(t.data_ptr())
    if _thp_mode() in ("always", "madvise"):
        assert huge >= 4096, f"{huge} KiB on huge pages"  # at least two of the four 2 MiB pages
    else:
        assert huge == 0


def _vm_flags(addr: int) -> list[str]:
    """VmFlags of the mapping that holds `addr` ("hg": advised onto huge pages)."""
    return _smaps_field(addr, "VmFlags:")


def test_opt_out_gives_ordinary_zeroed_memory(monkeypatch):
    monkeypatch.setenv("KVFLOW_HUGEPAGES", "0")
    t = hugepages.zeros(8 << 20, torch.uint8)
    t.fill_(1)
    assert t.sum().item() == 8 << 20
    # nobody advised it (numpy advises its own large buffers, so the opt-out must not use them)
    assert "hg" not in _vm_flags(t.data_ptr() + (4 << 20))  # inside its 2 MiB-aligned part
    if _thp_mode() != "always":  # "always" would give any big allocation huge pages
        assert _anon_huge_kib(t.data_ptr()) == 0


def _resident_pages(t: torch.Tensor) -> list[bool]:
    """mincore(2): which of the 4 KiB pages under `t` are in memory."""
    libc = ctypes.CDLL(None, use_errno=True)
    page = mmap.PAGESIZE
    n = t.numel() * t.element_size() // page
    vec = (ctypes.c_ubyte * n)()
    assert libc.mincore(ctypes.c_void_p(t.data_ptr()), ctypes.c_size_t(n * page), vec) == 0
    return [bool(v & 1) for v in vec]


def _wait_for(cond, timeout: float = 30.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


def test_populator_faults_pages_in_ahead_of_writes_and_keeps_their_contents():
    if load_library() is None:
        pytest.skip("no C compiler here: the populator has nothing to run")
    mib = 1 << 20
    buffers = [hugepages.zeros(16 * mib, torch.uint8) for _ in range(3)]
    buffers[1][5] = 7  # touched before: stays as written
    assert not any(_resident_pages(buffers[0])), "fresh buffers start unpopulated"
    lead = 2 * hugepages.HUGE_PAGE
    pop = hugepages.Populator(buffers, lead=lead)
    for b in buffers:  # the lead is populated at once, nothing past it
        assert _wait_for(lambda: all(_resident_pages(b)[:lead // mmap.PAGESIZE]))
    time.sleep(0.2)
    assert not any(_resident_pages(buffers[2])[2 * lead // mmap.PAGESIZE:])
    pop.need(10 * mib)  # writes reach 10 MiB: populated to 10 MiB + lead
    for b in buffers:
        assert _wait_for(lambda: all(_resident_pages(b)[:(10 * mib + lead) // mmap.PAGESIZE]))
    pop.need(64 * mib)  # past the end: the whole buffers, then the thread is done
    pop.thread.join(timeout=30)
    assert not pop.thread.is_alive()
    assert all(all(_resident_pages(b)) for b in buffers)
    assert buffers[1][5].item() == 7 and int(buffers[1].sum()) == 7
    assert int(buffers[0].sum()) == int(buffers[2].sum()) == 0


def test_populator_stops_when_its_buffers_are_freed():
    if load_library() is None:
        pytest.skip("no C compiler here: the populator has nothing to run")
    buffers = [hugepages.zeros(8 << 20, torch.uint8)]
    pop = hugepages.Populator(buffers, lead=hugepages.HUGE_PAGE)
    assert pop.thread.is_alive()
    del buffers
    gc.collect()
    pop.thread.join(timeout=10)  # it notices within its one-second wait
    assert not pop.thread.is_alive()
