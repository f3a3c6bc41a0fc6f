"""The EngineCore busy loop in its own process, for `kvflow serve`.

The frontend binds two ZeroMQ sockets and spawns this process, which connects to both:

    frontend --PUSH--> [type, msgpack]  --PULL--> core     (add / abort / utility)
    frontend <--PULL-- [kind, msgpack]  <--PUSH-- core     (ready / outputs / errors)

When no request is unfinished the loop blocks on its input socket (never spins); otherwise it
drains whatever arrived and runs one step. The child dies with its parent: PR_SET_PDEATHSIG
where Linux offers it, and a parent-pid check every loop as the fallback. The messages and
their frames are in kvflow.engine.protocol.
"""
from __future__ import annotations

import os
import sys
import traceback

import msgspec
import zmq

from kvflow.config import EngineConfig
from kvflow.engine.protocol import (CoreMessage, EngineCoreOutputs, EngineCoreReady,
                                    EngineCoreRequest, EngineCoreRequestType, EngineSnapshot,
                                    LoRAResult, UtilityCall)
from kvflow.lora_request import LoRARequest
from kvflow.engine.snapshot import SnapshotSource
from kvflow.utils.process import parent_alive, start_child_process

_IDLE_POLL_MS = 1000   # how often an idle core checks that its parent still lives


def run_engine_core(config: EngineConfig, input_addr: str, output_addr: str,
                    parent_pid: int | None) -> None:
    """Process entry point: load the model, report ready (or why not), then serve steps."""
    if not start_child_process(parent_pid):
        return  # the frontend is already gone
    ctx = zmq.Context(1)
    out_sock = ctx.socket(zmq.PUSH)
    out_sock.setsockopt(zmq.LINGER, 2000)
    out_sock.connect(output_addr)
    in_sock = ctx.socket(zmq.PULL)
    in_sock.setsockopt(zmq.LINGER, 0)
    in_sock.connect(input_addr)
    encoder = msgspec.msgpack.Encoder()
    try:
        # Imported here, in the core process: the frontend imports this module (to spawn the
        # process) and stays free of torch and the model.
        from kvflow.engine.core import EngineCore
        core = EngineCore(config)
    except Exception as e:  # noqa: BLE001 - any load failure is reported, not raised
        msg = str(e) if isinstance(e, (ValueError, RuntimeError, OSError)) else traceback.format_exc()
        out_sock.send_multipart([CoreMessage.FAILED, encoder.encode(f"{type(e).__name__}: {msg}")])
        out_sock.close()
        ctx.term()
        sys.exit(1)
    ready = EngineCoreReady(
        os.getpid(), core.model_path, core.max_model_len, core.cache_config.num_blocks,
        core.cache_config.block_size, core.scheduler_config.max_num_seqs, core.arch.vocab_size,
        core.startup_report(), core.supports_images)
    out_sock.send_multipart([CoreMessage.READY, encoder.encode(ready)])
    try:
        EngineCoreLoop(core, in_sock, out_sock, parent_pid).run()
    except Exception as e:  # noqa: BLE001
        from kvflow.distributed.executor import WorkerFailedError  # deferred like EngineCore

        # a tensor-parallel worker's death is reported in one line; anything else in full
        msg = f"{type(e).__name__}: {e}" if isinstance(e, WorkerFailedError) else traceback.format_exc()
        out_sock.send_multipart([CoreMessage.FAILED, encoder.encode(msg)])
        sys.exit(1)
    finally:
        core.shutdown()
        in_sock.close()
        out_sock.close()
        ctx.term()


