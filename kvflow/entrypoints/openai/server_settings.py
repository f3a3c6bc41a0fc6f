"""The server's own options (a light module: the CLI reads it without loading the server)."""
from __future__ import annotations

from dataclasses import dataclass, field

from kvflow import envs
from kvflow.config import option, parse_memory
from kvflow.core.routing import POLICIES


@dataclass
class ServerSettings:
    """The server's own options: each `option` field is a `kvflow serve` flag (kvflow/options.py);
    `served_model_names` is resolved from the model options, `shutting_down` is state."""

    host: str = option("127.0.0.1", "bind address (0.0.0.0 to listen on all)")
    port: int = option(8000, "HTTP port")
    api_key: str | None = option(
        None, "require 'Authorization: Bearer KEY' (default: KVFLOW_API_KEY, else none)")
    max_waiting_requests: int | None = option(
        None, "answer 503 (retry later) when more requests than this would wait")
    max_body_size: int | str = option("8MiB", "largest request body (413 above)")
    access_log: bool = option(False, "log every HTTP request")
    engine_stall_timeout: float = option(
        30.0, "seconds without engine progress while requests are pending before /health "
              "turns 503, streams end with an error and the server exits (0: never)")
    enable_prompt_tokens_details: bool = option(
        False, "report usage.prompt_tokens_details.cached_tokens and per-request prefix-cache "
        "hits on the dashboard (off: they tell one tenant whether another's prompt is cached)")
    tool_call_parser: str | None = option(
        None, "read the model's own tool calls (tool_choice auto) in this format: hermes "
        "(<tool_call>{...}</tool_call>), llama3_json (a bare JSON object) or openai (gpt-oss's "
        "harmony messages to functions.NAME)",
        choices=("hermes", "llama3_json", "openai"))
    reasoning_parser: str | None = option(
        None, "split the reasoning into message.reasoning_content: qwen3 (<think>...</think>, "
        "only when the output begins with <think>), deepseek_r1 (the output begins in "
        "reasoning, up to </think>) or openai_gptoss (gpt-oss's harmony analysis channel)",
        choices=("qwen3", "deepseek_r1", "openai_gptoss"))
    lora_allowed_root: str | None = option(
        None, "the folder under which POST /v1/load_lora_adapter may load adapters (with "
        "KVFLOW_ALLOW_RUNTIME_LORA_UPDATING=1; without this option run-time loads are refused)")
    load_balance_method: str = option(
        "least_load", "with --data-parallel-size N: how a replica is chosen; least_load "
        "(fewest requests in flight, ties to the longest cached prefix), cache_aware (SGLang's "
        "policy), power_of_two or round_robin", choices=POLICIES)
    served_model_names: list[str] = field(default_factory=lambda: ["kvflow"])
    # the adapters given by --lora-modules (name, path), in order; the server adds its own later
    lora_modules: list[tuple[str, str]] = field(default_factory=list)
    shutting_down: bool = field(default=False)

    def __post_init__(self) -> None:
        self.max_body_size = parse_memory(self.max_body_size)
        if self.max_body_size <= 0:
            raise ValueError(f"max_body_size must be positive, got {self.max_body_size}")
        if self.max_waiting_requests is not None and self.max_waiting_requests < 0:
            raise ValueError(f"max_waiting_requests must be >= 0, got {self.max_waiting_requests}")
        if self.engine_stall_timeout < 0:
            raise ValueError(f"engine_stall_timeout must be >= 0, got {self.engine_stall_timeout}")
        if self.load_balance_method not in POLICIES:
            raise ValueError(f"load_balance_method must be one of {', '.join(POLICIES)}, got "
                             f"{self.load_balance_method!r}")
        if self.api_key is None:
            self.api_key = envs.KVFLOW_API_KEY or None
        clash = {name for name, _ in self.lora_modules} & set(self.served_model_names)
        if clash:
            raise ValueError(f"lora_modules: {', '.join(sorted(clash))} is the base model's served "
                             f"name; give the adapter another")

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]
