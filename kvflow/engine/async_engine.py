"""AsyncLLM: the asyncio engine behind `kvflow serve`.

The EngineCore runs in its own process (EngineCoreClient). Here, in the frontend, one task
pulls the core's token deltas, detokenizes them (OutputProcessor) and hands each request's
RequestOutputs to that request's asyncio queue; `generate()` reads the queue. A generator
that is closed early (client gone, task cancelled) aborts its request in the core.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable

from kvflow.config import EngineConfig
from kvflow.engine.core_client import EngineCoreClient, EngineDeadError
from kvflow.engine.output_processor import OutputKind, OutputProcessor
from kvflow.engine.protocol import (CoreMessage, EngineCoreOutputs, EngineCoreReady, SchedulerStats,
                                    UtilityCall)
from kvflow.model_path import resolve_model_path
from kvflow.outputs import RequestOutput
from kvflow.sampling_params import SamplingParams
from kvflow.tokenizer import get_tokenizer, tokenizer_source

logger = logging.getLogger("kvflow")


class StatLogger:
    """Receives what the engine observes; the server's metrics implement it."""

    def record_stats(self, stats: SchedulerStats) -> None: ...
    def record_outputs(self, outputs: list[RequestOutput], now: float) -> None: ...
    def forget(self, request_id: str) -> None: ...


