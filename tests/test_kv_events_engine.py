"""KV events from a real engine: a tiny random Llama with `kv_events_config` publishes each
step's block events on a ZeroMQ PUB socket, as vLLM does ([topic, seq, msgpack KVEventBatch]),
and a plain SUB socket decodes them: the prompt's blocks stored under the hashes a router
computes from its token ids, their eviction when other prompts need the room, and a reset."""
from __future__ import annotations

import time

import msgspec
import pytest
import zmq

from conftest_model_helpers import save_byte_tokenizer, save_tiny_llama3
from kvflow import LLM, SamplingParams
from kvflow.core.kv_cache.block_pool import hash_token_blocks
from kvflow.engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

BS = 4
ONE = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("kv-events") / "tiny")
    save_tiny_llama3(path)
    save_byte_tokenizer(path)
    return path


def receive(sub: zmq.Socket, timeout_s: float = 10.0) -> tuple[bytes, int, KVEventBatch]:
    assert sub.poll(int(timeout_s * 1000)), "no KV event batch arrived"
    topic, seq, payload = sub.recv_multipart()
    return topic, int.from_bytes(seq, "big"), msgspec.msgpack.Decoder(KVEventBatch).decode(payload)


@pytest.mark.slow  # loads a (tiny) model
def test_an_engine_publishes_stored_removed_and_cleared_batches(tiny_model, tmp_path):
    endpoint = f"ipc://{tmp_path}/kv-events"
    llm = LLM(tiny_model, dtype="float32", max_model_len=24, block_size=BS, num_blocks=6,
              warmup=False, kv_events_config={"enable_kv_cache_events": True,
                                              "endpoint": endpoint, "topic": "kv"})
    sub = zmq.Context.instance().socket(zmq.SUB)
    try:
        sub.setsockopt(zmq.SUBSCRIBE, b"kv")
        sub.connect(endpoint)
        time.sleep(0.3)  # a SUB socket sees only what is sent after it has joined
        a, b, c = ([base + i for i in range(3 * BS)] for base in (10, 60, 110))
        llm.generate([a], ONE, use_tqdm=False)
        topic, seq, batch = receive(sub)
        assert topic == b"kv" and seq == 0 and batch.ts > 0 and batch.data_parallel_rank == 0
        assert batch.events == [BlockStored(hash_token_blocks(a, BS), None, a, BS, None, "CPU",
                                            None)]

        llm.generate([b], ONE, use_tqdm=False)  # the free blocks: nothing evicted
        llm.generate([c], ONE, use_tqdm=False)  # takes the three blocks a left
        seen = []
        while not any(type(e) is BlockRemoved for e in seen):
            _, seq, batch = receive(sub)
            seen += batch.events
        assert seq <= 3  # one batch per step that changed the cache, numbered in order
        removed = [h for e in seen if type(e) is BlockRemoved for h in e.block_hashes]
        assert sorted(removed) == sorted(hash_token_blocks(a, BS))
        stored = [e for e in seen if type(e) is BlockStored]
        assert [e.token_ids for e in stored] == [b, c]

        assert llm.reset_prefix_cache()
        _, _, batch = receive(sub)
        assert batch.events == [AllBlocksCleared()]
    finally:
        sub.close(linger=0)
        llm.engine.shutdown()


def test_a_bad_kv_events_config_names_the_key():
    with pytest.raises(ValueError, match="kv_events_config: unknown key"):
        LLM(kv_events_config={"enable_kv_cache_events": True, "endpoints": "tcp://*:1"})
    with pytest.raises(ValueError, match="kv_events_config: endpoint"):
        LLM(kv_events_config={"enable_kv_cache_events": True, "endpoint": "http://x"})


def test_each_data_parallel_replica_has_its_own_endpoint_the_front_can_follow():
    from kvflow.engine.dp_engine import listen_address, rank_config
    from kvflow.options import engine_config

    config = engine_config(data_parallel_size=2, kv_events_config={
        "enable_kv_cache_events": True, "endpoint": "tcp://*:5557"})
    ranks = [rank_config(config, i) for i in range(2)]
    assert [c.kv_events.endpoint for c in ranks] == ["tcp://*:5557", "tcp://*:5558"]
    assert [c.kv_events.data_parallel_rank for c in ranks] == [0, 1]
    assert [listen_address(c) for c in ranks] == ["tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558"]
    assert config.kv_events.endpoint == "tcp://*:5557"  # the shared config is left as it was
    off = engine_config(data_parallel_size=2, kv_events_config={
        "enable_kv_cache_events": True, "publisher": "null"})
    assert listen_address(rank_config(off, 1)) is None
    out = engine_config(data_parallel_size=2, kv_events_config={
        "enable_kv_cache_events": True, "endpoint": "tcp://collector:7000"})  # connects out
    assert listen_address(rank_config(out, 1)) is None


