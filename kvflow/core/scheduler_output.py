"""SchedulerOutput: the plain description of one step that the runner executes."""
from __future__ import annotations

from dataclasses import dataclass, field

from kvflow.sampling_params import SamplingParams


@dataclass(slots=True)
class NewRequestData:
    """A request the runner has not seen (first scheduled, or resumed after preemption).
    `token_ids` is prompt + outputs so far; outputs are non-empty only when resumed."""

    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams


@dataclass
class SchedulerOutput:
    step: int = 0
    # request id -> tokens this step, in schedule order (running first, then newly admitted)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    # request id -> num_computed_tokens before this step
    num_computed_tokens: dict[str, int] = field(default_factory=dict)
    # request id -> whole block table after this step's allocation
    block_ids: dict[str, list[int]] = field(default_factory=dict)
    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    resumed_req_ids: list[str] = field(default_factory=list)  # subset of the new ones
    preempted_req_ids: list[str] = field(default_factory=list)
    # finished (or aborted) since the previous schedule(): the runner drops their state
    finished_req_ids: set[str] = field(default_factory=set)
    # request id -> prompt tokens found in the prefix cache at admission
    num_cached_tokens: dict[str, int] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0
