"""The KV cache's memory: zeroed, 2 MiB-aligned, and on huge pages where THP allows it."""
import torch

from kvflow.model import hugepages


def _thp_mode() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return "never"


def _anon_huge_kib(addr: int) -> int:
    """AnonHugePages of the mapping that holds `addr` (from /proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == "AnonHugePages:":
                return int(line.split()[1])
    return 0


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


def test_opt_out_gives_ordinary_zeroed_memory(monkeypatch):
    monkeypatch.setenv("KVFLOW_HUGEPAGES", "0")
    t = hugepages.zeros(8 << 20, torch.uint8)
    t.fill_(1)
    assert t.sum().item() == 8 << 20
    if _thp_mode() != "always":  # "always" would give any big allocation huge pages
        assert _anon_huge_kib(t.data_ptr()) == 0
