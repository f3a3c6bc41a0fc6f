"""A tensor- or pipeline-parallel worker process: one rank other than the driver (started by
the supervisor as a subprocess, or by kvflow.distributed.ray_workers as a Ray actor).

It joins the rendezvous, reads what to load from the store (so that every rank uses the
driver's block count), loads its shard and its share of the KV cache, then follows the driver
step by step: each broadcast carries the step's SchedulerOutput and the tokens the driver
sampled in the previous step; the worker runs the same forward (taking part in the
all-reduces and the logits gather) and never samples. `None` ends the loop. Under pipeline
parallelism (kvflow/distributed/pipeline.py) it runs its stage's layers and the last stage's
tp_rank 0 samples. A LoRAUpdate between steps registers or drops adapters on this rank
(kvflow/distributed/lora_sync.py).

Run as `python -m kvflow.distributed.worker --rendezvous HOST:PORT --rank R --world-size N`."""
from __future__ import annotations

import argparse
import logging
import os
import sys

from kvflow.distributed.lora_sync import apply_lora_update
from kvflow.distributed.messages import BadMessageError, LoRAUpdate, decode_init, decode_step
from kvflow.utils.process import parent_alive, pid_alive, start_child_process

# Exit codes the supervisor tells apart.
EXIT_LOAD_FAILED = 2
EXIT_PEER_LOST = 3  # a collective failed: another rank (or the driver) went away first

logger = logging.getLogger("kvflow.distributed")


