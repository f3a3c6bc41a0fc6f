"""EngineCoreClient: the frontend's handle on the engine-core process (spawn, ZeroMQ, death)."""
from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import shutil
import tempfile

import msgspec
import zmq
import zmq.asyncio

from kvflow.config import EngineConfig
from kvflow.engine.core_proc import run_engine_core
from kvflow.engine.protocol import (CoreMessage, EngineCoreOutputs, EngineCoreReady,
                                    EngineCoreRequest, EngineCoreRequestType, EngineSnapshot,
                                    LoRAResult, UtilityCall)

# How often the output reader checks that the core process still lives while no message comes.
DEATH_POLL_S = 0.25

logger = logging.getLogger("kvflow")


class EngineDeadError(RuntimeError):
    """The engine-core process is gone; no request can complete. Its message is short and
    safe to show a client (tracebacks go to the server log only)."""

    code = "engine_dead"


class EngineStalledError(EngineDeadError):
    """The engine core made no progress for too long while requests were pending (stopped,
    or stuck in a collective); it is treated as dead."""

    code = "engine_stalled"


def failure_summary(text: str) -> str:
    """The last line of a core's failure report (its exception, not the whole traceback)."""
    lines = [line for line in text.strip().splitlines() if line.strip()]
    last = lines[-1].strip() if lines else "unknown error"
    return last if len(last) <= 200 else last[:197] + "..."


class EngineStartupError(RuntimeError):
    """The engine-core process could not load the model."""


