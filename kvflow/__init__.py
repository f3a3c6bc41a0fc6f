"""kvflow: a small, fast LLM serving engine."""
import os

# OpenMP reads this once, when torch loads: idle compute threads sleep instead of spinning,
# which on a 2-core machine keeps a second thread from stealing the core the frontend and the
# scheduler need (spin-waiting made small ops up to 50x slower there). Set it to ACTIVE in
# the environment to opt out; it has no effect if torch was imported before kvflow.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# KVFLOW_CPU_ISA caps PyTorch's and oneDNN's kernels as kvflow's (kvflow/utils/cpuinfo.py);
# they read their variables once, so this too only holds when torch loads after kvflow.
from kvflow.utils.cpuinfo import cap_torch_kernels  # noqa: E402 (standard library only)

cap_torch_kernels()

__version__ = "0.1.0"
__all__ = ["LLM", "LoRARequest", "SamplingParams", "PoolingParams", "RequestOutput", "CompletionOutput",
           "EmbeddingRequestOutput", "__version__"]

# Imported when first asked for: LLM pulls in torch (the frontend process stays light), and
# the rest msgspec, so a standard-library module of the package (kvflow/utils/w1_prompts.py)
# also imports in another engine's venv.
_LAZY = {"LLM": "kvflow.entrypoints.llm", "SamplingParams": "kvflow.sampling_params",
         "LoRARequest": "kvflow.lora_request",
         "RequestOutput": "kvflow.outputs", "CompletionOutput": "kvflow.outputs",
         "PoolingParams": "kvflow.pooling_params", "EmbeddingRequestOutput": "kvflow.outputs"}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(name)
    import importlib

    return getattr(importlib.import_module(module), name)
