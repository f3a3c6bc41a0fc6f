"""`weight_dtype`: the projections of an fp32 model on the CPU kept in half precision for the
decode GEMV (kvflow/csrc/gemv_f32.c widens them to fp32 in registers).

A batch-1 decode step streams every weight once, so its time is the bytes of weights over the
rate one core reads memory; bf16 or fp16 storage halves those bytes with the same fp32
arithmetic. bf16 -> fp32 and fp16 -> fp32 are exact, so for weights whose values are
representable in the storage dtype (a bf16 checkpoint stored as bf16) the model computes
exactly what the fp32 model computes. To keep that true for every batch size, the model's
fp32 weights themselves are rounded to the storage dtype at load: the GEMV's rows (up to
GEMV_MAX_ROWS) and oneDNN's longer batches then see the same weight values.

What is refused (ValueError) and why:
- a storage dtype on a model that does not compute in fp32 on the CPU (bf16 compute already
  stores bf16; a GPU serves its own GEMMs), or on a quantized model (its weights are blocks);
- a bf16 checkpoint stored as fp16, or an fp16 one stored as bf16: either loses bits of
  weights that the checkpoint holds exactly (fp16 has 5 exponent bits, bf16 7 mantissa bits);
- tensor parallelism (its ranks pack their shards without this option yet).
An fp32 checkpoint (or a GGUF file dequantised to fp32) is rounded to nearest even, as vLLM's
`--dtype bfloat16` rounds one, with a warning that says how many weights changed."""
from __future__ import annotations

import logging

import torch

logger = logging.getLogger("kvflow")

_TORCH = {"bfloat16": torch.bfloat16, "float16": torch.float16}
_SAFETENSORS = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


def storage_dtype(name: str, dtype: torch.dtype, on_cpu: bool = True, quantization: str = "none",
                  tp_size: int = 1) -> torch.dtype | None:
    """ModelConfig.weight_dtype -> the dtype the GEMV's panels are stored in, for a model
    computing in `dtype`: None for `auto` / `float32` (fp32 panels, as before), torch.bfloat16
    or torch.float16 where that makes sense; ValueError naming the option otherwise. (`name`
    is one of config.WEIGHT_DTYPES: ModelConfig checks it where the option is declared.)"""
    if name == "auto":
        return None
    if name == "float32":
        if dtype != torch.float32:
            raise ValueError(f"weight_dtype float32 needs dtype float32 (the model computes in "
                             f"{str(dtype).removeprefix('torch.')})")
        return None
    if name == "bfloat16" and dtype == torch.bfloat16 and quantization == "none":
        return None  # a bf16 model stores its weights in bf16 already
    if dtype != torch.float32 or not on_cpu:
        raise ValueError(f"weight_dtype {name} applies to an fp32 model on the CPU "
                         "(--dtype float32 --device cpu): there the decode GEMV widens the "
                         "stored weights to fp32")
    if quantization != "none":
        raise ValueError(f"weight_dtype {name} stores float weights, but the model is served "
                         f"quantized ({quantization}); pass quantization none to dequantise it")
    if tp_size > 1:
        raise ValueError(f"weight_dtype {name} is not implemented with tensor parallelism yet")
    return _TORCH[name]


def checkpoint_dtypes(path: str) -> set[torch.dtype]:
    """The float dtypes of an HF folder's safetensors tensors (empty for a GGUF file or a
    pytorch_model.bin: those are dequantised or read as fp32)."""
    from safetensors import safe_open

    from kvflow.checkpoint.hf_folder import hf_weight_files
    from kvflow.model_path import is_gguf

    if is_gguf(path):
        return set()
    found = set()
    for file in hf_weight_files(path)[0]:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                dt = _SAFETENSORS.get(f.get_slice(name).get_dtype())
                if dt is not None:
                    found.add(dt)
    return found


def check_checkpoint(path: str, storage: torch.dtype) -> bool:
    """Refuse a half-precision storage that would lose bits of a half-precision checkpoint;
    True where every float tensor of the checkpoint is already in `storage` (nothing to round)."""
    other = {torch.bfloat16: torch.float16, torch.float16: torch.bfloat16}[storage]
    found = checkpoint_dtypes(path)
    if other in found:
        have, want = (str(d).removeprefix("torch.") for d in (other, storage))
        raise ValueError(f"weight_dtype {want} would lose bits of this {have} checkpoint "
                         f"({path}); use weight_dtype {have}")
    return found == {storage}


def round_weights(weights: dict[str, torch.Tensor], storage: torch.dtype) -> int:
    """Round the 2-D fp32 weights (projections, embedding, LM head; norms stay fp32) in place
    to values of `storage`, so that every batch size computes with the weights the GEMV reads;
    returns how many values changed."""
    changed = 0
    for name, w in weights.items():
        if w.dim() != 2 or w.dtype != torch.float32:
            continue
        rounded = w.to(storage).float()
        changed += int((rounded != w).sum())
        weights[name] = rounded
    if changed:
        logger.warning("kvflow: weight_dtype %s rounded %d weights of this checkpoint to that "
                       "dtype (an fp32 checkpoint's values are not all representable in it)",
                       str(storage).removeprefix("torch."), changed)
    return changed
