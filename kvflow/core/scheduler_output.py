"""SchedulerOutput: the plain description of one step that the runner executes, and what the
scheduler decided in it and why, for the trace, stats, dashboard and narration."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from kvflow.kv_transfer.params import KVTransferParams
from kvflow.pooling_params import PoolingParams
from kvflow.sampling_params import SamplingParams


@dataclass(slots=True)
class NewRequestData:
    """A request the runner has not seen (first scheduled, or resumed after preemption).
    `token_ids` is prompt + outputs so far; outputs are non-empty only when resumed."""

    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    # an embedding request: the runner pools its prompt's hidden states and samples nothing
    pooling_params: PoolingParams | None = None
    lora_int_id: int = 0  # its LoRA adapter's id; 0: the base model
    mm_features: list = field(default_factory=list)  # its images (request.MultiModalFeatureSpec)


@dataclass(slots=True)
class KVLoad:
    """A pull the engine starts this step: the K/V of the prompt's tokens
    `[first_token, num_tokens)` from the remote blocks that hold them into the local ones (block
    for block when both sides' block sizes agree; else token by token, kv_transfer/blocks.py).
    The first local block starts at `first_token`, the first remote one at or before it."""

    req_id: str
    params: KVTransferParams
    local_block_ids: list[int]
    remote_block_ids: list[int]
    first_token: int  # tokens before it were found in the local prefix cache
    num_tokens: int  # the prompt's tokens but the last (recomputed for its logits)


@dataclass(slots=True)
class BlockCheck:
    """Admission's test of one waiting request: the blocks its whole remaining prompt would take
    from the free pool must fit in the free blocks not promised to admitted, unfinished prompts."""

    need: int  # blocks it would take (prefix-cache hits that sit in the free queue count)
    free: int  # free blocks in the pool at the check
    promised: int  # of those, still owed to admitted prompts that are not complete
    state_slot: bool = True  # a model with state layers: a state slot is free for it

    @property
    def fits(self) -> bool:
        return self.state_slot and self.need <= self.free - self.promised


class AdmissionStop(str, enum.Enum):
    """Why admission stopped before the end of the waiting queue (the rest wait for this)."""

    PREEMPTION = "preemption"  # nothing is admitted in a step that preempts
    BUDGET = "budget"  # the token budget is used up
    MAX_NUM_SEQS = "max_num_seqs"  # max_num_seqs requests already run
    ENCODER_BUDGET = "encoder_budget"  # the next request's image run does not fit this
    #                step's token or encoder budget (a run is scheduled whole)
    HELD = "held"  # the last skipped request was passed over max_admission_skips times:
    #                nobody overtakes it any more

    def __str__(self) -> str:
        return self.value


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
    # models with several KV cache groups (sliding-window layers; core/kv_cache/groups.py):
    # request id -> each group's whole block table (block_ids is group 0's); empty otherwise
    group_block_ids: dict[str, tuple[list[int], ...]] = field(default_factory=dict)
    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)  # admitted this step
    resumed_req_ids: list[str] = field(default_factory=list)  # subset of the new ones
    preempted_req_ids: list[str] = field(default_factory=list)
    # finished (or aborted) since the previous schedule(): the runner drops their state
    finished_req_ids: set[str] = field(default_factory=set)
    # request id -> prompt tokens found in the prefix cache at admission (admitted this step)
    num_cached_tokens: dict[str, int] = field(default_factory=dict)
    # constrained requests that sample in this step, in schedule order: the rows that need a
    # grammar mask (the engine fills their bitmask in one batch call before sampling)
    structured_output_request_ids: list[str] = field(default_factory=list)
    # of those, the ones whose output may still open its reasoning: id -> the reasoning's start
    # token, allowed besides the grammar's tokens
    structured_output_also_allowed: dict[str, int] = field(default_factory=dict)
    # request id -> why its grammar failed to compile; it finished (aborted) in this schedule()
    grammar_errors: dict[str, str] = field(default_factory=dict)
    # speculative decoding: request id -> its draft tokens checked this step (vLLM's name);
    # they are the last len(drafts) of its num_scheduled_tokens. Absent: no drafts.
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # a model with state layers and prefix caching: state slots copied (from, to) before the
    # forward (a hit resumes from a snapshot), and snapshots the forward writes: (request id,
    # the block boundary it is taken at, the snapshot slot), at most one per request
    state_restores: list[tuple[int, int]] = field(default_factory=list)
    state_saves: list[tuple[str, int, int]] = field(default_factory=list)

    # images: request id -> the indices (into its mm_features) of the images whose encoder
    # runs this step (vLLM's name); their placeholder runs are scheduled whole this step
    scheduled_encoder_inputs: dict[str, list[int]] = field(default_factory=dict)
    num_encoder_tokens: int = 0  # their image tokens, within SchedulerConfig.encoder_budget
    # -- what was decided and why: the runner does not need these ---------------------------
    # request id -> why its chunk stopped short of an image run: "image_run" (the token budget
    # left cannot take the run whole) or "encoder_budget" (the step's encoder budget cannot)
    encoder_cuts: dict[str, str] = field(default_factory=dict)
    # request id -> True when its tokens this step are prompt tokens (a prefill chunk, or a
    # resumed request recomputing), False for one decode token. The one definition of "prefill".
    is_prefill: dict[str, bool] = field(default_factory=dict)
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    # preempted id -> id of the running request whose need for a block preempted it (maybe itself)
    preempted_for: dict[str, str] = field(default_factory=dict)
    # waiting id -> admission's block check, for each waiting request it weighed, in queue order
    block_checks: dict[str, BlockCheck] = field(default_factory=dict)
    # waiting requests passed over for lack of blocks (they keep their place), in queue order
    skipped_req_ids: list[str] = field(default_factory=list)
    # admitted id -> why it did not look up the prefix cache though caching is on
    # ("prompt_logprobs", "pooling": it needs every prompt position computed)
    prefix_cache_bypassed: dict[str, str] = field(default_factory=dict)
    # why admission stopped before the end of the queue (None: it saw the whole queue)
    admission_stop: AdmissionStop | None = None
    # waiting requests passed over because their grammar is still compiling, in queue order
    waiting_for_grammar_ids: list[str] = field(default_factory=list)
    # waiting requests passed over because max_loras other adapters run (they keep their place)
    waiting_for_lora_ids: list[str] = field(default_factory=list)
    # -- KV transfer (prefill/decode disaggregation) -------------------------------------
    # pulls to start: their requests got their blocks this step and wait for the K/V
    kv_loads: list[KVLoad] = field(default_factory=list)
    # waiting requests passed over because their K/V is still being pulled, in queue order
    waiting_for_remote_kv_ids: list[str] = field(default_factory=list)
    # request id -> why its pull failed (kv_load_failure_policy `fail`); it finished (aborted)
    kv_load_errors: dict[str, str] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return (self.total_num_scheduled_tokens == 0 and not self.grammar_errors
                and not self.kv_load_errors)

    @property
    def num_preemptions(self) -> int:
        return len(self.preempted_req_ids)
