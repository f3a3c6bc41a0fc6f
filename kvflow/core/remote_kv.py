"""The scheduler's part in prefill/decode disaggregation (docs/disaggregation.md): pulling a
prompt's K/V from a prefill instance (decode side: `waiting_for_remote_kv`, the pull's plan,
its end) and lending a finished prompt's blocks under a lease (prefill side). A mixin of
Scheduler: it works on the scheduler's queues and KV cache manager, and the loop in
scheduler.py calls it where a request is admitted or finishes."""
from __future__ import annotations

import time

from kvflow.core.kv_cache.block_pool import cdiv
from kvflow.core.scheduler_output import BlockCheck, KVLoad, SchedulerOutput
from kvflow.kv_transfer.params import KVTransferParams
from kvflow.request import Request, RequestStatus


class RemoteKVMixin:
    def init_remote_kv(self) -> None:
        self.loading: dict[str, Request] = {}  # pulls in flight: id -> request (in `waiting`)
        # ended while waiting for remote KV (pulled or not yet): the engine tells the producer
        self.cancelled_loads: list[tuple[str, KVTransferParams]] = []
        self._kv_failed: dict[str, Request] = {}  # failed pulls (policy `fail`), reported next
        self._kv_errors: dict[str, str] = {}
        # finished requests whose blocks are lent to a decode instance: id -> (block ids, tokens);
        # the blocks stay in the KV manager under the id until release_lease()
        self.leases: dict[str, tuple[list[int], int]] = {}
        self.new_leases: dict[str, tuple[list[int], int]] = {}  # lent since the engine last looked

    # -- KV transfer: pulling a prompt's K/V (decode side) -------------------------------
    def _start_load(self, req: Request, out: SchedulerOutput, pending: int) -> None:
        """Give a remote-prefilled request its blocks (its own prefix-cache hit first) and plan the
        pull of the rest of its prompt but the last token; it waits in the queue meanwhile. Its
        new blocks are not findable in the prefix cache until the pull has succeeded."""
        rid = req.request_id
        if rid in self.loading:
            out.waiting_for_remote_kv_ids.append(rid)
            return
        kv = self.kv_cache_manager
        computed, num_cached = kv.get_computed_blocks(req)
        need = (kv.num_blocks_needed(req, req.num_tokens) - len(computed)
                + kv.num_evictable(computed))
        check = out.block_checks[rid] = BlockCheck(need, kv.num_free_blocks, pending)
        if not check.fits:
            out.skipped_req_ids.append(rid)
            return
        req.num_computed_tokens = num_cached
        new = kv.allocate_slots(req, req.num_tokens - num_cached, computed, cache=False)
        assert new is not None, "the block check passed"
        kv.prefix_queries += req.num_tokens
        kv.prefix_hits += num_cached
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = num_cached
        if req.first_scheduled_time is None:
            req.first_scheduled_time = time.time()
        last = req.num_prompt_tokens - 1  # recomputed here, for the first token's logits
        first, end = num_cached // self.block_size, cdiv(last, self.block_size)
        p = req.sampling_params.kv_transfer_params
        rbs = p.remote_block_size  # the prefill instance's blocks may be larger or smaller
        blocks = kv.get_block_ids(rid)
        out.kv_loads.append(KVLoad(rid, p, blocks[first:end],
                                   p.remote_block_ids[num_cached // rbs:cdiv(last, rbs)],
                                   num_cached, last))
        self.loading[rid] = req
        out.waiting_for_remote_kv_ids.append(rid)

    def finish_load(self, request_id: str, ok: bool, recompute: bool = True,
                    error: str = "") -> bool:
        """A pull ended. Success: the prompt but its last token counts as computed and its full
        blocks become findable; the request is admitted like any other. Failure: its blocks go
        back unfound by the prefix cache, and it either computes its prompt here (`recompute`)
        or ends, aborted, with `error`. False if the request is gone (aborted meanwhile)."""
        req = self.loading.pop(request_id, None)
        if req is None:
            return False
        kv = self.kv_cache_manager
        if ok:
            req.num_computed_tokens = req.num_prompt_tokens - 1
            kv.cache_blocks(req, req.num_computed_tokens)
            req.status = RequestStatus.WAITING
        elif recompute:
            kv.free(req)
            req.num_computed_tokens = 0
            req.status = RequestStatus.WAITING
        else:
            self.waiting.remove(req)
            req.stop_reason = f"kv_load_failed: {error}"
            self._finish(req, RequestStatus.FINISHED_ABORTED)
            self._kv_failed[request_id] = req
            self._kv_errors[request_id] = error
        return True

    # -- KV transfer: lending a prompt's K/V (prefill side) ------------------------------
    def release_lease(self, request_id: str) -> bool:
        """The decode side has the blocks (or the lease expired): they return to the pool."""
        if self.leases.pop(request_id, None) is None:
            return False
        self.kv_cache_manager.free_request_id(request_id)
        return True

    def end_remote_kv(self, req: Request, status: RequestStatus, was_waiting_for_kv: bool) -> bool:
        """A request finishes: a pull it waited for is cancelled (the engine tells the producer);
        a computed prompt for a decode instance lends its blocks. True if they are lent (not to
        be freed)."""
        rid = req.request_id
        p = req.sampling_params.kv_transfer_params
        if was_waiting_for_kv:
            self.loading.pop(rid, None)
            self.cancelled_loads.append((rid, p))  # the engine stops the pull, the producer is told
        if (p is not None and p.do_remote_decode and status != RequestStatus.FINISHED_ABORTED
                and rid in self.kv_cache_manager.req_to_blocks):
            # its prompt's blocks are lent to a decode instance, not freed
            lease = (self.kv_cache_manager.get_block_ids(rid), req.num_prompt_tokens)
            self.leases[rid] = self.new_leases[rid] = lease
            return True
        return False
