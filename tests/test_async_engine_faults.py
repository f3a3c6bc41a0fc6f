"""The frontend's request lifecycle and heartbeat, with the core replaced by a fake: every way
a request can fail after it was counted uncounts it, a silent core with work pending is
declared stalled, and a core's traceback stays out of the error clients see."""
from __future__ import annotations

import asyncio

import msgspec
import pytest
import zmq

from kvflow.config import EngineConfig
from kvflow.engine.async_engine import AsyncLLM
from kvflow.engine.core_client import EngineCoreClient, EngineDeadError, EngineStalledError
from kvflow.engine.output_processor import OutputProcessor
from kvflow.engine.protocol import CoreMessage, EngineCoreOutput, EngineCoreOutputs, EngineCoreReady
from kvflow.sampling_params import SamplingParams


class CharTokenizer:
    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=False):
        return "".join(chr(i) for i in ids)


class FakeClient:
    """Stands in for EngineCoreClient: records what is sent; `fail_add` makes sending raise."""

    def __init__(self) -> None:
        self.added, self.aborted, self.killed = [], [], False
        self.fail_add: BaseException | None = None
        self.fail_abort: BaseException | None = None
        self.messages: asyncio.Queue | None = None

    def add_request(self, request) -> None:
        if self.fail_add is not None:
            raise self.fail_add
        self.added.append(request.request_id)

    def abort_requests(self, ids) -> None:
        if self.fail_abort is not None:
            raise self.fail_abort
        self.aborted.extend(ids)

    async def get_message(self):
        return await self.messages.get()  # nothing comes unless a test puts it

    def kill(self) -> None:
        self.killed = True

    def shutdown(self) -> None:
        pass


def make_engine(stall_timeout: float = 0.0) -> AsyncLLM:
    engine = AsyncLLM(EngineConfig(), stall_timeout=stall_timeout)
    engine.client.shutdown()  # the real one's sockets: no process was started
    engine.client = FakeClient()
    engine.client.messages = asyncio.Queue()
    engine.processor = OutputProcessor(CharTokenizer())
    engine.info = EngineCoreReady(0, "fake", 256, 64, 16, 4, 1000, "")
    engine._output_task = asyncio.create_task(engine._output_loop())
    if stall_timeout:
        engine._heartbeat_task = asyncio.create_task(engine._heartbeat())
    return engine


def assert_nothing_counted(engine: AsyncLLM) -> None:
    assert engine.num_core_requests == 0 and engine.queues == {} and engine._core_ids == {}
    assert engine.processor.requests == {} and engine.processor.core_to_sample == {}
    assert engine.num_waiting_after(0) == 0


async def drain(gen) -> list:
    return [out async for out in gen]


@pytest.mark.parametrize("error", [
    ValueError("the request cannot be sent to the engine: can't serialize ints > 2**64 - 1"),
    OverflowError("can't serialize ints > 2**64 - 1"),  # raw, as before add_request caught it
    zmq.ZMQError(zmq.ETERM),
])
def test_a_request_that_fails_to_send_is_uncounted(error):
    async def run():
        engine = make_engine()
        engine.client.fail_add = error
        for i in range(5):
            with pytest.raises(type(error)):
                await drain(engine.generate([1, 2, 3], SamplingParams(n=2), f"r{i}"))
            assert_nothing_counted(engine)
        await engine.shutdown()
    asyncio.run(run())


def test_encode_failure_in_the_real_client_is_a_value_error_and_sends_nothing(monkeypatch):
    """The real client with a value msgspec cannot encode: ValueError (a 400), and nothing sent."""
    client = EngineCoreClient(EngineConfig())
    try:
        sent = []
        monkeypatch.setattr(client.input_sock, "send_multipart", lambda *a, **k: sent.append(a))
        from kvflow.engine.protocol import EngineCoreRequest
        for bad in (SamplingParams(seed=0), SamplingParams(stop=["ok"])):
            if bad.seed is not None:
                bad.seed = 2 ** 70  # past validation: the frontend must still survive it
            else:
                bad.stop = ["\ud800"]
            with pytest.raises(ValueError, match="cannot be sent to the engine"):
                client.add_request(EngineCoreRequest("r", [1, 2], bad))
        assert sent == []
    finally:
        client.shutdown()


