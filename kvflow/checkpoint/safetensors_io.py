"""safetensors files read and written one tensor at a time, in fresh memory.

safetensors' own `load_file` maps the file: its tensors are the file's pages, which count in
the resident set beside the packed copy a model makes of them (a 2.15 GB bf16 conversion cache
showed 2.27 GB of file-backed RSS on top of the packed weights), and stay until the last tensor
of the file is gone. Read here, each tensor is its own allocation, freed as soon as the model has
packed it. Its `save_file` copies every tensor to bytes first (twice the model's memory); written
here, nothing is copied."""
from __future__ import annotations

import json

import torch

DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.uint8: "U8",
          torch.int8: "I8", torch.int32: "I32", torch.int64: "I64", torch.float64: "F64"}
_TORCH = {v: k for k, v in DTYPES.items()}


class TensorFile:
    """A safetensors file open for reading tensors one by one (`names`, `read(name)`)."""

    def __init__(self, path: str):
        self._f = open(path, "rb")
        n = int.from_bytes(self._f.read(8), "little")
        self._header = json.loads(self._f.read(n))
        self._header.pop("__metadata__", None)
        self._base = 8 + n
        self.names = sorted(self._header, key=lambda k: self._header[k]["data_offsets"][0])

    def read(self, name: str) -> torch.Tensor:
        """Tensor `name` in fresh memory."""
        info = self._header[name]
        begin, end = info["data_offsets"]
        t = torch.empty(info["shape"], dtype=_TORCH[info["dtype"]])
        if end > begin:
            self._f.seek(self._base + begin)
            self._f.readinto(memoryview(t.view(-1).view(torch.uint8).numpy()))
        return t

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> "TensorFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_tensors(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file, each read into its own fresh tensor."""
    with TensorFile(path) as f:
        return {name: f.read(name) for name in f.names}


def write_tensors(tensors: dict[str, torch.Tensor], path: str, metadata: dict[str, str]) -> None:
    """The safetensors format, written tensor by tensor (no copy of the whole model)."""
    header: dict = {"__metadata__": metadata}
    offset = 0
    for name, t in tensors.items():
        size = t.numel() * t.element_size()
        header[name] = {"dtype": DTYPES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(len(blob).to_bytes(8, "little"))
        f.write(blob)
        for t in tensors.values():
            if t.numel():
                f.write(memoryview(t.contiguous().view(-1).view(torch.uint8).numpy()))
