"""The bytes of a transfer: for each layer, K then V, the requested blocks in order, raw (the
cache's own dtype and tile layout, so that both sides must agree on them: the compatibility
check). Gathered on the producer into frames or a staging buffer; scattered on the consumer into
its own blocks."""
from __future__ import annotations

import warnings

import torch


def transfer_bytes(kv_caches, num_blocks: int) -> tuple[int, int]:
    """(bytes of one tensor's blocks, bytes of the whole transfer)."""
    k0 = kv_caches[0][0]
    per_tensor = num_blocks * k0[0].numel() * k0.element_size()
    return per_tensor, per_tensor * 2 * len(kv_caches)


def gather_frames(kv_caches, block_ids: list[int]) -> list:
    """One contiguous uint8 array per layer and K/V (sent as ZeroMQ frames without copying)."""
    idx = torch.tensor(block_ids, dtype=torch.long)
    return [t.index_select(0, idx).view(torch.uint8).view(-1).numpy()
            for pair in kv_caches for t in pair]


def gather_into(kv_caches, block_ids: list[int], dst: torch.Tensor) -> None:
    """The same bytes, back to back, into `dst` (a flat uint8 staging buffer)."""
    idx = torch.tensor(block_ids, dtype=torch.long)
    per_tensor, _ = transfer_bytes(kv_caches, len(block_ids))
    for i, (k, v) in enumerate(kv_caches):
        for j, t in enumerate((k, v)):
            off = (2 * i + j) * per_tensor
            out = dst[off:off + per_tensor].view(t.dtype).view(len(idx), *t.shape[1:])
            torch.index_select(t, 0, idx, out=out)


def scatter(kv_caches, block_ids: list[int], frames: list) -> None:
    """Write received bytes into `block_ids` of this cache: `frames` is one ZeroMQ frame per
    tensor, or a single flat tensor (a staging buffer) holding them all. ValueError if the
    sizes are not this cache's."""
    n = len(block_ids)
    if n == 0:
        return
    idx = torch.tensor(block_ids, dtype=torch.long)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # read-only zmq buffers: only read here
        if len(frames) == 1 and isinstance(frames[0], torch.Tensor):
            whole = frames[0]
            per = whole.numel() // (2 * len(kv_caches))
            parts = [whole[i * per:(i + 1) * per] for i in range(2 * len(kv_caches))]
        else:
            parts = [torch.frombuffer(f.buffer, dtype=torch.uint8) for f in frames]
    if len(parts) != 2 * len(kv_caches):
        raise ValueError(f"a KV pull brought {len(parts)} tensors, expected {2 * len(kv_caches)}")
    for i, (k, v) in enumerate(kv_caches):
        for j, t in enumerate((k, v)):
            src = parts[2 * i + j]
            if src.numel() != n * t[0].numel() * t.element_size():
                raise ValueError("a KV pull's tensor has the wrong size")
            t.index_copy_(0, idx, src.view(t.dtype).view(n, *t.shape[1:]))
