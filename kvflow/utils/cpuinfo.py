"""The CPU's name and feature flags as /proc/cpuinfo gives them, read in one place for the
kernel selection, the kernel build's cache key and the benchmarks' machine lines.

KVFLOW_CPU_ISA caps what kvflow sees (`CPU_ISA_CAPS`): `avx2` runs an AVX-512 machine as an
AVX2-only CPU (the Zen 3 kind), `avx512` as one without AVX512-BF16 or AMX (the Skylake / Ice Lake
kind), so each kind's paths can be measured end to end where only the other is at hand. The flags
lose what the cap takes, the C kernels are built for it (`march_flags`) and the model name says
so; kvflow/__init__.py caps PyTorch's own kernels to match when it loads first."""
from __future__ import annotations

import functools
import os
import platform
from dataclasses import dataclass

from kvflow import envs

@dataclass(frozen=True)
class IsaCap:
    """What KVFLOW_CPU_ISA's value takes away and how the builds follow it."""
    removes: tuple[str, ...]  # prefixes of the flags it removes
    march: tuple[str, ...]  # the compiler's target flags for the C kernels
    aten: str  # PyTorch's ATEN_CPU_CAPABILITY
    onednn: str  # oneDNN's ONEDNN_MAX_CPU_ISA


CPU_ISA_CAPS = {
    "avx2": IsaCap(("avx512", "amx", "avx_vnni", "avx10"), ("-march=x86-64-v3",), "avx2", "AVX2"),
    "avx512": IsaCap(("avx512_bf16", "avx512_fp16", "amx"),
                     ("-march=native", "-mno-avx512bf16", "-mno-amx-tile", "-mno-amx-bf16",
                      "-mno-amx-int8"), "avx512", "AVX512_CORE_VNNI"),
}


def cpu_isa_cap() -> str | None:
    """KVFLOW_CPU_ISA (None: unset or empty); anything but a key of CPU_ISA_CAPS is refused."""
    cap = envs.KVFLOW_CPU_ISA
    if cap is not None and cap not in CPU_ISA_CAPS:
        raise ValueError(f"KVFLOW_CPU_ISA={cap!r}: expected one of {', '.join(CPU_ISA_CAPS)}")
    return cap


def mask_flags(flags: frozenset[str], cap: str | None) -> frozenset[str]:
    """`flags` without what the cap takes away."""
    if cap is None:
        return flags
    return frozenset(f for f in flags if not f.startswith(CPU_ISA_CAPS[cap].removes))


def cap_torch_kernels() -> None:
    """Under a cap, PyTorch's ATEN_CPU_CAPABILITY and oneDNN's ONEDNN_MAX_CPU_ISA to match,
    unless set (read once by torch: call before it loads). An unknown cap is left to
    read_cpuinfo to refuse."""
    cap = envs.KVFLOW_CPU_ISA
    if cap in CPU_ISA_CAPS:
        os.environ.setdefault("ATEN_CPU_CAPABILITY", CPU_ISA_CAPS[cap].aten)
        os.environ.setdefault("ONEDNN_MAX_CPU_ISA", CPU_ISA_CAPS[cap].onednn)


def march_flags() -> list[str]:
    """The compiler's target flags for the C kernels: this CPU, or the cap's."""
    cap = cpu_isa_cap()
    return ["-march=native"] if cap is None else list(CPU_ISA_CAPS[cap].march)


@dataclass(frozen=True)
class CpuInfo:
    model_name: str
    flags: frozenset[str]


@functools.cache
def read_cpuinfo() -> CpuInfo:
    """The first processor's `model name` and `flags` (empty where /proc/cpuinfo cannot be
    read, e.g. not on Linux), under KVFLOW_CPU_ISA's cap."""
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
    cap = cpu_isa_cap()
    name = (model or platform.processor() or "unknown CPU") + (f" as {cap} (KVFLOW_CPU_ISA)" if cap else "")
    return CpuInfo(name, mask_flags(frozenset(flags.split()), cap))
