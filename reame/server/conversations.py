"""Stored responses of OpenAI's Responses API, so that a request naming `previous_response_id` continues that
conversation: the messages up to and including the stored answer, kept per API key in RAM for a bounded
time and number. The KV of the conversation stays in the engine's slots and prefix cache on its own (the
continued prompt starts with the same tokens); only the messages are kept here. `store: false` keeps none.

What is kept is counted whole: the conversation and the response object (which echoes the request's
`tools`, `text`, `metadata`, `user`…) are kept as their JSON bytes, so the budget is the RAM they take (as
parsed objects, a 3 MiB body of empty objects took ~75 MiB). When the budget is full, the key that holds the
most gives up its oldest: one key storing in a loop evicts its own responses, never another key's.
"""

from __future__ import annotations

import collections
import json
import threading
import time
from dataclasses import dataclass
from typing import Any

KEEP_SECONDS = 3600.0
MAX_KEPT = 1000
MAX_KEPT_BYTES = 64 << 20  # all stored responses together, as JSON


@dataclass(frozen=True)
class Stored:
    owner: str
    messages_json: bytes  # the conversation, in chat messages, the stored answer last
    response_json: bytes  # the response object, for GET /v1/responses/{id}
    at: float

    @property
    def size(self) -> int:
        return len(self.messages_json) + len(self.response_json)

    @property
    def messages(self) -> list[dict[str, Any]]:
        return json.loads(self.messages_json)


class Conversations:
    """The stored responses, by key, least recently stored first. Thread-safe."""

    def __init__(self, keep_seconds: float = KEEP_SECONDS, max_kept: int = MAX_KEPT,
                 max_bytes: int = MAX_KEPT_BYTES) -> None:
        self.keep_seconds = keep_seconds
        self.max_kept = max_kept
        self.max_bytes = max_bytes
        self._kept: collections.OrderedDict[str, Stored] = collections.OrderedDict()  # oldest first
        self._by_owner: dict[str, collections.OrderedDict[str, None]] = {}  # each key's ids, oldest first
        self._owner_bytes: collections.Counter[str] = collections.Counter()
        self._bytes = 0
        self._lock = threading.Lock()

    def keep(self, owner: str, response_id: str, messages: list[dict[str, Any]], response: dict[str, Any]) -> None:
        stored = Stored(owner, compact(messages), compact(response), time.monotonic())
        if stored.size > self.max_bytes:
            return
        with self._lock:
            if response_id in self._kept:
                self._drop(response_id)
            self._kept[response_id] = stored
            self._by_owner.setdefault(owner, collections.OrderedDict())[response_id] = None
            self._owner_bytes[owner] += stored.size
            self._bytes += stored.size
            self._expire()
            while len(self._kept) > self.max_kept or self._bytes > self.max_bytes:
                self._drop(next(iter(self._by_owner[self._largest_owner()])))

    def find(self, owner: str, response_id: str) -> Stored | None:
        """The stored response of this key, if it has not expired (another key's is not found)."""
        with self._lock:
            self._expire()
            stored = self._kept.get(response_id)
            return stored if stored is not None and stored.owner == owner else None

    def forget(self, owner: str, response_id: str) -> bool:
        with self._lock:
            stored = self._kept.get(response_id)
            if stored is None or stored.owner != owner:
                return False
            self._drop(response_id)
            return True

    def _largest_owner(self) -> str:
        """The key holding the most (bytes, then responses): the one to give up its oldest."""
        return max(self._by_owner, key=lambda owner: (self._owner_bytes[owner], len(self._by_owner[owner])))

    def _expire(self) -> None:
        deadline = time.monotonic() - self.keep_seconds
        while self._kept and next(iter(self._kept.values())).at < deadline:
            self._drop(next(iter(self._kept)))

    def _drop(self, response_id: str) -> None:
        stored = self._kept.pop(response_id)
        ids = self._by_owner[stored.owner]
        del ids[response_id]
        if not ids:
            del self._by_owner[stored.owner]
        self._owner_bytes[stored.owner] -= stored.size
        if not self._owner_bytes[stored.owner]:
            del self._owner_bytes[stored.owner]
        self._bytes -= stored.size


def compact(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()
