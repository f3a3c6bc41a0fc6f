"""LoRARequest: which fine-tune (a PEFT LoRA adapter) a request runs under, vLLM's type and
field names. A plain dataclass: it rides with the request from the frontend to the engine core."""
from __future__ import annotations

from dataclasses import dataclass

MAX_LORA_NAME_CHARS = 256
MAX_LORA_PATH_CHARS = 4096


@dataclass(frozen=True)
class LoRARequest:
    """`lora_name` names the adapter (the OpenAI `model` a client passes), `lora_int_id` is
    its engine-wide id (positive; requests with the same id share its slot and their prefix
    cache blocks), `lora_path` the folder with `adapter_config.json` and
    `adapter_model.safetensors`."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be a positive integer, got {self.lora_int_id!r}")
        if not isinstance(self.lora_name, str) or not 0 < len(self.lora_name) <= MAX_LORA_NAME_CHARS:
            raise ValueError(f"lora_name must be 1 to {MAX_LORA_NAME_CHARS} characters")
        if not isinstance(self.lora_path, str) or len(self.lora_path) > MAX_LORA_PATH_CHARS:
            raise ValueError(f"lora_path must be a string of at most {MAX_LORA_PATH_CHARS} characters")
