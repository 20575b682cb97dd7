"""The Conclave: best-of-N answers from one prefill, elected by vote, stopped early once decided.

N attempts of one request run interleaved in one batch. The engine computes their
common prompt once and shares its KV with the others (scheduler.py: followers of
a prefilling twin). Attempt 0, the anchor, keeps the caller's settings, so greedy
stays greedy; the explorers get seeds of their own and a temperature of at least
EXPLORER_TEMPERATURE, so they can disagree with it.

Each finished attempt votes with its answer's key (`answer_key`): a short answer by
its numbers or its normalised words, a long one by its last number. As soon as one
key holds an absolute majority of the N votes nothing can overturn it: the attempts
still running are cancelled and free their KV. Without a majority at the end, the
most voted key wins if half the attempts voted and it has at least two votes;
otherwise the medoid, the answer most alike the others by word-set Jaccard.

This corrects variance, not bias: a model that is consistently wrong is outvoted by
nobody. `consensus` (the winner's votes out of N) tells a script when to escalate.
"""

from __future__ import annotations

import collections
import queue
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace

from reame.engine import Completion, Engine, FinishEvent, GenerationRequest, Handle, TokenEvent
from reame.engine.request import FINISH_STOP
from reame.model.sampling import MAX_SEED, SamplingParams

EXPLORER_TEMPERATURE = 0.7  # the least temperature of attempts 1..N-1
SHORT_ANSWER_WORDS = 12  # an answer of at most this many words votes with all of it, a longer one with its last number
MAX_ATTEMPTS = 16

_NUMBER = re.compile(r"(?:(?<![0-9A-Za-z])-)?\d(?:\d|,(?=\d{3}(?!\d))|\.(?=\d))*")
_WORD = re.compile(r"[0-9a-z]+")


def attempts(params: SamplingParams, n: int) -> list[SamplingParams]:
    """The N attempts' settings: the caller's for the anchor; distinct seeds (the caller's seed + i,
    or a random base) and a raised temperature for the explorers."""
    if not 1 <= n <= MAX_ATTEMPTS:
        raise ValueError(f"best-of takes 1..{MAX_ATTEMPTS} attempts, got {n}")
    base = params.seed if params.seed is not None else random.randrange(MAX_SEED + 1)
    anchor = replace(params, seed=base)
    return [anchor] + [replace(params, seed=(base + i) % (MAX_SEED + 1),
                               temperature=max(params.temperature, EXPLORER_TEMPERATURE)) for i in range(1, n)]


def numbers(text: str) -> list[str]:
    """The numbers in `text`, normalised: thousands separators dropped (`1,024` → `1024`), a decimal
    point kept with its digits but without trailing zeros (`12.50` → `12.5`, `3.0` → `3`); a minus
    sign only where it cannot be a hyphen (`twenty-two`, `A-4` have none)."""
    found = []
    for match in _NUMBER.finditer(text):
        number = match.group().replace(",", "")
        if "." in number:
            number = number.rstrip("0").rstrip(".")
        if number in ("-0", ""):
            number = "0"
        found.append(number)
    return found


def words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


def answer_key(text: str) -> str | None:
    """What an answer votes with: a short answer (SHORT_ANSWER_WORDS words at most) its numbers in
    order, or its words when it has none (so `€1,200` and `1200 EUR`, `No.` and `no` agree); a longer
    one its last number (a worked answer ends with its result); None when a long answer has no number."""
    found = numbers(text)
    if len(words(text)) <= SHORT_ANSWER_WORDS:
        key = " ".join(found) if found else " ".join(words(text))
        return key or None
    return found[-1] if found else None


def similarity(a: str, b: str) -> float:
    """Jaccard index of the two texts' lowercase word sets (0 when either has none)."""
    first, second = set(words(a)), set(words(b))
    if not first or not second:
        return 0.0
    return len(first & second) / len(first | second)


def medoid(texts: Sequence[str]) -> int:
    """The text most alike all the others (the first among equals)."""
    if len(texts) < 2:
        return 0
    scores = [sum(similarity(text, other) for j, other in enumerate(texts) if j != i) for i, text in enumerate(texts)]
    return max(range(len(texts)), key=lambda i: (scores[i], -i))


@dataclass(frozen=True)
class Candidate:
    text: str
    finish_reason: str
    key: str | None  # what it voted with; None: it did not vote (no answer key, cut short, or stopped)
    completion_tokens: int


@dataclass(frozen=True)
class Verdict:
    winner: int
    consensus: int  # the votes for the winner's answer (1 when elected as the medoid)
    candidates: tuple[Candidate, ...]
    early: bool  # decided by an absolute majority before every attempt ended

    @property
    def n(self) -> int:
        return len(self.candidates)

    def summary(self) -> dict:
        """The vote as the API shows it."""
        return {"n": self.n, "consensus": self.consensus, "winner": self.winner, "early_stop": self.early,
                "candidates": [{"index": i, "answer": c.key, "finish_reason": c.finish_reason,
                                "completion_tokens": c.completion_tokens}
                               for i, c in enumerate(self.candidates)]}