class EngineCoreLoop:
    """Drain input, step, send outputs; block while idle."""

    def __init__(self, core, in_sock: zmq.Socket, out_sock: zmq.Socket,
                 parent_pid: int | None) -> None:
        self.core = core
        self.in_sock, self.out_sock = in_sock, out_sock
        self.parent_pid = parent_pid
        self.poller = zmq.Poller()
        self.poller.register(in_sock, zmq.POLLIN)
        # the KV-transfer agent's news (a lease to free, a pull done) wakes an idle loop too
        self.kv_wake = getattr(core, "kv_wakeup_socket", None)
        if self.kv_wake is not None:
            self.poller.register(self.kv_wake, zmq.POLLIN)
        self.encoder = msgspec.msgpack.Encoder()
        self.add_decoder = msgspec.msgpack.Decoder(EngineCoreRequest)
        self.ids_decoder = msgspec.msgpack.Decoder(list[str])
        self.lora_decoder = msgspec.msgpack.Decoder(LoRARequest)
        self.running = True
        self.snapshots = SnapshotSource(core.scheduler)

    def run(self) -> None:
        while self.running:
            if self.parent_pid is not None and not parent_alive(self.parent_pid):
                return  # orphaned: the frontend is gone (a Ray actor: Ray ends it)
            busy = self.core.has_unfinished_requests()
            if not busy and not self.poller.poll(self.snapshots.wait_ms(_IDLE_POLL_MS)):
                self.core.check_health()  # a dead tensor-parallel worker ends an idle engine too
                self.send_snapshot(self.snapshots.poll())  # the state after the last step
                continue
            handled = self.drain_input()
            if not self.running:
                return
            if busy or handled:
                # Also after input alone (e.g. an abort): the step's stats tell the frontend
                # that blocks came back.
                out = self.core.step()
                self.send_outputs(out)
                self.send_snapshot(self.snapshots.after_step(out.scheduler_stats))

    def drain_input(self) -> int:
        n = 0
        if self.kv_wake is not None and self.kv_wake.poll(0):
            n += 1  # the step reads the agent's events
        while True:
            try:
                kind, payload = self.in_sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return n
            n += 1
            self.handle(kind.bytes, payload.buffer)
            if not self.running:
                return n

    def handle(self, kind: bytes, payload) -> None:
        if kind == EngineCoreRequestType.ADD.value:
            req = self.add_decoder.decode(payload)
            try:
                self.core.add_request(req)
            except ValueError as e:
                self.out_sock.send_multipart(
                    [CoreMessage.REQ_ERROR, self.encoder.encode([req.request_id, str(e)])])
        elif kind == EngineCoreRequestType.ABORT.value:
            self.core.abort_requests(self.ids_decoder.decode(payload))
        elif kind in (EngineCoreRequestType.ADD_LORA.value, EngineCoreRequestType.REMOVE_LORA.value):
            self.send_lora_result(kind == EngineCoreRequestType.ADD_LORA.value, payload)
        elif kind == EngineCoreRequestType.UTILITY.value:
            call = self.ids_decoder.decode(payload)[:1]
            if call == [UtilityCall.SHUTDOWN]:
                self.running = False
            elif call in ([UtilityCall.SNAPSHOTS_ON], [UtilityCall.SNAPSHOTS_OFF]):
                self.snapshots.set_enabled(call == [UtilityCall.SNAPSHOTS_ON])
            elif call == [UtilityCall.RESET_PREFIX_CACHE]:
                done = self.core.reset_prefix_cache()
                self.out_sock.send_multipart([CoreMessage.UTILITY, self.encoder.encode(
                    [UtilityCall.RESET_PREFIX_CACHE, done])])

    def send_lora_result(self, add: bool, payload) -> None:
        """Add or remove an adapter and answer: a refusal (a bad adapter, one in use) is a
        LoRAResult with its error; the loop goes on."""
        op = "add" if add else "remove"
        try:
            lr = self.lora_decoder.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as e:
            result = LoRAResult(op, 0, error=f"bad LoRA request: {e}")
        else:
            try:
                if add:
                    self.core.add_lora(lr)
                    result = LoRAResult(op, lr.lora_int_id)
                else:
                    result = LoRAResult(op, lr.lora_int_id, found=self.core.remove_lora(lr.lora_int_id))
            except ValueError as e:
                result = LoRAResult(op, lr.lora_int_id, error=str(e))
        self.out_sock.send_multipart([CoreMessage.LORA, self.encoder.encode(result)])

    def send_snapshot(self, snap: EngineSnapshot | None) -> None:
        if snap is not None:
            self.out_sock.send_multipart([CoreMessage.SNAPSHOT, self.encoder.encode(snap)],
                                         copy=False)

    def send_outputs(self, out: EngineCoreOutputs) -> None:
        self.out_sock.send_multipart([CoreMessage.OUTPUTS, self.encoder.encode(out)], copy=False)