@pytest.mark.slow
def test_data_parallel_replicas_publish_their_batches_under_their_rank(tiny_model, tmp_path):
    import httpx

    from server_helpers import ServerProcess

    endpoint = f"ipc://{tmp_path}/dp-events"
    srv = ServerProcess("--model", tiny_model, "--dtype", "float32", "--max-model-len", "24",
                        "--block-size", str(BS), "--num-blocks", "8", "--no-warmup",
                        "--data-parallel-size", "2", "--kv-events-config",
                        f'{{"enable_kv_cache_events": true, "endpoint": "{endpoint}"}}')
    ctx = zmq.Context.instance()
    subs = [ctx.socket(zmq.SUB) for _ in range(2)]
    try:
        for sub, addr in zip(subs, (endpoint, endpoint + "_dp1")):
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(addr)
        time.sleep(0.3)
        first, second = [10 + i for i in range(3 * BS)], [60 + i for i in range(3 * BS)]
        ranks = []
        for prompt in (first, second):
            r = httpx.post(srv.url + "/v1/completions", timeout=60,
                           json={"prompt": prompt, "max_tokens": 1, "temperature": 0})
            assert r.status_code == 200, r.text
            ready = [i for i, s in enumerate(subs) if s.poll(10_000)]
            assert len(ready) == 1, ready  # one replica ran it, and only it published
            _, _, batch = receive(subs[ready[0]])
            assert batch.data_parallel_rank == ready[0]
            assert batch.events[0].block_hashes == hash_token_blocks(prompt, BS)
            ranks.append(ready[0])
        assert sorted(ranks) == [0, 1]  # prompts sharing nothing spread over both
    finally:
        for sub in subs:
            sub.close(linger=0)
        srv.close()


@pytest.mark.slow  # loads a (tiny) model
def test_the_data_parallel_front_routes_by_its_replicas_events(tiny_model, tmp_path):
    """The front (not started: its replicas' endpoints are fed by publishers here) picks the
    replica whose events say it holds the prompt, and moves when that one evicts it."""
    import asyncio

    from kvflow.engine.async_engine import StatLogger
    from kvflow.engine.dp_engine import DPAsyncLLM
    from kvflow.engine.kv_events import ZmqEventPublisher
    from kvflow.options import engine_config

    endpoint = f"ipc://{tmp_path}/front-events"
    config = engine_config(model=tiny_model, data_parallel_size=2, kv_events_config={
        "enable_kv_cache_events": True, "endpoint": endpoint})
    publishers = [ZmqEventPublisher(config.kv_events.for_rank(i)) for i in range(2)]
    front = DPAsyncLLM(config, [StatLogger(), StatLogger()])
    prompt = [10 + i for i in range(3 * BS)]
    hashes = hash_token_blocks(prompt, BS)

    def publish_until(rank: int, blocks: list[int], *events) -> None:
        deadline = time.monotonic() + 30
        while [s["kv_cache_blocks"] for s in front.replica_status()] != blocks:
            assert time.monotonic() < deadline, front.replica_status()
            publishers[rank].publish(KVEventBatch(time.time(), list(events)))
            time.sleep(0.05)

    try:
        publish_until(1, [0, 3], BlockStored(hashes, None, prompt, BS, None, "CPU", None))
        assert front.choose(prompt) == 1  # with the tree alone: 0, the first of equals
        publish_until(1, [0, 0], BlockRemoved(hashes, "CPU"))
        publish_until(0, [3, 0], BlockStored(hashes, None, prompt, BS, None, "CPU", None))
        assert front.choose(prompt) == 0  # though the tree remembers sending it to 1
        assert front.choose(prompt, cache_salt="other") == 1  # other hashes: the emptier one
    finally:
        asyncio.run(front.shutdown())
        for p in publishers:
            p.shutdown()


def test_the_replay_socket_resends_buffered_batches_from_a_sequence_number(tmp_path):
    from kvflow.config import KVEventsConfig
    from kvflow.engine.kv_events import END_SEQ, ZmqEventPublisher

    pub = ZmqEventPublisher(KVEventsConfig(
        enable_kv_cache_events=True, endpoint=f"ipc://{tmp_path}/pub",
        replay_endpoint=f"ipc://{tmp_path}/replay", buffer_steps=2))
    replay = zmq.Context.instance().socket(zmq.DEALER)
    try:
        for i in range(3):  # the buffer keeps the last two
            pub.publish(KVEventBatch(float(i), [BlockRemoved([bytes([i]) * 32], "CPU")]))
        replay.connect(f"ipc://{tmp_path}/replay")
        deadline = time.monotonic() + 10
        got = []
        while len(got) < 2:  # until the publisher's thread has sent (and buffered) the last
            assert time.monotonic() < deadline
            replay.send_multipart([b"", (0).to_bytes(8, "big")])
            got = []
            while True:
                assert replay.poll(5000), "no replay answer"
                _, seq, payload = replay.recv_multipart()
                if seq == END_SEQ:
                    break
                got.append((int.from_bytes(seq, "big"),
                            msgspec.msgpack.Decoder(KVEventBatch).decode(payload).ts))
        assert got == [(1, 1.0), (2, 2.0)]
    finally:
        replay.close(linger=0)
        pub.shutdown()