def test_a_cancelled_request_and_a_failing_abort_are_uncounted():
    async def run():
        engine = make_engine()
        task = asyncio.create_task(drain(engine.generate([1, 2], SamplingParams(), "a")))
        await asyncio.sleep(0.05)
        assert engine.num_core_requests == 1
        engine.client.fail_abort = zmq.ZMQError(zmq.ETERM)  # the abort cannot be sent either
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert_nothing_counted(engine)
        await engine.shutdown()
    asyncio.run(run())


def test_an_error_handed_to_the_stream_uncounts_it():
    async def run():
        engine = make_engine()
        task = asyncio.create_task(drain(engine.generate([1, 2], SamplingParams(n=3), "a")))
        await asyncio.sleep(0.05)
        engine.queues["a"].put_nowait(RuntimeError("output path failed"))
        with pytest.raises(RuntimeError):
            await task
        assert_nothing_counted(engine)
        assert sorted(engine.client.aborted) == ["a#0", "a#1", "a#2"]
        await engine.shutdown()
    asyncio.run(run())


def test_a_silent_core_with_work_pending_is_declared_stalled():
    async def run():
        engine = make_engine(stall_timeout=0.4)
        await asyncio.sleep(1.0)  # idle: a quiet core is fine
        assert not engine.is_dead
        gen = engine.generate([1, 2], SamplingParams(max_tokens=3), "a")
        first = asyncio.ensure_future(anext(gen))
        await asyncio.sleep(0.05)  # registered and sent
        engine.client.messages.put_nowait((CoreMessage.OUTPUTS, EngineCoreOutputs(
            [EngineCoreOutput("a", [65])])))
        first = await asyncio.wait_for(first, 5)
        assert first.outputs[0].text == "A"
        with pytest.raises(EngineStalledError) as e:
            await asyncio.wait_for(anext(gen), 30)  # a hang guard; the stall is 0.4 s
        assert e.value.code == "engine_stalled" and isinstance(e.value, EngineDeadError)
        assert engine.is_dead and engine.client.killed
        await gen.aclose()
        assert_nothing_counted(engine)
        with pytest.raises(EngineStalledError):  # later requests say why, with the same code
            await drain(engine.generate([1, 2], SamplingParams(), "b"))
        await engine.shutdown()
    asyncio.run(run())


def test_a_core_failure_report_stays_in_the_log(caplog):
    """The error that /health and 503 bodies show names the exception, not the traceback."""
    report = ('Traceback (most recent call last):\n  File "/srv/secret/path/core.py", line 3, '
              'in step\n    x = 1 / 0\nZeroDivisionError: division by zero\n')

    async def run():
        client = EngineCoreClient(EngineConfig())
        push = zmq.Context.instance().socket(zmq.PUSH)
        push.connect(client.output_addr)
        push.send_multipart([CoreMessage.FAILED, msgspec.msgpack.encode(report)])
        try:
            with pytest.raises(EngineDeadError) as e:
                await asyncio.wait_for(client.get_message(), 30)
        finally:
            push.close(0)
            client.shutdown()
        return str(e.value)

    with caplog.at_level("ERROR", logger="kvflow"):
        message = asyncio.run(run())
    assert message == "engine core failed: ZeroDivisionError: division by zero"
    assert "Traceback" in caplog.text and "/srv/secret/path" in caplog.text


def test_a_request_that_fails_halfway_through_registering_leaves_nothing(monkeypatch):
    from kvflow.engine import output_processor

    real, made = output_processor.IncrementalDetokenizer, []

    def flaky(*args):
        made.append(1)
        if len(made) == 3:
            raise MemoryError("the third sample's detokenizer")
        return real(*args)

    monkeypatch.setattr(output_processor, "IncrementalDetokenizer", flaky)

    async def run():
        engine = make_engine()
        with pytest.raises(MemoryError):
            await drain(engine.generate([1, 2], SamplingParams(n=4), "a"))
        assert_nothing_counted(engine)
        await engine.shutdown()
    asyncio.run(run())


def test_a_utility_call_that_cannot_be_sent_leaves_no_pending_work():
    async def run():
        engine = make_engine()

        def fail():
            raise zmq.ZMQError(zmq.ETERM)

        engine.client.request_reset_prefix_cache = fail
        with pytest.raises(zmq.ZMQError):
            await engine.reset_prefix_cache()
        assert not engine.has_pending_work()  # else the heartbeat would count a stall
        await engine.shutdown()
    asyncio.run(run())
