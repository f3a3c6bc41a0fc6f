"""Prefill/decode disaggregation without a model: the scheduler's side of a pull
(waiting_for_remote_kv, the plan, success, failure, abort) and of a lease, the lease table, the
agents moving real bytes between two caches (ZeroMQ frames and shared memory), and the checks
at the boundary (the config, the request field, a compatibility mismatch)."""
from __future__ import annotations

import time

import pytest
import torch

from core_helpers import make_request, make_scheduler
from kvflow.config import EngineConfig, KVTransferConfig
from kvflow.core.scheduler_output import KVLoad
from kvflow.entrypoints.openai.protocol import CompletionRequest
from kvflow.kv_transfer.agent import KVTransferAgent, write_blocks
from kvflow.kv_transfer.blocks import KVShard, PagedKV, gather_into, scatter, transfer_bytes
from kvflow.kv_transfer.lease import LeaseTable
from kvflow.kv_transfer.params import KVTransferParams
from kvflow.request import FinishReason, RequestStatus
from server_helpers import free_port

BS = 4


def remote_params(num_tokens: int, block_ids=None, remote_bs=BS, **kw) -> KVTransferParams:
    n = -(-num_tokens // remote_bs)
    return KVTransferParams(
        do_remote_prefill=True, remote_engine_id="p", remote_host="127.0.0.1", remote_port=1,
        remote_block_ids=block_ids or list(range(100, 100 + n)), remote_num_tokens=num_tokens,
        remote_block_size=remote_bs, transfer_id=kw.pop("transfer_id", "t1"), compat_hash="h",
        compat=kw.pop("compat", {}), **kw)


def remote_request(rid: str, prompt_len: int, **kw):
    req = make_request(rid, prompt_len)
    req.sampling_params.kv_transfer_params = remote_params(prompt_len, **kw)
    return req


def test_remote_request_waits_with_its_blocks_then_computes_one_prompt_token():
    s = make_scheduler(num_blocks=32, block_size=BS)
    req = remote_request("r", 10)
    s.add_request(req)
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KV
    out = s.schedule()
    assert out.total_num_scheduled_tokens == 0 and out.waiting_for_remote_kv_ids == ["r"]
    [load] = out.kv_loads
    # the K/V of tokens 0..8 (the last prompt token is recomputed): blocks 0..2 of 3
    assert (load.first_token, load.num_tokens) == (0, 9)
    assert load.remote_block_ids == [100, 101, 102]
    assert load.local_block_ids == s.kv_cache_manager.get_block_ids("r")
    assert s.kv_cache_manager.num_free_blocks == 29
    # not findable in the prefix cache while the pull is under way
    other = make_request("o", 10)
    other.prompt_token_ids[:] = req.prompt_token_ids
    other.all_token_ids[:] = req.prompt_token_ids
    assert s.kv_cache_manager.get_computed_blocks(other)[1] == 0
    assert s.schedule().waiting_for_remote_kv_ids == ["r"]  # skipped, not planned twice
    assert s.finish_load("r", True)
    assert s.kv_cache_manager.get_computed_blocks(other)[1] == 8  # findable now
    out = s.schedule()
    assert out.num_scheduled_tokens == {"r": 1} and out.num_computed_tokens == {"r": 9}
    assert out.is_prefill["r"] and out.scheduled_new_reqs[0].req_id == "r"
    s.kv_cache_manager.check_invariants()


def test_a_local_prefix_hit_is_not_pulled_again():
    s = make_scheduler(num_blocks=32, block_size=BS)
    first = make_request("a", 12, max_tokens=1)
    s.add_request(first)
    out = s.schedule()
    s.update_from_output(out, {"a": [5]})
    req = remote_request("r", 14)
    req.prompt_token_ids[:12] = first.prompt_token_ids
    req.all_token_ids[:12] = first.prompt_token_ids
    s.add_request(req)
    [load] = s.schedule().kv_loads
    # blocks 0..2 are cached here: only block 3 (token 12, the last but one) is pulled
    assert (load.first_token, load.num_tokens) == (12, 13)
    assert load.remote_block_ids == [103]


def test_a_pull_from_another_block_size_names_the_remote_blocks_that_hold_its_tokens():
    s = make_scheduler(num_blocks=32, block_size=BS)
    first = make_request("a", 12, max_tokens=1)
    s.add_request(first)
    s.update_from_output(s.schedule(), {"a": [5]})
    req = remote_request("r", 30, remote_bs=8)  # remote blocks 100..103 hold tokens 0..31
    req.prompt_token_ids[:12] = first.prompt_token_ids
    req.all_token_ids[:12] = first.prompt_token_ids
    s.add_request(req)
    [load] = s.schedule().kv_loads
    # 12 tokens cached here; tokens 12..28 come from remote blocks 1..3 (tokens 8..31) into
    # local blocks 3..7 (the request's 4th to 8th block)
    assert (load.first_token, load.num_tokens) == (12, 29)
    assert load.remote_block_ids == [101, 102, 103]
    assert load.local_block_ids == s.kv_cache_manager.get_block_ids("r")[3:8]


def test_failed_pull_recomputes_and_its_blocks_never_enter_the_prefix_cache():
    s = make_scheduler(num_blocks=32, block_size=BS)
    s.add_request(remote_request("r", 10))
    s.schedule()
    assert s.finish_load("r", False, recompute=True, error="gone")
    assert s.kv_cache_manager.num_free_blocks == 32
    assert s.kv_cache_manager.block_pool.num_cached_free_blocks == 0
    out = s.schedule()
    assert out.num_scheduled_tokens == {"r": 10} and out.num_computed_tokens == {"r": 0}


def test_failed_pull_with_policy_fail_ends_the_request():
    s = make_scheduler(num_blocks=32, block_size=BS)
    s.add_request(remote_request("r", 10))
    s.schedule()
    s.finish_load("r", False, recompute=False, error="gone")
    out = s.schedule()
    assert out.kv_load_errors == {"r": "gone"} and not out.is_empty
    [u] = s.update_from_output(out, {})
    assert u.finish_reason == FinishReason.ABORT and "gone" in u.request.stop_reason
    assert s.kv_cache_manager.num_free_blocks == 32 and not s.has_unfinished_requests()


def test_abort_while_waiting_for_remote_kv_frees_blocks_and_names_the_pull():
    s = make_scheduler(num_blocks=32, block_size=BS)
    s.add_request(remote_request("r", 10))
    s.schedule()
    assert s.abort_request("r")
    assert [rid for rid, _ in s.cancelled_loads] == ["r"]
    assert s.kv_cache_manager.num_free_blocks == 32
    assert not s.finish_load("r", True)  # a late answer finds nothing to fill
    # one still queued for blocks (its pull not started) is named too: its lease is released
    s = make_scheduler(num_blocks=32, block_size=BS, budget=512)
    s.add_request(make_request("hog", 100))  # admitted first: it takes 25 blocks
    s.add_request(remote_request("big", 40, transfer_id="t2"))
    out = s.schedule()
    assert out.skipped_req_ids == ["big"] and not out.kv_loads
    s.abort_request("big")
    assert [rid for rid, _ in s.cancelled_loads] == ["big"]


def test_remote_decode_request_lends_its_blocks_until_released():
    s = make_scheduler(num_blocks=32, block_size=BS)
    req = make_request("p", 10, max_tokens=1)
    req.sampling_params.kv_transfer_params = KVTransferParams(do_remote_decode=True)
    s.add_request(req)
    out = s.schedule()
    [u] = s.update_from_output(out, {"p": [7]})
    assert u.finish_reason == FinishReason.LENGTH
    blocks, n = s.new_leases["p"]
    assert n == 10 and len(blocks) == 3 and s.kv_cache_manager.num_free_blocks == 29
    s.kv_cache_manager.check_invariants()
    assert s.release_lease("p") and not s.release_lease("p")
    assert s.kv_cache_manager.num_free_blocks == 32


def test_aborted_remote_decode_request_lends_nothing():
    s = make_scheduler(num_blocks=32, block_size=BS)
    req = make_request("p", 10, max_tokens=1)
    req.sampling_params.kv_transfer_params = KVTransferParams(do_remote_decode=True)
    s.add_request(req)
    s.schedule()
    s.abort_request("p")
    assert not s.leases and s.kv_cache_manager.num_free_blocks == 32


def test_lease_table_expires_unless_extended():
    t = LeaseTable(timeout_s=2.0)
    t.add("a", [1, 2], 8, now=0.0)
    t.add("b", [3], 4, now=0.0)
    assert t.extend("a", now=1.5) and not t.extend("zz", now=1.5)
    assert [x.transfer_id for x in t.expired(now=2.0)] == ["b"]
    assert t.expired(now=3.0) == [] and t.get("a") is not None
    assert [x.transfer_id for x in t.expired(now=3.5)] == ["a"] and len(t) == 0


def caches(seed: int, num_blocks=8, heads=2, bs=BS):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(num_blocks, heads, bs, 8, generator=g),
             torch.randn(num_blocks, heads, bs, 8, generator=g)) for _ in range(3)]


