"""The server's LoRA adapters (docs/lora.md): which `model` names are adapters, listed by
/v1/models with the base model as `parent`, and vLLM's runtime endpoints
`POST /v1/load_lora_adapter` / `POST /v1/unload_lora_adapter` (on only with
KVFLOW_ALLOW_RUNTIME_LORA_UPDATING=1, and loading only from under --lora-allowed-root)."""
from __future__ import annotations

import asyncio
import contextlib
import os

from pydantic import BaseModel, ConfigDict

from kvflow.entrypoints.openai.errors import APIError
from kvflow.lora_request import MAX_LORA_NAME_CHARS, MAX_LORA_PATH_CHARS, LoRARequest


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_path: str
    load_inplace: bool = False


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_int_id: int | None = None


class LoRAAdapters:
    """name -> LoRARequest of every adapter this server serves; ids are never reused, so a
    reloaded name never meets the prefix-cache blocks of what it was before."""

    def __init__(self, modules: list[tuple[str, str]], base_names: list[str],
                 allowed_root: str | None) -> None:
        # the engine core registers the start-up modules with ids 1..n in this order
        self.adapters = {name: LoRARequest(name, i, path) for i, (name, path) in enumerate(modules, 1)}
        self.base_names = base_names
        self.allowed_root = os.path.realpath(allowed_root) if allowed_root else None
        self.next_id = len(modules) + 1
        self.lock = asyncio.Lock()  # one load or unload at a time: names stay unique
        # lora_int_id -> requests of this server between their check and their end. The core
        # counts only the requests it holds; one still tokenizing is counted here, so that an
        # unload (and a reload of the name) cannot slip in before it reaches the core, which
        # would load the old adapter again under its old id, unlisted and never unloaded
        self.in_flight: dict[int, int] = {}

    def resolve(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names (None: the base model); 404 for neither."""
        if model is None or model in self.base_names:
            return None
        lr = self.adapters.get(model)
        if lr is None:
            served = self.base_names + list(self.adapters)
            raise APIError(404, f"The model `{model}` does not exist; this server serves "
                                f"{', '.join(repr(m) for m in served)}.",
                           param="model", code="model_not_found")
        return lr

    @contextlib.contextmanager
    def in_use(self, lr: LoRARequest | None):
        """Hold the adapter a request was checked against for the request's lifetime (the
        base model: nothing to hold). 404 if it was unloaded (or its name reloaded as another
        adapter) since the check."""
        if lr is None:
            yield
            return
        if self.adapters.get(lr.lora_name) is not lr:
            raise APIError(404, f"The lora adapter '{lr.lora_name}' was unloaded while the "
                                f"request was being prepared.", param="model",
                           code="model_not_found")
        self.in_flight[lr.lora_int_id] = self.in_flight.get(lr.lora_int_id, 0) + 1
        try:
            yield
        finally:
            left = self.in_flight.pop(lr.lora_int_id) - 1
            if left:
                self.in_flight[lr.lora_int_id] = left

    def model_cards(self, created: int) -> list[dict]:
        parent = self.base_names[0]
        return [{"id": name, "object": "model", "created": created, "owned_by": "kvflow",
                 "root": lr.lora_path, "parent": parent} for name, lr in self.adapters.items()]

    def _check_name(self, name: str) -> None:
        if not 0 < len(name) <= MAX_LORA_NAME_CHARS or not name.isprintable():
            raise APIError(400, f"lora_name must be 1 to {MAX_LORA_NAME_CHARS} printable characters",
                           param="lora_name", code="invalid_value")

    def _check_path(self, path: str) -> str:
        if self.allowed_root is None:
            raise APIError(400, "loading adapters at run time needs --lora-allowed-root (the "
                                "folder that adapters may be loaded from)",
                           param="lora_path", code="invalid_value")
        if not 0 < len(path) <= MAX_LORA_PATH_CHARS or "\x00" in path:
            raise APIError(400, "lora_path must be a path", param="lora_path", code="invalid_value")
        real = os.path.realpath(path)
        if os.path.commonpath([real, self.allowed_root]) != self.allowed_root:
            raise APIError(400, "lora_path is outside --lora-allowed-root", param="lora_path",
                           code="invalid_value")
        return real

    async def load(self, engine, req: LoadLoRAAdapterRequest) -> str:
        self._check_name(req.lora_name)
        if req.load_inplace:
            raise APIError(400, "load_inplace is not supported: unload the adapter, then load it",
                           param="load_inplace", code="invalid_value")
        path = self._check_path(req.lora_path)
        async with self.lock:
            if req.lora_name in self.adapters or req.lora_name in self.base_names:
                raise APIError(400, f"The lora adapter '{req.lora_name}' has already been loaded.",
                               param="lora_name", code="invalid_value")
            lr = LoRARequest(req.lora_name, self.next_id, path)
            try:
                await engine.add_lora(lr)
            except ValueError as e:
                raise APIError(400, str(e), param="lora_path", code="invalid_value") from None
            self.next_id += 1
            self.adapters[req.lora_name] = lr
        return f"Success: LoRA adapter '{req.lora_name}' added successfully."

    async def unload(self, engine, req: UnloadLoRAAdapterRequest) -> str:
        async with self.lock:
            lr = self.adapters.get(req.lora_name)
            if lr is None:
                raise APIError(404, f"The lora adapter '{req.lora_name}' cannot be found.",
                               param="lora_name", code="model_not_found")
            users = self.in_flight.get(lr.lora_int_id, 0)
            if users:
                raise APIError(400, f"LoRA adapter '{req.lora_name}' is in use by {users} "
                                    f"unfinished requests", param="lora_name", code="invalid_value")
            # gone for new requests at once: none may reach the core after the removal
            del self.adapters[req.lora_name]
            try:
                await engine.remove_lora(lr)
            except ValueError as e:
                self.adapters[req.lora_name] = lr  # the core refused: still served
                raise APIError(400, str(e), param="lora_name", code="invalid_value") from None
        return f"Success: LoRA adapter '{req.lora_name}' removed successfully."