class Election:
    """Votes as attempts finish; `decided` once a key holds an absolute majority of all N."""

    def __init__(self, n: int) -> None:
        self.n = n
        self._candidates: dict[int, Candidate] = {}
        self._tally: collections.Counter[str] = collections.Counter()
        self.decided: int | None = None
        self.early = False  # decided while some attempts were still running

    def finished(self, index: int, text: str, finish_reason: str, completion_tokens: int) -> bool:
        """Record attempt `index`'s end; True when this vote made the majority (stop the others).
        Only an answer that ended by itself votes: one cut by max_tokens or cancelled may be unfinished."""
        key = answer_key(text) if finish_reason == FINISH_STOP else None
        self._candidates[index] = Candidate(text, finish_reason, key, completion_tokens)
        if key is None:
            return False
        self._tally[key] += 1
        if self.decided is None and self._tally[key] * 2 > self.n:
            self.decided = min(i for i, c in self._candidates.items() if c.key == key)
            self.early = len(self._candidates) < self.n
            return True
        return False

    def verdict(self) -> Verdict:
        candidates = tuple(self._candidates.get(i, Candidate("", "cancelled", None, 0)) for i in range(self.n))
        if self.decided is not None:
            key = candidates[self.decided].key
            return Verdict(self.decided, self._tally[key or ""], candidates, self.early)
        voted = [i for i, c in enumerate(candidates) if c.key is not None]
        if len(voted) * 2 >= self.n:
            # The most voted key, the first attempt's among equals; at least two votes make it a choice.
            first: dict[str, int] = {}
            for i in voted:
                first.setdefault(candidates[i].key or "", i)
            key = max(first, key=lambda k: (self._tally[k], -first[k]))
            if self._tally[key] >= 2:
                return Verdict(first[key], self._tally[key], candidates, early=False)
        ended = [i for i, c in enumerate(candidates) if c.finish_reason != "cancelled"] or [0]
        return Verdict(ended[medoid([candidates[i].text for i in ended])], 1, candidates, early=False)


class Ballot:
    """Elections over attempts that answer into one sink, `group` attempts per prompt (the handles in order):
    each attempt votes as it ends, and once a prompt's majority is certain its other attempts are stopped.
    The one vote loop of the Conclave, for the CLI's --best-of and the API's best_of alike."""

    def __init__(self, handles: Sequence[Handle], group: int) -> None:
        self.handles, self.group = handles, group
        self.elections = [Election(group) for _ in range(len(handles) // group)]

    def finished(self, tag: int, text: str, finish_reason: str, completion_tokens: int) -> bool:
        """Attempt `tag` ended with `text`; True when its vote decided its prompt early (the others stopped)."""
        prompt = tag // self.group
        if not self.elections[prompt].finished(tag % self.group, text, finish_reason, completion_tokens):
            return False
        for handle in self.handles[prompt * self.group:(prompt + 1) * self.group]:
            if handle.finish is None:
                handle.cancel()
        return True

    def verdicts(self) -> list[Verdict]:
        return [election.verdict() for election in self.elections]


@dataclass(frozen=True)
class Outcome:
    verdict: Verdict
    completions: tuple[Completion, ...]  # per attempt

    @property
    def winner(self) -> Completion:
        return self.completions[self.verdict.winner]


def convene(engine: Engine, request: GenerationRequest, n: int, timeout_s: float | None = None) -> Outcome:
    """Run `request` as N attempts in one batch and elect the answer (the CLI's --best-of)."""
    sink: queue.SimpleQueue = queue.SimpleQueue()
    handles = engine.submit_together([replace(request, params=params) for params in attempts(request.params, n)],
                                     sink)
    try:
        ballot = Ballot(handles, n)
        pieces: list[list[str]] = [[] for _ in handles]
        tokens: list[list[int]] = [[] for _ in handles]
        finishes: dict[int, FinishEvent] = {}
        while len(finishes) < n:
            tag, event = sink.get(timeout=timeout_s)
            if isinstance(event, TokenEvent):
                pieces[tag].append(event.text)
                tokens[tag].append(event.token)
                continue
            finishes[tag] = event
            pieces[tag].append(event.text)
            ballot.finished(tag, "".join(pieces[tag]), event.reason, len(tokens[tag]))
    finally:
        for handle in handles:
            if handle.finish is None:
                handle.cancel()
    completions = tuple(Completion("".join(pieces[i]), tokens[i], finishes[i]) for i in range(n))
    return Outcome(ballot.verdicts()[0], completions)

