"""The engine's side of speculative decoding: after each step, draft tokens for the requests
that just sampled, from their tokens so far (n-gram lookup) or a small draft model, where the
policy says speculation pays. The scheduler stores them (`update_draft_token_ids`) and
schedules them with the next step; the runner checks them (kvflow/model/rejection_sampler.py)."""
from __future__ import annotations

from collections.abc import Callable

import torch

from kvflow.config import CacheConfig, SpeculativeConfig
from kvflow.core.scheduler import RequestUpdate
from kvflow.core.scheduler_output import SchedulerOutput
from kvflow.core.spec_decode import NgramProposer, SpecPolicy
from kvflow.model.arch import LlamaArchConfig


class Speculator:
    """One proposer (`propose_batch(items) -> drafts`, `forget(req_id)`) behind SpecPolicy."""

    def __init__(self, config: SpeculativeConfig, proposer, num_lookahead_tokens: int,
                 description: str, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.proposer = proposer
        self.num_lookahead_tokens = num_lookahead_tokens
        self.policy = SpecPolicy(config.disable_by_batch_size, config.min_acceptance_rate)
        self._description = description

    def describe(self) -> str:
        return self._description

    def propose(self, sched_out: SchedulerOutput, updates: list[RequestUpdate], num_running: int,
                block_ids: Callable[[str], list[int]]) -> dict[str, list[int]]:
        for rid in sched_out.finished_req_ids:  # aborted (or finished) since the last step
            self.proposer.forget(rid)
        for rid in sched_out.preempted_req_ids:  # its KV is gone: a draft model starts over
            self.proposer.forget(rid)
        allowed = self.policy.step_allows(num_running)
        k = self.policy.step_drafts(num_running, self.config.num_speculative_tokens)
        items = []
        for u in updates:
            req = u.request
            if u.finish_reason is not None:
                self.proposer.forget(req.request_id)
                continue
            # a constrained request speculates once its constraint is on (the scheduler cuts
            # drafts its grammar rejects), never in a reasoning part before it
            reasoning = req.structured_output is not None and (not req.constraint_active
                                                               or req.reasoning_undecided)
            if (not allowed or not u.new_token_ids or reasoning
                    or not self.policy.request_allows(req.num_draft_tokens,
                                                      req.num_accepted_tokens)):
                continue
            # drafts past max_tokens or max_model_len would be cut: never made
            cap = min(k, req.max_tokens - req.num_output_tokens - 1,
                      self.max_model_len - req.num_tokens)
            if cap > 0:
                items.append((req.request_id, req.all_token_ids, block_ids(req.request_id), cap))
        if not items:
            return {}
        return dict(zip((i[0] for i in items), self.proposer.propose_batch(items)))


def build_speculator(config: SpeculativeConfig, arch: LlamaArchConfig, dtype: torch.dtype,
                     kv_dtype: torch.dtype, cache_config: CacheConfig,
                     max_model_len: int, quantization: str | None = None) -> Speculator:
    """`quantization` is the engine's option as given: a draft model is served like a target
    model at that path would be in one process (a quantized GGUF draft stays quantized)."""
    k = config.num_speculative_tokens
    if config.method == "ngram":
        proposer = NgramProposer(k, config.prompt_lookup_min, config.prompt_lookup_max)
        return Speculator(config, proposer, 0,
                          f"speculative decoding: ngram k={k} n={config.prompt_lookup_min}.."
                          f"{config.prompt_lookup_max}", max_model_len)
    from kvflow.model.draft_proposer import DraftModelProposer
    proposer = DraftModelProposer(config.model, k, arch, dtype, kv_dtype,
                                  cache_config.num_blocks, cache_config.block_size, max_model_len,
                                  quantization)
    # the draft writes k - 1 positions past the last known token: slots held for it
    return Speculator(config, proposer, k,
                      f"speculative decoding: draft model {config.model} "
                      f"({proposer.arch.num_hidden_layers} layers, {proposer.quantization}) k={k}", max_model_len)