class EngineCoreClient:
    """Starts the core process and talks to it. Sends are synchronous (a PUSH socket with no
    high-water mark never blocks), so aborting works from any `finally` block."""

    def __init__(self, config: EngineConfig, on_ray: bool = False) -> None:
        # on_ray: the core is a Ray actor (engine/ray_core.py), which may run on another node,
        # so the sockets are TCP on this node's cluster address rather than ipc files
        self.config, self.on_ray = config, on_ray
        self._dir = tempfile.mkdtemp(prefix="kvflow-")
        if on_ray:
            from kvflow.engine.ray_core import ray_host
            host = ray_host(config)
            self.input_addr = self.output_addr = f"tcp://{host}:*"
        else:
            self.input_addr = f"ipc://{os.path.join(self._dir, 'input')}"
            self.output_addr = f"ipc://{os.path.join(self._dir, 'output')}"
        self.ctx = zmq.asyncio.Context()
        self.input_sock = zmq.Context.instance().socket(zmq.PUSH)
        self.input_sock.setsockopt(zmq.SNDHWM, 0)
        self.input_sock.setsockopt(zmq.LINGER, 0)
        self.input_sock.bind(self.input_addr)
        self.output_sock = self.ctx.socket(zmq.PULL)
        self.output_sock.setsockopt(zmq.RCVHWM, 0)
        self.output_sock.setsockopt(zmq.LINGER, 0)
        self.output_sock.bind(self.output_addr)
        if on_ray:  # the ports the system chose
            self.input_addr = self.input_sock.getsockopt_string(zmq.LAST_ENDPOINT)
            self.output_addr = self.output_sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.encoder = msgspec.msgpack.Encoder()
        self.outputs_decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)
        self.snapshot_decoder = msgspec.msgpack.Decoder(EngineSnapshot)
        self.proc: multiprocessing.process.BaseProcess | None = None
        self.info: EngineCoreReady | None = None
        self.closed = False

    # -- lifecycle -------------------------------------------------------------------
    async def start(self) -> EngineCoreReady:
        """Spawn the core (or start its actor) and wait until it has loaded the model (or say
        why it could not)."""
        if self.on_ray:
            from kvflow.engine.ray_core import RayEngineCore
            self.proc = await asyncio.to_thread(RayEngineCore, self.config, self.input_addr,
                                                self.output_addr)
        else:
            mp = multiprocessing.get_context("spawn")
            self.proc = mp.Process(target=run_engine_core, name="kvflow-engine-core", daemon=True,
                                   args=(self.config, self.input_addr, self.output_addr, os.getpid()))
            self.proc.start()
        while True:
            if await self.output_sock.poll(int(DEATH_POLL_S * 1000)):
                kind, payload = await self.output_sock.recv_multipart()
                if kind == CoreMessage.READY:
                    self.info = msgspec.msgpack.decode(payload, type=EngineCoreReady)
                    return self.info
                if kind == CoreMessage.FAILED:
                    self.proc.join(5)
                    raise EngineStartupError(msgspec.msgpack.decode(payload, type=str))
            elif not self.proc.is_alive():
                raise EngineStartupError(
                    f"engine core process exited with code {self.proc.exitcode} while loading the model")

    def is_alive(self) -> bool:
        return self.proc is not None and self.proc.is_alive()

    def shutdown(self, timeout: float = 3.0) -> None:
        """Stop the core process (politely, then by force) and remove the sockets."""
        if self.closed:
            return
        self.closed = True
        if self.proc is not None and self.proc.is_alive():
            try:
                self._send(EngineCoreRequestType.UTILITY, [UtilityCall.SHUTDOWN])
            except zmq.ZMQError:
                pass
            self.proc.join(timeout)
            if self.proc.is_alive():
                self.proc.terminate()
                self.proc.join(timeout)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join(timeout)
        self.input_sock.close(0)
        self.output_sock.close(0)
        self.ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)

    # -- messages --------------------------------------------------------------------
    def _send(self, kind: EngineCoreRequestType, obj) -> None:
        self.input_sock.send_multipart([kind.value, self.encoder.encode(obj)], copy=False)

    def add_request(self, request: EngineCoreRequest) -> None:
        """Send one request; ValueError (nothing sent) if it cannot be encoded, e.g. an int
        beyond 64 bits or a lone surrogate that escaped validation."""
        try:
            payload = self.encoder.encode(request)
        except (OverflowError, UnicodeEncodeError, TypeError, msgspec.EncodeError) as e:
            raise ValueError(f"the request cannot be sent to the engine: {e}") from None
        self.input_sock.send_multipart([EngineCoreRequestType.ADD.value, payload], copy=False)

    def send_lora(self, kind: EngineCoreRequestType, lora_request) -> None:
        """ADD_LORA or REMOVE_LORA; the core answers with a LORA message (LoRAResult)."""
        self._send(kind, lora_request)

    def kill(self) -> None:
        """SIGKILL the core now (it stalled: a stopped process may not handle SIGTERM)."""
        if self.proc is not None and self.proc.is_alive():
            self.proc.kill()

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids and not self.closed:
            self._send(EngineCoreRequestType.ABORT, list(request_ids))

    def request_reset_prefix_cache(self) -> None:
        """Ask the core to clear its prefix cache; it answers with a UTILITY message."""
        self._send(EngineCoreRequestType.UTILITY, [UtilityCall.RESET_PREFIX_CACHE])

    def enable_snapshots(self, on: bool) -> None:
        """Ask the core for dashboard snapshots (a few a second), or to stop making them."""
        if not self.closed:
            call = UtilityCall.SNAPSHOTS_ON if on else UtilityCall.SNAPSHOTS_OFF
            self._send(EngineCoreRequestType.UTILITY, [call])

    async def get_message(self) -> tuple[bytes, object]:
        """The next message from the core, decoded. Raises EngineDeadError once the process
        has died (noticed within DEATH_POLL_S while the core is silent)."""
        while True:
            if await self.output_sock.poll(int(DEATH_POLL_S * 1000)):
                kind, payload = await self.output_sock.recv_multipart()
                if kind == CoreMessage.OUTPUTS:
                    return kind, self.outputs_decoder.decode(payload)
                if kind == CoreMessage.SNAPSHOT:
                    return kind, self.snapshot_decoder.decode(payload)
                if kind == CoreMessage.REQ_ERROR:
                    return kind, msgspec.msgpack.decode(payload, type=tuple[str, str])
                if kind == CoreMessage.UTILITY:
                    return kind, msgspec.msgpack.decode(payload, type=tuple[str, bool])
                if kind == CoreMessage.LORA:
                    return kind, msgspec.msgpack.decode(payload, type=LoRAResult)
                if kind == CoreMessage.FAILED:
                    # the full report (maybe a traceback) is for the server log; the error,
                    # which /health and 503 bodies show, names only the exception
                    report = msgspec.msgpack.decode(payload, type=str).strip()
                    logger.error("engine core failed:\n%s", report)
                    raise EngineDeadError(f"engine core failed: {failure_summary(report)}")
            if not self.is_alive():
                code = self.proc.exitcode if self.proc is not None else None
                raise EngineDeadError(f"engine core process died (exit code {code})")
