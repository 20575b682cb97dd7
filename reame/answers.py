"""The exact answer cache: a deterministic request already answered (by this node, a one-shot prompt of
this machine, or another node sharing its store) is answered from the cache, without the engine.

Deterministic means greedy, or sampled with an explicit seed: then the same model, prompt tokens and
settings give the same tokens. The key is a sha256 over the model's fingerprint, the prompt tokens and
every setting that can change the output (sampling, stop strings, logit bias, grammar, max_tokens); so
two servers of the same model and context share answers, and any other difference misses. Only whole
answers are kept: one that ended by itself or at its max_tokens, never one cancelled, failed, timed out
or cut by a full context.

The cache looks in its tiers in order (RAM, this machine's disk, the shared store of `arca.remote`),
and an answer found in a later tier is copied into the earlier ones; an answer is kept in all of them.
Greedy decoding under speculation is exact only up to float rounding (a verification of several
tokens rounds differently from one token at a time), so without the cache two runs of one request may
differ after a near tie; with it, the first answer is the answer.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from reame.cache.answers import AnswerTier
from reame.engine import FinishEvent, SamplingParams, Usage
from reame.engine.request import FINISH_LENGTH, FINISH_STOP

if TYPE_CHECKING:
    from reame.arca.client import StoreCommands

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


class SharedAnswers:
    """The shared store as a tier: answers expire after `ttl_ms` (0: when the store evicts them)."""

    def __init__(self, store: StoreCommands, ttl_ms: int) -> None:
        self.store = store
        self.ttl_ms = ttl_ms

    def get(self, key: bytes) -> bytes | None:
        return self.store.get(key)

    def put(self, key: bytes, value: bytes) -> bool:
        return self.store.set(key, value, self.ttl_ms)


class AnswerCache:
    def __init__(self, tiers: Sequence[AnswerTier], fingerprint: bytes) -> None:
        """`tiers`: nearest first."""
        self.tiers = list(tiers)
        self.fingerprint = fingerprint

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
        for depth, tier in enumerate(self.tiers):
            value = tier.get(key)
            answer = decode(key, value) if value is not None else None
            if value is not None and answer is not None:
                for nearer in self.tiers[:depth]:
                    nearer.put(key, value)
                return answer
        return None

    def put(self, key: bytes, text: str, finish: FinishEvent) -> bool:
        """Keep a whole answer (True when some tier took it); False for one that is not whole (cancelled,
        failed, cut by the context)."""
        whole = finish.reason == FINISH_STOP or (finish.reason == FINISH_LENGTH and not finish.message)
        if not whole:
            return False
        value = json.dumps({"key": key.decode(), "text": text, "finish_reason": finish.reason,
                            "completion_tokens": finish.usage.completion_tokens}).encode()
        kept = [tier.put(key, value) for tier in self.tiers]
        return any(kept)


def decode(key: bytes, value: bytes) -> CachedAnswer | None:
    """The answer a tier returned, or None for a value that is not an answer to `key` (another
    program's, damaged, or a file copied under another name)."""
    try:
        stored = json.loads(value)
        if stored["key"] != key.decode() or stored["finish_reason"] not in (FINISH_STOP, FINISH_LENGTH):
            return None
        return CachedAnswer(str(stored["text"]), stored["finish_reason"], int(stored["completion_tokens"]))
    except (ValueError, KeyError, TypeError, RecursionError):
        return None
