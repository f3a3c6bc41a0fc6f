"""The CPU's name and feature flags as /proc/cpuinfo gives them, read in one place for the
kernel selection, the kernel build's cache key and the benchmarks' machine lines."""
from __future__ import annotations

import functools
import platform
from dataclasses import dataclass


@dataclass(frozen=True)
class CpuInfo:
    model_name: str
    flags: frozenset[str]


@functools.cache
def read_cpuinfo() -> CpuInfo:
    """The first processor's `model name` and `flags` (empty where /proc/cpuinfo cannot be
    read, e.g. not on Linux)."""
    model, flags = "", ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and not model:
                    model = line.partition(":")[2].strip()
                elif line.startswith("flags") and not flags:
                    flags = line.partition(":")[2]
                if model and flags:
                    break
    except OSError:
        pass
    return CpuInfo(model or platform.processor() or "unknown CPU", frozenset(flags.split()))
