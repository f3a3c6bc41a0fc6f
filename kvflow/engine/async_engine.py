"""AsyncLLM: the asyncio engine behind `kvflow serve`.

The EngineCore runs in its own process (EngineCoreClient). Here, in the frontend, one task
pulls the core's token deltas, detokenizes them (OutputProcessor) and hands each request's
RequestOutputs to that request's asyncio queue; `generate()` reads the queue. A generator
that is closed early (client gone, task cancelled) aborts its request in the core.

A heartbeat watches the core: while requests are pending, every step sends a message; if none
comes for `stall_timeout` seconds the core is treated as dead (EngineStalledError): it is
killed, in-flight requests end with that error and the server exits as on engine death. An
engine that resumes later is not trusted again (a step may have been cut anywhere).
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable

from kvflow.config import EngineConfig
import zmq

from kvflow.engine.core_client import EngineCoreClient, EngineDeadError, EngineStalledError
from kvflow.engine.input_processor import InputProcessor, RequestLimits
from kvflow.engine.output_processor import OutputKind, OutputProcessor
from kvflow.engine.protocol import (CoreMessage, EngineCoreOutputs, EngineCoreReady,
                                    EngineCoreRequestType, SchedulerStats, UtilityCall)
from kvflow.lora_request import LoRARequest
from kvflow.multimodal.inputs import MultiModalData
from kvflow.multimodal.processor import multimodal_processor
from kvflow.model_path import resolve_model_path
from kvflow.outputs import EmbeddingRequestOutput, RequestOutput
from kvflow.request import InvalidRequestError
from kvflow.pooling_params import PoolingParams
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

    def __init__(self, config: EngineConfig, stat_logger: StatLogger | None = None,
                 stall_timeout: float = 0.0) -> None:
        self.config = config
        self.stall_timeout = stall_timeout  # seconds; 0 = no heartbeat
        self.model_path = resolve_model_path(config.model_config.model)  # fail fast on a bad path
        self.tokenizer_path = tokenizer_source(config.model_config.tokenizer, self.model_path)
        pc = config.parallel_config
        self.client = EngineCoreClient(config, on_ray=pc.data_parallel_size > 1
                                       and pc.data_parallel_backend == "ray")
        self.stat_logger = stat_logger or StatLogger()
        self.tokenizer = None
        self.mm_processor = None  # a model that takes images: kvflow/multimodal/processor.py
        self.processor: OutputProcessor | None = None
        self._input_processor: InputProcessor | None = None  # once the core reports its limits
        self.info: EngineCoreReady | None = None
        self.queues: dict[str, asyncio.Queue] = {}
        self.num_core_requests = 0  # unfinished requests in the core, as sent from here
        self.last_stats = SchedulerStats()
        self.snapshot = None  # the core's latest EngineSnapshot while a dashboard watches
        self.dead_error: EngineDeadError | None = None
        self.on_dead: Callable[[EngineDeadError], None] | None = None
        self._output_task: asyncio.Task | None = None
        self._heartbeat_task: asyncio.Task | None = None
        self._last_progress = time.monotonic()  # a message from the core, or work arriving
        self._core_ids: dict[str, int] = {}  # request id -> number of unfinished core requests
        self._utility_waiters: dict[str, list[asyncio.Future]] = {}  # call name -> awaiting callers

    async def start(self, tokenizer_task: asyncio.Future | None = None) -> EngineCoreReady:
        """Load the tokenizer here while the core loads the model there (or await
        `tokenizer_task`, one load that data-parallel replicas share)."""
        tok_task = tokenizer_task or asyncio.create_task(
            asyncio.to_thread(get_tokenizer, self.tokenizer_path))
        try:
            self.info = await self.client.start()
        except BaseException:
            tok_task.cancel()
            self.client.shutdown()
            raise
        self.tokenizer = await tok_task
        self.processor = OutputProcessor(self.tokenizer)
        if getattr(self.info, "supports_images", False):  # its image processing, here
            from kvflow.model.arch import load_arch_config

            self.mm_processor = multimodal_processor(self.model_path, load_arch_config(self.model_path),
                                                     self.tokenizer)
        self._output_task = asyncio.create_task(self._output_loop(), name="kvflow-outputs")
        if self.stall_timeout > 0:
            self._heartbeat_task = asyncio.create_task(self._heartbeat(), name="kvflow-heartbeat")
        return self.info

    @property
    def max_model_len(self) -> int:
        return self.info.max_model_len

    @property
    def input_processor(self) -> InputProcessor:
        """The one request check, against the limits the core reported when it was ready."""
        if self._input_processor is None:
            self._input_processor = InputProcessor(self.config, RequestLimits.of(self.info))
        return self._input_processor

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
                       lora_request: LoRARequest | None = None, checked: bool = False,
                       multi_modal_data: MultiModalData | None = None,
                       ) -> AsyncIterator[RequestOutput]:
        """Stream DELTA RequestOutputs for one request (all its `n` samples) until finished.
        The input processor checks it first (ValueError naming the field: a 400), unless the
        caller did (`checked`: the server checks every prompt of a request before any runs).
        `multi_modal_data`: its images, one per image-start token of the prompt, in order: the
        prompt is expanded for them (off the event loop) and checked again."""
        if self.dead_error is not None:
            raise type(self.dead_error)(str(self.dead_error))  # keeps its code
        features = None
        if multi_modal_data:
            if self.mm_processor is None:
                raise InvalidRequestError("multi_modal_data: this model does not take images",
                                          "multi_modal_data")
            prompt_token_ids, features = await asyncio.to_thread(
                self.mm_processor.apply, list(prompt_token_ids), multi_modal_data)
            checked = False
        if not checked:
            self.input_processor.process(prompt_token_ids, params, lora_request)
        core_reqs = self.processor.add_request(
            request_id, prompt, prompt_token_ids, params, OutputKind.DELTA,
            arrival_time=arrival_time or time.time(), priority=priority, cache_salt=cache_salt,
            lora_request=lora_request, checked=True)
        finished = False
        # From here on the request is counted; every way out (an encode or send error, a
        # cancelled task, an error from the output path) passes the `finally` that uncounts it.
        try:
            queue: asyncio.Queue = asyncio.Queue()
            if not self.has_pending_work():
                self._last_progress = time.monotonic()  # the heartbeat counts from now
            self.queues[request_id] = queue
            self._core_ids[request_id] = len(core_reqs)
            self.num_core_requests += len(core_reqs)
            for r in core_reqs:
                r.mm_features = features
                self.client.add_request(r)
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            try:
                if not finished:
                    self.abort(request_id)
            finally:
                self._forget(request_id)

    async def encode(self, prompt_token_ids: list[int], params: PoolingParams, request_id: str,
                     prompt: str | None = None, priority: int = 0,
                     checked: bool = False,
                     lora_request: LoRARequest | None = None) -> EmbeddingRequestOutput:
        """Pool one prompt into its embedding (vLLM's name), under `lora_request`'s adapter if
        given; scheduled beside generation as a prefill-only request. `checked` as in
        generate."""
        if self.dead_error is not None:
            raise type(self.dead_error)(str(self.dead_error))
        if not checked:
            self.input_processor.process_pooling(prompt_token_ids, params, lora_request)
        core_req = self.processor.add_pooling_request(request_id, prompt, prompt_token_ids,
                                                      params, time.time(), priority, checked=True,
                                                      lora_request=lora_request)
        finished = False
        try:
            queue: asyncio.Queue = asyncio.Queue()
            if not self.has_pending_work():
                self._last_progress = time.monotonic()
            self.queues[request_id] = queue
            self._core_ids[request_id] = 1
            self.num_core_requests += 1
            self.client.add_request(core_req)
            item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            finished = True
            return item
        finally:
            try:
                if not finished:
                    self.abort(request_id)
            finally:
                self._forget(request_id)

    async def reset_prefix_cache(self) -> bool:
        """Clear the core's prefix cache; False (nothing done) while requests are running."""
        if self.dead_error is not None:
            raise type(self.dead_error)(str(self.dead_error))  # keeps its code
        fut = asyncio.get_running_loop().create_future()
        waiters = self._utility_waiters.setdefault(UtilityCall.RESET_PREFIX_CACHE, [])
        waiters.append(fut)
        try:
            self.client.request_reset_prefix_cache()
        except BaseException:
            waiters.remove(fut)  # never sent: no answer will come for it
            raise
        return await fut

    async def add_lora(self, lora_request: LoRARequest) -> None:
        """Load and register an adapter in the core; ValueError (nothing loaded) if refused."""
        result = await self._lora_call(EngineCoreRequestType.ADD_LORA, lora_request)
        if result.error is not None:
            raise ValueError(result.error)

    async def remove_lora(self, lora_request: LoRARequest) -> bool:
        """Unregister an adapter (by lora_int_id); False if the core did not have it,
        ValueError while requests use it."""
        result = await self._lora_call(EngineCoreRequestType.REMOVE_LORA, lora_request)
        if result.error is not None:
            raise ValueError(result.error)
        return result.found

    async def _lora_call(self, kind: EngineCoreRequestType, lora_request: LoRARequest):
        if self.dead_error is not None:
            raise type(self.dead_error)(str(self.dead_error))  # keeps its code
        fut = asyncio.get_running_loop().create_future()
        waiters = self._utility_waiters.setdefault("lora", [])
        waiters.append(fut)
        try:
            self.client.send_lora(kind, lora_request)
        except BaseException:
            waiters.remove(fut)
            raise
        return await fut

    def abort(self, request_id: str) -> None:
        """Drop a request here and in the core (its blocks return at the core's next step)."""
        if self.processor is None:
            return
        ids = self.processor.abort_request(request_id)
        self.stat_logger.forget(request_id)
        if ids and not self.is_dead:
            try:
                self.client.abort_requests(ids)
            except (zmq.ZMQError, ValueError, OverflowError) as e:
                # the socket is closing (the core goes with it), or ids that cannot be encoded
                # (then they never reached the core either)
                logger.warning("could not abort %s in the engine: %s", request_id, e)

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

    def has_pending_work(self) -> bool:
        """Requests (or a utility call) this frontend awaits an answer for from the core."""
        return bool(self.queues) or any(not f.done() for waiters in self._utility_waiters.values()
                                        for f in waiters)

    def _forget(self, request_id: str) -> None:
        self.queues.pop(request_id, None)
        self.num_core_requests -= self._core_ids.pop(request_id, 0)

    # -- the output task -----------------------------------------------------------------
    async def _output_loop(self) -> None:
        try:
            while True:
                kind, msg = await self.client.get_message()
                self._last_progress = time.monotonic()
                if kind == CoreMessage.OUTPUTS:
                    self._handle_outputs(msg)
                elif kind == CoreMessage.SNAPSHOT:
                    self.snapshot = msg
                elif kind == CoreMessage.REQ_ERROR:
                    self._handle_request_error(*msg)
                elif kind in (CoreMessage.UTILITY, CoreMessage.LORA):
                    name, result = (msg if kind == CoreMessage.UTILITY else ("lora", msg))
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
        self.stat_logger.record_outputs(
            [ro for ro in request_outputs if isinstance(ro, RequestOutput)], time.time())

    def _handle_request_error(self, core_id: str, message: str) -> None:
        entry = self.processor.core_to_sample.get(core_id)
        if entry is None:
            return
        rid = entry[0].request_id
        self.abort(rid)
        queue = self.queues.get(rid)
        if queue is not None:
            queue.put_nowait(ValueError(message))

    async def _heartbeat(self) -> None:
        """Declare the core stalled after `stall_timeout` s without a message while work is
        pending. An idle core sends nothing, so idle time never counts."""
        interval = min(1.0, self.stall_timeout / 4)
        last_tick = time.monotonic()
        while self.dead_error is None:
            await asyncio.sleep(interval)
            now = time.monotonic()
            if now - last_tick > max(2 * interval, self.stall_timeout / 2):
                # this loop itself was held up (a blocked event loop, a suspended process):
                # the core's messages may be queued unread, so give it the benefit of the doubt
                self._last_progress = now
            last_tick = now
            if not self.has_pending_work():
                self._last_progress = now
            elif now - self._last_progress > self.stall_timeout:
                self.client.kill()
                self._die(EngineStalledError(
                    f"the engine made no progress for {self.stall_timeout:g}s with requests "
                    "pending; it was stopped"))

    def _die(self, error: EngineDeadError) -> None:
        if self.dead_error is not None:
            return  # already dead (e.g. a stall, then the killed process noticed as gone)
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
        if self._heartbeat_task is not None:
            self._heartbeat_task.cancel()
            self._heartbeat_task = None
        if self._output_task is not None:
            self._output_task.cancel()
            try:
                await self._output_task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001
                pass
            self._output_task = None
        await asyncio.to_thread(self.client.shutdown)
