"""The dashboard without a model or a browser: the engine snapshot (the block map says who holds
each block, queues show progress, steps are split prefill/decode, snapshots are rare and cheap),
the frontend's last minute of request latencies and the prefill/decode transfer counts."""
from __future__ import annotations

import time

import msgspec

from core_helpers import FakeRunner, default_pool_scheduler, make_request, make_scheduler
from kvflow.engine.protocol import (CACHED_FREE, FREE, HELD, OWNER_BASE, SHARED, EngineSnapshot,
                                    KVTransferStats, SchedulerStats, StepTokens)
from kvflow.engine.snapshot import MAX_WAITING_SHOWN, SnapshotSource, build_snapshot
from kvflow.entrypoints.openai.dashboard import RecentLatencies, dashboard_event, hide_sharing
from kvflow.outputs import CompletionOutput, RequestOutput


def step(sched, runner):
    out = sched.schedule()
    sched.update_from_output(out, runner.execute(out))
    return out


def stats_of(sched, out) -> SchedulerStats:
    """EngineCore's split (taken before the update): tokens of requests still in their prompt
    are prefill, the rest decode."""
    prompt = sum(n for rid, n in out.num_scheduled_tokens.items()
                 if out.num_computed_tokens[rid] < sched.requests[rid].num_prompt_tokens)
    return SchedulerStats(num_prompt_tokens=prompt,
                          num_generation_tokens=out.total_num_scheduled_tokens - prompt)


def test_block_map_colours_each_block_by_its_holder():
    sched = make_scheduler(num_blocks=32, block_size=4, budget=64)
    shared_prefix = make_request("a", 12, max_tokens=20).prompt_token_ids
    sched.add_request(make_request("a", 12, max_tokens=20))
    runner = FakeRunner()
    step(sched, runner)  # a's 3 full blocks are now cached
    b = make_request("b", 14, max_tokens=20)
    b.prompt_token_ids[:12] = shared_prefix
    b.all_token_ids[:12] = shared_prefix
    sched.add_request(b)
    step(sched, runner)

    snap = build_snapshot(sched, [])
    kv = sched.kv_cache_manager
    a_blocks = {blk.block_id for blk in kv.req_to_blocks["a"]}
    b_blocks = {blk.block_id for blk in kv.req_to_blocks["b"]}
    both = a_blocks & b_blocks
    assert len(both) == 3, "b found a's three full prompt blocks in the prefix cache"
    index = {r.id: i for i, r in enumerate(snap.running)}
    for block_id, code in enumerate(snap.block_owners):
        if block_id in both:
            assert code == SHARED
        elif block_id in a_blocks:
            assert code == OWNER_BASE + index["a"]
        elif block_id in b_blocks:
            assert code == OWNER_BASE + index["b"]
        else:
            assert code == FREE
    assert snap.num_free_blocks == snap.block_owners.count(FREE) == kv.num_free_blocks
    assert {r.id: r.blocks for r in snap.running} == {"a": len(a_blocks), "b": len(b_blocks)}
    # Served without --enable-prompt-tokens-details, b's cache hit does not show: the shared
    # blocks are merely held; everything else is unchanged.
    hidden = hide_sharing(snap)
    assert SHARED not in hidden.block_owners
    assert [HELD if o == SHARED else o for o in snap.block_owners] == hidden.block_owners
    assert hidden.running == snap.running and SHARED in snap.block_owners


def test_finished_requests_leave_cached_free_blocks():
    sched = make_scheduler(num_blocks=16, block_size=4, budget=64)
    sched.add_request(make_request("a", 10, max_tokens=3))
    runner = FakeRunner()
    while sched.has_unfinished_requests():
        step(sched, runner)
    snap = build_snapshot(sched, [])
    assert snap.running == [] and snap.waiting == []
    # 10 prompt + 3 output tokens, 12 of them with K/V (the last is never fed back): 3 full
    # blocks of 4 stay findable by prefix; nothing else is cached
    assert snap.block_owners.count(CACHED_FREE) == snap.num_cached_free_blocks == 3
    assert snap.block_owners.count(FREE) == 16 - 3
    assert snap.num_free_blocks == 16


def test_queues_show_each_requests_progress():
    sched = make_scheduler(num_blocks=64, block_size=4, budget=16, max_num_seqs=2)
    for i, n in enumerate([20, 6, 5, 7]):
        sched.add_request(make_request(f"r{i}", n, max_tokens=9))
    runner = FakeRunner()
    step(sched, runner)  # r0 takes 16 of its 20 prompt tokens; r1 gets nothing (budget spent)
    snap = build_snapshot(sched, [])
    views = {r.id: r for r in snap.running}
    assert (views["r0"].computed, views["r0"].prompt, views["r0"].output) == (16, 20, 0)
    assert [r.id for r in snap.waiting] == ["r1", "r2", "r3"]
    assert snap.num_waiting == len(sched.waiting)
    for _ in range(3):
        step(sched, runner)
    views = {r.id: r for r in build_snapshot(sched, []).running}
    assert views["r0"].computed == 20 and views["r0"].output >= 1
    assert all(v.max_tokens == 9 for v in views.values())


def test_waiting_list_is_capped_but_counted():
    sched = make_scheduler(num_blocks=64, block_size=4, budget=16, max_num_seqs=1)
    for i in range(MAX_WAITING_SHOWN + 10):
        sched.add_request(make_request(f"w{i}", 4, max_tokens=2))
    snap = build_snapshot(sched, [])
    assert len(snap.waiting) == MAX_WAITING_SHOWN
    assert snap.num_waiting == MAX_WAITING_SHOWN + 10


