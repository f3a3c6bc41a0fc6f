"""Checkpoint tensors -> kvflow's fused names, shared by the whole-model loader and the
tensor-parallel shard loader: the fusing of HF names (qkv_proj = [q; k; v], gate_up_proj =
[gate; up]), routed through the model's family, and a GGUF file's conversion cache (an HF
folder's files are read by hf_folder.py).

A GGUF file is dequantised once; the fused weights are then cached as safetensors (in the
requested dtype) so that later starts skip the slow conversion. The cache file is written under
a lock (concurrent starts convert once), fsynced and renamed into place, and checked on every
load: a torn or truncated file (its size disagrees with its header, or its tensor count with
the count stamped in it) is converted again."""
from __future__ import annotations

import json
import logging
import os
import tempfile

import torch

from kvflow.checkpoint.gguf import read_gguf
from kvflow.checkpoint.safetensors_io import read_tensors, write_tensors
from kvflow.model.arch import LlamaArchConfig, save_arch_cache
from kvflow.model_path import cache_dir_for
from kvflow.models.registry import family_of
from kvflow.utils.files import file_lock, publish

logger = logging.getLogger("kvflow")
_COUNT_KEY = "kvflow_num_tensors"  # stamped in the cache file's metadata


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def fuse_weights(hf: dict[str, torch.Tensor], arch: LlamaArchConfig,
                 dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """HF parameter names -> kvflow's fused ones, by the model's family (kvflow/models/)."""
    return family_of(arch.architecture).fuse_weights(hf, arch, dtype)


# -- GGUF files --------------------------------------------------------------------------------
def gguf_cache_file(path: str, dtype: torch.dtype) -> str:
    """Where the fused safetensors conversion of the GGUF file `path` in `dtype` is cached."""
    return os.path.join(cache_dir_for(path), f"weights.{dtype_name(dtype)}.safetensors")


def cache_file_is_complete(path: str) -> bool:
    """A safetensors cache file whose size matches its header and whose tensor count matches
    the count stamped in it when it was written (False for a missing or torn file)."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if n <= 0 or 8 + n > size:
                return False
            header = json.loads(f.read(n))
        meta = header.pop("__metadata__", None) or {}
        end = max((t["data_offsets"][1] for t in header.values()), default=0)
        # (files from before the stamp have none: their size check suffices)
        return size == 8 + n + end and meta.get(_COUNT_KEY, str(len(header))) == str(len(header))
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return False


def load_gguf(path: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The fused weights of a GGUF file, from the conversion cache (made on a miss), each in
    fresh memory (safetensors_io.py): a model that packs them frees each as it goes."""
    return read_tensors(ensure_gguf_cache(path, dtype))


def ensure_gguf_cache(path: str, dtype: torch.dtype) -> str:
    """The fused safetensors conversion of a GGUF file, made once per machine (the only step
    that dequantises the whole model); ranks starting together wait for one conversion."""
    cached = gguf_cache_file(path, dtype)
    if not cache_file_is_complete(cached):
        with _conversion_lock(cached):
            if not cache_file_is_complete(cached):
                _convert_gguf(path, dtype, cached)
    return cached


def _conversion_lock(cached: str):
    return file_lock(os.path.join(os.path.dirname(cached), "convert.lock"))


def _convert_gguf(path: str, dtype: torch.dtype, cached: str) -> None:
    """Dequantise and fuse, then publish the cache file (call with the conversion lock held).
    Each tensor is in `dtype` as soon as it is read (a bf16 model never exists in fp32 at once:
    9.1 GB peak for a 2.15 GB bf16 file before, benchmarks/load_memory.py)."""
    if os.path.exists(cached):
        logger.warning("kvflow: the weight cache %s is incomplete; converting again", cached)

    def convert(a):
        return torch.from_numpy(a if a.flags.writeable else a.copy()).to(dtype)
    arch, hf = read_gguf(path, convert=convert)
    weights = fuse_weights(hf, arch, dtype)
    del hf
    cache = os.path.dirname(cached)
    os.makedirs(cache, exist_ok=True)
    save_arch_cache(arch, path)
    fd, tmp = tempfile.mkstemp(prefix="weights.", suffix=".tmp", dir=cache)
    os.close(fd)
    try:
        write_tensors(weights, tmp, {_COUNT_KEY: str(len(weights))})
        publish(tmp, cached)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