def run_worker(rendezvous: str, rank: int, world_size: int, parent_pid: int | None = None) -> int:
    # Imported here, not at the top: the supervisor (and a worker node's process, which only
    # supervises) imports this module for the exit codes, without torch.
    import torch

    from kvflow.distributed.parallel import CollectiveError, Rendezvous, TPGroup, rank_device
    from kvflow.distributed.pipeline import PipelineGroup, stage_arch, stage_layers, stage_place
    from kvflow.distributed.shared_kv import SharedKVMemory
    from kvflow.distributed.shm_allreduce import ShmAllReduce
    from kvflow.model.arch import LlamaArchConfig
    from kvflow.model.loader import load_sharded_model, weight_bytes
    from kvflow.model.sharding import local_arch
    from kvflow.worker.model_runner import ModelRunner

    host, _, port = rendezvous.rpartition(":")
    rdv = Rendezvous(host, int(port), world_size, is_master=False)
    store = rdv.store
    try:
        init = decode_init(store.get("init"))  # typed msgpack: nothing from the store is unpickled
    except BadMessageError as e:
        store.set(f"error/{rank}", str(e))
        return EXIT_LOAD_FAILED
    torch.set_num_threads(init.num_threads)
    tp = init.tp_size or world_size
    shm = None
    shm_path = init.stage_shm_paths[rank // tp] if init.stage_shm_paths else init.shm_path
    if shm_path:
        def driver_gone() -> str | None:
            alive = parent_alive(parent_pid) if parent_pid is not None else pid_alive(init.driver_pid)
            return None if alive else "the driver is gone"
        shm = ShmAllReduce(shm_path, rank % tp, tp, init.shm_slot_bytes, driver_gone)
    store.set(f"joined/{rank}", str(os.getpid()))  # the driver unlinks the segment after this
    device = rank_device(init.device, rank)
    pipe = None
    try:
        if init.pp_size > 1:  # the world group first, on every rank, then this stage's TP group
            pipe = PipelineGroup(rdv, rank, world_size, tp, init.pp_size)
            group = (TPGroup(rdv, pipe.tp_rank, tp, shm, device, prefix=f"tp{pipe.stage}")
                     if tp > 1 else None)
        else:
            group = TPGroup(rdv, rank, world_size, shm, device)
    except CollectiveError as e:
        logger.error("kvflow worker rank %d: could not join the group (%s)", rank, e)
        return EXIT_PEER_LOST
    try:
        dtype = getattr(torch, init.dtype)
        layers, full = None, LlamaArchConfig.from_dict(init.arch)
        if pipe is not None:
            layers = stage_layers(full.num_hidden_layers, init.pp_size, pipe.stage)
        model, arch = load_sharded_model(init.model_path, dtype, group,
                                         device if device.type != "cpu" else None, layers=layers,
                                         arch=full, quantization=init.quantization)
        kv_memory = (SharedKVMemory(init.kv_shm_paths[rank - 1]).zeros if init.kv_shm_paths
                     else None)  # the driver reads and writes it for KV transfer
        shard = local_arch(arch, tp) if tp > 1 else arch
        if layers is not None:
            shard = stage_arch(shard, layers)
        runner = ModelRunner(model, shard, init.num_blocks, init.block_size,
                             getattr(torch, init.kv_dtype), init.eos_token_id, device=device,
                             kv_memory=kv_memory, pp=pipe, max_model_len=init.max_model_len,
                             encoder_cache_size=init.encoder_cache_size,
                             **stage_place(full, layers))
        if init.max_loras:  # slots in this rank's projections; adapters come between steps
            runner.enable_lora(init.max_loras, init.max_lora_rank)
    except Exception as e:  # noqa: BLE001 - the driver reports it
        store.set(f"error/{rank}", f"{type(e).__name__}: {e}")
        return EXIT_LOAD_FAILED
    store.set(f"loaded/{rank}", str(weight_bytes(model)))  # the driver's start-up line reports it
    try:
        if pipe is not None:
            return _follow_pipeline(pipe, runner, store)
        while True:
            msg = decode_step(group.broadcast_bytes())
            if msg is None:
                return 0
            if isinstance(msg, LoRAUpdate):
                apply_lora_update(runner, msg, store, rank)
                continue
            runner.append_sampled(msg.sampled)
            runner.execute(msg.sched_out)
    except BadMessageError as e:  # the ranks cannot stay in step after a frame it cannot read
        logger.error("kvflow tensor-parallel worker rank %d: %s", rank, e)
        return EXIT_PEER_LOST
    except CollectiveError as e:  # a peer closed its connection: it died or the driver left
        logger.error("kvflow tensor-parallel worker rank %d: lost the group (%s)", rank, e)
        return EXIT_PEER_LOST


def _follow_pipeline(pipe, runner, store) -> int:
    """A pipeline rank's loop: each step message from the driver, in order; the last stage's
    tp_rank 0 samples (through the step's grammar masks, where it has some) and answers each
    one with what it sampled."""
    from kvflow.distributed.messages import encode_result
    from kvflow.distributed.pipeline import TAG_RESULT, TAG_STEP

    samples = pipe.rank == pipe.sampler_rank
    while True:
        msg = decode_step(pipe.recv_bytes(0, TAG_STEP))
        if msg is None:
            pipe.flush()
            return 0
        if isinstance(msg, LoRAUpdate):
            apply_lora_update(runner, msg, store, pipe.rank)
            continue
        if not samples:  # the sampler appended its own tokens when it sampled them
            runner.append_sampled(msg.sampled)
        out = runner.execute(msg.sched_out, msg.grammar if samples else None)
        if samples:
            pipe.send_bytes(encode_result(out.sampled, out.logprobs), 0, TAG_RESULT)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvflow.distributed.worker")
    p.add_argument("--rendezvous", required=True, help="HOST:PORT of the driver's store")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--parent-pid", type=int, default=None, help="exit when this process dies")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    # the driver (or the worker node) decides when workers stop, and no worker outlives it
    if not start_child_process(args.parent_pid):
        return EXIT_PEER_LOST  # the parent died before the death signal was armed
    return run_worker(args.rendezvous, args.rank, args.world_size, args.parent_pid)


if __name__ == "__main__":
    sys.exit(main())
