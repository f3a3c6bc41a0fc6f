"""The bytes of a transfer: for each layer, K then V, the requested blocks in order, raw (the
cache's own dtype and tile layout, so that both sides must agree on them: the compatibility
check), with every KV head of the model. Gathered on the producer into frames or a staging
buffer; scattered on the consumer into its own blocks.

Under tensor parallelism each rank holds the KV heads [start, start + n) of every block
(kvflow/model/sharding.py); a block's tiles are per head ([block, head, ...], kv_layout.py), so
the whole block is the ranks' shares side by side on the head axis. `PagedKV` is that view: the
producer assembles whole blocks from the shares, the consumer splits them into its ranks'
shares, and the wire never depends on either side's TP size."""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from kvflow.attention.kv_layout import (is_quantized, read_blocks, read_stored_rows, write_rows,
                                        write_stored_rows)


@dataclass
class KVShard:
    """One rank's cache: per layer (k, v), each [num_blocks, heads, block_size, head_dim],
    holding the model's KV heads [head_start, head_start + heads)."""

    head_start: int
    kv_caches: list


class PagedKV:
    """An engine's whole KV cache over the ranks that hold it (one shard without TP)."""

    def __init__(self, shards: list[KVShard]) -> None:
        self.shards = shards  # all of them: a pulled block is written into every replica
        # each head read from one rank (with fewer KV heads than ranks, heads are replicated)
        self.readers: list[KVShard] = []
        for s in sorted(shards, key=lambda s: s.head_start):
            if not self.readers or s.head_start >= self._heads_end(self.readers[-1]):
                self.readers.append(s)
        k0 = shards[0].kv_caches[0][0]
        self.num_layers = len(shards[0].kv_caches)
        self.num_heads = sum(self._heads(s) for s in self.readers)
        assert self.readers[0].head_start == 0 and self._heads_end(self.readers[-1]) == self.num_heads
        self.block_shape = (self.num_heads, k0.shape[2], k0.shape[3])
        self.dtype = k0.dtype
        # what blocks move as: fp8 as its bytes (torch's index ops take no float8)
        self.wire_dtype = torch.uint8 if k0.dtype == torch.float8_e4m3fn else k0.dtype
        self.block_bytes = self.num_heads * k0.shape[2] * k0.shape[3] * k0.element_size()

    @staticmethod
    def _heads(s: KVShard) -> int:
        return s.kv_caches[0][0].shape[1]

    def _heads_end(self, s: KVShard) -> int:
        return s.head_start + self._heads(s)

    def read(self, layer: int, j: int, idx: torch.Tensor, out: torch.Tensor | None = None):
        """Blocks `idx` of layer `layer`'s K (j=0) or V (j=1), all heads, contiguous."""
        parts = [s.kv_caches[layer][j].view(self.wire_dtype) for s in self.readers]
        if len(parts) == 1:
            return torch.index_select(parts[0], 0, idx, out=out) if out is not None \
                else parts[0].index_select(0, idx)
        pieces = [t.index_select(0, idx) for t in parts]
        return torch.cat(pieces, dim=1, out=out) if out is not None else torch.cat(pieces, dim=1)

    def write(self, layer: int, j: int, idx: torch.Tensor, src: torch.Tensor) -> None:
        """`src` [n, all heads, ...] into blocks `idx` of every rank, each its heads."""
        for s in self.shards:
            t = s.kv_caches[layer][j].view(self.wire_dtype)
            t.index_copy_(0, idx, src.view(self.wire_dtype)[:, s.head_start:s.head_start + t.shape[1]])


def transfer_bytes(kv: PagedKV, num_blocks: int) -> tuple[int, int]:
    """(bytes of one tensor's blocks, bytes of the whole transfer)."""
    per_tensor = num_blocks * kv.block_bytes
    return per_tensor, per_tensor * 2 * kv.num_layers


def gather_frames(kv: PagedKV, block_ids: list[int]) -> list:
    """One contiguous uint8 array per layer and K/V (sent as ZeroMQ frames without copying)."""
    idx = torch.tensor(block_ids, dtype=torch.long)
    return [kv.read(i, j, idx).view(torch.uint8).view(-1).numpy()
            for i in range(kv.num_layers) for j in (0, 1)]


