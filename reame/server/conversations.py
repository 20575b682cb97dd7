"""Stored responses of OpenAI's Responses API, so that a request naming `previous_response_id` continues that
conversation: the messages up to and including the stored answer, kept per API key in RAM for a bounded
time and number. The KV of the conversation stays in the engine's slots and prefix cache on its own (the
continued prompt starts with the same tokens); only the messages are kept here. `store: false` keeps none.
"""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass
from typing import Any

KEEP_SECONDS = 3600.0
MAX_KEPT = 1000
MAX_KEPT_CHARACTERS = 64 << 20  # all stored conversations' text together


@dataclass(frozen=True)
class Stored:
    owner: str
    messages: list[dict[str, Any]]  # the conversation, in chat messages, the stored answer last
    response: dict[str, Any]  # the response object, for GET /v1/responses/{id}
    at: float
    characters: int


class Conversations:
    """The stored responses, least recently stored first. Thread-safe."""

    def __init__(self, keep_seconds: float = KEEP_SECONDS, max_kept: int = MAX_KEPT,
                 max_characters: int = MAX_KEPT_CHARACTERS) -> None:
        self.keep_seconds = keep_seconds
        self.max_kept = max_kept
        self.max_characters = max_characters
        self._kept: collections.OrderedDict[str, Stored] = collections.OrderedDict()
        self._characters = 0
        self._lock = threading.Lock()

    def keep(self, owner: str, response_id: str, messages: list[dict[str, Any]], response: dict[str, Any]) -> None:
        characters = sum(len(str(message.get("content") or "")) + len(str(message.get("tool_calls") or ""))
                         for message in messages)
        if characters > self.max_characters:
            return
        with self._lock:
            self._kept[response_id] = Stored(owner, messages, response, time.monotonic(), characters)
            self._characters += characters
            self._expire()
            while len(self._kept) > self.max_kept or self._characters > self.max_characters:
                self._drop(next(iter(self._kept)))

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

    def _expire(self) -> None:
        deadline = time.monotonic() - self.keep_seconds
        while self._kept and next(iter(self._kept.values())).at < deadline:
            self._drop(next(iter(self._kept)))

    def _drop(self, response_id: str) -> None:
        self._characters -= self._kept.pop(response_id).characters
