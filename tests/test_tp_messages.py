"""The tensor-parallel wire: typed msgpack, never pickle. A step's runner view round-trips exactly, and a
frame that is not a kvflow message (a pickle among them) is refused without being run."""
from __future__ import annotations

import pickle
from dataclasses import replace

import pytest

from kvflow.core.scheduler_output import AdmissionStop, BlockCheck, NewRequestData, SchedulerOutput
from kvflow.distributed.messages import (BadMessageError, StepMasks, WorkerInit, decode_init,
                                         decode_step, encode_init, encode_step)
from kvflow.sampling_params import SamplingParams


def test_a_step_round_trips_exactly():
    out = SchedulerOutput(
        step=7, num_scheduled_tokens={"a": 5, "b": 1}, total_num_scheduled_tokens=6,
        num_computed_tokens={"a": 0, "b": 9}, block_ids={"a": [3, 4], "b": [1]},
        scheduled_new_reqs=[NewRequestData("a", [1, 2, 3, 4, 5], 5, SamplingParams(
            temperature=0.7, top_k=5, seed=11, stop=["x"], stop_token_ids=[2], logprobs=2))],
        resumed_req_ids=[], preempted_req_ids=["c"], finished_req_ids={"d", "e"},
        num_cached_tokens={"a": 0}, is_prefill={"a": True, "b": False}, num_prefill_tokens=5,
        num_decode_tokens=1, preempted_for={"c": "b"}, block_checks={"a": BlockCheck(2, 10, 0)},
        skipped_req_ids=["f"], admission_stop=AdmissionStop.BUDGET)
    msg = decode_step(encode_step(out, {"b": [42]}))
    # everything the runner reads arrives exactly; the scheduler's record of its decisions
    # (for the trace and stats, growing with the waiting queue) stays on the driver
    runner_view = replace(out, is_prefill={}, preempted_for={}, block_checks={},
                          skipped_req_ids=[], admission_stop=None)
    assert msg.sched_out == runner_view and msg.sampled == {"b": [42]}
    assert msg.sched_out.num_prefill_tokens == 5 and msg.sched_out.preempted_req_ids == ["c"]
    assert isinstance(msg.sched_out.scheduled_new_reqs[0].sampling_params, SamplingParams)
    assert decode_step(encode_step(None, {})) is None  # stop


def test_a_steps_grammar_masks_reach_the_last_stage_as_the_driver_filled_them():
    import numpy as np

    class Filled:  # the driver's GrammarBitmask, as the runner reads it
        req_ids, num_rows = ["a", "b"], [1, 1]
        bitmask = np.array([[-1, 5, 0], [7, 0, 1 << 30]], dtype=np.int32)

    out = SchedulerOutput(step=1, num_scheduled_tokens={"a": 1, "b": 1}, total_num_scheduled_tokens=2)
    masks = decode_step(encode_step(out, {}, StepMasks.of(Filled))).grammar
    assert masks.req_ids == ["a", "b"] and masks.num_rows == [1, 1]
    assert np.array_equal(masks.bitmask, Filled.bitmask)
    assert decode_step(encode_step(out, {})).grammar is None
    with pytest.raises(BadMessageError, match="grammar masks do not match"):
        StepMasks(["a", "b"], [1, 2], 3, masks.mask_bytes).bitmask  # 3 rows claimed, 2 sent
    assert StepMasks(["a"], [2], 3, masks.mask_bytes).bitmask.shape == (2, 3)  # one id, 2 rows


def test_worker_init_round_trips():
    init = WorkerInit("/m.gguf", "bfloat16", "float32", 128, 16, 2, [2, 3], "/dev/shm/x", 4096)
    assert decode_init(encode_init(init)) == init and init.device == "cpu"
    on_gpu = WorkerInit("/m", "bfloat16", "bfloat16", 64, 16, 1, 2, device="cuda")
    assert decode_init(encode_init(on_gpu)).device == "cuda"


class Boom:
    def __reduce__(self):
        return (exec, ("raise SystemExit('pickle ran')",))


@pytest.mark.parametrize("frame", [pickle.dumps(Boom()), pickle.dumps((SchedulerOutput(), {})),
                                   b"\x93\x01\x02\x03", b""])
def test_a_foreign_frame_is_refused_not_run(frame):
    with pytest.raises(BadMessageError):
        decode_step(frame)
    with pytest.raises(BadMessageError):
        decode_init(frame)


def test_nothing_on_the_tensor_parallel_path_imports_pickle():
    import ast
    import pathlib

    root = pathlib.Path(__file__).resolve().parent.parent / "kvflow" / "distributed"
    for path in root.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n and n.split(".")[0] in ("pickle", "cloudpickle") for n in names), path.name
