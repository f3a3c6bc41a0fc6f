"""ModelRunner: SchedulerOutput -> flat batch tensors -> one forward -> sampled token ids."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from kvflow.core.scheduler_output import SchedulerOutput
from kvflow.engine.protocol import TokenLogprobs
from kvflow.model.arch import LlamaArchConfig
from kvflow.model.attention import allocate_kv_caches, build_attention_metadata
from kvflow.model.sampler import Sampler, SamplingRow, build_sampling_metadata
from kvflow.sampling_params import SamplingParams


@dataclass(slots=True)
class CachedRequestState:
    """What the runner remembers of a request between steps."""

    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    generator: torch.Generator | None


@dataclass
class ModelRunnerOutput:
    sampled: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)


class ModelRunner:
    """Keeps a persistent per-request state, builds the flattened batch of each step with numpy,
    runs the model once, and samples only where a request's known tokens are all computed."""

    def __init__(self, model: torch.nn.Module, arch: LlamaArchConfig, num_blocks: int,
                 block_size: int, dtype: torch.dtype, eos_token_id: int | None) -> None:
        self.model = model
        self.arch = arch
        self.block_size = block_size
        self.eos_token_id = eos_token_id
        self.kv_caches = allocate_kv_caches(arch, num_blocks, block_size, dtype)
        self.sampler = Sampler()
        self.requests: dict[str, CachedRequestState] = {}

    def _update_states(self, out: SchedulerOutput) -> None:
        for rid in out.finished_req_ids:
            self.requests.pop(rid, None)
        for rid in out.preempted_req_ids:
            self.requests.pop(rid, None)
        for new in out.scheduled_new_reqs:
            old = self.requests.get(new.req_id)
            gen = old.generator if old is not None else None
            if gen is None and new.sampling_params.seed is not None:
                gen = torch.Generator().manual_seed(new.sampling_params.seed)
            self.requests[new.req_id] = CachedRequestState(
                new.req_id, list(new.token_ids), new.num_prompt_tokens, new.sampling_params, gen)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(out)
        if out.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput()
        req_ids = list(out.num_scheduled_tokens)
        states = [self.requests[rid] for rid in req_ids]
        query_lens = np.fromiter(out.num_scheduled_tokens.values(), dtype=np.int64, count=len(req_ids))
        starts = np.fromiter((out.num_computed_tokens[r] for r in req_ids), dtype=np.int64,
                             count=len(req_ids))
        seq_lens = starts + query_lens
        num_known = np.fromiter((len(s.token_ids) for s in states), dtype=np.int64, count=len(states))
        samples = seq_lens == num_known

        input_ids: list[int] = []
        for s, start, end in zip(states, starts.tolist(), seq_lens.tolist()):
            input_ids.extend(s.token_ids[start:end])
        cu = np.zeros(len(req_ids) + 1, dtype=np.int64)
        np.cumsum(query_lens, out=cu[1:])
        positions = np.arange(cu[-1], dtype=np.int64) - np.repeat(cu[:-1] - starts, query_lens)

        meta = build_attention_metadata(query_lens, seq_lens,
                                        [out.block_ids[r] for r in req_ids], self.block_size)
        hidden = self.model(torch.tensor(input_ids, dtype=torch.long),
                            torch.from_numpy(positions), self.kv_caches, meta)

        rows = np.nonzero(samples)[0]
        result = ModelRunnerOutput()
        if len(rows) == 0:
            return result
        logits = self.model.compute_logits(hidden[torch.from_numpy(cu[rows + 1] - 1)])
        sampling_rows = [
            SamplingRow(states[i].params, states[i].token_ids[:states[i].num_prompt_tokens],
                        states[i].token_ids[states[i].num_prompt_tokens:], states[i].generator,
                        self.eos_token_id)
            for i in rows.tolist()
        ]
        sampled = self.sampler(logits, build_sampling_metadata(sampling_rows, logits.shape[-1]))
        for i, token, lp in zip(rows.tolist(), sampled.sampled_token_ids, sampled.logprobs):
            state = states[i]
            state.token_ids.append(token)
            result.sampled[state.req_id] = [token]
            if lp is not None:
                result.logprobs[state.req_id] = lp
        return result
