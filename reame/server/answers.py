"""The exact answer cache as the server uses it (reame/answers.py): an answer served from it in place of
the engine's handle (replayed as the token-sized pieces a generation streams), and the tap that hands a
computed answer to the cache when it ends."""

from __future__ import annotations

import queue
from collections.abc import Callable

from reame.engine import FinishEvent, TokenEvent
from reame.engine.textstream import TextStream
from reame.model.backend import Backend


class StoredAnswer:
    """Stands where the engine's handle would for an answer served from the store: nothing to cancel."""

    def __init__(self, prompt_tokens: list[int]) -> None:
        self.prompt_tokens = prompt_tokens
        self.finish: FinishEvent | None = None

    def cancel(self) -> None:
        pass

    def delivered(self) -> None:
        pass


def replayed(text: str, backend: Backend) -> list[TokenEvent]:
    """A kept answer as the events a generation of it streams: one per token, each with the text that
    token completes (a character split across tokens arrives whole, as the engine sends it). Clients and
    the thinking and tool-call parsers then see a kept answer arrive as a computed one does. A text that
    does not tokenize back to itself (a tokenizer that adds a leading space, say) arrives as one piece."""
    tokens = backend.tokenize(text, add_special=False, parse_special=False)
    stream = TextStream()
    events = [TokenEvent(token, stream.push(backend.token_piece(token))) for token in tokens]
    events.append(TokenEvent(-1, stream.flush()))
    if "".join(event.text for event in events) != text:
        return [TokenEvent(-1, text)]
    return [event for event in events if event.text]


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
