"""llama-server's per-request telemetry, as a request's body asks for it: `timings_per_token` (a `timings`
object on every streamed piece, not only on the last) and `return_progress` (streamed `prompt_progress`
records while the prompt is prefilled: one once the request has its slot, saying what it found cached, then
one per step that fed some of it). llama-server's own /completion, OpenAI's chat and completions and the
Responses API carry them as llama-server does; the web UI, llama.vim and scripts that show a prompt's
progress read them."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from reame.engine import ProgressEvent, Usage
from reame.server.validation import Fields


def timings(prompt_n: int, cache_n: int, prompt_s: float, predicted_n: int, predicted_s: float, drafted: int = 0,
            accepted: int = 0) -> dict[str, Any]:
    """llama-server's `timings` object."""
    prompt_ms, predicted_ms = prompt_s * 1000, predicted_s * 1000
    shaped: dict[str, Any] = {
        "cache_n": cache_n, "prompt_n": prompt_n, "prompt_ms": prompt_ms,
        "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n else 0.0,
        "prompt_per_second": 1000 * prompt_n / prompt_ms if prompt_ms > 0 else 0.0,
        # The first token comes out of the prompt's last batch: the rate is over the decode steps after it.
        "predicted_n": predicted_n, "predicted_ms": predicted_ms,
        "predicted_per_token_ms": predicted_ms / (predicted_n - 1) if predicted_n > 1 else 0.0,
        "predicted_per_second": 1000 * (predicted_n - 1) / predicted_ms if predicted_n > 1 and predicted_ms > 0
        else 0.0}
    if drafted:
        shaped["draft_n"], shaped["draft_n_accepted"] = drafted, accepted
    return shaped


def final_timings(usage: Usage, cached: int) -> dict[str, Any]:
    """The `timings` of a generation that ended (`cached`: its prompt tokens not computed)."""
    return timings(usage.prompt_tokens - cached, cached, usage.prompt_seconds, usage.completion_tokens,
                   usage.decode_seconds, usage.draft_tokens, usage.accepted_draft_tokens)


@dataclass
class Clock:
    """One choice's progress so far: its prompt's last progress, its first token's time, its tokens."""

    prompt: ProgressEvent | None = None
    first_token_at: float = 0.0
    predicted: int = 0


@dataclass
class Telemetry:
    """What a request asked to be told as it streams, and each choice's clock for it."""

    per_token: bool = False
    progress: bool = False
    clocks: dict[int, Clock] = field(default_factory=dict)

    @classmethod
    def asked(cls, fields: Fields) -> Telemetry:
        return cls(fields.boolean("timings_per_token", False), fields.boolean("return_progress", False))

    @property
    def watches_prefill(self) -> bool:
        """The engine says how the prefill goes (Asked.progress): progress records need it, and so do running
        timings (their prompt counts and time)."""
        return self.per_token or self.progress

    def progressed(self, tag: int, event: ProgressEvent) -> dict[str, Any] | None:
        """Note choice `tag`'s prefill progress; its `prompt_progress` object when the request asked for them."""
        self.clocks.setdefault(tag, Clock()).prompt = event
        if not self.progress:
            return None
        return {"total": event.total, "cache": event.cache, "processed": event.processed,
                "time_ms": event.seconds * 1000}

    def decoded(self, tag: int, predicted: int) -> None:
        """Choice `tag` has said `predicted` tokens so far."""
        clock = self.clocks.setdefault(tag, Clock())
        if not clock.first_token_at:
            clock.first_token_at = time.perf_counter()
        clock.predicted = predicted

    def running(self, tag: int) -> dict[str, Any] | None:
        """Choice `tag`'s `timings` so far, when the request asked for them on every piece (else None). Before
        any prompt token was computed, its prompt time is 0."""
        if not self.per_token:
            return None
        clock = self.clocks.get(tag, Clock())
        prompt = clock.prompt
        computed = prompt.processed - prompt.cache if prompt is not None else 0
        prompt_s = prompt.seconds if prompt is not None and computed else 0.0
        predicted_s = time.perf_counter() - clock.first_token_at if clock.first_token_at else 0.0
        return timings(computed, prompt.cache if prompt is not None else 0, prompt_s, clock.predicted,
                       predicted_s)
