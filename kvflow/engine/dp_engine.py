"""DPAsyncLLM: `kvflow serve --data-parallel-size N`, N engine-core replicas behind one server.

Each replica is an AsyncLLM (its own EngineCore process, ZeroMQ sockets, output task and
tokenizer); this front picks one per request and otherwise looks like a single AsyncLLM to the
server. The pick (kvflow/core/routing.py) sees each replica's requests in flight from here; the
default, `least_load`, breaks ties by the longest prefix of the prompt's token ids that the
replica was sent before (an approximate tree, bounded per replica), so that a shared system
prompt meets its cached blocks. `cache_aware` (SGLang's policy) and `round_robin` are the others.
With `--kv-events-config` each replica publishes its KV events (replica i on the endpoint's port
+ i, as vLLM) and this front follows them: the tie (or, for `cache_aware`, the choice) goes by
the blocks each replica's prefix cache really holds rather than by the tree of what it was sent.

Death is the engine's, as in vLLM: if one replica's core dies, the server is dead (its in-flight
requests and the other replicas' end with the error, /health answers 503 and the server exits),
so that a supervisor or `kvflow router` sees one failed instance rather than a degraded one."""
from __future__ import annotations

import asyncio
import copy
from collections.abc import AsyncIterator

from kvflow.config import EngineConfig
from kvflow.core.kv_cache.block_pool import hash_token_blocks
from kvflow.core.routing import CacheAwareConfig, make_policy
from kvflow.engine.async_engine import AsyncLLM, StatLogger
from kvflow.engine.core_client import EngineDeadError
from kvflow.engine.kv_events_subscriber import KVEventListeners
from kvflow.engine.protocol import EngineCoreReady
from kvflow.lora_request import LoRARequest
from kvflow.outputs import EmbeddingRequestOutput, RequestOutput
from kvflow.pooling_params import PoolingParams
from kvflow.request import block_salt_bytes
from kvflow.sampling_params import SamplingParams
from kvflow.tokenizer import get_tokenizer


