"""A person's request stops a decode that carries only background rows (a batch's lines).

A step of a batch line's prompt takes up to a second on a 2-core box, and a chat arriving meanwhile waited for
it before its own prefill could start (the plan already keeps background rows out of a step that prefills a
foreground prompt, step.plan_step). Now that step is interrupted instead: ggml stops within one graph node
(Backend.interrupt), the KV keeps nothing of the batch, the engine thread takes the chat, and the line's rows
are computed again in a later step. The batch loses part of one step; the person waits for none.

Callers' threads say a foreground generation arrived (`arrived`), the engine thread says when it took it from
its inbox (`taken`) and runs every background-only decode inside `background_decode`. One lock orders the two
sides, so an arrival is never missed between the engine's last look at its inbox and the decode's start.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from reame.model.backend import Backend


class BackgroundInterruption:
    """Whether foreground generations wait in the inbox, and the backend's stop flag while a background decode
    runs (the flag is clear at every other time: a foreground decode is never stopped)."""

    def __init__(self, backend: Backend) -> None:
        self._backend = backend
        self._lock = threading.Lock()
        self._arrived = 0  # foreground generations submitted and not yet taken by the engine thread
        self._running = False  # a decode of background rows only is in progress

    def arrived(self, generations: int) -> None:
        """Foreground generations were put in the engine's inbox (a caller's thread)."""
        if not generations:
            return
        with self._lock:
            self._arrived += generations
            if self._running:
                self._backend.interrupt(True)

    def taken(self, generations: int) -> None:
        """The engine thread took foreground generations from its inbox."""
        with self._lock:
            self._arrived -= generations

    @contextmanager
    def background_decode(self) -> Iterator[None]:
        """Around a decode of background rows only: stopped at once if a foreground generation is waiting
        already, or as soon as one arrives."""
        with self._lock:
            self._running = True
            self._backend.interrupt(self._arrived > 0)
        try:
            yield
        finally:
            with self._lock:
                self._running = False
                self._backend.interrupt(False)
