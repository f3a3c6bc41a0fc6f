"""Tensors of safetensors files read with plain reads into fresh memory, one tensor (or one
slice along its first dim: one expert of a stacked [experts, ...] tensor) at a time.

safetensors' own reader maps the file: every page a tensor touches counts in the process's RSS
for as long as the mapping lives (and a tensor it returns may be a view that keeps it alive),
beside any copy made of it. A loader that converts tensor by tensor (MXFP4 experts into
panels) would hold the file once mapped and once converted; read this way it holds only what
it keeps, plus the one tensor in flight."""
from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import torch

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
           "U8": torch.uint8, "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn,
           "F8_E5M2": torch.float8_e5m2}


@dataclass(frozen=True, slots=True)
class StoredTensor:
    """Where one tensor's bytes sit in its file."""

    file: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # from the start of the file
    nbytes: int

    @property
    def slice_bytes(self) -> int:
        """Bytes of one index along the first dim."""
        return self.nbytes // self.shape[0] if self.shape and self.shape[0] else self.nbytes


def index_files(files: list[str]) -> dict[str, StoredTensor]:
    """Every tensor's name -> where it is stored, from the files' headers."""
    where = {}
    for file in files:
        with open(file, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
        header.pop("__metadata__", None)
        for name, info in header.items():
            if info["dtype"] not in _DTYPES:
                raise ValueError(f"{file}: tensor {name!r} has dtype {info['dtype']}, not one kvflow reads")
            begin, end = info["data_offsets"]
            where[name] = StoredTensor(file, _DTYPES[info["dtype"]], tuple(info["shape"]), 8 + n + begin,
                                       end - begin)
    return where


def read_tensor(t: StoredTensor, index: int | None = None) -> torch.Tensor:
    """The whole tensor, or its `index`-th slice along the first dim, in a fresh tensor."""
    shape, offset, nbytes = t.shape, t.offset, t.nbytes
    if index is not None:
        if not 0 <= index < shape[0]:
            raise IndexError(f"index {index} out of {shape[0]}")
        shape, nbytes = shape[1:], t.slice_bytes
        offset += index * nbytes
    out = torch.empty(shape, dtype=t.dtype)
    assert out.numel() * out.element_size() == nbytes, (t, index)
    if nbytes:
        with open(t.file, "rb", buffering=0) as f:
            f.seek(offset)
            view = memoryview(out.view(-1).view(torch.uint8).numpy())
            got = f.readinto(view)
            while got < nbytes:  # a short read: carry on where it stopped
                more = f.readinto(view[got:])
                if not more:
                    raise ValueError(f"{t.file} ends inside a tensor")
                got += more
    return out


def read_numpy(t: StoredTensor, index: int | None = None) -> np.ndarray:
    """read_tensor as a numpy array (the integer dtypes MXFP4 blocks and scales are)."""
    return read_tensor(t, index).numpy()


__all__ = ["StoredTensor", "index_files", "read_numpy", "read_tensor"]
