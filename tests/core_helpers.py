"""A model-free driver for the core: a fake 'model' whose next token is a pure function of the
context, so outputs must not depend on batching, chunking or preemption."""
from __future__ import annotations

from kvflow.config import CacheConfig, SchedulerConfig
from kvflow.core.scheduler import Scheduler
from kvflow.request import Request
from kvflow.sampling_params import SamplingParams


def fake_next_token(context: list[int]) -> int:
    h = 17
    for t in context:
        h = (h * 31 + t) % 1_000_003
    return 3 + h % 997


class FakeRunner:
    """Tracks token ids per request the way the real runner does, from SchedulerOutput only."""

    def __init__(self) -> None:
        self.tokens: dict[str, list[int]] = {}

    def execute(self, out) -> dict[str, list[int]]:
        for rid in out.finished_req_ids | set(out.preempted_req_ids):
            self.tokens.pop(rid, None)
        for new in out.scheduled_new_reqs:
            self.tokens[new.req_id] = list(new.token_ids)
        sampled = {}
        for rid, n in out.num_scheduled_tokens.items():
            toks = self.tokens[rid]
            if out.num_computed_tokens[rid] + n == len(toks):
                t = fake_next_token(toks)
                toks.append(t)
                sampled[rid] = [t]
        return sampled


def make_scheduler(num_blocks=64, block_size=4, budget=32, max_num_seqs=16, max_model_len=256,
                   **config):
    """`config`: more SchedulerConfig fields (policy, max_admission_skips, ...)."""
    return Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
                                     max_model_len=max_model_len, **config),
                     CacheConfig(block_size=block_size, num_blocks=num_blocks))


def make_request(rid: str, prompt_len: int, max_tokens: int = 8, priority: int = 0, **kw) -> Request:
    salt = sum(ord(c) * 131 ** k for k, c in enumerate(rid))
    prompt = [(7 * i + salt) % 500 + 3 for i in range(prompt_len)]
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0, **kw),
                   priority=priority)


def run_to_completion(sched, runner=None, max_steps=10_000, on_step=None):
    runner = runner or FakeRunner()
    outputs: dict[str, list[int]] = {}
    steps = []
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            break
        out = sched.schedule()
        sampled = runner.execute(out)
        updates = sched.update_from_output(out, sampled)
        sched.kv_cache_manager.check_invariants()
        for u in updates:
            outputs.setdefault(u.request.request_id, []).extend(u.new_token_ids)
        steps.append(out)
        if on_step:
            on_step(out, updates)
    return outputs, steps


def default_pool_scheduler(num_requests: int = 160, steps: int = 30):
    """The default 4 GiB pool of the default model (5,825 blocks of 16) with 128 requests
    running after `steps` steps of FakeRunner: the dashboard's worst ordinary case."""
    sched = make_scheduler(num_blocks=5825, block_size=16, budget=2048, max_num_seqs=128,
                           max_model_len=8192)
    for i in range(num_requests):
        sched.add_request(make_request(f"r{i}", 300 + i, max_tokens=400))
    runner = FakeRunner()
    for _ in range(steps):
        out = sched.schedule()
        sched.update_from_output(out, runner.execute(out))
    return sched
