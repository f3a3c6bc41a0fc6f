"""Scheduler: decides, each step, who runs and how many tokens each (continuous batching with
chunked prefill), reserves their KV slots, and applies the sampled tokens afterwards."""
from __future__ import annotations

import time
from dataclasses import dataclass

from kvflow.config import CacheConfig, SchedulerConfig
from kvflow.core.kv_cache.coordinator import KVCacheCoordinator
from kvflow.core.kv_cache.groups import make_kv_cache_groups
from kvflow.core.kv_cache.spec import FullAttentionSpec, KVCacheSpec
from kvflow.core.request_queue import RequestQueue
from kvflow.core.remote_kv import RemoteKVMixin
from kvflow.core.scheduler_output import AdmissionStop, BlockCheck, NewRequestData, SchedulerOutput
from kvflow.core.spec_decode import SpecDecodeStats
from kvflow.logger import init_logger
from kvflow.request import InvalidRequestError, FinishReason, Request, RequestStatus, check_request_fits

logger = init_logger("kvflow.scheduler")

__all__ = ["Scheduler", "SchedulerOutput", "RequestUpdate"]


@dataclass(slots=True)
class RequestUpdate:
    """What one step changed for one request: its new tokens and, if it ended, why."""

    request: Request
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    num_draft_tokens: int = 0  # speculative decoding: drafts checked this step
    num_accepted_tokens: int = 0  # of which accepted (new_token_ids holds one more, or is cut)


