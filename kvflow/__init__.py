"""kvflow: a small, fast LLM serving engine."""
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
