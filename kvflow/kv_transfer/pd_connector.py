"""PDConnector: prefill/decode disaggregation (docs/disaggregation.md) as a KVConnector. A
producer lends a finished prompt's blocks under a lease; a consumer pulls them before it
decodes. The agent thread (agent.py) does the network; this object is the engine core's side:
what it checks of a request's kv_transfer_params, how it starts pulls and applies what the
agent reports (leases ended, pulls done or failed), how it lends, and its stats."""
from __future__ import annotations

import msgspec

from kvflow.config import KVTransferConfig
from kvflow.kv_transfer.agent import KVTransferAgent, write_blocks
from kvflow.kv_transfer.blocks import PagedKV
from kvflow.kv_transfer.connector import KVConnector
from kvflow.kv_transfer.params import KVTransferParams, check_role
from kvflow.kv_transfer.stats import KVTransferStats
from kvflow.logger import init_logger

logger = init_logger("kvflow.engine")


def check_engine(cache_config, device_type: str) -> None:
    """ValueError for what KV transfer cannot do with this engine (before workers start)."""
    if any(w is not None for w in cache_config.layer_windows):
        raise ValueError("kv_transfer_config: KV transfer of a model with sliding-window "
                         "layers (one block table per KV cache group) is not implemented yet")
    if device_type != "cpu":
        raise ValueError("kv_transfer_config: KV transfer moves CPU caches only; "
                         f"this engine's cache is on {device_type}")


class PDConnector(KVConnector):
    """Lends and pulls KV blocks between a prefill and a decode instance."""

    def __init__(self, config: KVTransferConfig, compat: dict, kv: PagedKV,
                 block_size: int) -> None:
        self.config = config
        self.block_size = block_size
        self.agent = KVTransferAgent(config, compat, kv, block_size)
        self._trace: list[dict] = []  # events since the last traced step

    # -- scheduler side: a request --------------------------------------------------------
    def check_request(self, prompt_token_ids: list[int], params) -> None:
        p = params.kv_transfer_params
        check_role(self.config, p)
        if not p.do_remote_prefill:
            return
        self.agent.check_compatible(p)
        if p.remote_num_tokens != len(prompt_token_ids):
            raise ValueError(f"kv_transfer_params: the prefill instance computed "
                             f"{p.remote_num_tokens} prompt tokens, this prompt has "
                             f"{len(prompt_token_ids)}")
        if params.structured_outputs is not None:
            raise ValueError("kv_transfer_params.do_remote_prefill with structured_outputs "
                             "is not implemented")

    def request_refused(self, params: KVTransferParams) -> None:
        if params.do_remote_prefill:  # the producer's lease goes at once, not on expiry
            self.agent.release_remote(params)

    def request_queued(self, request) -> None:
        p = request.sampling_params.kv_transfer_params
        if p is not None and p.do_remote_prefill:
            self.agent.watch(p)  # heartbeats until its pull starts

    def requests_aborted(self, scheduler) -> None:
        cancelled, scheduler.cancelled_loads = scheduler.cancelled_loads, []
        for rid, params in cancelled:
            self.agent.cancel(rid, params)
            self._trace.append({"id": rid, "event": "load_cancelled"})

    # -- scheduler side: the step ---------------------------------------------------------
    def before_schedule(self, scheduler) -> None:
        """Apply what the agent reports: leases to free, pulls done (their bytes go into the
        cache here, on the engine's thread) or failed."""
        agent, s = self.agent, scheduler
        recompute = self.config.kv_load_failure_policy == "recompute"
        for ev in agent.drain_events():
            if ev.kind == "released":
                s.release_lease(ev.req_id)
                self._trace.append({"id": ev.req_id, "event": f"lease_{ev.error}"})
                continue
            if ev.req_id not in s.loading:  # aborted meanwhile: its blocks are gone already
                if ev.kind == "loaded":
                    agent.release_remote(ev.load.params)
                continue
            error = ev.error
            if ev.kind == "loaded":
                try:
                    self.write_received(ev)
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
                    self._trace.append({"id": ev.req_id, "event": "loaded",
                                        "blocks": len(ev.load.local_block_ids),
                                        "bytes": ev.num_bytes,
                                        "seconds": round(ev.seconds, 6),
                                        "shm": len(ev.frames) == 1})
                    continue
            logger.warning("kvflow: request %s: KV pull failed (%s); %s", ev.req_id, error,
                           "computing its prompt here" if recompute else "it ends")
            s.finish_load(ev.req_id, False, recompute, error)
            self._trace.append({"id": ev.req_id, "event": "load_failed", "error": error,
                                "recompute": recompute})

    def after_schedule(self, scheduler, sched_out) -> None:
        for load in sched_out.kv_loads:
            # traced as an event: the step that plans a pull often runs nothing (and is not traced)
            self._trace.append({"id": load.req_id, "event": "pulling",
                                "blocks": len(load.local_block_ids)})
            if load.local_block_ids:
                self.agent.load(load)
            else:  # its prompt but the last token was in the local prefix cache already
                self.agent.release_remote(load.params)
                scheduler.finish_load(load.req_id, True)

    def wait_idle(self, scheduler) -> None:
        if scheduler.loading and not scheduler.running:
            self.agent.wait(0.01)  # nothing to run until a pull ends: no busy spin

    def after_update(self, scheduler) -> dict[str, KVTransferParams]:
        """Prompts computed for a decode instance: lend their blocks; what each answer carries."""
        lent = {}
        for rid, (blocks, n) in scheduler.new_leases.items():
            self.agent.offer(rid, blocks, n)
            # the prompt's blocks (a request that also decoded here holds more, all lent)
            prompt_blocks = blocks[:-(-n // self.block_size)]
            lent[rid] = self.agent.params_for(rid, prompt_blocks, n)
            self._trace.append({"id": rid, "event": "lent", "blocks": len(blocks)})
        scheduler.new_leases = {}
        return lent

    def take_trace_events(self) -> list[dict]:
        events, self._trace = self._trace, []
        return events

    def stats(self, scheduler) -> KVTransferStats:
        return msgspec.structs.replace(self.agent.stats, leases_active=len(scheduler.leases),
                                       loads_active=len(scheduler.loading))

    # -- worker side ----------------------------------------------------------------------
    def write_received(self, event) -> None:
        write_blocks(self.agent.kv, event)

    # -- the connector itself -------------------------------------------------------------
    @property
    def wakeup_socket(self):
        return self.agent.wakeup_socket

    def describe(self) -> str:
        kt = self.config
        return f"KV transfer {kt.kv_role} engine {self.agent.engine_id} on {kt.kv_ip}:{kt.kv_port}"

    def shutdown(self) -> None:
        self.agent.shutdown()
