"""Where the engine's memory goes, for the start-up line: the weights as loaded (packed
copies included), the KV cache as allocated, and the runtime (Python, torch, the tokenizer,
scratch: the resident set less the other two), with the resident set and its peak as the
kernel counts them (/proc/self/status; RssFile: pages of mapped files, shared with every
process that maps them)."""
from __future__ import annotations


def process_memory() -> dict[str, int]:
    """VmRSS, VmHWM (the peak), RssAnon and RssFile of this process in bytes ({} without /proc)."""
    out: dict[str, int] = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                    out[key] = int(value.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return {}
    return out


def kv_cache_bytes(kv_caches) -> int:
    """The bytes of a runner's KV cache tensors, each once (layers may share one)."""
    seen: dict[int, int] = {}
    for pair in kv_caches or ():
        for t in pair or ():
            if t is not None and hasattr(t, "data_ptr"):
                seen[t.data_ptr()] = t.numel() * t.element_size()
    return sum(seen.values())


def memory_line(weights: int, kv: int) -> str:
    """"memory: weights W MB, KV K MB, runtime R MB (RSS ..., peak ...)" for this process."""
    mem = process_memory()
    mb = lambda b: f"{b / 1e6:.0f} MB"
    if not mem:
        return f"memory: weights {mb(weights)}, KV {mb(kv)}"
    rss = mem["VmRSS"]
    return (f"memory: weights {mb(weights)}, KV {mb(kv)}, runtime {mb(max(rss - weights - kv, 0))} "
            f"(RSS {mb(rss)}: {mb(mem.get('RssAnon', 0))} anonymous, {mb(mem.get('RssFile', 0))} "
            f"file-backed; peak {mb(mem.get('VmHWM', rss))})")
