"""The exact answer cache: a deterministic request already answered (by this node or another sharing
the store) is answered from the store, without the engine.

Deterministic means greedy, or sampled with an explicit seed: then the same model, prompt tokens and
settings give the same tokens. The key is a sha256 over the model's fingerprint, the prompt tokens and
every setting that can change the output (sampling, stop strings, logit bias, grammar, max_tokens); so
two servers of the same model and context share answers, and any other difference misses. Only whole
answers are kept: one that ended by itself or at its max_tokens, never one cancelled, failed, timed out
or cut by a full context.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import queue
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from reame.arca.client import StoreClient
from reame.engine import FinishEvent, SamplingParams, TokenEvent, Usage
from reame.engine.request import FINISH_LENGTH, FINISH_STOP

KEY_PREFIX = b"reame:answer:"


@dataclass(frozen=True)
class CachedAnswer:
    text: str
    finish_reason: str
    completion_tokens: int

    def finish(self, prompt_tokens: int) -> FinishEvent:
        """The answer's end as the engine would report it: every prompt token 'cached', no time spent."""
        return FinishEvent(self.finish_reason, Usage(prompt_tokens, self.completion_tokens, 0.0, 0.0,
                                                     cached_tokens=prompt_tokens))


class AnswerCache:
    def __init__(self, store: StoreClient, fingerprint: bytes, ttl_ms: int) -> None:
        self.store = store
        self.fingerprint = fingerprint
        self.ttl_ms = ttl_ms

    @staticmethod
    def deterministic(params: SamplingParams) -> bool:
        return params.temperature == 0 or params.seed is not None

    def key(self, prompt_tokens: Sequence[int], params: SamplingParams, shape: str) -> bytes:
        """`shape`: what else the server does with the text (chat or completion, tools offered)."""
        settings = dataclasses.asdict(params)
        settings["logit_bias"] = sorted(params.logit_bias.items())
        if params.temperature == 0:
            settings["seed"] = None  # greedy ignores it
        digest = hashlib.sha256(self.fingerprint)
        digest.update(json.dumps([list(prompt_tokens), settings, shape], sort_keys=True).encode())
        return KEY_PREFIX + digest.hexdigest().encode()

    def get(self, key: bytes) -> CachedAnswer | None:
        value = self.store.get(key)
        if value is None:
            return None
        try:
            stored = json.loads(value)
            return CachedAnswer(str(stored["text"]), str(stored["finish_reason"]), int(stored["completion_tokens"]))
        except (ValueError, KeyError, TypeError):
            return None  # not ours, or damaged: a miss

    def put(self, key: bytes, text: str, finish: FinishEvent) -> bool:
        """Keep a whole answer; False for one that is not (cancelled, failed, cut by the context)."""
        whole = finish.reason == FINISH_STOP or (finish.reason == FINISH_LENGTH and not finish.message)
        if not whole:
            return False
        value = json.dumps({"text": text, "finish_reason": finish.reason,
                            "completion_tokens": finish.usage.completion_tokens}).encode()
        return self.store.set(key, value, self.ttl_ms)


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
