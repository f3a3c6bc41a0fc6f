"""Engine snapshots for the live dashboard: the queues, recent steps' token use and the KV block
map, taken in the core process a few times per second (never every step) and sent to the
frontend as one compact message."""
from __future__ import annotations

import time
from collections import deque

from kvflow.core.scheduler import Scheduler
from kvflow.engine.protocol import (CACHED_FREE, FREE, HELD, OWNER_BASE, SHARED, EngineSnapshot,
                                    RequestView, SchedulerStats, StepTokens)

SNAPSHOT_INTERVAL_S = 0.25  # at most 4 snapshots a second
HISTORY_STEPS = 120  # recent steps kept for the token-budget chart
MAX_WAITING_SHOWN = 64  # the queue can be long; its length is always reported


def _view(req, num_blocks: int) -> RequestView:
    return RequestView(req.request_id, req.num_prompt_tokens,
                       min(req.num_computed_tokens, req.num_prompt_tokens),
                       req.num_output_tokens, req.max_tokens, num_blocks, req.num_preemptions)


def block_owners(scheduler: Scheduler) -> list[int]:
    """One small int per KV block. O(blocks held + blocks cached), not a walk over the pool."""
    kv = scheduler.kv_cache_manager
    pool = kv.block_pool
    owners = [FREE] * pool.num_blocks
    for block in pool.cached.values():
        owners[block.block_id] = CACHED_FREE  # overwritten below when someone holds it
    for i, req in enumerate(scheduler.running):
        code = OWNER_BASE + i
        for block in kv.req_to_blocks.get(req.request_id, ()):
            owners[block.block_id] = SHARED if block.ref_cnt > 1 else code
    # blocks lent to a decode instance, or being filled from a prefill instance: held
    for rid in [*scheduler.leases, *scheduler.loading]:
        for block in kv.req_to_blocks.get(rid, ()):
            if owners[block.block_id] < OWNER_BASE:
                owners[block.block_id] = HELD
    return owners


def build_snapshot(scheduler: Scheduler, recent_steps) -> EngineSnapshot:
    """The dashboard's view of `scheduler` now; `recent_steps` is an iterable of StepTokens."""
    kv = scheduler.kv_cache_manager
    held = kv.req_to_blocks
    running = [_view(r, len(held.get(r.request_id, ()))) for r in scheduler.running]
    waiting = []
    for r in scheduler.waiting:
        if len(waiting) == MAX_WAITING_SHOWN:
            break
        waiting.append(_view(r, 0))
    return EngineSnapshot(
        time=time.time(), step=scheduler.step_index,
        budget=scheduler.config.max_num_batched_tokens, max_num_seqs=scheduler.config.max_num_seqs,
        block_size=scheduler.block_size, num_free_blocks=kv.num_free_blocks,
        num_cached_free_blocks=kv.block_pool.num_cached_free_blocks,
        num_waiting=len(scheduler.waiting), running=running, waiting=waiting,
        steps=list(recent_steps), block_owners=block_owners(scheduler))


class SnapshotSource:
    """Lives beside the core's loop: records each step's token split (O(1)) and hands out a
    snapshot when one is due. Snapshots are made only while `enabled` (a dashboard is
    watching), at most every `interval_s`, and once more after the last change, so that a
    viewer sees the engine fall idle."""

    def __init__(self, scheduler: Scheduler, interval_s: float = SNAPSHOT_INTERVAL_S,
                 history: int = HISTORY_STEPS) -> None:
        self.scheduler = scheduler
        self.interval_s = interval_s
        self.steps: deque[StepTokens] = deque(maxlen=history)
        self.enabled = False
        self._dirty = True
        self._last = 0.0
        self.build_time = 0.0  # seconds spent building snapshots, for the cost report
        self.num_built = 0

    def set_enabled(self, on: bool) -> None:
        self.enabled = on
        self._dirty = True

    def after_step(self, stats: SchedulerStats | None) -> EngineSnapshot | None:
        """Call after every step; returns a snapshot when one is due."""
        if stats is not None and stats.num_prompt_tokens + stats.num_generation_tokens:
            self.steps.append(StepTokens(self.scheduler.step_index - 1, stats.num_prompt_tokens,
                                         stats.num_generation_tokens, stats.num_encoder_tokens))
        self._dirty = True
        return self.poll()

    def poll(self) -> EngineSnapshot | None:
        """A snapshot if one is due and something changed since the last one."""
        if not (self.enabled and self._dirty):
            return None
        now = time.monotonic()
        if now - self._last < self.interval_s:
            return None
        t0 = time.perf_counter()
        snap = build_snapshot(self.scheduler, self.steps)
        self.build_time += time.perf_counter() - t0
        self.num_built += 1
        self._last, self._dirty = now, False
        return snap

    def wait_ms(self, idle_ms: int) -> int:
        """How long an idle loop may block before a pending snapshot falls due."""
        if not (self.enabled and self._dirty):
            return idle_ms
        left = self.interval_s - (time.monotonic() - self._last)
        return max(1, min(idle_ms, int(left * 1000) + 1))
