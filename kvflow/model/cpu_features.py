"""What the CPU offers the kernels, read once from /proc/cpuinfo (kvflow/utils/cpuinfo.py): the instruction sets that
decide which GEMM, attention and dtype serve best (kvflow/model/kernels.py)."""
from __future__ import annotations

import functools
from dataclasses import dataclass

from kvflow.utils.cpuinfo import read_cpuinfo


@dataclass(frozen=True)
class CpuFeatures:
    """The CPU's feature flags (as /proc/cpuinfo spells them)."""

    flags: frozenset[str] = frozenset()

    @property
    def avx2(self) -> bool:
        return "avx2" in self.flags

    @property
    def avx512(self) -> bool:
        return "avx512f" in self.flags

    @property
    def avx512_bf16(self) -> bool:
        return "avx512_bf16" in self.flags

    @property
    def amx_bf16(self) -> bool:
        """AMX tiles with bf16 dot products (Intel Xeon, Sapphire Rapids and later): oneDNN's
        bf16 GEMM runs on them."""
        return {"amx_bf16", "amx_tile"} <= self.flags

    @property
    def native_bf16(self) -> bool:
        """AVX512-BF16 or AMX: without them bf16 matmuls are emulated (several times slower
        than fp32)."""
        return bool(self.flags & {"avx512_bf16", "amx_bf16"})

    @property
    def isa(self) -> str:
        """The widest vector set the kernels use here, for the start-up line."""
        if self.avx512:
            return "avx512-bf16" if self.avx512_bf16 else "avx512"
        return "avx2" if self.avx2 else "scalar"

    @classmethod
    def from_names(cls, *names: str) -> "CpuFeatures":
        return cls(frozenset(names))


@functools.cache
def cpu_features() -> CpuFeatures:
    """This machine's features (none where /proc/cpuinfo cannot be read)."""
    return CpuFeatures(read_cpuinfo().flags)
