"""The waiting queue's O(1) removal: aborting many waiting requests is linear, in any order,
and the queue keeps its order and its invariants."""
from __future__ import annotations

import random

import pytest

from core_helpers import FakeRunner, make_request, make_scheduler, run_to_completion
from kvflow.core.request_queue import RequestQueue
from kvflow.request import Request

N = 20_000


@pytest.fixture
def counted_compares(monkeypatch):
    """Counts Request comparisons: what list/deque removal spends, one per element passed."""
    calls = [0]

    def eq(self, other):
        calls[0] += 1
        return self is other

    monkeypatch.setattr(Request, "__eq__", eq)
    monkeypatch.setattr(Request, "__hash__", object.__hash__)
    return calls


@pytest.mark.parametrize("order", ["arrival", "reverse", "random"])
def test_aborting_20k_waiting_requests_is_linear(order, counted_compares):
    sched = make_scheduler(num_blocks=64, max_num_seqs=4)
    for i in range(N):
        sched.add_request(make_request(f"r{i}", 4))
    ids = [f"r{i}" for i in range(N)]
    if order == "reverse":
        ids.reverse()
    elif order == "random":
        random.Random(0).shuffle(ids)
    peak = 0
    for k, rid in enumerate(ids):
        assert sched.abort_request(rid)
        if k % 97 == 0:
            # dead entries never pile up: storage stays within twice the live count
            peak = max(peak, sched.waiting.storage_size - 2 * len(sched.waiting))
    assert counted_compares[0] == 0  # no scan of the queue at all (a deque.remove: ~N^2/2)
    assert peak <= 32
    assert len(sched.waiting) == 0 and not sched.has_unfinished_requests()
    assert sched.kv_cache_manager.num_free_blocks == 64


def test_aborting_in_one_batch_walks_the_running_batch_once(counted_compares):
    sched = make_scheduler(num_blocks=4096, budget=4096, max_num_seqs=1000)
    for i in range(1000):
        sched.add_request(make_request(f"r{i}", 2))
    out = sched.schedule()
    assert len(sched.running) == 1000
    assert sched.abort_requests([f"r{i}" for i in range(999, -1, -1)] + ["unknown"]) == 1000
    assert counted_compares[0] == 0 and sched.running == []
    assert sched.kv_cache_manager.num_free_blocks == 4096
    assert out.num_scheduled_tokens  # (the step that admitted them)


def test_removal_keeps_queue_order_and_front_insertions():
    q = RequestQueue()
    reqs = [make_request(f"r{i}", 2) for i in range(100)]
    for r in reqs:
        q.append(r)
    for r in reqs[10:90]:
        q.remove(r)
    q.appendleft(reqs[50])  # e.g. preempted: back to the front
    assert [r.request_id for r in q] == ["r50"] + [f"r{i}" for i in [*range(10), *range(90, 100)]]
    assert len(q) == 21 and q[0] is reqs[50] and q[-1] is reqs[99]
    assert reqs[50] in q and reqs[20] not in q
    with pytest.raises(ValueError):
        q.remove(reqs[20])


def test_priority_insertion_skips_removed_entries():
    q = RequestQueue()
    key = lambda r: (r.priority, r.arrival_time)  # noqa: E731
    reqs = [Request(f"p{i}", [1, 2], priority=p, arrival_time=float(i))
            for i, p in enumerate([0, 2, 1, 2, 0])]
    for r in reqs:
        q.insert_sorted(r, key)
    q.remove(reqs[2])
    q.insert_sorted(Request("late", [1], priority=1, arrival_time=9.0), key)
    assert [r.request_id for r in q] == ["p0", "p4", "late", "p1", "p3"]


def test_abort_in_the_middle_of_a_workload_changes_no_other_output():
    """Aborted requests vanish; the rest produce what they produce alone."""
    sched = make_scheduler(num_blocks=32, max_num_seqs=2)
    for i in range(30):
        sched.add_request(make_request(f"r{i}", 5, max_tokens=4))
    for i in range(0, 30, 3):
        sched.abort_request(f"r{i}")
    outputs, _ = run_to_completion(sched, FakeRunner())
    assert sorted(outputs) == sorted(f"r{i}" for i in range(30) if i % 3)