class AsyncLLM:
    """Owns the core process, the output processor and the per-request queues."""

    def __init__(self, config: EngineConfig, stat_logger: StatLogger | None = None) -> None:
        self.config = config
        self.model_path = resolve_model_path(config.model_config.model)  # fail fast on a bad path
        self.tokenizer_path = tokenizer_source(config.model_config.tokenizer, self.model_path)
        self.client = EngineCoreClient(config)
        self.stat_logger = stat_logger or StatLogger()
        self.tokenizer = None
        self.processor: OutputProcessor | None = None
        self.info: EngineCoreReady | None = None
        self.queues: dict[str, asyncio.Queue] = {}
        self.num_core_requests = 0  # unfinished requests in the core, as sent from here
        self.last_stats = SchedulerStats()
        self.snapshot = None  # the core's latest EngineSnapshot while a dashboard watches
        self.dead_error: EngineDeadError | None = None
        self.on_dead: Callable[[EngineDeadError], None] | None = None
        self._output_task: asyncio.Task | None = None
        self._core_ids: dict[str, int] = {}  # request id -> number of unfinished core requests
        self._utility_waiters: dict[str, list[asyncio.Future]] = {}  # call name -> awaiting callers

    async def start(self) -> EngineCoreReady:
        """Load the tokenizer here while the core loads the model there."""
        tok_task = asyncio.create_task(asyncio.to_thread(get_tokenizer, self.tokenizer_path))
        try:
            self.info = await self.client.start()
        except BaseException:
            tok_task.cancel()
            self.client.shutdown()
            raise
        self.tokenizer = await tok_task
        self.processor = OutputProcessor(self.tokenizer)
        self._output_task = asyncio.create_task(self._output_loop(), name="kvflow-outputs")
        return self.info

    @property
    def max_model_len(self) -> int:
        return self.info.max_model_len

    @property
    def is_dead(self) -> bool:
        return self.dead_error is not None

    def num_waiting_after(self, n_new: int) -> int:
        """Requests that would wait in the core if `n_new` more arrived now: beyond the
        `max_num_seqs` slots, or queued behind those the core already reports waiting."""
        over_slots = self.num_core_requests + n_new - self.info.max_num_seqs
        queued = self.last_stats.num_waiting + n_new if self.last_stats.num_waiting else 0
        return max(over_slots, queued, 0)

    # -- requests --------------------------------------------------------------------
    async def generate(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str,
                       prompt: str | None = None, arrival_time: float | None = None,
                       priority: int = 0, cache_salt: str | None = None,
                       ) -> AsyncIterator[RequestOutput]:
        """Stream DELTA RequestOutputs for one request (all its `n` samples) until finished."""
        if self.dead_error is not None:
            raise EngineDeadError(str(self.dead_error))
        core_reqs = self.processor.add_request(
            request_id, prompt, prompt_token_ids, params, OutputKind.DELTA,
            arrival_time=arrival_time or time.time(), priority=priority, cache_salt=cache_salt)
        queue: asyncio.Queue = asyncio.Queue()
        self.queues[request_id] = queue
        self._core_ids[request_id] = len(core_reqs)
        self.num_core_requests += len(core_reqs)
        for r in core_reqs:
            self.client.add_request(r)
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)
            self._forget(request_id)

    async def reset_prefix_cache(self) -> bool:
        """Clear the core's prefix cache; False (nothing done) while requests are running."""
        if self.dead_error is not None:
            raise EngineDeadError(str(self.dead_error))
        fut = asyncio.get_running_loop().create_future()
        self._utility_waiters.setdefault(UtilityCall.RESET_PREFIX_CACHE, []).append(fut)
        self.client.request_reset_prefix_cache()
        return await fut

    def abort(self, request_id: str) -> None:
        """Drop a request here and in the core (its blocks return at the core's next step)."""
        if self.processor is None:
            return
        ids = self.processor.abort_request(request_id)
        if ids and not self.is_dead:
            self.client.abort_requests(ids)
        self.stat_logger.forget(request_id)

    def enable_snapshots(self, on: bool) -> None:
        """Dashboard snapshots from the core: on while someone watches."""
        if not on:
            self.snapshot = None
        self.client.enable_snapshots(on)

    def abort_all(self, error: BaseException) -> None:
        """End every in-flight request with `error` (shutdown)."""
        for rid, queue in list(self.queues.items()):
            self.abort(rid)
            queue.put_nowait(error)

    def _forget(self, request_id: str) -> None:
        self.queues.pop(request_id, None)
        self.num_core_requests -= self._core_ids.pop(request_id, 0)

    # -- the output task -----------------------------------------------------------------
    async def _output_loop(self) -> None:
        try:
            while True:
                kind, msg = await self.client.get_message()
                if kind == CoreMessage.OUTPUTS:
                    self._handle_outputs(msg)
                elif kind == CoreMessage.SNAPSHOT:
                    self.snapshot = msg
                elif kind == CoreMessage.REQ_ERROR:
                    self._handle_request_error(*msg)
                elif kind == CoreMessage.UTILITY:
                    name, result = msg
                    waiters = self._utility_waiters.get(name)
                    if waiters:  # the core answers calls in the order they were sent
                        fut = waiters.pop(0)
                        if not fut.done():
                            fut.set_result(result)
        except EngineDeadError as e:
            self._die(e)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - a bug here must not leave clients hanging
            logger.exception("output loop failed")
            self._die(EngineDeadError(f"engine frontend failed: {e!r}"))

    def _handle_outputs(self, outs: EngineCoreOutputs) -> None:
        if outs.scheduler_stats is not None:
            self.last_stats = outs.scheduler_stats
            self.stat_logger.record_stats(outs.scheduler_stats)
        if not outs.outputs:
            return
        request_outputs, to_abort = self.processor.process_outputs(outs.outputs)
        if to_abort:
            self.client.abort_requests(to_abort)
        for ro in request_outputs:
            queue = self.queues.get(ro.request_id)
            if queue is not None:
                queue.put_nowait(ro)
            if ro.finished:
                self._forget(ro.request_id)
        self.stat_logger.record_outputs(request_outputs, time.time())

    def _handle_request_error(self, core_id: str, message: str) -> None:
        entry = self.processor.core_to_sample.get(core_id)
        if entry is None:
            return
        rid = entry[0].request_id
        self.abort(rid)
        queue = self.queues.get(rid)
        if queue is not None:
            queue.put_nowait(ValueError(message))

    def _die(self, error: EngineDeadError) -> None:
        logger.error("%s", error)
        self.dead_error = error
        for queue in self.queues.values():
            queue.put_nowait(error)
        for waiters in self._utility_waiters.values():
            for fut in waiters:
                if not fut.done():
                    fut.set_exception(error)
        self._utility_waiters.clear()
        if self.on_dead is not None:
            self.on_dead(error)

    async def shutdown(self) -> None:
        if self._output_task is not None:
            self._output_task.cancel()
            try:
                await self._output_task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001
                pass
            self._output_task = None
        await asyncio.to_thread(self.client.shutdown)
