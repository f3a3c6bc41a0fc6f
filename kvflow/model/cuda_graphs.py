"""CUDA graphs for decode-only steps, vLLM's way: persistent input and metadata buffers, one
graph captured per batch size of a ladder (1, 2, 4, then multiples of 8), a step's batch padded
up to the next captured size and replayed, so a decode step costs a few copies and one launch
instead of hundreds of kernel launches from Python.

Padding rows are inert: slot -1 (the KV write skips it) and sequence length 0 (the decode
kernel writes zeros for it); their hidden states are dropped. With `capture=False` (a CPU, or
--enforce-eager) the same buffers and padding are used and the forward runs eagerly, which is
how the bookkeeping is tested without a GPU."""
from __future__ import annotations

import bisect
from dataclasses import replace
from typing import Callable

import numpy as np
import torch

from kvflow.model.gpu_batch import DeviceMetadata, num_decode_splits

MAX_CAPTURE_SIZE = 512


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, then every multiple of 8, up to max_num_seqs, which is
    included (so every decode batch the scheduler can form has a graph) unless it is past
    MAX_CAPTURE_SIZE (larger batches run eagerly)."""
    top = min(max_num_seqs, MAX_CAPTURE_SIZE)
    sizes = [s for s in (1, 2, 4) if s <= top] + list(range(8, top + 1, 8))
    if sizes[-1] != top:
        sizes.append(top)
    return sizes


class DecodeGraphs:
    """Persistent buffers for decode steps of up to `sizes[-1]` requests whose block tables
    are at most `max_blocks` wide, and the graphs captured over them."""

    def __init__(self, sizes: list[int], max_blocks: int, num_heads: int, head_dim: int,
                 num_splits: int, device: torch.device | str, capture: bool) -> None:
        self.sizes = sorted(sizes)
        self.num_splits = num_splits  # fixed: it shapes the captured decode kernels
        self.capture = capture
        n = self.sizes[-1]
        dev = torch.device(device)
        self.input_ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.long, device=dev)
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=dev)
        self.block_tables = torch.zeros(n, max_blocks, dtype=torch.int32, device=dev)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self.workspace = (torch.empty(n * num_heads * num_splits, head_dim, device=dev),
                          torch.empty(n * num_heads * num_splits, device=dev))
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None
        self.replays = 0
        self.eager_steps = 0

    def padded_size(self, num_reqs: int) -> int | None:
        """The captured size a batch of `num_reqs` decodes runs at (None: too big, run eager)."""
        i = bisect.bisect_left(self.sizes, num_reqs)
        return self.sizes[i] if i < len(self.sizes) else None

    def fits(self, num_reqs: int, table_width: int) -> bool:
        return self.padded_size(num_reqs) is not None and table_width <= self.block_tables.shape[1]

    def prepare(self, meta, input_ids: list[int]):
        """Write a decode-only step (its AttentionMetadata and tokens) into the buffers, pad it,
        and return (padded size, the step's metadata pointing at the buffers)."""
        n = len(input_ids)
        size = self.padded_size(n)
        width = meta.decode_block_tables.shape[1]
        put = lambda buf, a: buf.copy_(torch.from_numpy(np.ascontiguousarray(a)), non_blocking=True)  # noqa: E731
        put(self.input_ids[:n], np.asarray(input_ids, dtype=np.int64))
        put(self.positions[:n], meta.positions.astype(np.int64))
        self.slot_mapping[:n].copy_(meta.slot_mapping, non_blocking=True)
        put(self.seq_lens[:n], meta.seq_lens.astype(np.int32))
        put(self.block_tables[:n, :width], meta.decode_block_tables.astype(np.int32))
        if size > n:  # padding rows: write nothing, read nothing
            self.input_ids[n:size].zero_()
            self.positions[n:size].zero_()
            self.slot_mapping[n:size].fill_(-1)
            self.seq_lens[n:size].zero_()
        gpu = DeviceMetadata(self.block_tables[:size], self.seq_lens[:size],
                             self.query_start_loc[:size + 1], 1, self.num_splits, self.workspace)
        return size, replace(meta, num_tokens=size, gpu=gpu, device_positions=self.positions[:size],
                             slot_mapping=self.slot_mapping[:size])

    def capture_all(self, forward: Callable[[torch.Tensor, object], torch.Tensor],
                    block_size: int) -> None:
        """Capture every size now (at start-up) instead of on first use: a dummy decode of
        `size` one-token sequences on block 0, which no request has been handed yet."""
        from kvflow.attention.metadata import build_attention_metadata
        device = self.input_ids.device
        for size in self.sizes:
            meta = build_attention_metadata(np.ones(size), np.ones(size), [[0]] * size,
                                            block_size, device)
            size, padded = self.prepare(meta, [0] * size)
            self.run(size, padded, forward)
        self.replays = 0

    def run(self, size: int, meta, forward: Callable[[torch.Tensor, object], torch.Tensor]) -> torch.Tensor:
        """Hidden states [size, hidden] of the prepared step: replayed from the graph of this
        size (captured on first use), or `forward(input_ids, meta)` run eagerly."""
        ids = self.input_ids[:size]
        if not self.capture:
            self.eager_steps += 1
            return forward(ids, meta)
        if size not in self.graphs:
            # one eager run first (Triton compiles, the allocator warms), then the capture;
            # every size shares one memory pool
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                forward(ids, meta)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                out = forward(ids, meta)
            self.pool = graph.pool()
            self.graphs[size] = (graph, out)
        graph, out = self.graphs[size]
        graph.replay()
        self.replays += 1
        return out


def decode_graphs_for(arch, block_size: int, max_num_seqs: int, max_model_len: int,
                      device: torch.device | str, capture: bool = True) -> DecodeGraphs:
    """The graphs of an engine: its whole batch-size ladder, block tables as wide as
    max_model_len, and the decode splits that length calls for."""
    return DecodeGraphs(capture_sizes(max_num_seqs), -(-max_model_len // block_size),
                        arch.num_attention_heads, arch.head_dim,
                        num_decode_splits(max_model_len), device, capture)