def test_source_splits_steps_into_prefill_and_decode_and_keeps_the_last_ones():
    sched = make_scheduler(num_blocks=64, block_size=4, budget=8)
    sched.add_request(make_request("a", 13, max_tokens=4))
    source = SnapshotSource(sched, interval_s=0.0, history=3)
    runner = FakeRunner()
    split = []
    while sched.has_unfinished_requests():
        out = sched.schedule()
        stats = stats_of(sched, out)
        sched.update_from_output(out, runner.execute(out))
        source.after_step(stats)
        split.append((out.step, stats.num_prompt_tokens, stats.num_generation_tokens))
    # 13 prompt tokens in chunks of 8 + 5 (the second samples the first token), then 3 decodes
    assert [(p, d) for _, p, d in split] == [(8, 0), (5, 0), (0, 1), (0, 1), (0, 1)]
    assert list(source.steps) == [StepTokens(*s) for s in split[-3:]]


def test_snapshots_only_while_watched_and_at_most_every_interval():
    sched = make_scheduler()
    sched.add_request(make_request("a", 5, max_tokens=50))
    source = SnapshotSource(sched, interval_s=0.2)
    runner = FakeRunner()
    step(sched, runner)
    assert source.after_step(None) is None, "nobody watches: no snapshot is built"
    source.set_enabled(True)
    first = source.after_step(None)
    assert isinstance(first, EngineSnapshot)
    assert source.after_step(None) is None, "too soon after the previous one"
    assert 0 < source.wait_ms(1000) <= 201, "an idle loop wakes up for the pending one"
    time.sleep(0.21)
    assert source.poll() is not None
    assert source.poll() is None, "nothing changed since"
    assert source.wait_ms(1000) == 1000


def test_snapshot_covers_every_block_of_the_default_pool():
    """128 running requests over 5,825 blocks (the default 4 GiB pool of the default model): the
    snapshot names an owner for every block and encodes (its cost: benchmarks/snapshot_cost.py)."""
    sched = default_pool_scheduler()
    assert len(sched.running) == 128
    snap = build_snapshot(sched, [StepTokens(i, 1900, 128) for i in range(120)])
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(snap), type=EngineSnapshot)
    assert len(decoded.block_owners) == 5825
    held = {b for r in sched.running for b in sched.kv_cache_manager.get_block_ids(r.request_id)}
    assert {i for i, o in enumerate(decoded.block_owners) if o >= OWNER_BASE or o == SHARED} == held


def delta(rid: str, n_tokens: int, finished: bool = False) -> RequestOutput:
    return RequestOutput(rid, None, [1, 2, 3], [CompletionOutput(0, "x", [7] * n_tokens)], finished,
                         metrics={"arrival_time": 100.0})


def test_latencies_of_finished_requests_over_the_last_minute():
    recent = RecentLatencies(window_s=60)
    recent.record_outputs([delta("a", 1)], now=100.5)  # first token 0.5 s after arrival
    recent.record_outputs([delta("a", 1), delta("b", 1)], now=100.6)
    recent.record_outputs([delta("a", 2)], now=100.7)
    recent.record_outputs([delta("a", 1, finished=True)], now=100.8)
    recent.forget("b")  # aborted: no finish comes, and nothing is kept for it
    assert "b" not in recent._live
    [(t, ttft, itl)] = recent.last_minute(now=101.0)
    assert t == 100.8 and abs(ttft - 0.5) < 1e-9
    assert abs(itl - 0.1) < 1e-9, "0.3 s between the first and the last of 4 deltas"
    assert recent.last_minute(now=161.0) == [], "older than a minute"


class FakeEngine:
    """What the stream reads of the AsyncLLM."""

    def __init__(self, kv_transfer=None) -> None:
        self.info = None
        self.is_dead = False
        self.last_stats = SchedulerStats(kv_transfer=kv_transfer)


def event_of(engine) -> dict:
    """One stream event as the page receives it (through JSON)."""
    body = dashboard_event(engine, None, RecentLatencies(), "m", now=10.0)
    return msgspec.json.decode(msgspec.json.encode(body))


def test_transfers_show_on_both_sides_from_the_engines_stats():
    assert event_of(FakeEngine())["kv_transfer"] is None, "no --kv-transfer-config: no panel"
    prefill = event_of(FakeEngine(KVTransferStats(
        leases_active=1, leases_granted=5, leases_released=3, leases_expired=1, pulls_served=3,
        bytes_sent=3 * 4096, blocks_sent=6)))["kv_transfer"]
    assert prefill["prefill"] == {"leases_active": 1, "leases_granted": 5, "leases_released": 3,
                                  "leases_expired": 1, "pulls_served": 3, "blocks_sent": 6,
                                  "bytes_sent": 12288}
    assert prefill["decode"]["loads_done"] == 0 and prefill["decode"]["mean_load_s"] is None
    decode = event_of(FakeEngine(KVTransferStats(
        loads_active=2, loads_done=4, loads_failed=1, bytes_received=8192, blocks_received=8,
        load_seconds=0.5, late_frames=1)))["kv_transfer"]
    assert decode["decode"] == {"loads_active": 2, "loads_done": 4, "loads_failed": 1,
                                "blocks_received": 8, "bytes_received": 8192, "late_frames": 1,
                                "mean_load_s": 0.125}, "0.5 s over 4 finished pulls"
    assert decode["prefill"]["pulls_served"] == 0