class DPAsyncLLM:
    """N AsyncLLM replicas, one chosen per request; the AsyncLLM surface the server uses."""

    def __init__(self, config: EngineConfig, stat_loggers: list[StatLogger],
                 stall_timeout: float = 0.0, policy: str = "least_load",
                 cache: CacheAwareConfig | None = None) -> None:
        n = config.parallel_config.data_parallel_size
        if len(stat_loggers) != n:
            raise ValueError(f"one stat logger per replica: {n} replicas, {len(stat_loggers)}")
        self.config = config
        configs = [rank_config(config, i) for i in range(n)]
        self.replicas = [AsyncLLM(configs[i], stat_loggers[i], stall_timeout) for i in range(n)]
        # the replicas' own KV events, where they publish somewhere this process can listen
        addrs = [listen_address(c) for c in configs]
        self.kv_events = KVEventListeners(config.kv_events.topic) if all(addrs) else None
        self.policy = make_policy(policy, cache, tree_ties=True,
                                  blocks=self.kv_events.index if self.kv_events else None)
        if self.kv_events is not None:
            for i, addr in enumerate(addrs):
                self.kv_events.listen(i, addr)
        self.inflight = [0] * n  # requests sent to each replica and not finished
        self.routed = [0] * n  # requests sent to each replica since start
        self.dead_error: EngineDeadError | None = None
        self.on_dead = None
        for i, r in enumerate(self.replicas):
            r.on_dead = lambda e, i=i: self._replica_dead(i, e)

    async def start(self) -> EngineCoreReady:
        """Start every replica at once (each loads the model in its own process)."""
        first = self.replicas[0]
        tok = asyncio.ensure_future(asyncio.to_thread(get_tokenizer, first.tokenizer_path))
        results = await asyncio.gather(*(r.start(tok) for r in self.replicas),
                                       return_exceptions=True)
        failed = next((e for e in results if isinstance(e, BaseException)), None)
        if failed is not None:
            await self.shutdown()
            raise failed
        return results[0]

    # -- what the server reads (replica 0 stands for all: they load the same model) -----------
    @property
    def info(self) -> EngineCoreReady | None:
        return self.replicas[0].info

    @property
    def input_processor(self):
        """The one request check; the replicas load one model with one set of options."""
        return self.replicas[0].input_processor

    @property
    def infos(self) -> list[EngineCoreReady]:
        return [r.info for r in self.replicas]

    @property
    def tokenizer(self):
        return self.replicas[0].tokenizer

    @property
    def model_path(self) -> str:
        return self.replicas[0].model_path

    @property
    def max_model_len(self) -> int:
        return self.replicas[0].max_model_len

    @property
    def last_stats(self):
        return self.replicas[0].last_stats

    @property
    def snapshot(self):
        return self.replicas[0].snapshot  # the dashboard shows replica 0

    @property
    def is_dead(self) -> bool:
        return self.dead_error is not None

    def num_waiting_after(self, n_new: int) -> int:
        """Requests that would wait if `n_new` more arrived and went to the replica with the
        fewest waiting."""
        waiting = [r.num_waiting_after(0) for r in self.replicas]
        best = min(range(len(waiting)), key=waiting.__getitem__)
        return sum(waiting) - waiting[best] + self.replicas[best].num_waiting_after(n_new)

    def enable_snapshots(self, on: bool) -> None:
        self.replicas[0].enable_snapshots(on)

    # -- requests --------------------------------------------------------------------
    def choose(self, prompt_token_ids: list[int], cache_salt: str | None = None,
               lora_request: LoRARequest | None = None) -> int:
        return self._pick(prompt_token_ids, cache_salt, lora_request)[0]

    def _pick(self, prompt_token_ids: list[int], cache_salt: str | None = None,
              lora_request: LoRARequest | None = None) -> tuple[int, list[bytes] | None]:
        """The replica for a prompt, and its block hashes where KV events are followed."""
        # a salted prompt (or an adapter's) shares cached blocks only with its own salt
        # (adapter): its key starts with it
        key = prompt_token_ids
        lora_id = lora_request.lora_int_id if lora_request is not None else 0
        if lora_request is not None:
            key = [-1 - (lora_request.lora_int_id & 0x7FFFFFFF), *key]
        if cache_salt:
            key = [-1 - (hash(cache_salt) & 0x7FFFFFFF), *key]
        hashes = None
        if self.kv_events is not None and self.kv_events.index.block_size:
            hashes = hash_token_blocks(prompt_token_ids, self.kv_events.index.block_size,
                                       block_salt_bytes(cache_salt, lora_id))
        i = self.policy.choose(dict(enumerate(self.inflight)), key, hashes).replica
        self.policy.routed(i, key)
        return i, hashes

    def _started(self, i: int, hashes: list[bytes] | None, delta: int) -> None:
        """A request began (+1) or ended (-1) on replica i: its prompt's blocks count as held
        there while it runs (kvflow/core/block_index.py)."""
        self.inflight[i] += delta
        if hashes:
            self.kv_events.index.running(i, hashes, delta)

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams,
                       request_id: str, **kwargs) -> AsyncIterator[RequestOutput]:
        """AsyncLLM.generate on the chosen replica."""
        if self.dead_error is not None:
            raise type(self.dead_error)(str(self.dead_error))
        i, hashes = self._pick(prompt_token_ids, kwargs.get("cache_salt"),
                               kwargs.get("lora_request"))
        self._started(i, hashes, 1)
        self.routed[i] += 1
        try:
            async for out in self.replicas[i].generate(prompt_token_ids, params, request_id,
                                                       **kwargs):
                yield out
        finally:
            self._started(i, hashes, -1)

    async def encode(self, prompt_token_ids: list[int], params: PoolingParams, request_id: str,
                     **kwargs) -> EmbeddingRequestOutput:
        """AsyncLLM.encode on the chosen replica."""
        if self.dead_error is not None:
            raise type(self.dead_error)(str(self.dead_error))
        i, hashes = self._pick(prompt_token_ids, lora_request=kwargs.get("lora_request"))
        self._started(i, hashes, 1)
        self.routed[i] += 1
        try:
            return await self.replicas[i].encode(prompt_token_ids, params, request_id, **kwargs)
        finally:
            self._started(i, hashes, -1)

    async def add_lora(self, lora_request: LoRARequest) -> None:
        """Load the adapter in every replica (any may be chosen for its requests); a refusal
        unloads it from those that took it."""
        done = []
        try:
            for r in self.replicas:
                await r.add_lora(lora_request)
                done.append(r)
        except BaseException:
            for r in done:
                try:
                    await r.remove_lora(lora_request)
                except ValueError:
                    pass
            raise

    async def remove_lora(self, lora_request: LoRARequest) -> bool:
        """Unregister the adapter in every replica; True if any had it."""
        found = [await r.remove_lora(lora_request) for r in self.replicas]
        return any(found)

    async def reset_prefix_cache(self) -> bool:
        """Every replica's; True only if all were reset (none runs a request)."""
        done = await asyncio.gather(*(r.reset_prefix_cache() for r in self.replicas))
        if all(done):
            for i in range(len(self.replicas)):
                self.policy.forget(i)
        return all(done)

    def abort_all(self, error: BaseException) -> None:
        for r in self.replicas:
            r.abort_all(error)

    def _replica_dead(self, i: int, error: EngineDeadError) -> None:
        if self.dead_error is not None:
            return
        self.dead_error = type(error)(f"data-parallel replica {i}: {error}")
        for j, r in enumerate(self.replicas):
            if j != i:
                r.abort_all(self.dead_error)
        if self.on_dead is not None:
            self.on_dead(self.dead_error)

    def replica_status(self) -> list[dict]:
        out = [{"replica": i, "pid": r.info.pid if r.info else None, "inflight": self.inflight[i],
                "routed": self.routed[i], "dead": r.is_dead}
               for i, r in enumerate(self.replicas)]
        if self.kv_events is not None:  # the blocks each holds, as its KV events say
            for i, status in enumerate(out):
                status["kv_cache_blocks"] = self.kv_events.index.size(i)
        return out

    async def shutdown(self) -> None:
        if self.kv_events is not None:
            self.kv_events.close()
        await asyncio.gather(*(r.shutdown() for r in self.replicas), return_exceptions=True)


def rank_config(config: EngineConfig, rank: int) -> EngineConfig:
    """Replica `rank`'s config: its own KV events endpoint (KVEventsConfig.for_rank)."""
    if config.kv_events is None:
        return config
    out = copy.copy(config)
    out.kv_events = config.kv_events.for_rank(rank)
    return out


def listen_address(config: EngineConfig) -> str | None:
    """Where this process can subscribe to a replica's events: its bound tcp endpoint on the
    loopback (a wildcard host) or its ipc path; None where it publishes nothing, connects out
    to a collector, or runs elsewhere (a Ray replica)."""
    ev = config.kv_events
    if ev is None or not ev.publishes or config.parallel_config.data_parallel_backend == "ray":
        return None
    if ev.endpoint.startswith("ipc://"):
        return ev.endpoint
    host, _, port = ev.endpoint.removeprefix("tcp://").rpartition(":")
    if ev.endpoint.startswith("tcp://") and host in ("*", "0.0.0.0", "127.0.0.1", "localhost"):
        return f"tcp://127.0.0.1:{port}"
    return None
