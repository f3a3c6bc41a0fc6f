"""EngineCore: owns the scheduler and the executor; step() is schedule -> execute -> update."""
from __future__ import annotations

import os
import time
from collections import deque
from dataclasses import dataclass, replace

import torch

from kvflow.models.registry import family_of
from kvflow.config import EngineConfig
from kvflow.core.kv_cache.groups import make_kv_cache_groups
from kvflow.core.kv_cache.spec import StateSpec
from kvflow.core.scheduler import Scheduler, SchedulerOutput
from kvflow.distributed.executor import TPExecutor
from kvflow.distributed.pipeline import stage_layers
from kvflow.engine.input_processor import InputProcessor, RequestLimits
from kvflow.engine.kv_events import KVEventBatch, make_publisher, to_wire
from kvflow.engine.kv_sizing import max_concurrency, num_kv_blocks
from kvflow.engine.memory_report import kv_cache_bytes, memory_line
from kvflow.engine.protocol import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, SchedulerStats
from kvflow.engine.speculator import build_speculator
from kvflow.engine.step_trace import StepTrace
from kvflow.engine.warmup import warmup_outputs
from kvflow.kv_transfer.blocks import KVShard, PagedKV
from kvflow.kv_transfer.connector import KVConnector
from kvflow.kv_transfer.pd_connector import PDConnector, check_engine
from kvflow.logger import init_logger
from kvflow.lora_request import LoRARequest
from kvflow.model.arch import load_arch_config
from kvflow.model.executor import CompletedStep, Executor, UniProcExecutor
from kvflow.model import gpu_memory
from kvflow.model.cuda_graphs import decode_graphs_for
from kvflow.model.key_scales import key_scales_digest
from kvflow.model.kv_cache import kv_bytes_per_token, kv_cache_groups, kv_layer_shapes
from kvflow.attention.kv_layout import INT8_SCALE_BYTES, resolve_kv_dtype
from kvflow.model.loader import load_model, resolve_device, resolve_dtype, weight_bytes
from kvflow.model.quant.load import resolve_quantization
from kvflow.model.sharding import kv_bytes_per_token_per_rank, shard_layout
from kvflow.model.weight_dtype import storage_dtype
from kvflow.model_path import resolve_model_path
from kvflow.request import Request
from kvflow.structured import StructuredOutputManager
from kvflow.tokenizer import get_tokenizer, tokenizer_source

logger = init_logger("kvflow.engine")


@dataclass(slots=True)
class _StartedStep:
    """A step scheduled and handed to the executor, its tokens not applied yet."""

    sched_out: SchedulerOutput
    handle: object  # .result() -> ModelRunnerOutput
    start: float  # wall clock, for the trace
    t0: float  # perf_counter, for the step time


