"""An HF folder's weight files -> tensors under their HF names: its safetensors files (through
the index when there is one), or else its pytorch_model.bin."""
from __future__ import annotations

import glob
import json
import os

import torch


def hf_weight_files(path: str) -> tuple[list[str], str | None]:
    """An HF folder's safetensors files (through its index when there is one), or else its
    pytorch_model.bin; ValueError when it has neither."""
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted({os.path.join(path, v) for v in json.load(f)["weight_map"].values()})
    if files:
        return files, None
    bin_path = os.path.join(path, "pytorch_model.bin")
    if os.path.isfile(bin_path):
        return [], bin_path
    raise ValueError(f"no safetensors weights in {path!r}")


def read_hf_folder(path: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every tensor of an HF folder under its HF name."""
    from safetensors import safe_open

    files, bin_path = hf_weight_files(path)
    if bin_path is not None:
        return torch.load(bin_path, map_location="cpu", weights_only=True)
    weights = {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                weights[name] = f.get_tensor(name).to(dtype)
    return weights