def gather_into(kv: PagedKV, block_ids: list[int], dst: torch.Tensor) -> None:
    """The same bytes, back to back, into `dst` (a flat uint8 staging buffer)."""
    idx = torch.tensor(block_ids, dtype=torch.long)
    per_tensor, _ = transfer_bytes(kv, len(block_ids))
    for i in range(kv.num_layers):
        for j in (0, 1):
            off = (2 * i + j) * per_tensor
            kv.read(i, j, idx, out=dst[off:off + per_tensor].view(kv.wire_dtype)
                     .view(len(idx), *kv.block_shape))


def _parts(kv: PagedKV, frames: list) -> list[torch.Tensor]:
    """One flat uint8 tensor per layer and K/V: from one ZeroMQ frame each, or cut out of a
    single flat tensor (a staging buffer) holding them all."""
    num = 2 * kv.num_layers
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # read-only zmq buffers: only read here
        if len(frames) == 1 and isinstance(frames[0], torch.Tensor):
            whole = frames[0]
            per = whole.numel() // num
            parts = [whole[i * per:(i + 1) * per] for i in range(num)]
        else:
            parts = [torch.frombuffer(f.buffer, dtype=torch.uint8) for f in frames]
    if len(parts) != num:
        raise ValueError(f"a KV pull brought {len(parts)} tensors, expected {num}")
    return parts


def scatter(kv: PagedKV, block_ids: list[int], frames: list) -> None:
    """Write received blocks (this cache's block size) into `block_ids`, block for block.
    ValueError if the sizes are not this cache's."""
    n = len(block_ids)
    if n == 0:
        return
    idx = torch.tensor(block_ids, dtype=torch.long)
    parts = _parts(kv, frames)
    for i in range(kv.num_layers):
        for j in (0, 1):
            src = parts[2 * i + j]
            if src.numel() != n * kv.block_bytes:
                raise ValueError("a KV pull's tensor has the wrong size")
            kv.write(i, j, idx, src.view(kv.wire_dtype).view(n, *kv.block_shape))


def scatter_tokens(kv: PagedKV, frames: list, remote_block_size: int, num_remote_blocks: int,
                   local_block_ids: list[int], first_token: int, num_tokens: int) -> None:
    """Received blocks of another block size: their tiles back to rows (kv_layout.py), then the
    tokens `[first_token, num_tokens)` written by slot into `local_block_ids` (the first of
    which starts at `first_token`; the first remote block at the block boundary before it).
    ValueError if the sizes do not add up."""
    bs = kv.block_shape[1]
    if num_tokens <= first_token or not local_block_ids:
        return
    if first_token % bs or len(local_block_ids) != -(-(num_tokens - first_token) // bs):
        raise ValueError("a KV pull's local blocks do not match its tokens")
    r0 = first_token // remote_block_size * remote_block_size  # the first remote block's token
    if num_tokens > r0 + num_remote_blocks * remote_block_size:
        raise ValueError("a KV pull's remote blocks do not hold its tokens")
    rshape = (num_remote_blocks, kv.num_heads, remote_block_size, kv.block_shape[2])
    rbytes = num_remote_blocks * kv.block_bytes // bs * remote_block_size
    parts = _parts(kv, frames)
    if any(p.numel() != rbytes for p in parts):
        raise ValueError("a KV pull's tensor has the wrong size")
    t = torch.arange(first_token, num_tokens)
    local = torch.tensor(local_block_ids, dtype=torch.long)
    slots = local[(t - first_token) // bs] * bs + t % bs
    table = torch.arange(num_remote_blocks).view(1, -1)
    for i in range(kv.num_layers):
        k, v = (parts[2 * i + j].view(kv.dtype).view(rshape) for j in (0, 1))
        if is_quantized(kv.dtype):  # the stored bytes (and scales) as they are: no requantizing
            rows_k, rows_v = read_stored_rows(k, v, t - r0)
        else:
            rows_k, rows_v = read_blocks(k, v, table)  # [1, blocks * remote size, heads, dim]
            rows_k, rows_v = (r[0, first_token - r0:num_tokens - r0] for r in (rows_k, rows_v))
        for s in kv.shards:
            kc, vc = s.kv_caches[i]
            h = slice(s.head_start, s.head_start + kc.shape[1])
            (write_stored_rows if is_quantized(kv.dtype) else write_rows)(
                kc, vc, rows_k[:, h], rows_v[:, h], slots)
