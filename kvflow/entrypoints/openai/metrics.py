"""Prometheus metrics for `GET /metrics` (names follow vLLM's, with a `kvflow:` prefix)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvflow.engine.async_engine import StatLogger
from kvflow.engine.protocol import SchedulerStats
from kvflow.entrypoints.openai.dashboard import RecentLatencies
from kvflow.outputs import RequestOutput

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                60.0, 120.0, 240.0, 480.0, 960.0)


_KV_COUNTERS = (
    ("leases_granted", "Prompts whose KV blocks were lent to a decode instance."),
    ("leases_released", "Leases released by the decode side."),
    ("leases_expired", "Leases that expired without word from the decode side."),
    ("pulls_served", "KV pulls served to decode instances."),
    ("bytes_sent", "KV bytes sent to decode instances."),
    ("blocks_sent", "KV blocks sent to decode instances."),
    ("loads_done", "KV pulls from prefill instances that succeeded."),
    ("loads_failed", "KV pulls from prefill instances that failed."),
    ("bytes_received", "KV bytes received from prefill instances."),
    ("blocks_received", "KV blocks received from prefill instances."),
    ("load_seconds", "Seconds spent in successful KV pulls (divide by loads_done: latency)."),
    ("late_frames", "KV answers that came after their pull had ended (dropped)."),
)


class ServerMetrics(StatLogger):
    """Engine gauges from the cores' SchedulerStats, one series per engine core (vLLM's `engine`
    label: "0", or each data-parallel replica's index); request latencies measured here, in the
    frontend, from what the client actually sees, over all of them."""

    def __init__(self, model_name: str, num_engines: int = 1) -> None:
        self.registry = r = CollectorRegistry()
        label = ["model_name"]

        def hist(name, doc, buckets):
            return Histogram(name, doc, label, registry=r, buckets=buckets).labels(model_name)

        self.ttft = hist("kvflow:time_to_first_token_seconds", "Time to first token.", _LATENCY_BUCKETS)
        self.itl = hist("kvflow:inter_token_latency_seconds", "Time between output deltas.",
                        _LATENCY_BUCKETS)
        self.e2e = hist("kvflow:e2e_request_latency_seconds", "Arrival to last token.", _E2E_BUCKETS)
        self.queue_time = hist("kvflow:request_queue_time_seconds",
                               "Arrival to first scheduled.", _E2E_BUCKETS)
        self.prompt_tokens = Counter("kvflow:prompt_tokens", "Prompt tokens of started requests.",
                                     label, registry=r).labels(model_name)
        self.generation_tokens = Counter("kvflow:generation_tokens", "Generated tokens.", label,
                                         registry=r).labels(model_name)
        self._finished = Counter("kvflow:request_success", "Finished requests by finish reason.",
                                 ["model_name", "finished_reason"], registry=r)
        self._model_name = model_name
        families = _EngineFamilies(r)
        self.engines = [EngineMetrics(self, families, model_name, str(i))
                        for i in range(num_engines)]
        self._last_token_time: dict[str, float] = {}
        self.recent = RecentLatencies()  # the dashboard's last minute

    def for_engine(self, index: int) -> EngineMetrics:
        """The stat logger of one data-parallel replica."""
        return self.engines[index]

    def set_total_blocks(self, num_blocks: int) -> None:
        for e in self.engines:
            e.set_total_blocks(num_blocks)

    def record_stats(self, stats: SchedulerStats) -> None:
        self.engines[0].record_stats(stats)

    def record_outputs(self, outputs: list[RequestOutput], now: float) -> None:
        self.recent.record_outputs(outputs, now)
        for out in outputs:
            rid = out.request_id
            n_new = sum(len(c.token_ids) for c in out.outputs)
            if n_new:
                self.generation_tokens.inc(n_new)
                last = self._last_token_time.get(rid)
                if last is None:
                    arrival = out.metrics.get("arrival_time") or now
                    self.ttft.observe(max(0.0, now - arrival))
                    self.prompt_tokens.inc(len(out.prompt_token_ids))
                    scheduled = out.metrics.get("first_scheduled_time")
                    if scheduled:
                        self.queue_time.observe(max(0.0, scheduled - arrival))
                else:
                    self.itl.observe(now - last)
                self._last_token_time[rid] = now
            for c in out.outputs:
                if c.finish_reason is not None:
                    self._finished.labels(self._model_name, c.finish_reason).inc()
            if out.finished:
                self._last_token_time.pop(rid, None)
                arrival = out.metrics.get("arrival_time")
                if arrival:
                    self.e2e.observe(max(0.0, now - arrival))

    def forget(self, request_id: str) -> None:
        self.recent.forget(request_id)
        self._last_token_time.pop(request_id, None)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineFamilies:
    """The per-engine metric families (labels model_name, engine), made once per registry."""

    def __init__(self, r: CollectorRegistry) -> None:
        label = ["model_name", "engine"]

        def gauge(name, doc):
            return Gauge(name, doc, label, registry=r)

        def counter(name, doc):
            return Counter(name, doc, label, registry=r)

        self.running = gauge("kvflow:num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("kvflow:num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = gauge("kvflow:kv_cache_usage_perc", "Fraction of KV blocks in use (0-1).")
        self.free_blocks = gauge("kvflow:num_free_blocks", "Free KV cache blocks.")
        self.total_blocks = gauge("kvflow:num_total_blocks", "KV cache blocks in the pool.")
        self.preemptions = counter("kvflow:num_preemptions", "Preemptions.")
        self.prefix_queries = counter("kvflow:prefix_cache_queries",
                                      "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("kvflow:prefix_cache_hits",
                                   "Prompt tokens found in the prefix cache.")
        # speculative decoding (vLLM's names): draft runs checked, their tokens, accepted ones
        self.spec_drafts = counter("kvflow:spec_decode_num_drafts",
                                   "Draft runs checked by the target (one per request and step).")
        self.spec_draft_tokens = counter("kvflow:spec_decode_num_draft_tokens",
                                         "Draft tokens checked by the target.")
        self.spec_accepted_tokens = counter("kvflow:spec_decode_num_accepted_tokens",
                                            "Draft tokens accepted.")
        self.spec_acceptance_rate = gauge("kvflow:spec_decode_acceptance_rate",
                                          "Accepted / drafted tokens since start (0-1).")
        self.spec_mean_acceptance_length = gauge(
            "kvflow:spec_decode_mean_acceptance_length",
            "Tokens per checked draft run since start: 1 + accepted / runs.")
        # prefill/decode transfers (with --kv-transfer-config): the core's cumulative counts
        self.kv_leases_active = gauge("kvflow:kv_transfer_leases_active",
                                      "Lent KV block sets not yet released (prefill side).")
        self.kv_loads_active = gauge("kvflow:kv_transfer_loads_active",
                                     "KV pulls in flight (decode side).")
        self.kv_counters = {f: counter(f"kvflow:kv_transfer_{f}", doc) for f, doc in _KV_COUNTERS}
        self.finished = counter("kvflow:engine_requests_finished",
                                "Requests this engine core finished (a data-parallel "
                                "replica's share).")


class EngineMetrics(StatLogger):
    """One engine core's series; its request outputs go to the server's latencies."""

    def __init__(self, server: ServerMetrics, fam: _EngineFamilies, model_name: str,
                 engine: str) -> None:
        self.server = server

        def child(family):
            return family.labels(model_name, engine)

        self.running, self.waiting = child(fam.running), child(fam.waiting)
        self.kv_usage, self.free_blocks = child(fam.kv_usage), child(fam.free_blocks)
        self.total_blocks, self.preemptions = child(fam.total_blocks), child(fam.preemptions)
        self.prefix_queries, self.prefix_hits = child(fam.prefix_queries), child(fam.prefix_hits)
        self._last_prefix = (0, 0)  # the core reports cumulative counts; counters take deltas
        self.spec_drafts = child(fam.spec_drafts)
        self.spec_draft_tokens = child(fam.spec_draft_tokens)
        self.spec_accepted_tokens = child(fam.spec_accepted_tokens)
        self.spec_acceptance_rate = child(fam.spec_acceptance_rate)
        self.spec_mean_acceptance_length = child(fam.spec_mean_acceptance_length)
        self._last_spec = (0, 0, 0)
        self.kv_leases_active = child(fam.kv_leases_active)
        self.kv_loads_active = child(fam.kv_loads_active)
        self._kv_counters = {f: child(c) for f, c in fam.kv_counters.items()}
        self._kv_last: dict[str, float] = {}
        self.finished = child(fam.finished)

    def set_total_blocks(self, num_blocks: int) -> None:
        self.total_blocks.set(num_blocks)
        self.free_blocks.set(num_blocks)

    def record_outputs(self, outputs: list[RequestOutput], now: float) -> None:
        done = sum(1 for out in outputs if out.finished)
        if done:
            self.finished.inc(done)
        self.server.record_outputs(outputs, now)

    def forget(self, request_id: str) -> None:
        self.server.forget(request_id)

    def record_stats(self, stats: SchedulerStats) -> None:
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_cache_usage)
        self.free_blocks.set(stats.num_free_blocks)
        if stats.num_total_blocks:
            self.total_blocks.set(stats.num_total_blocks)
        if stats.num_preemptions:
            self.preemptions.inc(stats.num_preemptions)
        queries, hits = stats.prefix_cache_queries, stats.prefix_cache_hits
        last_q, last_h = self._last_prefix
        if queries > last_q:
            self.prefix_queries.inc(queries - last_q)
        if hits > last_h:
            self.prefix_hits.inc(hits - last_h)
        self._last_prefix = (max(queries, last_q), max(hits, last_h))
        spec = (stats.spec_decode_num_drafts, stats.spec_decode_num_draft_tokens,
                stats.spec_decode_num_accepted_tokens)
        if spec[0] > self._last_spec[0]:
            for metric, now, last in zip((self.spec_drafts, self.spec_draft_tokens,
                                          self.spec_accepted_tokens), spec, self._last_spec):
                if now > last:
                    metric.inc(now - last)
            self._last_spec = spec
            self.spec_acceptance_rate.set(spec[2] / spec[1] if spec[1] else 0.0)
            self.spec_mean_acceptance_length.set(1.0 + spec[2] / spec[0])
        kt = stats.kv_transfer
        if kt is not None:
            self.kv_leases_active.set(kt.leases_active)
            self.kv_loads_active.set(kt.loads_active)
            for f, c in self._kv_counters.items():
                value, last = getattr(kt, f), self._kv_last.get(f, 0)
                if value > last:
                    c.inc(value - last)
                    self._kv_last[f] = value
