"""The input processor: every request check in one place, run once where a request enters
(`LLM`, the engines, the server), with the engine core and scheduler only asserting."""
from __future__ import annotations

import pytest

from kvflow.config import EngineConfig, LoRAConfig, ParallelConfig
from kvflow.engine.input_processor import InputProcessor, RequestLimits
from kvflow.engine.protocol import EngineCoreRequest
from kvflow.entrypoints.openai.errors import APIError
from kvflow.entrypoints.openai.serving_engine import OpenAIServing
from kvflow.lora_request import LoRARequest
from kvflow.pooling_params import PoolingParams
from kvflow.request import InvalidRequestError
from kvflow.sampling_params import SamplingParams, StructuredOutputsParams

LIMITS = RequestLimits(vocab_size=100, max_model_len=64, block_size=16, num_blocks=3)


def processor(**config) -> InputProcessor:
    return InputProcessor(EngineConfig(**config), LIMITS)


def test_a_request_within_every_bound_passes():
    processor().process([1, 2, 99], SamplingParams(max_tokens=8, stop_token_ids=[99], top_k=100))
    processor().process_pooling([0] * 48, PoolingParams())


@pytest.mark.parametrize("ids, kwargs, param, message", [
    ([1, 100], {}, None, "prompt contains token id 100, outside the vocabulary [0, 100)"),
    ([1, -1], {}, None, "prompt contains token id -1"),
    ([1], {"stop_token_ids": [100]}, None, "stop_token_ids contains token id 100"),
    ([1], {"logit_bias": {500: 1.0}}, None, "logit_bias contains token id 500"),
    ([1], {"top_k": 101}, None, "top_k must be -1 (disable) or at most the vocabulary size 100"),
    ([1] * 60, {"max_tokens": 8}, "max_tokens",
     "prompt has 60 tokens and max_tokens is 8: 68 is over max_model_len 64"),
    ([1] * 64, {"max_tokens": None}, "prompt", "prompt has 64 tokens; max_model_len is 64"),
    ([1] * 4, {"max_tokens": None, "min_tokens": 61}, "min_tokens", "min_tokens (61) must not exceed max_tokens (60"),
    ([], {}, "prompt", "prompt must not be empty"),
])
def test_each_bound_is_named_with_its_numbers(ids, kwargs, param, message):
    with pytest.raises(ValueError) as e:
        processor().process(ids, SamplingParams(**kwargs))
    assert str(e.value).startswith(message), str(e.value)
    if param is not None:
        assert isinstance(e.value, InvalidRequestError) and e.value.param == param


def test_the_kv_pool_bounds_a_request_below_max_model_len():
    """3 blocks of 16 hold 48 tokens: a request within max_model_len (64) that needs more
    blocks than the pool has is refused, naming both."""
    with pytest.raises(InvalidRequestError, match=r"need 50 tokens \(4 KV blocks\).*only 3 blocks"):
        processor().process([1] * 40, SamplingParams(max_tokens=10))
    with pytest.raises(InvalidRequestError, match=r"holds only 3 blocks"):
        processor().process_pooling([1] * 49)


def test_options_of_this_engine_refuse_what_they_cannot_serve():
    ngram = {"method": "ngram", "num_speculative_tokens": 2}
    with pytest.raises(InvalidRequestError, match="prompt_logprobs is not supported with "
                                                  "speculative decoding"):
        processor(speculative_config=ngram).process([1], SamplingParams(prompt_logprobs=1))
    choice = SamplingParams(structured_outputs=StructuredOutputsParams(choice=["a", "b"]))
    processor().process([1], choice)
    # the last stage samples through masks that travel with the step
    processor(parallel_config=ParallelConfig(pipeline_parallel_size=2)).process([1], choice)
    adapter = LoRARequest("sql", 1, "/adapters/sql")
    with pytest.raises(ValueError, match="'sql' is a LoRA adapter.*enable_lora"):
        processor().process([1], SamplingParams(), adapter)
    processor(lora_config=LoRAConfig(enable_lora=True)).process([1], SamplingParams(), adapter)
    with pytest.raises(InvalidRequestError, match="'sql' is a LoRA adapter.*enable_lora") as e:
        processor().process_pooling([1], None, adapter)
    assert e.value.param == "model"
    processor(lora_config=LoRAConfig(enable_lora=True)).process_pooling([1], None, adapter)


