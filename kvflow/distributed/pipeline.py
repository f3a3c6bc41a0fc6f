"""Pipeline parallelism: the decoder layers split into `pipeline_parallel_size` stages, each
run by `tensor_parallel_size` ranks (global rank = stage * tp + tp_rank; the driver is rank 0,
on the first stage).

Every step the driver sends the step's message to each rank point to point (not a broadcast:
a collective would wait for the later stages, which are still busy with the previous batch,
and the stages could not overlap). The first stage embeds the tokens; each stage runs its
layers and sends the residual stream and the last MLP output ([2, T, hidden]) to the rank of
the same tp_rank on the next stage; the last stage's tp_rank 0 samples and sends the sampled
tokens (and logprobs) back to the driver. All of it is gloo send/recv over one group of every
rank, with a tag per stream, so messages of one stream arrive in the order they were sent."""
from __future__ import annotations

import time
from datetime import timedelta

import torch

from kvflow.distributed.parallel import CollectiveError, Rendezvous, gloo_group
from kvflow.model.arch import LlamaArchConfig

TAG_STEP, TAG_HIDDEN, TAG_RESULT = 0, 1, 2


def check_pp_size(arch: LlamaArchConfig, pp: int) -> None:
    """ValueError naming the numbers when `arch` cannot be cut into `pp` stages."""
    if pp > arch.num_hidden_layers:
        raise ValueError(f"pipeline_parallel_size {pp} is more than the model's "
                         f"{arch.num_hidden_layers} decoder layers")


def stage_layers(num_layers: int, pp: int, stage: int) -> range:
    """The decoder layers of `stage`: an even split, the first stages taking one more where it
    does not divide (vLLM splits the same way)."""
    base, extra = divmod(num_layers, pp)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (stage < extra))


def stage_place(arch: LlamaArchConfig, layers: range | None) -> dict:
    """The ModelRunner arguments that place a stage's `layers` in the whole model `arch`: the
    model's KV cache groups (sliding-window layers make several) are the scheduler's, so a
    stage's layers keep their group and shared tensor (none: one process, nothing to place)."""
    if layers is None:
        return {}
    return {"model_kv_windows": tuple(arch.kv_layer_windows()), "first_layer": layers.start}


def stage_arch(shard: LlamaArchConfig, layers: range) -> LlamaArchConfig:
    """The arch a stage's runner and KV cache are built from: its own layers only (each stage
    allocates only its layers' KV; the block count is the driver's for every stage)."""
    from dataclasses import replace
    types = shard.layer_types[layers.start:layers.stop] if shard.layer_types else None
    return replace(shard, num_hidden_layers=len(layers), layer_types=types)


class PipelineGroup:
    """This rank's place in the pipeline and the point-to-point traffic of the module
    docstring. Sends are asynchronous (the tensor stays referenced until gloo is done with it);
    receives wait. A peer that goes away becomes a CollectiveError."""

    def __init__(self, rdv: Rendezvous, rank: int, world_size: int, tp: int, pp: int) -> None:
        self.rank, self.world_size, self.tp, self.pp = rank, world_size, tp, pp
        self.stage, self.tp_rank = divmod(rank, tp)
        self.is_first, self.is_last = self.stage == 0, self.stage == pp - 1
        self.sampler_rank = (pp - 1) * tp  # the last stage's tp_rank 0
        self.pg = gloo_group(rdv, "pp", rank, world_size)
        self._pending: list = []  # (work, tensor) of sends gloo may still be reading
        # unwaited sends kept before the oldest half are waited on: those are then some 2 x pp
        # steps old (the driver sends 2 tensors to every rank each step), long received
        self._max_pending = 8 * world_size * pp
        self.hidden_bytes_sent = 0
        self.message_bytes_sent = 0
        self.recv_wait_s = 0.0

    def _wait(self, work) -> None:
        try:
            work.wait()
        except RuntimeError as e:
            raise CollectiveError(str(e).split(". ")[0]) from None

    def _isend(self, t: torch.Tensor, dst: int, tag: int) -> None:
        if len(self._pending) >= self._max_pending:
            # gloo marks a send complete only once it is waited on: wait for the oldest ones,
            # which the (at most pp steps behind) receivers have long taken
            half = self._max_pending // 2
            old, self._pending = self._pending[:half], self._pending[half:]
            for w, _ in old:
                self._wait(w)
        try:
            self._pending.append((self.pg.send([t], dst, tag), t))
        except RuntimeError as e:
            raise CollectiveError(str(e).split(". ")[0]) from None

    def _recv(self, t: torch.Tensor, src: int, tag: int) -> torch.Tensor:
        t0 = time.perf_counter()
        try:
            work = self.pg.recv([t], src, tag)
        except RuntimeError as e:
            raise CollectiveError(str(e).split(". ")[0]) from None
        self._wait(work)
        self.recv_wait_s += time.perf_counter() - t0
        return t

    def send_bytes(self, data: bytes, dst: int, tag: int) -> None:
        """A length, then the bytes (two sends of one stream: they arrive in order)."""
        self._isend(torch.tensor([len(data)], dtype=torch.int64), dst, tag)
        self._isend(torch.frombuffer(bytearray(data), dtype=torch.uint8), dst, tag)
        self.message_bytes_sent += len(data) + 8

    def recv_bytes(self, src: int, tag: int) -> bytes:
        n = int(self._recv(torch.empty(1, dtype=torch.int64), src, tag)[0])
        return self._recv(torch.empty(n, dtype=torch.uint8), src, tag).numpy().tobytes()

    def send_hidden(self, hidden: torch.Tensor) -> None:
        """This stage's [2, T, hidden] to the same tp_rank of the next stage."""
        hidden = hidden.contiguous()
        self._isend(hidden, self.rank + self.tp, TAG_HIDDEN)
        self.hidden_bytes_sent += hidden.numel() * hidden.element_size()

    def recv_hidden(self, num_tokens: int, hidden_size: int, dtype: torch.dtype) -> torch.Tensor:
        """The previous stage's [2, T, hidden] for this step."""
        return self._recv(torch.empty(2, num_tokens, hidden_size, dtype=dtype),
                          self.rank - self.tp, TAG_HIDDEN)

    def flush(self, timeout_s: float = 5.0) -> None:
        """Wait (a bounded time) for the sends gloo has not finished: before closing."""
        deadline = time.monotonic() + timeout_s
        pending, self._pending = self._pending, []
        for w, _ in pending:
            try:
                w.wait(timedelta(seconds=max(0.01, deadline - time.monotonic())))
            except RuntimeError:
                return  # a peer is gone or too slow: closing anyway

    def close(self) -> None:
        self._pending = []
        self.pg = None
