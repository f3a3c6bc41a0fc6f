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
        assert topic == b"kv" and seq == 0 and batch.ts > 0
        assert batch.events == [BlockStored(hash_token_blocks(a, BS), None, a, BS, None, "CPU",
                                            None)]

        llm.generate([b], ONE, use_tqdm=False)  # the free blocks: nothing evicted
        llm.generate([c], ONE, use_tqdm=False)  # takes the three blocks a left (a prompt takes three)
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
