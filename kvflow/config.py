"""Engine configuration: plain dataclasses validated once on construction."""
from __future__ import annotations

from dataclasses import dataclass, field
from kvflow import envs


def parse_memory(value: int | float | str) -> int:
    """Parse '4GiB', '512MiB', '2GB', '1.5g' or a plain byte count into bytes."""
    if isinstance(value, (int, float)):
        return int(value)
    text = value.strip().lower().replace(" ", "")
    units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
             "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
             "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40, "b": 1}
    for suffix, mult in units.items():
        if text.endswith(suffix):
            return int(float(text[: -len(suffix)]) * mult)
    return int(float(text))


def dtype_name(value: str, option: str) -> str:
    """auto | bfloat16 | float32 (bf16 and fp32 accepted); ValueError naming `option` otherwise."""
    if value not in ("auto", "bfloat16", "bf16", "float32", "fp32"):
        raise ValueError(f"{option} must be auto, bfloat16 or float32, got {value!r}")
    return {"bf16": "bfloat16", "fp32": "float32"}.get(value, value)


@dataclass
class ModelConfig:
    """Which weights to load and how. `model=None` means the default SmolLM2-135M-Instruct."""

    model: str | None = None
    dtype: str = "auto"  # auto | bfloat16 | float32
    max_model_len: int | None = None  # None: the model's own context length
    seed: int = 0
    tokenizer: str | None = None
    served_model_name: str | None = None

    def __post_init__(self) -> None:
        self.dtype = dtype_name(self.dtype, "dtype")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")


@dataclass
class CacheConfig:
    """Paged KV cache: blocks of `block_size` tokens; the pool is sized from `kv_cache_memory`
    (capped by free RAM) unless `num_blocks` is given."""

    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_memory: int | str = "4GiB"
    enable_prefix_caching: bool = True
    # auto: the model's dtype; bfloat16 halves the cache (and what decode attention reads) for
    # an fp32 model at a small cost in accuracy
    cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        self.cache_dtype = dtype_name(self.cache_dtype, "kv_cache_dtype")
        if self.block_size <= 0 or self.block_size % 2:
            # the cache tiles pair keys (kvflow/model/kv_layout.py)
            raise ValueError(f"block_size must be positive and even, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {self.num_blocks}")
        self.kv_cache_memory = parse_memory(self.kv_cache_memory)
        if self.kv_cache_memory <= 0:
            raise ValueError("kv_cache_memory must be positive")


@dataclass
class SchedulerConfig:
    """Per-step limits: token budget, concurrent sequences, context length."""

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    max_model_len: int = 8192
    # a prefill takes at most this many tokens per step (0: no cap), so long prompts can't starve
    long_prefill_token_threshold: int = 0
    # a waiting request that lacks blocks may be passed over this many steps, then it goes first
    max_admission_skips: int = 16
    policy: str = "fcfs"  # fcfs | priority (lower `priority` value first, then arrival)

    def __post_init__(self) -> None:
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling policy must be fcfs or priority, got {self.policy!r}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be >= 0")
        if self.max_num_batched_tokens <= 0:
            raise ValueError(f"max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}")
        if self.max_num_seqs <= 0:
            raise ValueError(f"max_num_seqs must be positive, got {self.max_num_seqs}")
        if self.max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")


def parse_init_method(init_method: str) -> tuple[str, int]:
    """'tcp://HOST:PORT' -> (HOST, PORT); the form torch.distributed documents."""
    host, sep, port = init_method.removeprefix("tcp://").rpartition(":")
    if not init_method.startswith("tcp://") or not sep or not host.strip("[]") or not port.isdigit():
        raise ValueError(f"distributed init method must look like tcp://HOST:PORT, got {init_method!r}")
    return host.strip("[]"), int(port)


@dataclass
class ParallelConfig:
    """Tensor parallelism: `tensor_parallel_size` ranks spread evenly over `nnodes` machines,
    this one being `node_rank` (0 runs the engine). The ranks meet at `distributed_init_method`
    (tcp://HOST:PORT of node 0; None: a free loopback port, for a single machine)."""

    tensor_parallel_size: int = 1
    distributed_init_method: str | None = None
    nnodes: int = 1
    node_rank: int = 0

    def __post_init__(self) -> None:
        tp, nnodes = self.tensor_parallel_size, self.nnodes
        if tp < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {tp}")
        if nnodes < 1:
            raise ValueError(f"nnodes must be >= 1, got {nnodes}")
        if not 0 <= self.node_rank < nnodes:
            raise ValueError(f"node_rank must be in 0..{nnodes - 1} (nnodes is {nnodes}), "
                             f"got {self.node_rank}")
        if tp % nnodes:
            raise ValueError(f"tensor_parallel_size {tp} must be a multiple of nnodes {nnodes} "
                             "(every node runs the same number of ranks)")
        if self.distributed_init_method is not None:
            parse_init_method(self.distributed_init_method)
        elif nnodes > 1:
            raise ValueError("several nodes need --distributed-init-method tcp://HOST:PORT, an "
                             "address of node 0 that every node can reach")


def default_num_threads() -> int:
    """Compute threads for torch: KVFLOW_NUM_THREADS, else 1 (measured fastest on 2 cores:
    the second core is left for the engine's own CPU work and OpenMP never spin-waits)."""
    return envs.KVFLOW_NUM_THREADS or 1


@dataclass
class EngineConfig:
    model_config: ModelConfig = field(default_factory=ModelConfig)
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    num_threads: int = field(default_factory=default_num_threads)
    trace: str | None = None  # path of a JSONL step trace
    warmup: bool = True  # run a few throw-away steps at start-up (kvflow/engine/warmup.py)


def engine_config(model: str | None = None, dtype: str = "auto", max_model_len: int | None = None,
                  max_num_seqs: int = 128, max_num_batched_tokens: int = 2048, block_size: int = 16,
                  num_blocks: int | None = None, kv_cache_memory: int | str = "4GiB", seed: int = 0,
                  trace: str | None = None, num_threads: int | None = None,
                  enable_prefix_caching: bool = True, kv_cache_dtype: str = "auto",
                  long_prefill_token_threshold: int = 0,
                  scheduling_policy: str = "fcfs", tensor_parallel_size: int = 1,
                  distributed_init_method: str | None = None, nnodes: int = 1,
                  node_rank: int = 0) -> EngineConfig:
    """The EngineConfig of the flat engine options that `LLM(...)` and the CLI share (the CLI's
    flags carry the same names); an unknown option is a TypeError, never silently dropped."""
    return EngineConfig(
        model_config=ModelConfig(model=model, dtype=dtype, max_model_len=max_model_len, seed=seed),
        cache_config=CacheConfig(block_size=block_size, num_blocks=num_blocks,
                                 kv_cache_memory=kv_cache_memory,
                                 enable_prefix_caching=enable_prefix_caching,
                                 cache_dtype=kv_cache_dtype),
        scheduler_config=SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens,
                                         max_num_seqs=max_num_seqs,
                                         long_prefill_token_threshold=long_prefill_token_threshold,
                                         policy=scheduling_policy),
        parallel_config=ParallelConfig(tensor_parallel_size=tensor_parallel_size,
                                       distributed_init_method=distributed_init_method,
                                       nnodes=nnodes, node_rank=node_rank),
        num_threads=num_threads or default_num_threads(),
        trace=trace)