class EngineCore:
    """The busy part of the engine. Used in-process by LLMEngine and in its own process by
    `kvflow serve`."""

    def __init__(self, config: EngineConfig) -> None:
        t0 = time.perf_counter()
        self.config = config
        torch.set_num_threads(config.num_threads)
        self._resolve_placement()  # model path, device, dtypes, parallel sizes
        self._refuse_unsupported()  # option combinations refused before anything loads
        free_at_start = torch.cuda.mem_get_info(self.device)[0] if self._on_gpu else 0
        model = self._load_model()  # the weights here, or (ranks load shards) the config only
        self._refuse_for_state_layers(model)
        self.kv_bytes_per_token, block_bytes_per_token = self._kv_cache_spec()
        self.scheduler_config, self.cache_config = self._cache_configs(
            model, block_bytes_per_token, free_at_start)  # block count from the memory budget
        self.scheduler = Scheduler(self.scheduler_config, self.cache_config,
                                   self._kv_cache_specs(), self.num_state_slots or None)
        # checks what callers other than the frontends hand add_request (EngineCoreRequest.checked)
        self.supports_images = bool(getattr(family_of(self.arch.architecture).model_class(self.arch),
                                            "supports_images", False))
        self.input_processor = InputProcessor(config, RequestLimits(
            self.arch.vocab_size, self.max_model_len, self.cache_config.block_size,
            self.cache_config.num_blocks, self.supports_images))
        self.structured = self._structured_outputs()
        self.spec = self._speculator()
        self.trace = None
        # moves KV beyond this process (prefill/decode transfer); the base class does nothing
        self.kv_connector: KVConnector = KVConnector()
        if config.kv_transfer is not None:  # refused before any worker starts
            check_engine(self.cache_config, self.device.type)
        self._batch_queue: deque[_StartedStep] = deque()  # steps started, not yet finished
        # the prefix cache's block events, drained once a step (docs: --kv-events-config)
        self.kv_event_publisher = None
        self.executor = self._make_executor(model)
        self.scheduler.max_concurrent_batches = self.executor.max_concurrent_batches
        try:
            self._start_up()  # adapters, KV transfer, trace, warm-up, CUDA graphs
        except BaseException:
            self.shutdown()  # no worker outlives a failed start
            raise
        # after the warm-up: unseeded sampling draws from here, so --seed fixes its stream
        torch.manual_seed(config.model_config.seed)
        self.startup_time = time.perf_counter() - t0
        logger.info(self.startup_report())

    # -- start-up, step by step ------------------------------------------------------------
    @property
    def _on_gpu(self) -> bool:
        return self.device.type == "cuda"

    def _resolve_placement(self) -> None:
        mc, pc = self.config.model_config, self.config.parallel_config
        self.model_path = resolve_model_path(mc.model)
        self.device = resolve_device(mc.device)
        self.dtype = resolve_dtype(mc.dtype, self.device)
        cache_dtype = self.config.cache_config.cache_dtype
        self.kv_dtype = self.dtype if cache_dtype == "auto" else resolve_kv_dtype(cache_dtype)
        self.tp_size, self.pp_size = pc.tensor_parallel_size, pc.pipeline_parallel_size
        self.num_ranks = pc.world_size

    def _refuse_unsupported(self) -> None:
        """ValueError for option combinations not supported yet, before anything loads."""
        config = self.config
        if self._on_gpu and config.speculative_config is not None:
            raise ValueError("speculative_config runs on the CPU only for now (its GPU path is "
                             "not verified); drop it or use --device cpu")
        if self._on_gpu and self.tp_size > 1 and config.cache_config.num_blocks is None:
            # the profile run that sizes the pool by --gpu-memory-utilization is one process's
            raise ValueError("tensor parallelism on cuda needs --num-blocks: the KV pool is not "
                             "sized from --gpu-memory-utilization across ranks yet")

    def _load_model(self):
        """The model in this process (None when the executor's ranks load their shards; never
        the whole model here then); sets `arch` and `max_model_len`."""
        mc, on_gpu = self.config.model_config, self._on_gpu
        # quantized weights are the CPU's, one process's (refused here, before anything loads)
        self.quantization = quantization = resolve_quantization(mc.quantization, self.model_path,
                                                                self.num_ranks, on_gpu)
        weight_dtype = storage_dtype(mc.weight_dtype, self.dtype, not on_gpu, quantization,
                                     self.num_ranks)
        self.arch = load_arch_config(self.model_path)  # read once: passed to the loader and the ranks
        model = None
        if self.num_ranks == 1:
            model, _ = load_model(self.model_path, self.dtype, device=self.device if on_gpu else None,
                                  quantization=quantization, weight_dtype=weight_dtype, arch=self.arch)
        self.max_model_len = mc.max_model_len or self.arch.max_position_embeddings
        return model

    @property
    def state_bytes_per_request(self) -> int:
        """The fixed-size state one request holds across a hybrid model's state layers (0: none)."""
        return self.arch.state_bytes_per_request(self.dtype.itemsize)

    def _refuse_for_state_layers(self, model) -> None:
        """ValueError for what a model with state layers (LFM2's convolutions) cannot run with
        yet; sets `num_state_slots` (one per request that may run: max_num_seqs)."""
        self.num_state_slots, self._state_snapshots = 0, False
        if not self.state_bytes_per_request:
            return
        config, name = self.config, self.arch.architecture
        if config.speculative_config is not None:
            raise ValueError(f"speculative_config with {name} (layers that keep a state) is not "
                             "supported yet: its state cannot be rolled back to the last accepted token")
        if config.kv_transfer is not None:
            raise ValueError(f"kv_transfer with {name} (layers that keep a state) is not supported "
                             "yet: the transfer moves KV blocks, not the layers' states")
        self.num_state_slots = config.scheduler_config.max_num_seqs
        # prefix-cache hits need the layers to keep (and restore) snapshots of a state
        self._state_snapshots = (config.cache_config.enable_prefix_caching
                                 and hasattr(model, "copy_states"))

    @property
    def _state_copies(self) -> int:
        """Slots per running request: its own, and with prefix caching as many snapshots
        (core/kv_cache/state.py) where the layers keep them."""
        return 2 if self._state_snapshots else 1

    def _kv_cache_specs(self) -> list:
        """One spec per KV cache group, attention groups first, then the state layers'."""
        cc = self.cache_config
        specs = [g.spec for g in make_kv_cache_groups(cc.layer_windows or (None,), cc.layer_kv_shapes)]
        if self.num_state_slots:
            specs.append(StateSpec(self.state_bytes_per_request, snapshots=self._state_snapshots))
        return specs

    def _kv_cache_spec(self) -> tuple[int, int]:
        """KV bytes per token on one rank (every layer it holds), and per token of one block
        (the layers of one KV cache group)."""
        # under tensor parallelism each rank holds its KV heads' share of every block
        per_token = kv_bytes_per_token_per_rank(
            self.arch, self.tp_size, self.kv_dtype.itemsize,
            INT8_SCALE_BYTES if self.kv_dtype == torch.int8 else 0)
        num_layers = self.arch.num_hidden_layers
        if self.pp_size > 1:  # a stage holds its layers' KV only; the largest stage decides
            return (per_token * len(stage_layers(num_layers, self.pp_size, 0)) // num_layers,) * 2
        if self.tp_size > 1:  # with sliding windows a block spans one group's layers, not all
            windows = tuple(self.arch.kv_layer_windows())
            return per_token, per_token * len(make_kv_cache_groups(windows)[0].layers) // len(windows)
        # each layer at its own shape; a block spans one group's tensors (kv_cache.py)
        return kv_bytes_per_token(kv_cache_groups(self.arch, self.kv_dtype), self.kv_dtype)

    def _cache_configs(self, model, block_bytes_per_token: int, free_at_start: int):
        """The scheduler's and the cache's configs, resolved: max_model_len, and the block
        count from the memory budget (on a GPU: what is left after a profile run)."""
        config = self.config
        sc = replace(config.scheduler_config, max_model_len=self.max_model_len)
        cc = config.cache_config
        self.gpu_memory = None
        if self._on_gpu and cc.num_blocks is None:
            # weights, a profile run of the largest step, then the KV pool gets what is left
            self.gpu_memory = gpu_memory.measure(
                model, self.arch, self.kv_dtype, cc.block_size, sc.max_num_batched_tokens,
                sc.max_num_seqs, self.max_model_len, self.device, free_at_start)
            num_blocks = gpu_memory.num_gpu_blocks(
                self.gpu_memory, cc.gpu_memory_utilization, block_bytes_per_token, cc.block_size)
        else:  # the state slots' bytes (and their snapshots') come out of the same budget
            state = self.num_state_slots * self._state_copies * self.state_bytes_per_request
            num_blocks = num_kv_blocks(replace(cc, kv_cache_memory=max(cc.kv_cache_memory - state, 0)),
                                       block_bytes_per_token)
        return sc, replace(cc, num_blocks=num_blocks,
                           layer_windows=tuple(self.arch.kv_layer_windows()),
                           layer_kv_shapes=kv_layer_shapes(self.arch, self.kv_dtype))

    def _structured_outputs(self) -> StructuredOutputManager:
        # grammars compile in its thread; the tokenizer loads there on the first constrained request
        mc = self.config.model_config
        return StructuredOutputManager(
            self.config.structured_outputs_backend,
            lambda: get_tokenizer(tokenizer_source(mc.tokenizer, self.model_path)),
            self.arch.vocab_size, list(self.arch.eos_token_ids))

    def _speculator(self):
        """The draft proposer, with speculative_config (None without).

        Under tensor parallelism drafts are made here, on the driver: n-gram lookup reads
        token ids, and a draft model runs unsharded in this process (vLLM's draft TP=1; a
        small draft split over ranks would pay two all-reduces per layer per draft token).
        Only the target's verification forward runs sharded; the ranks see the drafts as
        scheduled tokens in the step's SchedulerOutput."""
        if self.config.speculative_config is None:
            return None
        spec = build_speculator(self.config.speculative_config, self.arch, self.dtype,
                                self.kv_dtype, self.cache_config, self.max_model_len,
                                self.config.model_config.quantization)
        self.scheduler.num_lookahead_tokens = spec.num_lookahead_tokens
        return spec

    def _make_executor(self, model) -> Executor:
        """What runs each step: in this process, or over tensor_parallel_size ranks."""
        cc, sc, a = self.cache_config, self.scheduler_config, self.arch
        if self.num_ranks > 1:
            return TPExecutor(self.config, self.model_path, a, self.dtype, self.kv_dtype,
                              cc.num_blocks, cc.block_size, a.eos_token_ids, self.device.type,
                              self.quantization)
        # an expert block groups tokens on the host (moe.py): no CUDA graph
        graphs = (decode_graphs_for(a, cc.block_size, sc.max_num_seqs, self.max_model_len,
                                    self.device,
                                    capture=not self.config.model_config.enforce_eager)
                  if self._on_gpu and not a.num_experts else None)
        return UniProcExecutor(model, a, cc.num_blocks, cc.block_size, self.kv_dtype,
                               a.eos_token_ids, self.device, graphs, max_model_len=self.max_model_len,
                               num_state_slots=self.num_state_slots * self._state_copies,
                               encoder_cache_size=sc.encoder_cache_tokens)

    def _start_up(self) -> None:
        """What needs the executor's workers: adapters, the KV-transfer agent, the trace,
        the warm-up steps and CUDA graphs."""
        config, cc, sc = self.config, self.cache_config, self.scheduler_config
        lc = config.lora_config
        if lc.enable_lora:  # slots in every projection, then the adapters named at start
            self.executor.runner.enable_lora(lc.max_loras, lc.max_lora_rank)
            self.scheduler.max_loras = lc.max_loras
            for i, (name, path) in enumerate(lc.modules(), start=1):
                self.add_lora(LoRARequest(name, i, path))
        self.kv_event_publisher = make_publisher(config.kv_events)
        if self.kv_event_publisher is not None:
            self.scheduler.kv_cache_manager.record_events()
            logger.info("KV events: publishing on %s%s", config.kv_events.endpoint,
                        f" (replay on {config.kv_events.replay_endpoint})"
                        if config.kv_events.replay_endpoint else "")
        if config.kv_transfer is not None:
            self.kv_connector = PDConnector(config.kv_transfer, self.kv_compat(),
                                            self._paged_kv(), cc.block_size)
        self.trace = StepTrace(config.trace, sc.max_num_batched_tokens, cc.block_size,
                               cc.num_blocks) if config.trace else None
        if config.warmup:
            for sched_out in warmup_outputs(self.arch.vocab_size, cc.block_size, cc.num_blocks,
                                            sc.max_num_batched_tokens):
                self.executor.execute(sched_out)
        self.executor.runner.capture_graphs()  # on a GPU: every decode batch size, now
        if self.spec is not None:  # drafts kept within the one-call decode step's rows
            self.spec.policy.one_call_rows = self.executor.decode_step_rows()

    def kv_compat(self) -> dict:
        """What two engines must agree on for their KV blocks to be interchangeable."""
        a = self.arch
        return {"model": os.path.basename(os.path.normpath(self.model_path)),
                "architecture": a.architecture, "vocab_size": a.vocab_size,
                "dtype": str(self.dtype).removeprefix("torch."),
                "kv_dtype": str(self.kv_dtype).removeprefix("torch."),
                "num_layers": a.num_hidden_layers, "num_kv_heads": a.num_key_value_heads,
                "head_dim": a.head_dim,
                "key_scales": key_scales_digest(self.executor.runner.model)}

    def _paged_kv(self) -> PagedKV:
        """The whole cache as KV transfer sees it: each rank's share with its first KV head."""
        return PagedKV([KVShard(shard_layout(self.arch, r, self.tp_size).kv_head_start, caches)
                        for r, caches in enumerate(self.executor.rank_kv_caches())])

    @property
    def kv_wakeup_socket(self):
        """Readable when the KV connector has news (the core loop polls it); else None."""
        return self.kv_connector.wakeup_socket

    def startup_report(self) -> str:
        cc, a = self.cache_config, self.arch
        groups = make_kv_cache_groups(cc.layer_windows or (None,), cc.layer_kv_shapes)
        # with several groups a token takes a block's slot in each (a lower bound on the
        # concurrency: local groups need only their window)
        tokens = cc.num_blocks * cc.block_size // len(groups)
        sizes = sorted({len(g.layers) for g in groups})  # layers packed k to a page: k times as many
        group_note = (f" in {len(groups)} KV cache groups of {'/'.join(map(str, sizes))} layers"
                      if len(groups) > 1 else "")
        return (f"kvflow: model {self.model_path} ({a.architecture}, "
                f"{a.num_parameters() / 1e6:.1f}M params, {str(self.dtype).removeprefix('torch.')}); "
                f"KV {str(self.kv_dtype).removeprefix('torch.')} {self.kv_bytes_per_token} B/token; "
                f"{cc.num_blocks} blocks x {cc.block_size}{group_note} = "
                f"{tokens} tokens; "
                + (f"state {self.state_bytes_per_request / 1024:.1f} KiB/request x {self.num_state_slots} "
                   f"slots" + (f" + {self.num_state_slots} prefix-cache snapshots"
                               if self._state_copies > 1 else "")
                   + f" = {self.state_bytes_per_request * self.num_state_slots * self._state_copies / 2**20:.1f} MiB; "
                   if self.num_state_slots else "")
                + f"max concurrency at max_model_len "
                f"{self.max_model_len}: {max_concurrency(cc.num_blocks // len(groups), cc.block_size, self.max_model_len):.2f}; "
                f"threads {torch.get_num_threads()}; "
                + (f"tensor-parallel size {self.tp_size} (KV per rank); " if self.tp_size > 1 else "")
                + (f"pipeline-parallel size {self.pp_size} (KV per stage, up to "
                   f"{self.pp_size} steps in flight); " if self.pp_size > 1 else "")
                + (f"{self.config.parallel_config.distributed_executor_backend} executor; "
                   f"{self._rank_weights_report()}; " if self.num_ranks > 1 else "")
                + (self._gpu_report() if self.device.type == "cuda" else "")
                + f"{self.executor.runner.model.kernels.describe()}; "
                + (f"{self._memory_report()}; " if self.device.type == "cpu" else "")
                + self._lora_report()
                + (f"{self.spec.describe()}; " if self.spec is not None else "")
                + (f"{self.kv_connector.describe()}; " if self.kv_connector.describe() else "")
                + f"ready in {self.startup_time:.1f}s")

    def _memory_report(self) -> str:
        """This process's weights, KV cache and runtime memory (memory_report.py)."""
        runner = self.executor.runner
        sizes = getattr(self.executor, "rank_weight_bytes", None)
        weights = sizes[0] if sizes else weight_bytes(runner.model)
        return memory_line(weights, kv_cache_bytes(getattr(runner, "kv_caches", None)))

    def _rank_weights_report(self) -> str:
        """Each rank's weights in memory, as each rank loaded them (quantized: as stored)."""
        sizes = getattr(self.executor, "rank_weight_bytes", None)
        if not sizes:
            return "weights per rank unknown"
        quantized = getattr(getattr(self.executor, "model", None), "quant_report", None)
        kind = f"{self.quantization}, as stored" if quantized else "float"
        return (f"weights per rank ({kind}) " + "/".join(f"{b / 1e6:.1f}" for b in sizes) + " MB")

    def _lora_report(self) -> str:
        lora = self.executor.runner.lora
        if lora is None:
            return ""
        lc = self.config.lora_config
        return (f"LoRA {lc.max_loras} slots of rank {lc.max_lora_rank} "
                f"({lora.slots.nbytes / 2**20:.0f} MiB{' on the driver' if self.num_ranks > 1 else ''}, kernel "
                f"{self.executor.runner.model.kernels.lora_name}), "
                f"{len(lora.adapters)} adapters loaded; ")

    def _gpu_report(self) -> str:
        name = torch.cuda.get_device_name(self.device)
        graphs = self.executor.runner.graphs
        eager = graphs is None or not graphs.capture
        line = f"device cuda ({name}); " + ("eager decode; " if eager else
                                             f"CUDA graphs at {len(graphs.sizes)} batch sizes up to "
                                             f"{graphs.sizes[-1]}; ")
        m = self.gpu_memory
        if m is not None:
            gib = 2**30
            line += (f"GPU memory {self.cache_config.gpu_memory_utilization:g} of "
                     f"{m.total / gib:.1f} GiB: weights {m.weights / gib:.2f}, activation peak "
                     f"{m.activation_peak / gib:.2f}, other {m.non_torch / gib:.2f} GiB; ")
        return line

    # -- requests ------------------------------------------------------------------------
    def add_request(self, r: EngineCoreRequest) -> None:
        """Queue a request. A frontend checked it already (`r.checked`); one from any other
        caller is checked here by the same input processor (ValueError naming the field).
        A refused request that was to pull remote KV releases the producer's lease at once."""
        try:
            if not r.checked:
                self.input_processor.process_core_request(r)
            self._add_request(r)
        except ValueError:
            p = r.sampling_params.kv_transfer_params
            if p is not None:
                self.kv_connector.request_refused(p)
            raise

    def _add_request(self, r: EngineCoreRequest) -> None:
        """Queue a checked request: only what the input processor made true is asserted."""
        n = len(r.prompt_token_ids)
        if r.lora_request is not None:  # loaded on first use (ValueError if it cannot be)
            self.add_lora(r.lora_request)
        if r.pooling_params is not None:  # an embedding: prefill only, nothing sampled
            assert 0 < n <= self.max_model_len
            pooling = r.pooling_params.resolved(self.config.model_config.pooler_config)
            req = Request(r.request_id, r.prompt_token_ids,
                          arrival_time=r.arrival_time or time.time(), priority=r.priority,
                          cache_salt=r.cache_salt, pooling_params=pooling,
                          lora_request=r.lora_request)
            self.scheduler.add_request(req)
            return
        params = r.sampling_params
        if params.max_tokens is None:  # as many as max_model_len leaves
            params = replace(params, max_tokens=self.max_model_len - n)
        assert 0 < n and n + params.max_tokens <= self.max_model_len, "checked at the input"
        if params.kv_transfer_params is not None:  # against this engine's cache and role
            self.kv_connector.check_request(r.prompt_token_ids, params)
        so = params.structured_outputs
        eos = r.eos_token_ids if r.eos_token_ids is not None else self.arch.eos_token_ids
        req = Request(r.request_id, r.prompt_token_ids, params, eos_token_id=eos,
                      arrival_time=r.arrival_time or time.time(), priority=r.priority,
                      cache_salt=r.cache_salt, lora_request=r.lora_request,
                      mm_features=list(r.mm_features or ()))
        if so is not None:
            req.structured_output = self.structured.request(so)  # compiles off the loop
        try:
            self.scheduler.add_request(req)
        except ValueError:
            if req.structured_output is not None:
                req.structured_output.close()
            raise
        self.kv_connector.request_queued(req)

    # -- LoRA adapters ---------------------------------------------------------------------
    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load, check and register an adapter (False: this id is registered already with this
        path). ValueError naming the problem, nothing loaded, if it cannot be served."""
        lora = self.executor.runner.lora
        if lora is None:
            raise ValueError(f"model {lora_request.lora_name!r} is a LoRA adapter: the engine "
                             f"serves adapters only with enable_lora (--enable-lora)")
        added = self.executor.add_lora(lora_request)  # on every rank
        if added:
            logger.info("kvflow: LoRA adapter %s (id %d, rank %d) from %s", lora_request.lora_name,
                        lora_request.lora_int_id, lora.adapters[lora_request.lora_int_id].rank,
                        lora_request.lora_path)
            cap = self.config.lora_config.max_cpu_loras
            if cap is not None:  # the new one counts as busy: its request is about to queue
                busy = {r.lora_int_id for r in self.scheduler.requests.values()
                        if r.lora_int_id and not r.is_finished} | {lora_request.lora_int_id}
                for lid in lora.trim(cap, busy):
                    self.executor.remove_lora(lid)  # the other ranks' parts too
                    logger.info("kvflow: LoRA adapter %d dropped from host memory "
                                "(max_cpu_loras %d)", lid, cap)
        return added

    def remove_lora(self, lora_int_id: int) -> bool:
        """Unregister an adapter (False: not registered); ValueError while requests use it."""
        lora = self.executor.runner.lora
        if lora is None:
            return False
        users = sum(1 for r in self.scheduler.requests.values()
                    if r.lora_int_id == lora_int_id and not r.is_finished)
        if users:
            raise ValueError(f"LoRA adapter {lora_int_id} is in use by {users} unfinished requests")
        return self.executor.remove_lora(lora_int_id)

    def list_loras(self) -> list[int]:
        lora = self.executor.runner.lora
        return sorted(lora.adapters) if lora is not None else []

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.abort_requests(request_ids)  # one pass, however many
        self.kv_connector.requests_aborted(self.scheduler)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._batch_queue)

    def reset_prefix_cache(self) -> bool:
        """Clear the prefix cache; refused (False) while requests are running."""
        done = self.scheduler.reset_prefix_cache()
        self.publish_kv_events()
        return done

    def publish_kv_events(self) -> None:
        """Hand the block events recorded since the last call to the publisher, as one batch
        (the publisher's thread sends it)."""
        if self.kv_event_publisher is None:
            return
        events = self.scheduler.kv_cache_manager.take_events()
        if events:
            medium = "GPU" if self._on_gpu else "CPU"
            self.kv_event_publisher.publish(KVEventBatch(time.time(), to_wire(events, medium)))

    # -- the loop ------------------------------------------------------------------------
    def step(self) -> EngineCoreOutputs:
        """One turn of the loop (_step), then its KV events out."""
        out = self._step()
        self.publish_kv_events()
        return out

    def _step(self) -> EngineCoreOutputs:
        """One turn of the loop: schedule a step and start it, then finish the oldest step in
        flight. With one step in flight at most (no pipeline) that is the step just started;
        under pipeline parallelism (vLLM's batch queue) up to `max_concurrent_batches` steps
        are in the pipeline, a new one is scheduled while the older ones run, and a step is
        finished only when the queue is full or nothing new could be scheduled."""
        queue = self._batch_queue
        started = None
        if len(queue) < self.executor.max_concurrent_batches:
            started = self._start_step()
            if not isinstance(started, _StartedStep):
                if not queue:
                    return started  # nothing ran (its stats only)
                started = None
            else:
                queue.append(started)
        if queue and (started is None or len(queue) >= self.executor.max_concurrent_batches):
            return self._finish_step(queue.popleft())
        return EngineCoreOutputs(scheduler_stats=self.stats(started.sched_out, 0.0))

    def _start_step(self):
        """Schedule and start a step: its _StartedStep, or the outputs of an empty one."""
        start = time.time()
        t0 = time.perf_counter()
        self.kv_connector.before_schedule(self.scheduler)
        sched_out = self.scheduler.schedule()
        if sched_out.kv_loads:
            self.kv_connector.after_schedule(self.scheduler, sched_out)
        if sched_out.is_empty:
            self.kv_connector.wait_idle(self.scheduler)
            return EngineCoreOutputs(scheduler_stats=self.stats(sched_out, 0.0))
        if sched_out.structured_output_request_ids:  # only steps with a constrained row pay
            ids = sched_out.structured_output_request_ids
            reqs = self.scheduler.requests
            # filled in the background while the forward runs; the sampler waits for it
            grammar = self.structured.grammar_bitmask(
                ids, [reqs[rid].structured_output for rid in ids],
                also_allowed=sched_out.structured_output_also_allowed,
                drafts=sched_out.scheduled_spec_decode_tokens)
            try:  # under pipeline parallelism the masks travel with the step to the last stage
                handle = (self.executor.execute_async(sched_out, grammar)
                          if self.executor.max_concurrent_batches > 1
                          else CompletedStep(self.executor.execute(sched_out, grammar)))
            finally:
                grammar.wait()  # no matcher advances while the fill may still read it
        elif self.executor.max_concurrent_batches > 1:
            handle = self.executor.execute_async(sched_out)  # returns while the pipeline works
        else:
            handle = CompletedStep(self.executor.execute(sched_out))
        return _StartedStep(sched_out, handle, start, t0)

    def _finish_step(self, started: "_StartedStep") -> EngineCoreOutputs:
        """Wait for a started step's tokens and apply them: stops, drafts, outputs."""
        sched_out, start, t0 = started.sched_out, started.start, started.t0
        runner_out = started.handle.result()
        updates = self.scheduler.update_from_output(sched_out, runner_out.sampled)
        if self.spec is not None:  # drafts for the next step, from this step's outcome
            self.scheduler.update_draft_token_ids(self.spec.propose(
                sched_out, updates, len(self.scheduler.running),
                self.scheduler.kv_cache_manager.get_block_ids))
        lent = self.kv_connector.after_update(self.scheduler) if self.scheduler.new_leases else {}
        outputs = []
        prompt_lps = runner_out.prompt_logprobs
        for u in updates:
            rid = u.request.request_id
            lp = runner_out.logprobs.get(rid)
            finish = u.finish_reason.value if u.finish_reason is not None else None
            outputs.append(EngineCoreOutput(
                rid, u.new_token_ids, lp[:len(u.new_token_ids)] if lp is not None else None, finish,
                u.request.stop_reason if finish else None,
                num_cached_tokens=max(u.request.num_cached_tokens, 0),
                first_scheduled_time=u.request.first_scheduled_time,
                kv_transfer_params=lent.get(rid), pooled=runner_out.pooled.get(rid),
                prompt_logprobs=prompt_lps.pop(rid, None) if prompt_lps else None))
        for rid, chunk in prompt_lps.items():  # a prompt chunk that sampled nothing yet
            if rid in self.scheduler.requests:
                outputs.append(EngineCoreOutput(rid, [], prompt_logprobs=chunk))
        step_time = time.perf_counter() - t0
        if self.trace:
            kv = self.scheduler.kv_cache_manager
            self.trace.record(sched_out, updates, start, step_time, kv.num_free_blocks,
                              kv.block_pool.num_cached_free_blocks,
                              self.kv_connector.take_trace_events())
        else:
            self.kv_connector.take_trace_events()  # nobody reads them
        return EngineCoreOutputs(outputs, self.stats(sched_out, step_time))

    def stats(self, sched_out: SchedulerOutput, step_time: float) -> SchedulerStats:
        """The queues and the pool now, and what `sched_out`'s step did (a pure read)."""
        s = self.scheduler
        kv = s.kv_cache_manager
        return SchedulerStats(
            num_running=len(s.running), num_waiting=len(s.waiting), kv_cache_usage=kv.usage,
            num_free_blocks=kv.num_free_blocks, num_total_blocks=kv.num_total_blocks,
            num_preemptions=sched_out.num_preemptions,
            num_prompt_tokens=sched_out.num_prefill_tokens,
            num_generation_tokens=sched_out.num_decode_tokens, step_time=step_time,
            prefix_cache_queries=kv.prefix_queries, prefix_cache_hits=kv.prefix_hits,
            spec_decode_num_drafts=s.spec_stats.num_drafts,
            spec_decode_num_draft_tokens=s.spec_stats.num_draft_tokens,
            spec_decode_num_accepted_tokens=s.spec_stats.num_accepted_tokens,
            kv_transfer=self.kv_connector.stats(s),
            num_encoder_tokens=sched_out.num_encoder_tokens)

    def check_health(self) -> None:
        """WorkerFailedError if a tensor-parallel worker has died (checked while idle, so that
        a server with no requests notices too); nothing to check in a single process."""
        self.executor.check_health()

    def shutdown(self) -> None:
        if self.kv_event_publisher is not None:
            self.kv_event_publisher.shutdown()
            self.kv_event_publisher = None
        self.structured.shutdown()
        self.kv_connector.shutdown()
        self.kv_connector = KVConnector()
        if self.trace:
            self.trace.close()
            self.trace = None
        self.executor.shutdown()
