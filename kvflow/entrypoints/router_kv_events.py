"""The router's view of its replicas' prefix caches, from their KV events.

`kvflow router --replicas A B --kv-events-endpoints tcp://hostA:5557 tcp://hostB:5557` (one
endpoint per worker, in order; each replica started with `--kv-events-config
'{"enable_kv_cache_events": true}'`) subscribes to every replica's events
(kvflow/engine/kv_events_subscriber.py) and keeps the block hashes each one holds
(kvflow/core/block_index.py). To score a completion or chat request it needs the prompt's token
ids, exactly as the replica will see them (chat template and all): it asks one replica's
`/tokenize` with the request's prompt or messages (the router loads no tokenizer), hashes the
ids as the engine does (block size learnt from the events, the request's `cache_salt`), and the
cache-aware policy routes by the longest run of leading blocks a replica holds. Where that is
not possible (no event yet, /tokenize failed, another endpoint, a prompt shorter than a block)
the request is routed by the text tree as without events. A request for a LoRA adapter is
hashed as the base model's prompt (the replica salts its blocks with the adapter's id, which the
router does not know), so it is scored by base-model blocks it cannot use."""
from __future__ import annotations

import httpx

from kvflow.core.kv_cache.block_pool import hash_token_blocks
from kvflow.engine.kv_events_subscriber import KVEventListeners, check_endpoint
from kvflow.request import block_salt_bytes

TOKENIZED = ("/v1/completions", "/v1/chat/completions")
TOKENIZE_TIMEOUT_S = 10.0
MAX_TOKENS = 2**20  # of a /tokenize answer


def tokenize_body(path: str, body: dict) -> dict | list[int] | None:
    """What to ask /tokenize for the prompt of `body` (or its token ids, where the client gave
    them); None where the prompt is not one text or one list of ids."""
    if path == "/v1/completions":
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch goes to one replica: route by its first prompt
        if isinstance(prompt, list):
            return prompt if all(type(t) is int for t in prompt) else None
        if not isinstance(prompt, str):
            return None
        return {"model": body.get("model"), "prompt": prompt,
                "add_special_tokens": body.get("add_special_tokens", True)}
    if path == "/v1/chat/completions" and isinstance(body.get("messages"), list):
        keys = ("model", "messages", "tools", "add_generation_prompt", "chat_template_kwargs")
        return {k: body[k] for k in keys if k in body}
    return None


class KVEventRouting(KVEventListeners):
    """The index, one listener per worker that has an events endpoint, and the hashing."""

    async def block_hashes(self, client: httpx.AsyncClient, tokenizer_url: str, path: str,
                           body: dict, headers: dict) -> list[bytes] | None:
        """The prompt's block hashes as the replicas' prefix caches name them, or None."""
        bs = self.index.block_size
        if bs is None or path not in TOKENIZED:
            return None
        ask = tokenize_body(path, body)
        if ask is None:
            return None
        if isinstance(ask, list):
            ids = ask
        else:
            try:
                r = await client.post(tokenizer_url + "/tokenize", json=ask, headers=headers,
                                      timeout=TOKENIZE_TIMEOUT_S)
                ids = r.json().get("tokens") if r.status_code == 200 else None
            except (httpx.HTTPError, ValueError, AttributeError):
                return None
        if (not isinstance(ids, list) or len(ids) > MAX_TOKENS
                or not all(type(t) is int for t in ids)):
            return None
        salt = body.get("cache_salt")
        try:
            return hash_token_blocks(ids, bs, block_salt_bytes(
                salt if isinstance(salt, str) else None)) or None
        except OverflowError:  # an id past int64: no engine took it either
            return None


__all__ = ["KVEventRouting", "check_endpoint", "tokenize_body"]