def whole(c) -> PagedKV:
    return PagedKV([KVShard(0, c)])


def split(c, tp: int) -> PagedKV:
    """The same cache as `tp` ranks would hold it: rank r has heads [r*H/tp, (r+1)*H/tp)."""
    h = c[0][0].shape[1] // tp
    return PagedKV([KVShard(r * h, [(k[:, r * h:(r + 1) * h].clone(), v[:, r * h:(r + 1) * h].clone())
                                    for k, v in c]) for r in range(tp)])


def assembled(kv: PagedKV):
    """Per layer (k, v) with every head, put back together from the ranks' shares."""
    return [tuple(torch.cat([s.kv_caches[i][j] for s in kv.readers], dim=1) for j in (0, 1))
            for i in range(kv.num_layers)]


def wait_event(agent, kind, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for ev in agent.drain_events():
            if ev.kind == kind:
                return ev
        agent.wait(0.05)
    raise AssertionError(f"no {kind} event")


@pytest.mark.parametrize("use_shm", [False, True], ids=["zmq", "shm"])
def test_agents_move_the_exact_bytes_and_end_the_lease(use_shm):
    port = free_port()
    compat = {"dtype": "float32"}
    src, dst = caches(0), caches(1)
    producer = KVTransferAgent(KVTransferConfig("kv_producer", kv_port=port), compat, whole(src), BS)
    consumer = KVTransferAgent(KVTransferConfig("kv_consumer", kv_use_shm=use_shm), compat,
                               whole(dst), BS)
    try:
        producer.offer("t", [5, 2, 7], 12)
        p = producer.params_for("t", [5, 2, 7], 12)
        consumer.check_compatible(p)
        consumer.load(KVLoad("r", p, [1, 3], [5, 2], 0, 11))
        ev = wait_event(consumer, "loaded")
        assert (len(ev.frames) == 1) == use_shm
        write_blocks(consumer.kv, ev)
        consumer.release_remote(p, done=True)  # the engine's word once the bytes are in place
        for (sk, sv), (dk, dv) in zip(src, dst):
            assert torch.equal(dk[[1, 3]], sk[[5, 2]]) and torch.equal(dv[[1, 3]], sv[[5, 2]])
        assert wait_event(producer, "released").error == "done"
        assert ev.num_bytes == producer.stats.bytes_sent == 2 * 3 * 2 * (2 * BS * 8 * 4)
        assert producer.stats.blocks_sent == 2
    finally:
        producer.shutdown()
        consumer.shutdown()


@pytest.mark.parametrize("use_shm", [False, True], ids=["zmq", "shm"])
@pytest.mark.parametrize("tp_src,tp_dst", [(2, 1), (1, 2), (2, 2), (4, 2)])
def test_tensor_parallel_shards_are_assembled_and_split_by_head(tp_src, tp_dst, use_shm):
    """A TP producer sends whole blocks (its ranks' head ranges side by side); a TP consumer
    writes each rank's heads into that rank's cache: the bytes match whatever the TP sizes."""
    port = free_port()
    full_src, full_dst = caches(0, heads=4), caches(1, heads=4)
    src, dst = split(full_src, tp_src), split(full_dst, tp_dst)
    producer = KVTransferAgent(KVTransferConfig("kv_producer", kv_port=port), {}, src, BS)
    consumer = KVTransferAgent(KVTransferConfig("kv_consumer", kv_use_shm=use_shm), {}, dst, BS)
    try:
        producer.offer("t", [6, 0, 3], 12)
        p = producer.params_for("t", [6, 0, 3], 12)
        consumer.load(KVLoad("r", p, [2, 5, 7], [6, 0, 3], 0, 11))
        ev = wait_event(consumer, "loaded")
        assert (len(ev.frames) == 1) == use_shm
        write_blocks(consumer.kv, ev)
        got = assembled(consumer.kv)
        for (sk, sv), (dk, dv), (ok, ov) in zip(full_src, got, full_dst):
            assert torch.equal(dk[[2, 5, 7]], sk[[6, 0, 3]]) and torch.equal(dv[[2, 5, 7]], sv[[6, 0, 3]])
            rest = [0, 1, 3, 4, 6]  # blocks the pull does not name are untouched
            assert torch.equal(dk[rest], ok[rest]) and torch.equal(dv[rest], ov[rest])
        assert ev.num_bytes == 3 * 2 * 3 * (4 * BS * 8 * 4)
    finally:
        producer.shutdown()
        consumer.shutdown()


@pytest.mark.parametrize("use_shm", [False, True], ids=["zmq", "shm"])
@pytest.mark.parametrize("src_bs,dst_bs,tp_src,tp_dst", [(8, 4, 1, 1), (4, 8, 1, 2), (16, 4, 2, 1)])
def test_blocks_of_another_size_are_moved_token_by_token(src_bs, dst_bs, tp_src, tp_dst, use_shm):
    """The two sides' block sizes differ: the consumer turns the producer's tiles back into rows
    and writes the pulled tokens by slot into its own blocks (here after a local prefix hit of
    one block), with tensor parallelism on either side as well."""
    from kvflow.attention.kv_layout import read_rows

    full_src, full_dst = caches(0, heads=4, bs=src_bs), caches(1, heads=4, bs=dst_bs)
    src, dst = split(full_src, tp_src), split(full_dst, tp_dst)
    remote = [5, 0, 3, 6, 2, 7][:-(-23 // src_bs)]  # a 23-token prompt's blocks
    first, num = dst_bs, 22  # one local block cached; the last prompt token is recomputed
    local = [7, 2, 5, 1, 3, 6][:-(-(num - first) // dst_bs)]
    producer = KVTransferAgent(KVTransferConfig("kv_producer", kv_port=free_port()), {}, src, src_bs)
    consumer = KVTransferAgent(KVTransferConfig("kv_consumer", kv_use_shm=use_shm), {}, dst, dst_bs)
    try:
        producer.offer("t", remote, 23)
        p = producer.params_for("t", remote, 23)
        consumer.check_compatible(p)
        consumer.load(KVLoad("r", p, local, remote[first // src_bs:-(-num // src_bs)], first, num))
        write_blocks(consumer.kv, wait_event(consumer, "loaded"))
        t = torch.arange(first, num)
        src_slots = torch.tensor(remote)[t // src_bs] * src_bs + t % src_bs
        dst_slots = torch.tensor(local)[(t - first) // dst_bs] * dst_bs + t % dst_bs
        untouched = [b for b in range(8) if b not in local]
        for (sk, sv), (dk, dv), (ok, ov) in zip(full_src, assembled(consumer.kv), full_dst):
            for got, want in zip(read_rows(dk, dv, dst_slots), read_rows(sk, sv, src_slots)):
                assert torch.equal(got, want)
            assert torch.equal(dk[untouched], ok[untouched]) and torch.equal(dv[untouched], ov[untouched])
    finally:
        producer.shutdown()
        consumer.shutdown()


def test_replicated_kv_heads_are_read_once_and_written_to_every_replica():
    """More ranks than KV heads: each head lives on several ranks (sharding.py)."""
    c = caches(0, heads=1)
    replicas = PagedKV([KVShard(0, [(k.clone(), v.clone()) for k, v in c]) for _ in range(2)])
    assert len(replicas.readers) == 1 and replicas.num_heads == 1
    src = whole(caches(3, heads=1))
    staging = torch.empty(transfer_bytes(src, 2)[1], dtype=torch.uint8)
    gather_into(src, [1, 2], staging)
    scatter(replicas, [4, 5], [staging])
    src = caches(3, heads=1)
    for s in replicas.shards:
        for (k, v), (sk, sv) in zip(s.kv_caches, src):
            assert torch.equal(k[[4, 5]], sk[[1, 2]]) and torch.equal(v[[4, 5]], sv[[1, 2]])


def test_pull_of_an_unknown_lease_fails_and_a_late_answer_is_dropped():
    port = free_port()
    producer = KVTransferAgent(KVTransferConfig("kv_producer", kv_port=port,
                                                kv_lease_timeout_s=0.3), {}, whole(caches(0)), BS)
    consumer = KVTransferAgent(KVTransferConfig("kv_consumer"), {}, whole(caches(1)), BS)
    try:
        producer.offer("t", [1], 4)
        p = producer.params_for("t", [1], 4)
        assert wait_event(producer, "released").error == "expired"  # nobody pulled in time
        consumer.load(KVLoad("r", p, [0], [1], 0, 3))
        assert "no lease" in wait_event(consumer, "failed").error
    finally:
        producer.shutdown()
        consumer.shutdown()


def test_mismatched_kv_layout_is_refused_naming_the_field():
    consumer = KVTransferAgent(KVTransferConfig("kv_consumer"), {"kv_dtype": "float32"},
                               whole(caches(1)), BS)
    try:
        p = remote_params(8, compat={"kv_dtype": "bfloat16"})
        with pytest.raises(ValueError, match="kv_dtype 'bfloat16' there, 'float32' here"):
            consumer.check_compatible(p)
        p = remote_params(9, compat={"kv_dtype": "float32"}, remote_bs=3)
        with pytest.raises(ValueError, match="remote_block_size 3 is odd"):
            consumer.check_compatible(p)
    finally:
        consumer.shutdown()


def test_kv_transfer_config_is_checked_once():
    cfg = EngineConfig(kv_transfer_config='{"kv_role": "kv_consumer", "kv_port": 9000}')
    assert cfg.kv_transfer.is_consumer and not cfg.kv_transfer.is_producer
    assert cfg.kv_transfer.kv_load_failure_policy == "recompute"
    assert cfg.kv_transfer.kv_lease_timeout_s == 30.0
    with pytest.raises(ValueError, match="unknown key"):
        EngineConfig(kv_transfer_config='{"kv_role": "kv_both", "kv_buffer": 1}')
    with pytest.raises(ValueError, match="kv_role"):
        EngineConfig(kv_transfer_config='{"kv_role": "producer"}')
    with pytest.raises(ValueError, match="kv_load_failure_policy"):
        KVTransferConfig(kv_load_failure_policy="retry")


def test_request_field_is_bounded_and_refuses_what_it_cannot_do():
    ok = CompletionRequest(prompt="x", kv_transfer_params={"do_remote_decode": True})
    assert ok.sampling_params(1, None).kv_transfer_params.do_remote_decode
    with pytest.raises(ValueError, match="bogus"):
        CompletionRequest(prompt="x", kv_transfer_params={"bogus": 1})
    with pytest.raises(ValueError, match="do_remote_prefill needs"):
        CompletionRequest(prompt="x", kv_transfer_params={"do_remote_prefill": True}
                          ).sampling_params(4, None)
    with pytest.raises(ValueError, match="n must be 1"):
        CompletionRequest(prompt="x", n=2, kv_transfer_params={"do_remote_decode": True}
                          ).sampling_params(4, None)
    body = dict(do_remote_prefill=True, remote_engine_id="e", remote_host="h", remote_port=1,
                remote_block_ids=[1, 2, 3], remote_num_tokens=9, remote_block_size=4,
                transfer_id="t", compat_hash="c", compat={})
    assert CompletionRequest(prompt="x", kv_transfer_params=body).sampling_params(4, None)
    with pytest.raises(ValueError, match="take 3 blocks"):
        CompletionRequest(prompt="x", kv_transfer_params=dict(body, remote_block_ids=[1])
                          ).sampling_params(4, None)
    with pytest.raises(ValueError):
        CompletionRequest(prompt="x", kv_transfer_params=dict(body, remote_port=70000))


def test_a_ranks_shared_kv_cache_is_the_drivers_too_and_orphans_are_swept():
    """Under TP a rank's KV cache lives in a shared file laid out front to back, so the driver's
    mapping sees the same tensors; a dead driver's files go at the next start."""
    import os
    import subprocess

    from kvflow.distributed import shared_kv

    path = shared_kv.create_kv_segment(shared_kv.kv_segment_bytes(2, 100, torch.float32))
    try:
        rank, driver = shared_kv.SharedKVMemory(path), shared_kv.SharedKVMemory(path)
        mine = [rank.zeros(100, torch.float32) for _ in range(4)]  # K, V of 2 layers
        seen = [driver.zeros(100, torch.float32) for _ in range(4)]
        mine[3][7], seen[1][0] = 5.0, 2.0
        assert seen[3][7] == 5.0 and mine[1][0] == 2.0 and mine[0].abs().sum() == 0
        with pytest.raises(ValueError, match="holds"):
            rank.zeros(1, torch.float32)
    finally:
        os.unlink(path)
    gone = subprocess.Popen(["true"])
    gone.wait()
    orphan = os.path.join(shared_kv.SHM_DIR, f"kvflow-tpkv-{gone.pid}-test")
    live = os.path.join(shared_kv.SHM_DIR, f"kvflow-tpkv-{os.getpid()}-test")
    for p in (orphan, live):
        open(p, "w").close()
    try:
        shared_kv.sweep_orphans()
        assert not os.path.exists(orphan) and os.path.exists(live)
    finally:
        for p in (orphan, live):
            if os.path.exists(p):
                os.unlink(p)
