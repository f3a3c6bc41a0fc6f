"""kvflow: a small, fast LLM serving engine."""
import os

# OpenMP reads this once, when torch loads: idle compute threads sleep instead of spinning,
# which on a 2-core machine keeps a second thread from stealing the core the frontend and the
# scheduler need (spin-waiting made small ops up to 50x slower there). Set it to ACTIVE in
# the environment to opt out; it has no effect if torch was imported before kvflow.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
from kvflow.outputs import CompletionOutput, RequestOutput
from kvflow.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "__version__"]


def __getattr__(name: str):
    # LLM pulls in torch; import it only when asked for, so the frontend process stays light.
    if name == "LLM":
        from kvflow.entrypoints.llm import LLM
        return LLM
    raise AttributeError(name)