class Scheduler(RemoteKVMixin):
    """Running requests first, in admission order (decode = 1 token, an ongoing prefill takes
    what budget is left), then waiting requests first-come-first-served while the token budget,
    `max_num_seqs` and free blocks allow. When a running request cannot get a block, the most
    recently admitted running request is preempted and recomputed later (under the priority
    policy: the lowest priority, latest arrival). Each SchedulerOutput also records why: who
    was admitted or skipped, who was preempted for whom, which tokens are prefill.

    `kv_cache_specs`: one KV cache spec per KV cache group of the model (core/kv_cache/),
    attention groups first; by default the groups of `cache_config.layer_windows` (and
    `layer_kv_shapes`). A model
    with state layers adds a StateSpec and `num_state_slots` (default: max_num_seqs, so
    that a slot never limits the batch)."""

    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig,
                 kv_cache_specs: list[KVCacheSpec] | None = None,
                 num_state_slots: int | None = None) -> None:
        if cache_config.num_blocks is None:
            raise ValueError("CacheConfig.num_blocks must be set before building a Scheduler")
        self.config = scheduler_config
        self.block_size = cache_config.block_size
        if kv_cache_specs is None:
            windows = cache_config.layer_windows
            kv_cache_specs = ([g.spec for g in make_kv_cache_groups(windows, cache_config.layer_kv_shapes)]
                              if windows
                              else [FullAttentionSpec()])
        self.kv_cache_manager = KVCacheCoordinator(
            kv_cache_specs, cache_config.num_blocks, cache_config.block_size,
            cache_config.enable_prefix_caching, scheduler_config.max_num_batched_tokens,
            scheduler_config.max_num_seqs if num_state_slots is None else num_state_slots)
        self.requests: dict[str, Request] = {}
        self.waiting = RequestQueue()  # O(1) removal: aborting many requests stays linear
        self.running: list[Request] = []
        self.step_index = 0
        # pipeline parallelism: up to this many steps in flight at once (vLLM's batch queue);
        # a request in a step that has not come back is not scheduled again (nor preempted)
        self.max_concurrent_batches = 1
        self.in_flight: set[str] = set()
        self._finished_ids: set[str] = set()
        self._grammar_failed: dict[str, Request] = {}  # reported by the next update_from_output
        # speculative decoding: slots reserved past a sampling step for a draft model's own
        # k steps (it writes its K/V at the same positions of its own pool); 0 otherwise
        self.num_lookahead_tokens = 0
        # with LoRA adapters: how many distinct ones may run at once (0: no adapters)
        self.max_loras = 0
        self.spec_stats = SpecDecodeStats()
        self._encoder_budget = scheduler_config.encoder_budget  # what this step has left
        self.init_remote_kv()  # prefill/decode disaggregation (remote_kv.py)

    # -- requests in and out -------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        check_request_fits(req.num_prompt_tokens, req.max_tokens, self.config.max_model_len,
                           self.block_size, self.kv_cache_manager.num_total_blocks)
        kv = self.kv_cache_manager
        need = kv.max_blocks_needed(req.num_prompt_tokens + req.max_tokens)
        if need > kv.num_total_blocks:  # its KV cache groups' blocks, all together
            raise InvalidRequestError(
                f"prompt ({req.num_prompt_tokens} tokens) and max_tokens ({req.max_tokens}) need "
                f"{need} KV blocks over the model's KV cache groups; the pool has "
                f"{kv.num_total_blocks}", "max_tokens")
        self._check_images(req)
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        self.requests[req.request_id] = req
        if req.structured_output is not None:
            req.status = RequestStatus.WAITING_FOR_GRAMMAR  # until its grammar has compiled
        p = req.sampling_params.kv_transfer_params
        if p is not None and p.do_remote_prefill:
            req.status = RequestStatus.WAITING_FOR_REMOTE_KV  # until its prompt's K/V arrived
        self._enqueue(req)

    def _check_images(self, req: Request) -> None:
        """An image's placeholder run is computed in one step (its tokens attend to each other):
        refuse one that no step's token or encoder budget could ever take whole."""
        c = self.config
        room = min(c.max_num_batched_tokens, c.long_prefill_token_threshold or c.max_num_batched_tokens)
        for f in req.mm_features:
            if f.length > room or f.length > c.encoder_budget:
                raise InvalidRequestError(
                    f"multi_modal_data: an image takes {f.length} tokens, more than one step computes "
                    f"(max_num_batched_tokens {c.max_num_batched_tokens}, long_prefill_token_threshold "
                    f"{c.long_prefill_token_threshold}, encoder budget {c.encoder_budget})",
                    "multi_modal_data")

    def _cut_for_images(self, req: Request, computed: int, n: int,
                        out: SchedulerOutput) -> tuple[int, list[int]]:
        """The tokens of `req` this step may take of the `n` planned from `computed`, and the
        images whose encoder runs for them: a chunk takes an image's remaining run whole or
        stops before it (for lack of tokens or of this step's encoder budget, recorded in
        `out.encoder_cuts`), so that the run's tokens are computed together."""
        encoder, budget = [], self._encoder_budget
        for i, f in enumerate(req.mm_features):
            if f.end <= computed:
                continue  # computed already (or found in the prefix cache)
            if f.offset >= computed + n:
                break
            why = ("image_run" if computed + n < f.end else
                   "encoder_budget" if f.length > budget else None)
            if why is not None:
                out.encoder_cuts[req.request_id] = why
                return max(0, f.offset - computed), encoder
            encoder.append(i)
            budget -= f.length
        return n, encoder

    def _enqueue(self, req: Request, front: bool = False) -> None:
        if self.config.policy == "priority":
            # lower priority value first, then arrival; a preempted request keeps its rank
            self.waiting.insert_sorted(req, lambda r: (r.priority, r.arrival_time))
        elif front:
            self.waiting.appendleft(req)
        else:
            self.waiting.append(req)

    def abort_request(self, request_id: str) -> bool:
        """End a request wherever it is; its blocks return to the pool now."""
        return self.abort_requests([request_id]) == 1

    def abort_requests(self, request_ids) -> int:
        """End each of these requests wherever it is; returns how many were unfinished. O(1)
        per waiting request, and one pass over the running batch for all of them."""
        n = 0
        stopped: dict[str, Request] = {}  # running ones, in the order given
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None or req.is_finished or rid in stopped:
                continue
            n += 1
            if req.status == RequestStatus.RUNNING:
                stopped[rid] = req
            else:
                self.waiting.remove(req)
                self._finish(req, RequestStatus.FINISHED_ABORTED)
        if stopped:
            self.running = [r for r in self.running if r.request_id not in stopped]
            for req in stopped.values():
                self._finish(req, RequestStatus.FINISHED_ABORTED)
        return n

    def reset_prefix_cache(self) -> bool:
        """Clear the prefix cache; refused (False) while any request holds blocks."""
        if self.running:
            return False
        return self.kv_cache_manager.reset_prefix_cache()

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    # -- one step ------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(step=self.step_index, finished_req_ids=self._finished_ids,
                              kv_load_errors=self._kv_errors)
        self._finished_ids = set()
        self._kv_errors = {}
        budget = self.config.max_num_batched_tokens
        self._encoder_budget = self.config.encoder_budget
        kv = self.kv_cache_manager

        cap = self.config.long_prefill_token_threshold
        in_flight = self.in_flight
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if req.request_id in in_flight:  # its previous step is still in the pipeline
                i += 1
                continue
            n = min(req.num_tokens + len(req.spec_token_ids) - req.num_computed_tokens, budget)
            if 0 < cap < n:
                n = cap
            assert n > 0, f"running request {req.request_id} has nothing to compute"
            encoder = None
            if req.mm_features:
                n, encoder = self._cut_for_images(req, req.num_computed_tokens, n, out)
                if n == 0:  # its next image run waits for a step with room for it
                    i += 1
                    continue
            # drafts the budget leaves room for; they are dropped before anyone is preempted
            num_spec = max(0, n - (req.num_tokens - req.num_computed_tokens))
            lookahead = self.num_lookahead_tokens
            cache = not req.is_pooling  # an embedding's blocks are never findable
            if num_spec and kv.allocate_slots(req, n, cache=cache,
                                              num_lookahead_tokens=lookahead) is None:
                n, num_spec = n - num_spec, 0
            while kv.allocate_slots(req, n, cache=cache, num_lookahead_tokens=lookahead) is None:
                victim = self._pick_victim()
                vi = self.running.index(victim)
                del self.running[vi]
                if victim.request_id in out.num_scheduled_tokens:  # priority policy only
                    budget += self._unschedule(victim, out)
                self._preempt(victim, out)
                out.preempted_for[victim.request_id] = req.request_id
                if vi < i:
                    i -= 1
                if victim is req:
                    break
            else:
                self._schedule(req, n, out, num_spec, encoder)
                budget -= n
                i += 1
                continue
            if req.status == RequestStatus.PREEMPTED:
                continue  # `req` itself was preempted; the one now at index i is next
            i += 1

        if out.preempted_req_ids:
            out.admission_stop = AdmissionStop.PREEMPTION
        else:
            budget = self._admit(budget, out)

        if self.max_concurrent_batches > 1:
            in_flight.update(out.num_scheduled_tokens)
        out.state_restores, out.state_saves = kv.take_state_copies()
        self.step_index += 1
        return out

    def _admit(self, budget: int, out: SchedulerOutput) -> int:
        """Admit waiting requests in queue order while budget, max_num_seqs and blocks allow. A
        request whose whole remaining prompt does not fit is passed over (it keeps its place) at
        most `max_admission_skips` times; after that nobody overtakes it."""
        kv = self.kv_cache_manager
        cap = self.config.long_prefill_token_threshold
        # Blocks the admitted prefills still need, so admission never promises them twice.
        pending = sum(kv.num_blocks_needed(r, r.num_tokens) for r in self.running
                      if r.num_computed_tokens + out.num_scheduled_tokens.get(r.request_id, 0)
                      < r.num_tokens)
        admitted, failed = [], []
        now = time.time()
        # adapters running: a step holds at most max_loras of them (their slots)
        loras = {r.lora_int_id for r in self.running if r.lora_int_id} if self.max_loras else set()
        for req in self.waiting:
            if budget <= 0:
                out.admission_stop = AdmissionStop.BUDGET
                break
            if len(self.running) >= self.config.max_num_seqs:
                out.admission_stop = AdmissionStop.MAX_NUM_SEQS
                break
            if req.status == RequestStatus.WAITING_FOR_GRAMMAR:
                so = req.structured_output
                if not so.is_ready():
                    out.waiting_for_grammar_ids.append(req.request_id)
                    continue  # compiling off the loop: the requests behind it go on
                if so.error is not None:
                    failed.append(req)
                    continue
                req.status = RequestStatus.WAITING
            if req.status == RequestStatus.WAITING_FOR_REMOTE_KV:
                self._start_load(req, out, pending)
                continue  # its pull runs off the loop: the requests behind it go on
            lid = req.lora_int_id
            if lid and self.max_loras and lid not in loras and len(loras) >= self.max_loras:
                out.waiting_for_lora_ids.append(req.request_id)
                continue  # its adapter waits for a slot: requests of running adapters go on
            # a request whose K/V was pulled holds its blocks already: no prefix lookup
            held = req.request_id in kv.req_to_blocks
            # prompt logprobs (and a pooling over every position) read each prompt position's
            # output, which a prefix-cache hit skips: such a request computes its whole prompt
            # (and, prompt logprobs, still caches its blocks for others)
            bypass = None if held or not kv.enable_caching else req.prefix_cache_bypass
            if held:
                computed, num_cached = [], req.num_computed_tokens
            elif bypass is not None:
                computed, num_cached = [], 0
                out.prefix_cache_bypassed[req.request_id] = bypass
            else:
                computed, num_cached = kv.get_computed_blocks(req)
            need = (kv.num_blocks_needed(req, req.num_tokens + self.num_lookahead_tokens)
                    - len(computed)
                    + kv.num_evictable(computed))
            check = out.block_checks[req.request_id] = BlockCheck(
                need, kv.num_free_blocks, pending, kv.has_room(req))
            if not check.fits:
                out.skipped_req_ids.append(req.request_id)
                if req.num_skips >= self.config.max_admission_skips:
                    out.admission_stop = AdmissionStop.HELD
                    break  # it has waited long enough: it goes first once it fits
                req.num_skips += 1
                continue
            n = min(req.num_tokens - num_cached, budget)
            if 0 < cap < n:
                n = cap
            encoder = None
            if req.mm_features:
                n, encoder = self._cut_for_images(req, num_cached, n, out)
                if n == 0:  # its image run does not fit what is left of this step
                    out.admission_stop = AdmissionStop.ENCODER_BUDGET
                    break
            req.num_computed_tokens = num_cached
            new = kv.allocate_slots(req, n, computed, cache=not req.is_pooling,
                                   num_lookahead_tokens=self.num_lookahead_tokens)
            assert new is not None, "admission checked the blocks"
            if not held and bypass is None:
                kv.prefix_queries += req.num_tokens
                kv.prefix_hits += num_cached
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_cached
            admitted.append(req)
            if lid:
                loras.add(lid)
            resumed = req.status == RequestStatus.PREEMPTED
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled_new_reqs.append(NewRequestData(
                req.request_id, list(req.all_token_ids), req.num_prompt_tokens, req.sampling_params,
                req.pooling_params, req.lora_int_id, req.mm_features))
            if resumed:
                out.resumed_req_ids.append(req.request_id)
            out.num_cached_tokens[req.request_id] = num_cached
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now
            self._schedule(req, n, out, encoder=encoder)
            budget -= n
            pending += kv.num_blocks_needed(req, req.num_tokens)
        for req in admitted:
            self.waiting.remove(req)
        for req in failed:
            # validation at the boundary catches bad constraints; this is the backstop
            logger.error("kvflow: request %s: its grammar failed to compile: %s",
                         req.request_id, req.structured_output.error)
            self.waiting.remove(req)
            out.grammar_errors[req.request_id] = req.structured_output.error
            req.stop_reason = f"structured_outputs: {req.structured_output.error}"
            self._finish(req, RequestStatus.FINISHED_ABORTED)
            self._grammar_failed[req.request_id] = req
        return budget

    def _pick_victim(self) -> Request:
        """fcfs: the most recently admitted; priority: the lowest priority, latest arrival."""
        running = ([r for r in self.running if r.request_id not in self.in_flight]
                   if self.in_flight else self.running)  # never one whose step is in flight
        if self.config.policy == "priority":
            return max(running, key=lambda r: (r.priority, r.arrival_time))
        return running[-1]

    def _schedule(self, req: Request, n: int, out: SchedulerOutput, num_spec: int = 0,
                  encoder: list[int] | None = None) -> None:
        computed = req.num_computed_tokens
        assert computed + n <= self.config.max_model_len
        rid = req.request_id
        out.num_scheduled_tokens[rid] = n
        if encoder:  # its images' encoder runs this step
            out.scheduled_encoder_inputs[rid] = encoder
            used = sum(req.mm_features[i].length for i in encoder)
            out.num_encoder_tokens += used
            self._encoder_budget -= used
        if num_spec:  # its last num_spec tokens are drafts; the runner checks them
            out.scheduled_spec_decode_tokens[rid] = req.spec_token_ids[:num_spec]
        req.spec_token_ids = []  # the next drafts come from this step's outcome
        out.num_computed_tokens[rid] = computed
        kv = self.kv_cache_manager
        out.block_ids[rid] = kv.get_block_ids(rid)
        if kv.num_groups > 1:
            out.group_block_ids[rid] = kv.get_group_block_ids(rid)
        out.total_num_scheduled_tokens += n
        if (req.structured_output is not None and computed + n - num_spec == req.num_tokens
                and (req.constraint_active or req.reasoning_undecided)):  # not while it reasons
            out.structured_output_request_ids.append(rid)  # it samples: its row needs a mask
            if req.reasoning_undecided:  # it may still begin its reasoning: allow that too
                out.structured_output_also_allowed[rid] = req.reasoning_start_next
        # a decode feeds back the one newest token, sampled in an earlier step; anything else
        # (a prompt chunk, or recomputing prompt and outputs after a preemption) is a prefill
        prefill = not (n - num_spec == 1 and computed == req.num_tokens - 1
                       and req.num_output_tokens > 0)
        out.is_prefill[rid] = prefill
        if prefill:
            out.num_prefill_tokens += n
        else:
            out.num_decode_tokens += n

    def _unschedule(self, req: Request, out: SchedulerOutput) -> int:
        rid = req.request_id
        n = out.num_scheduled_tokens.pop(rid)
        del out.num_computed_tokens[rid]
        del out.block_ids[rid]
        out.group_block_ids.pop(rid, None)
        out.total_num_scheduled_tokens -= n
        out.scheduled_spec_decode_tokens.pop(rid, None)  # it is preempted next: drafts go
        encoder = out.scheduled_encoder_inputs.pop(rid, None)
        if encoder:
            used = sum(req.mm_features[i].length for i in encoder)
            out.num_encoder_tokens -= used
            self._encoder_budget += used
        if rid in out.structured_output_request_ids:
            out.structured_output_request_ids.remove(rid)
            out.structured_output_also_allowed.pop(rid, None)
        if out.is_prefill.pop(rid):
            out.num_prefill_tokens -= n
        else:
            out.num_decode_tokens -= n
        return n

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.kv_cache_manager.free(req)
        req.spec_token_ids = []
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self._enqueue(req, front=True)
        out.preempted_req_ids.append(req.request_id)

    def update_from_output(self, sched_out: SchedulerOutput,
                           sampled: dict[str, list[int]]) -> list[RequestUpdate]:
        """Advance each scheduled request by its tokens, append what was sampled, check stops,
        and free the blocks of requests that finished in this step."""
        updates = [RequestUpdate(self._grammar_failed.pop(rid), [], FinishReason.ABORT)
                   for rid in sched_out.grammar_errors if rid in self._grammar_failed]
        updates += [RequestUpdate(self._kv_failed.pop(rid), [], FinishReason.ABORT)
                    for rid in sched_out.kv_load_errors if rid in self._kv_failed]
        finished: set[str] = set()
        self.kv_cache_manager.commit_states()  # the snapshots this step wrote are in place
        if self.in_flight:
            self.in_flight.difference_update(sched_out.num_scheduled_tokens)
        for req_id, n in sched_out.num_scheduled_tokens.items():
            req = self.requests.get(req_id)
            if req is None or req.status != RequestStatus.RUNNING:
                continue  # aborted while the step ran
            req.num_computed_tokens += n
            if req.is_pooling:
                if req.num_computed_tokens >= req.num_prompt_tokens:  # prefill only: done
                    finished.add(req_id)
                    self._finish(req, RequestStatus.FINISHED_STOPPED)
                    updates.append(RequestUpdate(req, [], req.finish_reason))
                continue
            new_tokens = sampled.get(req_id)
            if not new_tokens:
                continue
            drafts = sched_out.scheduled_spec_decode_tokens.get(req_id)
            num_accepted = 0
            if drafts:
                # the runner returns the accepted drafts and then the target's own token: the
                # rejected drafts' positions are computed again (their slots are reused)
                num_accepted = len(new_tokens) - 1
                assert 0 <= num_accepted <= len(drafts) and new_tokens[:-1] == drafts[:num_accepted]
                req.num_computed_tokens -= len(drafts) - num_accepted
                req.num_draft_tokens += len(drafts)
                req.num_accepted_tokens += num_accepted
                self.spec_stats.record(len(drafts), num_accepted)
            finish = None
            accepted = []
            so = req.structured_output
            for token in new_tokens:
                active = so is not None and req.constraint_active  # masked when sampled
                undecided = so is not None and req.reasoning_undecided
                req.append_output_token(token)
                accepted.append(token)
                # an output that left the reasoning's start run is constrained from its start
                feed = [token] if active else (list(req.output_token_ids)
                                               if undecided and req.constraint_active else [])
                for fed in feed:
                    # the matcher advances exactly once per sampled token, here; a preempted
                    # request keeps its outputs, so its matcher stays in step with them; the
                    # reasoning before `reasoning_end_token_ids` (and that run) is not fed
                    if not so.accept(fed):
                        logger.error("kvflow: request %s: token %d is outside its grammar "
                                     "(%s)", req_id, fed, so.error)
                        finish = RequestStatus.FINISHED_ABORTED
                        break
                    if so.is_terminated():
                        finish = RequestStatus.FINISHED_STOPPED  # the grammar is complete
                        break
                if finish is not None:
                    break
                finish = self._check_stop(req, token)
                if finish is not None:
                    break
            if finish is not None:
                finished.add(req_id)
                self._finish(req, finish)
            updates.append(RequestUpdate(req, accepted, req.finish_reason,
                                         len(drafts) if drafts else 0, num_accepted))
        if finished:  # one pass over the batch, however many finished
            self.running = [r for r in self.running if r.request_id not in finished]
        return updates

    def update_draft_token_ids(self, drafts: dict[str, list[int]]) -> None:
        """Store each decoding request's drafts for its next step (vLLM's name), cut to what
        max_tokens and max_model_len leave: k drafts yield up to k + 1 tokens. A constrained
        request's drafts are cut where its grammar stops accepting them."""
        max_len = self.config.max_model_len
        for rid, tokens in drafts.items():
            req = self.requests.get(rid)
            if (req is None or req.status != RequestStatus.RUNNING or not tokens
                    or req.num_computed_tokens != req.num_tokens - 1):
                continue
            room = min(req.max_tokens - req.num_output_tokens - 1, max_len - req.num_tokens)
            tokens = list(tokens[:max(room, 0)])
            so = req.structured_output
            if so is not None and tokens:
                tokens = self._grammar_drafts(req, tokens)
            req.spec_token_ids = tokens

    @staticmethod
    def _grammar_drafts(req: Request, tokens: list[int]) -> list[int]:
        """A constrained request's drafts, cut to the longest prefix its grammar accepts (the
        matcher is left as it was; vLLM's validate_tokens) and before any end-of-sequence
        token (one would end the grammar: the rows after it have no mask). A request still
        in, or maybe beginning, its reasoning does not speculate: its constraint starts later."""
        so = req.structured_output
        if so.matcher is None or not req.constraint_active or req.reasoning_undecided:
            return []
        for i, t in enumerate(tokens):
            if t in req.eos_token_ids:
                tokens = tokens[:i]
                break
        return tokens[:so.validate_drafts(tokens)] if tokens else []

    def _check_stop(self, req: Request, token: int) -> RequestStatus | None:
        params = req.sampling_params
        if req.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token in req.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if params.stop_token_ids and token in params.stop_token_ids:
                req.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if req.num_output_tokens >= req.max_tokens or req.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH_CAPPED
        return None

    def _finish(self, req: Request, status: RequestStatus) -> None:
        was_waiting_for_kv = req.status == RequestStatus.WAITING_FOR_REMOTE_KV
        req.status = status
        if req.structured_output is not None:
            req.structured_output.close()  # a compile still queued is cancelled
        if not self.end_remote_kv(req, status, was_waiting_for_kv):  # lent blocks stay held
            self.kv_cache_manager.free(req)
        self.kv_cache_manager.forget(req)
        self._finished_ids.add(req.request_id)
        del self.requests[req.request_id]
