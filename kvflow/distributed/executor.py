"""Driver side of tensor and pipeline parallelism: rank 0 runs in the engine's own process;
ranks 1..N-1 run in worker processes that this executor starts and watches: subprocesses (the
`mp` backend, supervisor.py; those of node 0) or Ray actors (the `ray` backend, ray_workers.py).

Each step the driver broadcasts (SchedulerOutput, tokens sampled last step), then every rank
runs the same forward over its shard and the driver samples; the scheduler stays single, on
the driver. Under pipeline parallelism (pipeline.py) the driver is the first stage: it sends
the step to every rank point to point, runs its stage and returns while the later stages work
(`execute_async`); the last stage samples and sends the tokens back. TPExecutor is the
multi-process Executor (kvflow.model.executor), so EngineCore uses it or the single-process
one without knowing which."""
from __future__ import annotations

import math
import os
import time
import weakref

import torch

from kvflow.config import EngineConfig
from kvflow.distributed.parallel import (CollectiveError, CommStats, Rendezvous, rendezvous_timeout,
                                         TPGroup, parse_init_method, rank_device)
from kvflow.distributed.lora_sync import wait_for_replies
from kvflow.distributed.messages import (LoRAUpdate, StepMasks, WorkerInit, decode_result,
                                         encode_init, encode_lora_update, encode_step)
from kvflow.distributed.shared_kv import (SharedKVMemory, create_kv_segment, kv_segment_bytes,
                                         sweep_orphans as sweep_kv_orphans)
from kvflow.distributed.shm_allreduce import (MAX_SLOT_BYTES, ShmAllReduce, create_segment,
                                              shm_supported)
from kvflow.distributed.pipeline import (PipelineGroup, TAG_RESULT, TAG_STEP, check_pp_size,
                                         stage_arch, stage_layers, stage_place)
from kvflow.distributed.supervisor import WorkerSupervisor, spawn_worker
from kvflow.distributed import ray_workers
from kvflow.logger import init_logger
from kvflow.model.arch import LlamaArchConfig
from kvflow.model.kv_cache import allocate_kv_caches
from kvflow.model.executor import Executor
from kvflow.attention.kv_layout import cache_shape
from kvflow.model.loader import load_sharded_model, weight_bytes
from kvflow.model.sharding import check_tp_size, local_arch
from kvflow.models.registry import family_of
from kvflow.worker.model_runner import ModelRunner, ModelRunnerOutput
from kvflow import envs

logger = init_logger("kvflow.distributed")
# After a collective fails, how long to wait for the supervisor to name the rank that died.
BLAME_WAIT_S = 2.0


def use_shm() -> bool:
    """Shared-memory all-reduce on one machine, unless KVFLOW_TP_SHM=0 (gloo for everything)."""
    return shm_supported() and envs.KVFLOW_TP_SHM


class WorkerFailedError(RuntimeError):
    """A tensor-parallel rank died or left the group; the engine cannot run another step."""


