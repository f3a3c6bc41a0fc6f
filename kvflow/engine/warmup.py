"""Warm-up: a few throw-away steps at start-up, so that the first real requests do not pay for
oneDNN's first-call setup, the C kernels' first load and the allocator growing its pools.

The steps go through `execute` like any other (so tensor-parallel workers warm up too) on
blocks the scheduler has not handed out yet; nothing they write is ever read, because a block
is always written before a request reads it and none of them enters the prefix cache."""
from __future__ import annotations

import random

from kvflow.core.scheduler_output import NewRequestData, SchedulerOutput
from kvflow.sampling_params import SamplingParams

WARMUP_PREFIX = "__kvflow_warmup__"


def warmup_outputs(vocab_size: int, block_size: int, num_blocks: int,
                   max_num_batched_tokens: int) -> list[SchedulerOutput]:
    """Prefill of two requests (one greedy, one sampled with top-p), one decode step of both,
    and the step that drops them."""
    rng = random.Random(0)
    long_len = max(1, min(128, max_num_batched_tokens - 16, (num_blocks - 2) * block_size))
    lens = {f"{WARMUP_PREFIX}0": long_len, f"{WARMUP_PREFIX}1": min(16, block_size)}
    params = {f"{WARMUP_PREFIX}0": SamplingParams(temperature=0.0, max_tokens=2),
              f"{WARMUP_PREFIX}1": SamplingParams(temperature=1.0, top_p=0.9, max_tokens=2, seed=0)}
    blocks, next_block = {}, 0
    for rid, n in lens.items():
        count = -(-(n + 1) // block_size)  # blocks for the prompt and one decoded token
        blocks[rid] = list(range(next_block, next_block + count))
        next_block += count
    if next_block > num_blocks:
        return []
    prefill = SchedulerOutput(
        step=-2, num_scheduled_tokens=dict(lens), total_num_scheduled_tokens=sum(lens.values()),
        num_computed_tokens={rid: 0 for rid in lens}, block_ids=blocks,
        scheduled_new_reqs=[NewRequestData(rid, [rng.randrange(vocab_size) for _ in range(n)], n,
                                           params[rid]) for rid, n in lens.items()])
    decode = SchedulerOutput(
        step=-1, num_scheduled_tokens={rid: 1 for rid in lens}, total_num_scheduled_tokens=len(lens),
        num_computed_tokens=dict(lens), block_ids=blocks)
    drop = SchedulerOutput(step=0, finished_req_ids=set(lens))
    return [prefill, decode, drop]
