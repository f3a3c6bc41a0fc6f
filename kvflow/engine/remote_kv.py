"""EngineCore's part in prefill/decode disaggregation (docs/disaggregation.md): what the
engine checks of a request's kv_transfer_params, how it starts pulls and applies what its
KV-transfer agent reports (leases ended, pulls done or failed), how it lends a finished prompt's
blocks, and its transfer stats. A mixin of EngineCore; the step in core.py calls it."""
from __future__ import annotations

import msgspec

from kvflow.core.scheduler import SchedulerOutput
from kvflow.engine.protocol import EngineCoreRequest, KVTransferStats
from kvflow.kv_transfer.agent import write_blocks
from kvflow.kv_transfer.blocks import KVShard, PagedKV
from kvflow.kv_transfer.params import KVTransferParams
from kvflow.logger import init_logger
from kvflow.model.sharding import shard_layout

logger = init_logger("kvflow.engine")


class EngineKVTransferMixin:
    def _check_kv_transfer_config(self, cc) -> None:
        """ValueError for what KV transfer cannot do with this engine (before workers start)."""
        if any(w is not None for w in cc.layer_windows):
            raise ValueError("kv_transfer_config: KV transfer of a model with sliding-window "
                             "layers (one block table per KV cache group) is not implemented yet")
        if self.device.type != "cpu":
            raise ValueError("kv_transfer_config: KV transfer moves CPU caches only; "
                             f"this engine's cache is on {self.device.type}")

    def _paged_kv(self) -> PagedKV:
        """The whole cache as KV transfer sees it: each rank's share with its first KV head."""
        return PagedKV([KVShard(shard_layout(self.arch, r, self.tp_size).kv_head_start, caches)
                        for r, caches in enumerate(self.executor.rank_kv_caches())])

    def _check_kv_transfer(self, r: EngineCoreRequest) -> None:
        """ValueError (a 400) if this engine cannot do what the request's kv_transfer_params
        ask (add_request then releases the producer's lease at once)."""
        p = r.sampling_params.kv_transfer_params
        kt = self.config.kv_transfer
        if p.do_remote_decode and (kt is None or not kt.is_producer):
            raise ValueError("kv_transfer_params.do_remote_decode: this instance lends no KV "
                             "blocks (start it with --kv-transfer-config '{\"kv_role\": "
                             "\"kv_producer\"}' or kv_both)")
        if not p.do_remote_prefill:
            return
        if kt is None or not kt.is_consumer:
            raise ValueError("kv_transfer_params.do_remote_prefill: this instance pulls no KV "
                             "blocks (start it with --kv-transfer-config '{\"kv_role\": "
                             "\"kv_consumer\"}' or kv_both)")
        self.kv_agent.check_compatible(p)
        if p.remote_num_tokens != len(r.prompt_token_ids):
            raise ValueError(f"kv_transfer_params: the prefill instance computed "
                             f"{p.remote_num_tokens} prompt tokens, this prompt has "
                             f"{len(r.prompt_token_ids)}")
        if r.sampling_params.structured_outputs is not None:
            raise ValueError("kv_transfer_params.do_remote_prefill with structured_outputs "
                             "is not implemented")

    def _cancel_loads(self) -> None:
        cancelled, self.scheduler.cancelled_loads = self.scheduler.cancelled_loads, []
        for rid, params in cancelled:
            self.kv_agent.cancel(rid, params)
            self._kv_trace.append({"id": rid, "event": "load_cancelled"})

    # -- KV transfer -----------------------------------------------------------------------
    def _kv_events(self) -> None:
        """Apply what the agent reports: leases to free, pulls done (their bytes go into the
        cache here, on the engine's thread) or failed."""
        agent, s = self.kv_agent, self.scheduler
        recompute = self.config.kv_transfer.kv_load_failure_policy == "recompute"
        for ev in agent.drain_events():
            if ev.kind == "released":
                s.release_lease(ev.req_id)
                self._kv_trace.append({"id": ev.req_id, "event": f"lease_{ev.error}"})
                continue
            if ev.req_id not in s.loading:  # aborted meanwhile: its blocks are gone already
                if ev.kind == "loaded":
                    agent.release_remote(ev.load.params)
                continue
            error = ev.error
            if ev.kind == "loaded":
                try:
                    write_blocks(self.kv_agent.kv, ev)
                except ValueError as e:
                    error = str(e)
                    agent.stats.loads_failed += 1
                    agent.release_remote(ev.load.params)
                else:
                    agent.release_remote(ev.load.params, done=True)
                    st = agent.stats
                    st.loads_done += 1
                    st.bytes_received += ev.num_bytes
                    st.blocks_received += len(ev.load.local_block_ids)
                    st.load_seconds += ev.seconds
                    s.finish_load(ev.req_id, True)
                    self._kv_trace.append({"id": ev.req_id, "event": "loaded",
                                           "blocks": len(ev.load.local_block_ids),
                                           "bytes": ev.num_bytes,
                                           "seconds": round(ev.seconds, 6),
                                           "shm": len(ev.frames) == 1})
                    continue
            logger.warning("kvflow: request %s: KV pull failed (%s); %s", ev.req_id, error,
                           "computing its prompt here" if recompute else "it ends")
            s.finish_load(ev.req_id, False, recompute, error)
            self._kv_trace.append({"id": ev.req_id, "event": "load_failed", "error": error,
                                   "recompute": recompute})

    def _start_loads(self, sched_out: SchedulerOutput) -> None:
        for load in sched_out.kv_loads:
            # traced as an event: the step that plans a pull often runs nothing (and is not traced)
            self._kv_trace.append({"id": load.req_id, "event": "pulling",
                                   "blocks": len(load.local_block_ids)})
            if load.local_block_ids:
                self.kv_agent.load(load)
            else:  # its prompt but the last token was in the local prefix cache already
                self.kv_agent.release_remote(load.params)
                self.scheduler.finish_load(load.req_id, True)

    def _lend(self) -> dict[str, KVTransferParams]:
        """Prompts computed for a decode instance: lend their blocks; what each answer carries."""
        lent = {}
        for rid, (blocks, n) in self.scheduler.new_leases.items():
            self.kv_agent.offer(rid, blocks, n)
            # the prompt's blocks (a request that also decoded here holds more, all lent)
            prompt_blocks = blocks[:-(-n // self.cache_config.block_size)]
            lent[rid] = self.kv_agent.params_for(rid, prompt_blocks, n)
            self._kv_trace.append({"id": rid, "event": "lent", "blocks": len(blocks)})
        self.scheduler.new_leases = {}
        return lent

    def _transfer_stats(self) -> KVTransferStats | None:
        a = self.kv_agent
        if a is None:
            return None
        return msgspec.structs.replace(a.stats, leases_active=len(self.scheduler.leases),
                                       loads_active=len(self.scheduler.loading))
