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
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from reame.cache.answers import AnswerTier, DiskAnswers, RamAnswers
from reame.model.sampling import SamplingParams

if TYPE_CHECKING:  # the engine is not imported: a one-shot answered from here never loads it
    from reame.arca.client import StoreCommands
    from reame.engine import FinishEvent
    from reame.settings import Settings

log = logging.getLogger("reame")
# A whole answer's ends (reame/engine/request.py's FINISH_STOP and FINISH_LENGTH).
FINISH_STOP, FINISH_LENGTH = "stop", "length"

KEY_PREFIX = b"reame:answer:"
PROMPT_PREFIX = b"reame:prompt:"


@dataclass(frozen=True)
class CachedAnswer:
    text: str
    finish_reason: str
    completion_tokens: int

    def finish(self, prompt_tokens: int) -> FinishEvent:
        """The answer's end as the engine would report it: every prompt token 'cached', no time spent."""
        from reame.engine import FinishEvent, Usage
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
        return KEY_PREFIX + self._digest(list(prompt_tokens), params, shape)

    def prompt_key(self, described: Mapping[str, object], params: SamplingParams) -> bytes:
        """A one-shot prompt's name: its text and everything else that decides its tokens (`described`:
        system message, chat template setting, Reame's version), so that a repeated one-shot finds its
        answer before the model is loaded to tokenize it (`by_prompt`)."""
        return PROMPT_PREFIX + self._digest(dict(described), params, "one-shot")

    def _digest(self, prompt: object, params: SamplingParams, shape: str) -> bytes:
        settings = dataclasses.asdict(params)
        settings["logit_bias"] = sorted(params.logit_bias.items())
        if params.temperature == 0:
            settings["seed"] = None  # greedy ignores it
        digest = hashlib.sha256(self.fingerprint)
        digest.update(json.dumps([prompt, settings, shape], sort_keys=True).encode())
        return digest.hexdigest().encode()

    def name_prompt(self, named: bytes, key: bytes, dated: bool) -> None:
        """Keep that the prompt `named` (prompt_key) has the answer `key`; `dated`: its chat template reads
        the clock (strftime_now), so the name holds only today."""
        value = json.dumps({"named": named.decode(), "key": key.decode(),
                            "day": time.strftime("%Y-%m-%d") if dated else None}).encode()
        for tier in self.tiers:
            tier.put(named, value)

    def by_prompt(self, named: bytes) -> CachedAnswer | None:
        """The answer kept for the prompt `named`, or None (never named, named on another day by a template
        that reads the clock, or the answer itself is gone)."""
        for tier in self.tiers:
            value = tier.get(named)
            key = named_key(named, value) if value is not None else None
            if key is not None:
                return self.get(key)
        return None

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


def named_key(named: bytes, value: bytes) -> bytes | None:
    """The answer key a prompt's name holds, or None (not a name of `named`, damaged, or dated another day)."""
    try:
        stored = json.loads(value)
        key = stored["key"]
        if stored["named"] != named.decode() or not isinstance(key, str) or not key.startswith(KEY_PREFIX.decode()) \
                or stored["day"] not in (None, time.strftime("%Y-%m-%d")):
            return None
        return key.encode()
    except (ValueError, KeyError, TypeError, RecursionError):
        return None


def answer_cache(settings: Settings, fingerprint: bytes, ram: bool) -> AnswerCache | None:
    """The exact answer cache of one model (see answer_tiers); None when cache.answers is off."""
    tiers = answer_tiers(settings, ram)
    return AnswerCache(tiers, fingerprint) if tiers else None


def answer_tiers(settings: Settings, ram: bool) -> list[AnswerTier]:
    """Where exact answers are kept: RAM (`ram`: a server's, not a one-shot prompt's), then this machine's disk,
    then the store `arca.remote` names (ARCA or a real Redis) if any; none when cache.answers is off. The
    models of one server share them (their keys hold each model's fingerprint) and so their budgets."""
    options = settings.answers
    if not options.enabled:
        log.info("exact answers are not kept (cache.answers = false)")
        return []
    tiers: list[AnswerTier] = [RamAnswers(options.ram_budget_bytes)] if ram and options.ram_budget_bytes else []
    if options.disk_budget_bytes:
        try:
            tiers.append(DiskAnswers(options.directory, options.disk_budget_bytes))
        except OSError as error:
            log.warning("exact answers are not kept on disk: cannot use %s (%s); set cache.answers_dir to a "
                        "writable directory", options.directory, error.strerror)
    if settings.arca.remote:
        from reame.arca.stores import shared_store, store_description  # only then the store's client loads
        store = shared_store(settings.arca.remote, settings.arca.secret)
        log.info("exact answers are shared through %s",
                 store_description(settings.arca.remote, settings.arca.secret))
        tiers.append(SharedAnswers(store, settings.arca.answer_ttl_ms))
    return tiers
