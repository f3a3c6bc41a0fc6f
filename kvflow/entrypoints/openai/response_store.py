"""Stored responses (`store: true`, the default): what `GET /v1/responses/{id}` returns and what
`previous_response_id` continues from. Kept in memory, least recently used first out, bounded
by count and by bytes; a server restart forgets them."""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import msgspec

MAX_STORED_RESPONSES = 1024
MAX_STORED_BYTES = 64 * 2**20


@dataclass(slots=True)
class StoredResponse:
    response: dict  # the Response object, as sent
    history: list[dict]  # the conversation after it, chat messages, without instructions
    input_items: list[dict] = field(default_factory=list)  # this turn's input, each with an id
    size: int = 0


class ResponseStore:
    def __init__(self, max_items: int = MAX_STORED_RESPONSES,
                 max_bytes: int = MAX_STORED_BYTES) -> None:
        self.max_items, self.max_bytes = max_items, max_bytes
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._items)

    def put(self, response: dict, history: list[dict], input_items: list[dict] = ()) -> None:
        """Keep `response`; one too big for the whole store is not kept."""
        entry = StoredResponse(response, history, list(input_items))
        entry.size = sum(len(msgspec.json.encode(x)) for x in (response, history, entry.input_items))
        self.delete(response["id"])
        if entry.size > self.max_bytes:
            return
        self._items[response["id"]] = entry
        self.bytes += entry.size
        while len(self._items) > self.max_items or self.bytes > self.max_bytes:
            _, old = self._items.popitem(last=False)
            self.bytes -= old.size

    def get(self, response_id: str) -> StoredResponse | None:
        entry = self._items.get(response_id)
        if entry is not None:
            self._items.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        entry = self._items.pop(response_id, None)
        if entry is None:
            return False
        self.bytes -= entry.size
        return True
