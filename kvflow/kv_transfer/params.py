"""KVTransferParams: vLLM's `kv_transfer_params` request and response field, as one plain
dataclass that rides inside SamplingParams to the engine core. No torch, no sockets."""
from __future__ import annotations

from dataclasses import dataclass

MAX_REMOTE_BLOCKS = 1 << 20  # far past any pool; bounds what a client may make the core read
MAX_ID_CHARS = 256


@dataclass
class KVTransferParams:
    """To a prefill instance: `do_remote_decode=True` (compute the prompt, lend its blocks).
    From it, and then to a decode instance: `do_remote_prefill=True` and where the blocks are
    (engine id, host, port, block ids, token count, block size), the KV layout's compatibility
    hash and fields, and the transfer id that names the lease."""

    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    remote_engine_id: str | None = None
    remote_host: str | None = None
    remote_port: int | None = None
    remote_block_ids: list[int] | None = None
    remote_num_tokens: int | None = None
    remote_block_size: int | None = None
    remote_host_id: str | None = None  # same value on both sides: shared memory is possible
    transfer_id: str | None = None
    compat_hash: str | None = None
    compat: dict[str, str | int] | None = None

    def __post_init__(self) -> None:
        if self.do_remote_decode and self.do_remote_prefill:
            raise ValueError("kv_transfer_params: do_remote_decode and do_remote_prefill "
                             "exclude each other")
        if not self.do_remote_prefill:
            return
        missing = [n for n in ("remote_engine_id", "remote_host", "remote_port",
                               "remote_block_ids", "remote_num_tokens", "remote_block_size",
                               "transfer_id", "compat_hash", "compat") if getattr(self, n) is None]
        if missing:
            raise ValueError(f"kv_transfer_params: do_remote_prefill needs {', '.join(missing)}")
        for n in ("remote_engine_id", "remote_host", "transfer_id", "compat_hash",
                  "remote_host_id"):
            v = getattr(self, n)
            if v is not None and (not isinstance(v, str) or not 0 < len(v) <= MAX_ID_CHARS):
                raise ValueError(f"kv_transfer_params.{n} must be a string of 1..{MAX_ID_CHARS} "
                                 "characters")
        if not _int(self.remote_port) or not 0 < self.remote_port < 65536:
            raise ValueError("kv_transfer_params.remote_port must be in 1..65535")
        if not _int(self.remote_num_tokens) or self.remote_num_tokens < 1:
            raise ValueError("kv_transfer_params.remote_num_tokens must be a positive integer")
        if not _int(self.remote_block_size) or not 0 < self.remote_block_size <= 4096:
            raise ValueError("kv_transfer_params.remote_block_size must be in 1..4096")
        ids = self.remote_block_ids
        if not isinstance(ids, list) or len(ids) > MAX_REMOTE_BLOCKS or not all(
                _int(b) and 0 <= b < MAX_REMOTE_BLOCKS for b in ids):
            raise ValueError("kv_transfer_params.remote_block_ids must be a list of block ids "
                             f"in [0, {MAX_REMOTE_BLOCKS})")
        need = -(-self.remote_num_tokens // self.remote_block_size)
        if len(ids) != need:
            raise ValueError(f"kv_transfer_params: {self.remote_num_tokens} tokens in blocks of "
                             f"{self.remote_block_size} take {need} blocks, remote_block_ids "
                             f"has {len(ids)}")
        if not isinstance(self.compat, dict) or len(self.compat) > 32:
            raise ValueError("kv_transfer_params.compat must be an object of at most 32 fields")


def check_role(config, p: KVTransferParams) -> None:
    """ValueError if an engine with this KVTransferConfig (None: none) cannot take a request
    carrying `p`: lending needs a producer, pulling a consumer."""
    if p.do_remote_decode and (config is None or not config.is_producer):
        raise ValueError("kv_transfer_params.do_remote_decode: this instance lends no KV "
                         "blocks (start it with --kv-transfer-config '{\"kv_role\": "
                         "\"kv_producer\"}' or kv_both)")
    if p.do_remote_prefill and (config is None or not config.is_consumer):
        raise ValueError("kv_transfer_params.do_remote_prefill: this instance pulls no KV "
                         "blocks (start it with --kv-transfer-config '{\"kv_role\": "
                         "\"kv_consumer\"}' or kv_both)")


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def compat_mismatch(local: dict, remote: dict) -> str | None:
    """The fields on which two KV layouts differ, as a sentence; None when they agree."""
    diffs = [f"{k} {remote.get(k)!r} there, {local.get(k)!r} here"
             for k in sorted(set(local) | set(remote)) if local.get(k) != remote.get(k)]
    return "; ".join(diffs) if diffs else None