class TPExecutor(Executor):
    """Runs the model over `tensor_parallel_size` x `pipeline_parallel_size` ranks (see the
    module docstring), their workers started as processes (`mp`) or Ray actors (`ray`)."""

    def __init__(self, config: EngineConfig, model_path: str, arch: LlamaArchConfig,
                 dtype: torch.dtype, kv_dtype: torch.dtype, num_blocks: int, block_size: int,
                 eos_token_id: int | list[int] | None, device: str = "cpu",
                 quantization: str = "none") -> None:
        pc, lc = config.parallel_config, config.lora_config
        tp, pp, nnodes = pc.tensor_parallel_size, pc.pipeline_parallel_size, pc.nnodes
        n = tp * pp
        family = family_of(arch.architecture)
        family.supports.check(family.name, tensor_parallel_size=tp, pipeline_parallel_size=pp)
        check_tp_size(arch, tp)
        check_pp_size(arch, pp)
        if pc.node_rank != 0:
            raise ValueError("the engine runs on node 0; start the other nodes as workers "
                             "(the same command with --node-rank K)")
        if pp > 1 and config.kv_transfer is not None:
            raise ValueError("kv_transfer_config: KV transfer with pipeline parallelism is not "
                             "implemented (pipeline_parallel_size 1)")
        if pp > 1 and device != "cpu":
            raise ValueError("pipeline parallelism runs on the CPU only for now (device cpu)")
        on_ray = pc.distributed_executor_backend == "ray"
        if on_ray and device != "cpu":
            # the engine's own rank would take a GPU outside the placement group, which Ray
            # may also hand to a worker on the same node
            raise ValueError("distributed_executor_backend ray runs on the CPU only for now "
                             "(device cpu); on GPUs use the mp backend")
        self.world_size, self.tp, self.pp, self.failed, self.closed = n, tp, pp, None, False
        self.group: TPGroup | None = None
        self.pipe: PipelineGroup | None = None
        self.supervisor = None  # WorkerSupervisor (mp) or RayWorkers (ray)
        self._sampled: dict[str, list[int]] = {}
        self._in_flight = 0  # pipeline steps sent whose result has not come back
        self.num_steps = 0
        self.hidden_bytes = 0  # pipeline: bytes across each stage boundary, summed over steps
        self._shm_paths: list[str] = []
        self._kv_paths: list[str] = []
        self._rank_kv = []
        self._lora_seq = 0  # LoRAUpdates that wait for the ranks' answers, numbered
        self.rank_weight_bytes: list[int] = []  # each rank's weights, for the start-up line
        self.rdv = None
        try:
            if on_ray:
                started, host = ray_workers.connect(pc.ray_address, n)
                bundle = {"CPU": 1.0}
                self.supervisor = ray_workers.RayWorkers(list(range(1, n)),
                                                         pc.placement_group_strategy, bundle, started)
                self._finalizer = weakref.finalize(self, self.supervisor.kill)
                port = 0
                if pc.distributed_init_method:
                    host, port = parse_init_method(pc.distributed_init_method)
                me = ray_workers.node_id()
                one_machine = all(w[0] == me for w in self.supervisor.where.values())
            else:
                host, port = (parse_init_method(pc.distributed_init_method)
                              if pc.distributed_init_method else ("127.0.0.1", 0))
                one_machine = nnodes == 1
            self.rdv = Rendezvous(host, port, n, is_master=True)
            # All ranks on this machine: all-reduce through shared memory, sized for the largest
            # step ([max_num_batched_tokens, hidden] in fp32) up to a cap.
            slot_bytes = min(config.scheduler_config.max_num_batched_tokens * arch.hidden_size * 4,
                             MAX_SLOT_BYTES)
            # (under pipeline parallelism: one segment per stage, for its tp ranks)
            self._shm_paths = ([create_segment(tp, slot_bytes) for _ in range(pp)]
                               if one_machine and tp > 1 and use_shm() else [])
            # KV transfer reaches every rank's cache from here: the other ranks' live in shared files
            shard = local_arch(arch, tp)
            if config.kv_transfer is not None:
                if not one_machine:
                    raise ValueError("kv_transfer_config: KV transfer under tensor parallelism "
                                     "over several machines is not implemented (one machine is)")
                seg = kv_segment_bytes(arch.num_hidden_layers, math.prod(cache_shape(
                    num_blocks, block_size, shard.num_key_value_heads, shard.head_dim, kv_dtype)),
                                       kv_dtype)
                sweep_kv_orphans()
                self._kv_paths = [create_kv_segment(seg) for _ in range(1, n)]
            self.rdv.store.set("init", encode_init(WorkerInit(
                model_path, str(dtype).removeprefix("torch."), str(kv_dtype).removeprefix("torch."),
                num_blocks, block_size,
                config.num_threads, eos_token_id,
                shm_path=self._shm_paths[0] if self._shm_paths and pp == 1 else None,
                stage_shm_paths=self._shm_paths if pp > 1 and self._shm_paths else None,
                shm_slot_bytes=slot_bytes, device=device, kv_shm_paths=self._kv_paths or None,
                tp_size=tp, pp_size=pp, driver_pid=os.getpid(),
                max_model_len=config.model_config.max_model_len or 0, arch=arch.to_dict(),
                encoder_cache_size=config.scheduler_config.encoder_cache_tokens,
                max_loras=lc.max_loras if lc.enable_lora else 0,
                max_lora_rank=lc.max_lora_rank if lc.enable_lora else 0,
                quantization=quantization)))
            if on_ray:
                self.supervisor.start(self.rdv.address, n)
            else:
                self.supervisor = WorkerSupervisor(
                    {r: spawn_worker(self.rdv.address, r, n) for r in range(1, n // nnodes)})
                # Workers that never started are killed even if shutdown() is never called.
                self._finalizer = weakref.finalize(self, WorkerSupervisor.kill, self.supervisor)
            self._wait_for("joined")
            sup = self.supervisor  # not `self`: no reference cycle keeps the executor alive
            shm = (ShmAllReduce(self._shm_paths[0], 0, tp, slot_bytes, lambda: sup.failure)
                   if self._shm_paths else None)
            self._unlink_shm()  # every rank has it mapped: nothing is left in /dev/shm
            rank0 = rank_device(device, 0)
            layers = None
            if pp > 1:  # the world group first (every rank does the same), then stage 0's TP
                self.pipe = PipelineGroup(self.rdv, 0, n, tp, pp)
                self.group = (TPGroup(self.rdv, 0, tp, shm=shm, device=rank0, prefix="tp0")
                              if tp > 1 else None)
                layers = stage_layers(arch.num_hidden_layers, pp, 0)
                shard = stage_arch(shard if tp > 1 else arch, layers)
            else:
                self.group = TPGroup(self.rdv, 0, n, shm=shm, device=rank0)
            self.model, _ = load_sharded_model(model_path, dtype, self.group,
                                               rank0 if rank0.type != "cpu" else None, layers=layers,
                                               arch=arch, quantization=quantization)
            self.runner = ModelRunner(self.model, shard, num_blocks, block_size,
                                      kv_dtype, eos_token_id, device=rank0, pp=self.pipe,
                                      max_model_len=config.model_config.max_model_len or 0,
                                      encoder_cache_size=config.scheduler_config.encoder_cache_tokens,
                                      **stage_place(arch, layers))
            self._wait_for("loaded")
            self.rank_weight_bytes = [weight_bytes(self.model)] + [
                int(self.rdv.store.get(f"loaded/{r}")) for r in range(1, n)]
            self._rank_kv = [self.runner.kv_caches] + [
                allocate_kv_caches(shard, num_blocks, block_size, kv_dtype,
                                   zeros=SharedKVMemory(p).zeros) for p in self._kv_paths]
            self._unlink_kv()
        except BaseException:
            self._abort()
            raise
        if self.group is not None:
            self.group.stats = CommStats()  # count the serving steps only

    @property
    def max_concurrent_batches(self) -> int:
        """Steps the engine may keep in flight: one per pipeline stage."""
        return self.pp

    def rank_kv_caches(self) -> list:
        """Every rank's KV cache: rank 0's own, the others' mapped from their shared files
        (only with KV transfer; none otherwise)."""
        return self._rank_kv

    def _wait_for(self, key: str) -> None:
        """Until every worker has set `key/RANK` in the store; a worker error or death ends it."""
        store, pending = self.rdv.store, set(range(1, self.world_size))
        timeout_s = rendezvous_timeout().total_seconds()
        deadline = time.monotonic() + timeout_s
        while pending:
            for r in sorted(pending):
                if store.check([f"error/{r}"]):
                    raise WorkerFailedError(f"tensor-parallel worker rank {r}: "
                                            + store.get(f"error/{r}").decode())
                if store.check([f"{key}/{r}"]):
                    pending.discard(r)
            if self.supervisor.failure and pending:
                time.sleep(0.2)  # its error message may still be on its way to the store
                if not any(store.check([f"error/{r}"]) for r in pending):
                    raise WorkerFailedError(self.supervisor.failure)
            elif pending and time.monotonic() > deadline:
                raise WorkerFailedError(
                    f"tensor-parallel ranks {sorted(pending)} did not reach the rendezvous at "
                    f"{self.rdv.address} within {timeout_s:.0f}s; start "
                    "every node with the same --distributed-init-method, --nnodes and "
                    "--tensor-parallel-size")
            elif pending:
                time.sleep(0.05)

    # -- steps ---------------------------------------------------------------------------
    def execute(self, sched_out, grammar=None) -> ModelRunnerOutput:
        """One step on every rank; the driver's sampled tokens come back. Only the driver
        samples, so only it applies the grammar masks; the other ranks never see them."""
        if self.pipe is not None:
            return self.execute_async(sched_out, grammar).result()
        self.check_health()
        try:
            self.group.broadcast_bytes(encode_step(sched_out, self._sampled))
            out = self.runner.execute(sched_out, grammar)
        except CollectiveError as e:
            self._lost_rank(e)
        except BaseException as e:
            self._driver_failed(e)
            raise
        self._sampled = out.sampled
        self.num_steps += 1
        return out

    def execute_async(self, sched_out, grammar=None):
        """Start one step and return its handle (`.result()`: the sampled tokens). Under
        pipeline parallelism the driver sends the step to every rank and runs the first stage
        here, then returns while the later stages work; results come back in the order the
        steps were started, so the handles must be waited on in that order."""
        if self.pipe is None:
            return super().execute_async(sched_out, grammar)
        self.check_health()
        try:
            # the masks go with the step (only the last stage, which samples, reads them); a
            # constrained request is not scheduled again before its step is back, so its
            # grammar has advanced past every token it sampled
            data = encode_step(sched_out, self._sampled,
                               None if grammar is None else StepMasks.of(grammar))
            self._sampled = {}  # every rank gets them with this step
            for r in range(1, self.world_size):
                self.pipe.send_bytes(data, r, TAG_STEP)
            self._in_flight += 1
            self.runner.execute(sched_out)  # stage 0: its hidden states go on to stage 1
        except CollectiveError as e:
            self._lost_rank(e)
        except BaseException as e:
            self._driver_failed(e)
            raise
        self.num_steps += 1
        self.hidden_bytes += (2 * sched_out.total_num_scheduled_tokens * self.runner.arch.hidden_size
                              * self.model.dtype.itemsize * self.tp)
        return _PipelineStep(self)

    def _receive_result(self) -> ModelRunnerOutput:
        """The oldest step's result from the last stage (it sampled); the driver's runner and
        the next step's message take its tokens."""
        self.check_health()
        try:
            res = decode_result(self.pipe.recv_bytes(self.pipe.sampler_rank, TAG_RESULT))
        except CollectiveError as e:
            self._lost_rank(e)
        except BaseException as e:
            self._driver_failed(e)
            raise
        self._in_flight -= 1
        self.runner.append_sampled(res.sampled)
        self._sampled.update(res.sampled)  # steps in flight hold different requests
        return ModelRunnerOutput(res.sampled, res.logprobs)

    # -- LoRA adapters (kvflow/distributed/lora_sync.py) ----------------------------------
    def add_lora(self, lora_request) -> bool:
        """The driver reads and checks the adapter, then every other rank loads its part of
        it before the next step; where a rank cannot, it is dropped everywhere and refused."""
        if not super().add_lora(lora_request):
            return False
        self._lora_seq += 1
        seq = self._lora_seq
        self._send_lora(LoRAUpdate(seq, [lora_request], []))
        try:
            errors = wait_for_replies(self.rdv.store, seq, range(1, self.world_size),
                                      self.check_health, rendezvous_timeout().total_seconds())
        except TimeoutError as e:
            self._fail(f"loading LoRA adapter {lora_request.lora_name!r}: {e}")
        if errors:
            self.remove_lora(lora_request.lora_int_id)
            rank, why = min(errors.items())
            raise ValueError(f"LoRA adapter {lora_request.lora_name!r}: rank {rank} could not "
                             f"load it ({why})")
        return True

    def remove_lora(self, lora_int_id: int) -> bool:
        removed = super().remove_lora(lora_int_id)
        self._send_lora(LoRAUpdate(0, [], [lora_int_id]))
        return removed

    def _send_lora(self, update: LoRAUpdate) -> None:
        """To every other rank, in the step stream (after the steps sent, before the next)."""
        self.check_health()
        data = encode_lora_update(update)
        try:
            if self.pipe is not None:
                for r in range(1, self.world_size):
                    self.pipe.send_bytes(data, r, TAG_STEP)
            else:
                self.group.broadcast_bytes(data)
        except CollectiveError as e:
            self._lost_rank(e)

    def _lost_rank(self, e: Exception) -> None:
        blame = self.supervisor.wait_failure(BLAME_WAIT_S)
        self._fail(blame or f"a tensor-parallel rank left the group ({e})")

    def _driver_failed(self, e: BaseException) -> None:
        # the ranks are out of step now: no further step could be trusted
        self.failed = f"a step failed on the driver ({type(e).__name__}: {e}); the engine has stopped"
        self._abort()

    def check_health(self) -> None:
        """WorkerFailedError if a rank has died (or the engine stopped after a failure)."""
        if self.failed:
            raise WorkerFailedError(self.failed)
        if self.supervisor.failure:
            self._fail(self.supervisor.failure)

    def _fail(self, why: str) -> None:
        self.failed = f"{why}; the engine has stopped"
        self._abort()
        raise WorkerFailedError(self.failed) from None

    def reset_comm_stats(self) -> None:
        """Count collectives from here on (e.g. after warm-up)."""
        if self.group is not None:
            self.group.stats = CommStats()
        if self.pipe is not None:
            self.pipe.message_bytes_sent = self.pipe.hidden_bytes_sent = 0
            self.pipe.recv_wait_s = 0.0
        self.hidden_bytes = 0
        self.num_steps = 0

    def comm_summary(self) -> dict:
        """The driver's time in collectives per step, as numbers (see comm_report); under
        pipeline parallelism also the bytes per step between stages."""
        s, n = self.group.stats if self.group is not None else None, self.num_steps
        pipe = {} if self.pipe is None or not n else {
            "pp_steps": n,
            # what each stage boundary carries per step, over all its TP ranks' links
            "pp_hidden_bytes_per_step": self.hidden_bytes / n,
            "pp_step_message_bytes_per_step": self.pipe.message_bytes_sent / n,
            "pp_driver_recv_wait_ms_per_step": self.pipe.recv_wait_s / n * 1e3}
        if s is None or not n:
            return {"tp_steps": n, **pipe}
        return {"tp_steps": n, **pipe, "comm_ms_per_step": s.seconds / n * 1e3,
                "collectives_per_step": s.calls / n,
                "comm_ms_per_step_by_op": {op: t / n * 1e3 for op, t in sorted(s.seconds_by_op.items())},
                "comm_report": self.comm_report()}

    def comm_report(self) -> str:
        """Steps so far and the driver's time in collectives per step (waits included)."""
        s, n = self.group.stats if self.group is not None else None, self.num_steps
        if s is None or not n:
            return "no steps"
        parts = ", ".join(f"{op} {t / n * 1e3:.2f}" for op, t in sorted(s.seconds_by_op.items()))
        return (f"{n} steps, {s.calls / n:.0f} collectives and {s.seconds / n * 1e3:.2f} ms per "
                f"step in collectives on the driver ({parts} ms)")

    # -- lifecycle -----------------------------------------------------------------------
    def _abort(self) -> None:
        """Kill the local workers (remote ones see the group close and exit)."""
        if self.supervisor is not None:
            self.supervisor.stopping = True
            self.supervisor.kill()
        self._close_group()

    def _close_group(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None
        if self.pipe is not None:
            self.pipe.close()
            self.pipe = None
        self._unlink_shm()
        self._unlink_kv()
        if self.rdv is not None:
            self.rdv.close()

    def _unlink_kv(self) -> None:
        for p in self._kv_paths:
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass
        self._kv_paths = []

    def _unlink_shm(self) -> None:
        for p in self._shm_paths:
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass
        self._shm_paths = []

    def shutdown(self, timeout: float = 5.0) -> None:
        """Tell every rank to exit, wait for the local ones, then kill stragglers."""
        if self.closed:
            return
        self.closed = True
        if self.failed is None and self.pipe is not None:
            try:
                while self._in_flight:  # the last stage answers every step before it stops
                    self._receive_result()
                for r in range(1, self.world_size):
                    self.pipe.send_bytes(encode_step(None, {}), r, TAG_STEP)
                self.pipe.flush(timeout)
            except (CollectiveError, WorkerFailedError):
                pass
        elif self.failed is None and self.group is not None:
            logger.debug("kvflow tensor parallel: %s", self.comm_report())
            try:
                self.group.broadcast_bytes(encode_step(None, {}))
            except CollectiveError:
                pass
        if self.supervisor is not None:
            self.supervisor.stop(timeout)
        self._close_group()


class _PipelineStep:
    """A step in the pipeline: `result()` waits for what the last stage sampled."""

    def __init__(self, executor: TPExecutor) -> None:
        self._executor, self._out = executor, None

    def result(self) -> ModelRunnerOutput:
        if self._out is None:
            self._out = self._executor._receive_result()
        return self._out
