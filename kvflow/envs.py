"""Every environment variable kvflow reads, declared once: name, type, default and meaning.

Code reads them as attributes of this module (`envs.KVFLOW_HUGEPAGES`), parsed on each read, so
a test or a launcher that sets one before use is seen. Nothing else in kvflow touches
`os.environ` for a KVFLOW_ variable; `docs/environment.md` is generated from this table."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

_FALSE = ("0", "false", "no", "off")
_TRUE = ("1", "true", "yes", "on")


@dataclass(frozen=True)
class EnvVar:
    name: str
    type: type  # bool | int | float | str
    default: Any  # None: unset means "not given"
    help: str

    def read(self) -> Any:
        raw = os.environ.get(self.name)
        if raw is None or raw == "":
            return self.default
        if self.type is bool:
            if raw.strip().lower() in _TRUE:
                return True
            if raw.strip().lower() in _FALSE:
                return False
            raise ValueError(f"{self.name} must be 0 or 1, got {raw!r}")
        try:
            return self.type(raw)
        except ValueError:
            raise ValueError(f"{self.name} must be a {self.type.__name__}, got {raw!r}") from None


def _cache_dir_default() -> str:
    return os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kvflow")


_VARS = [
    EnvVar("KVFLOW_CACHE_DIR", str, None,
           "where converted GGUF weights and the compiled C kernels are cached "
           "(default: $XDG_CACHE_HOME/kvflow, else ~/.cache/kvflow)"),
    EnvVar("KVFLOW_NUM_THREADS", int, None,
           "compute threads when --num-threads is not given (default 1)"),
    EnvVar("KVFLOW_LOG_LEVEL", str, "INFO", "log level of the kvflow loggers"),
    EnvVar("KVFLOW_API_KEY", str, None, "the server's API key when --api-key is not given"),
    EnvVar("KVFLOW_ALLOW_RUNTIME_LORA_UPDATING", bool, False,
           "the server accepts POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's "
           "VLLM_ALLOW_RUNTIME_LORA_UPDATING; docs/lora.md)"),
    EnvVar("KVFLOW_NO_KERNELS", bool, False,
           "1: never build or load the C kernels (PyTorch paths everywhere)"),
    EnvVar("KVFLOW_NO_ONEDNN", bool, False, "1: projections through plain F.linear, not oneDNN"),
    EnvVar("KVFLOW_NO_PANEL_GEMM", bool, False,
           "1: bf16 projections through oneDNN instead of kvflow's panel GEMM"),
    EnvVar("KVFLOW_NO_GEMV", bool, False,
           "1: fp32 decode-sized batches through oneDNN instead of kvflow's fp32 GEMV"),
    EnvVar("KVFLOW_GEMV_ISA", str, None,
           "avx2: the fp32 GEMV takes its AVX2 path even on an AVX-512 CPU (to measure "
           "that path where no AVX2-only CPU is at hand)"),
    EnvVar("KVFLOW_CPU_ISA", str, None,
           "avx2: run as an AVX2-only CPU (the Zen 3 kind), avx512: as one without AVX512-BF16 "
           "or AMX; kvflow's kernel choices, its C kernels' build and (when set before torch "
           "loads) PyTorch's and oneDNN's kernels are capped there, to measure the other kind's "
           "paths end to end (docs/performance.md)"),
    EnvVar("KVFLOW_NO_AMX_PANELS", bool, False,
           "1: on a CPU with AMX, bf16 batches past a few rows take oneDNN's AMX GEMM from a second, "
           "blocked copy of every weight, not AMX's tiles over the panels (more memory; "
           "docs/performance.md's Memory after load)"),
    EnvVar("KVFLOW_NO_AMX_ATTENTION", bool, False,
           "1: prompt attention on AVX512-BF16 even on a CPU with AMX (to measure the AMX path)"),
    EnvVar("KVFLOW_NO_DECODE_GRAPH", bool, False,
           "1: decode steps run layer by layer from Python, not all decoder layers in one "
           "C call (kvflow/model/decode_graph.py)"),
    EnvVar("KVFLOW_HUGEPAGES", bool, True, "0: the KV cache on ordinary pages, not 2 MiB pages"),
    EnvVar("KVFLOW_KV_POPULATE", bool, True,
           "0: no idle thread faulting the KV cache's pages in ahead of the writes"),
    EnvVar("KVFLOW_MALLOC_TUNING", bool, True,
           "0: leave glibc's mmap and trim thresholds alone"),
    EnvVar("KVFLOW_TP_SHM", bool, True,
           "0: tensor-parallel all-reduce through gloo instead of shared memory"),
    EnvVar("KVFLOW_SHM_SPINS", int, 64, "shared-memory all-reduce: busy polls before yielding"),
    EnvVar("KVFLOW_SHM_YIELDS", int, 256, "shared-memory all-reduce: yields before sleeping"),
    EnvVar("KVFLOW_SHM_SLEEP", float, 50e-6, "shared-memory all-reduce: sleep per poll (seconds)"),
    EnvVar("KVFLOW_DIST_TIMEOUT", float, 600.0,
           "seconds tensor-parallel ranks wait for each other to meet"),
]
ENV_VARS: dict[str, EnvVar] = {v.name: v for v in _VARS}


def cache_dir() -> str:
    """KVFLOW_CACHE_DIR, else the XDG cache folder's kvflow/ (one answer for every cache)."""
    return ENV_VARS["KVFLOW_CACHE_DIR"].read() or _cache_dir_default()


def __getattr__(name: str) -> Any:
    var = ENV_VARS.get(name)
    if var is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return var.read()


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(ENV_VARS))


def markdown_table() -> str:
    rows = ["| variable | default | meaning |", "|---|---|---|"]
    for v in _VARS:
        default = "unset" if v.default is None else (int(v.default) if v.type is bool else v.default)
        rows.append(f"| `{v.name}` | {default} | {v.help} |")
    return "\n".join(rows)


DOCS_HEADER = """# Environment variables

Every variable kvflow reads (declared in `kvflow/envs.py`; this page is generated from it by
`python -m kvflow.envs docs/environment.md`). Options of the engine are flags and `LLM`
keywords instead ([configuration.md](configuration.md)).

"""


if __name__ == "__main__":  # python -m kvflow.envs PATH: write the environment page
    import sys

    with open(sys.argv[1] if len(sys.argv) > 1 else "docs/environment.md", "w") as f:
        f.write(DOCS_HEADER + markdown_table() + "\n")
