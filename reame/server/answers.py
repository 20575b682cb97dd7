"""The exact answer cache as the server uses it (reame/answers.py): an answer served from it in place of
the engine's handle, and the tap that hands a computed answer to the cache when it ends."""

from __future__ import annotations

import queue
from collections.abc import Callable

from reame.engine import FinishEvent, TokenEvent


class StoredAnswer:
    """Stands where the engine's handle would for an answer served from the store: nothing to cancel."""

    def __init__(self, prompt_tokens: list[int]) -> None:
        self.prompt_tokens = prompt_tokens
        self.finish: FinishEvent | None = None

    def cancel(self) -> None:
        pass

    def delivered(self) -> None:
        pass


class AnswerTap:
    """A request's event queue, read by the handler as usual, that hands the whole answer to `keep` when
    it ends (the raw generated text: before tool-call parsing, without an echoed prompt)."""

    def __init__(self, events: queue.SimpleQueue, keep: Callable[[str, FinishEvent], None]) -> None:
        self.events = events
        self.keep = keep
        self.pieces: list[str] = []

    def get(self, block: bool = True, timeout: float | None = None) -> tuple[int, TokenEvent | FinishEvent]:
        tag, event = self.events.get(block, timeout)
        self.pieces.append(event.text)  # a finish carries the text held back until the end
        if isinstance(event, FinishEvent):
            self.keep("".join(self.pieces), event)
        return tag, event