def test_kv_transfer_params_are_refused_at_the_input_only_without_a_kv_connector():
    """With no kv_transfer_config nothing in the core could take them: refused at the input.
    With one, the KV connector checks them in the core (against its role and its cache), where
    a refusal can release the producer's lease at once."""
    from kvflow.kv_transfer.params import KVTransferParams

    lend = SamplingParams(kv_transfer_params=KVTransferParams(do_remote_decode=True))
    with pytest.raises(ValueError, match="^kv_transfer_params.do_remote_decode: this instance "
                                         "lends no KV blocks"):
        processor().process([1], lend)
    pull = SamplingParams(kv_transfer_params=KVTransferParams(
        do_remote_prefill=True, remote_engine_id="p", remote_host="127.0.0.1", remote_port=1,
        remote_block_ids=[7], remote_num_tokens=1, remote_block_size=16, transfer_id="t",
        compat_hash="h", compat={}))
    with pytest.raises(ValueError, match="^kv_transfer_params.do_remote_prefill: this instance "
                                         "pulls no KV blocks"):
        processor().process([1], pull)
    consumer = processor(kv_transfer_config='{"kv_role": "kv_consumer", "kv_port": 9000}')
    consumer.process([1], lend)  # the connector's to refuse, in the core


def test_a_constraint_the_backend_cannot_enforce_is_refused():
    bad = SamplingParams(structured_outputs=StructuredOutputsParams(regex="[a-"))
    with pytest.raises(ValueError, match="structured_outputs.regex"):
        processor().process([1], bad)


def test_a_direct_core_request_is_checked_whole_including_its_eos_ids():
    ok = EngineCoreRequest("r", [1, 2], SamplingParams(max_tokens=4), eos_token_ids=[99])
    processor().process_core_request(ok)
    with pytest.raises(ValueError, match="^eos_token_ids contains token id 100"):
        processor().process_core_request(
            EngineCoreRequest("r", [1, 2], SamplingParams(max_tokens=4), eos_token_ids=[100]))
    with pytest.raises(ValueError, match="^prompt contains token id 100"):
        processor().process_core_request(
            EngineCoreRequest("r", [100], SamplingParams(), pooling_params=PoolingParams()))


class _Engine:
    """What OpenAIServing reads of the engine to check a prompt."""

    input_processor = processor()


@pytest.mark.parametrize("ids, params, param, words", [
    ([1] * 60, SamplingParams(max_tokens=8), "max_tokens", ["60 tokens", "max_tokens is 8",
                                                           "max_model_len 64"]),
    ([1] * 64, SamplingParams(max_tokens=None), "prompt", ["64 tokens", "max_model_len is 64"]),
    ([7, 100], SamplingParams(max_tokens=1), "prompt", ["token id 100", "[0, 100)"]),
    ([1] * 40, SamplingParams(max_tokens=10), "max_tokens", ["4 KV blocks", "only 3 blocks"]),
])
def test_the_server_400_names_the_field_and_the_bounds(ids, params, param, words):
    serving = OpenAIServing.__new__(OpenAIServing)
    serving.engine = _Engine()
    with pytest.raises(APIError) as e:
        serving.check_prompt(ids, params)
    assert (e.value.status, e.value.param, e.value.code) == (400, param, "invalid_value")
    for w in words:
        assert w in e.value.message, e.value.message


@pytest.fixture(scope="module")
def llm(default_model_path):
    from kvflow import LLM

    llm = LLM(default_model_path, dtype="float32", max_model_len=256, num_blocks=64,
              warmup=False)
    yield llm
    llm.engine.shutdown()


def test_request_is_checked_once_at_the_input_processor(llm, monkeypatch):
    """A prompt passes LLM -> LLMEngine -> EngineCore -> Scheduler, in n core requests, and
    its every check still runs once: at the input processor, where it entered."""
    calls = []
    for name in ("check_params", "check_constraint", "check_fits", "process_core_request"):
        original = getattr(InputProcessor, name)
        monkeypatch.setattr(InputProcessor, name, lambda self, *a, _f=original, _n=name, **k:
                            (calls.append(_n), _f(self, *a, **k))[1])
    outs = llm.generate(["Hello", "The sky is"], SamplingParams(max_tokens=3, n=2, seed=1),
                        use_tqdm=False)
    assert [len(o.outputs) for o in outs] == [2, 2]
    assert sorted(calls) == sorted(["check_params", "check_constraint", "check_fits"] * 2)


def test_the_core_asserts_what_the_input_processor_checked(llm):
    """A request marked checked is trusted: the core asserts its invariant (a programming
    error), it does not answer with a user-facing refusal. Unmarked, it is checked there."""
    core = llm.engine.core
    too_long = [5] * 250
    with pytest.raises(AssertionError):
        core.add_request(EngineCoreRequest("trusted", too_long, SamplingParams(max_tokens=10),
                                           checked=True))
    with pytest.raises(InvalidRequestError, match="250 tokens and max_tokens is 10"):
        core.add_request(EngineCoreRequest("direct", too_long, SamplingParams(max_tokens=10)))
    assert not core.has_unfinished_requests()


def test_a_bad_prompt_of_a_batch_queues_none(llm):
    with pytest.raises(ValueError, match="^prompt contains token id"):
        llm.generate([[5, 6], [5, 10**6]], SamplingParams(max_tokens=2), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
