"""The semantic answer cache (opt-in, `cache.semantic`): a question that means what an answered one meant,
asked of the same document with the same settings, gets the kept answer without the engine.

A chat request splits into its *scope* (everything but the last user message's text: the model, the
rendered conversation around the question, the settings, what else the server does with the text) and
its *question*. Within one scope the cache keeps each answered question's embedding and the key of its
answer in the exact answer cache (reame/answers.py), which holds the text: no answer is kept twice. A new
question is answered from the cache when its nearest kept question is at least `threshold` similar
(cosine of unit vectors) and both say the same numbers and both or neither negate: an embedding barely
tells "10 days" from "60 days" or "open" from "not open" (bench/semantic_cache.py measured it), and that
check is cheap. It cannot tell "open" from "close": docs/cache.md (Semantic answers) says what the study
found and why the cache is off by default. `chat_question` finds a chat's question and `look_up` its match;
the server's exchange (server/exchange.py) embeds it and keeps what was computed.

Vectors of different embedding models are not comparable: the embedder's identity is part of the scope.
With a shared store (`arca.remote`) each scope is also a stream of its questions, so a node finds what
every node has answered; what the store sends is checked like any input.
"""

from __future__ import annotations

import array
import collections
import dataclasses
import hashlib
import json
import logging
import math
import operator
import re
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from reame.answers import KEY_PREFIX as ANSWER_PREFIX
from reame.engine import SamplingParams
from reame.errors import ReameError

if TYPE_CHECKING:
    from reame.arca.client import StoreCommands

STREAM_PREFIX = b"reame:semantic:"
MAX_QUESTION_CHARS = 2000  # a longer last message is a document, not a question: not looked up
QUESTIONS_PER_SCOPE = 256  # kept per scope (the oldest go), in RAM and in the store's stream
MAX_SCOPES = 1024  # scopes in RAM (the least recently used go)
MAX_INDEX_BYTES = 64 << 20  # what every scope's kept questions take in RAM together, as KeptQuestion.size counts
# (at 1,024 scopes of 256 long questions the index once took 1.2-1.6 GiB)

NUMBER_WORDS = {
    word: str(value) for value, words in enumerate([
        ("zero",), (), ("two", "due"), ("three", "tre"), ("four", "quattro"), ("five", "cinque"), ("six", "sei"),
        ("seven", "sette"), ("eight", "otto"), ("nine", "nove"), ("ten", "dieci"), ("eleven", "undici"),
        ("twelve", "dodici"), ("thirteen", "tredici"), ("fourteen", "quattordici"), ("fifteen", "quindici"),
        ("sixteen", "sedici"), ("seventeen", "diciassette"), ("eighteen", "diciotto"), ("nineteen", "diciannove"),
        ("twenty", "venti")]) for word in words
} | {"thirty": "30", "trenta": "30", "forty": "40", "quaranta": "40", "fifty": "50", "cinquanta": "50",
     "hundred": "100", "cento": "100", "thousand": "1000", "mille": "1000"}
# "one", "un", "uno", "una" are left out: mostly articles and pronouns, not counts.
NEGATIONS = {"not", "no", "never", "none", "nobody", "nothing", "nowhere", "neither", "nor", "without", "cannot",
             "non", "mai", "nessun", "nessuno", "nessuna", "niente", "nulla", "senza", "né"}
WORD = re.compile(r"\d+(?:[.,]\d+)*|[^\W\d_]+(?:'[^\W\d_]+)*")


def canonical(question: str) -> str:
    """The question as it is embedded: its words alone, without the spacing and end punctuation people
    type differently ("what time do you close" and "What time do you close?" are one question; an
    embedding model weighs the question mark as much as a word)."""
    return " ".join(question.split()).rstrip("?!.。？！ ")


@dataclass(frozen=True)
class Details:
    """What a question says that its embedding barely weighs: its numbers, and whether it negates."""

    numbers: tuple[str, ...]
    negated: bool


def details(question: str) -> Details:
    numbers, negated = [], False
    for word in WORD.findall(question.lower().replace("\u2019", "'")):
        if word[0].isdigit():
            numbers.append(word.replace(",", "."))
        elif word in NUMBER_WORDS:
            numbers.append(NUMBER_WORDS[word])
        elif word in NEGATIONS or word.endswith("n't"):
            negated = True
    return Details(tuple(sorted(numbers)), negated)


@dataclass(frozen=True)
class KeptQuestion:
    text: str
    vector: array.array  # unit length, float32
    answer_key: bytes
    details: Details

    @property
    def size(self) -> int:
        """Bytes it takes in RAM, at most (a character counted at 4 bytes, a number's string at 64)."""
        return 256 + 4 * len(self.text) + self.vector.itemsize * len(self.vector) + len(self.answer_key) + \
            64 * len(self.details.numbers)


@dataclass(frozen=True)
class Match:
    question: KeptQuestion
    similarity: float


def similarity(a: Sequence[float], b: Sequence[float]) -> float:
    """Cosine of two unit vectors."""
    return math.fsum(map(operator.mul, a, b))


def nearest(kept: Sequence[KeptQuestion], vector: Sequence[float], question: str) -> Match | None:
    """The kept question most similar to `vector` among those that say the same numbers and negate alike."""
    said = details(question)
    best: Match | None = None
    for candidate in kept:
        if candidate.details != said:
            continue
        score = similarity(candidate.vector, vector)
        if best is None or score > best.similarity:
            best = Match(candidate, score)
    return best


class Scope:
    """One scope's kept questions (by answer key, oldest first) and how far its stream has been read."""

    def __init__(self) -> None:
        self.questions: collections.OrderedDict[bytes, KeptQuestion] = collections.OrderedDict()
        self.read_up_to = b"0-0"
        self.size = 0  # the kept questions' sizes together

    def keep(self, question: KeptQuestion) -> int:
        """Keep `question` (the oldest go past QUESTIONS_PER_SCOPE); how many bytes the scope grew by."""
        before = self.size
        replaced = self.questions.pop(question.answer_key, None)
        self.size -= replaced.size if replaced is not None else 0
        self.questions[question.answer_key] = question
        self.size += question.size
        while len(self.questions) > QUESTIONS_PER_SCOPE:
            self.size -= self.questions.popitem(last=False)[1].size
        return self.size - before


class SemanticIndex:
    """Every scope's kept questions, in RAM and in the shared store if any. Thread-safe; never raises on
    the store's account (a store that is down or sends junk only misses)."""

    def __init__(self, fingerprint: bytes, embedder_id: str, threshold: float, store: StoreCommands | None = None,
                 ttl_ms: int = 0) -> None:
        self.fingerprint = fingerprint
        self.embedder_id = embedder_id
        self.threshold = threshold
        self.store = store
        self.ttl_ms = ttl_ms
        self._scopes: collections.OrderedDict[bytes, Scope] = collections.OrderedDict()
        self._bytes = 0  # every scope's size together
        self._lock = threading.Lock()

    def scope(self, context: str, params: SamplingParams, shape: str) -> bytes:
        """`context`: the rendered prompt with the question replaced by a placeholder."""
        settings = dataclasses.asdict(params)
        settings["logit_bias"] = sorted(params.logit_bias.items())
        settings["seed"] = None if params.temperature == 0 else params.seed
        digest = hashlib.sha256(self.fingerprint)
        digest.update(json.dumps([self.embedder_id, context, settings, shape], sort_keys=True).encode())
        return digest.hexdigest().encode()

    def find(self, scope: bytes, question: str, vector: Sequence[float]) -> Match | None:
        """The kept question that may answer `question`, if one is similar enough."""
        self._read_store(scope, len(vector))
        with self._lock:
            kept = list(self._scopes[scope].questions.values()) if scope in self._scopes else []
        match = nearest(kept, vector, question)
        return match if match is not None and match.similarity >= self.threshold else None

    def add(self, scope: bytes, question: str, vector: Sequence[float], answer_key: bytes) -> None:
        packed = unit_float32(vector)
        with self._lock:
            self._keep(scope, [KeptQuestion(question, packed, answer_key, details(question))])
        if self.store is not None:
            stream = STREAM_PREFIX + scope
            self.store.xadd(stream, {b"q": question.encode(), b"v": little_endian(packed), b"a": answer_key},
                            QUESTIONS_PER_SCOPE)
            if self.ttl_ms:
                self.store.call(b"PEXPIRE", stream, str(self.ttl_ms).encode())

    def _scope(self, scope: bytes) -> Scope:
        """The scope's entry, now the most recently used (lock held)."""
        entry = self._scopes.get(scope)
        if entry is None:
            entry = self._scopes[scope] = Scope()
            self._trim()
        self._scopes.move_to_end(scope)
        return entry

    def _keep(self, scope: bytes, questions: list[KeptQuestion]) -> Scope:
        """Keep `questions` in `scope`, then give up the least recently used other scopes while the index
        is over MAX_INDEX_BYTES (lock held)."""
        entry = self._scope(scope)
        for question in questions:
            self._bytes += entry.keep(question)
        self._trim()
        return entry

    def _trim(self) -> None:
        """The least recently used scopes go while there are more than MAX_SCOPES or they take more than
        MAX_INDEX_BYTES (the most recent one stays, whatever its size). Lock held."""
        while len(self._scopes) > MAX_SCOPES or (self._bytes > MAX_INDEX_BYTES and len(self._scopes) > 1):
            self._bytes -= self._scopes.popitem(last=False)[1].size

    def _read_store(self, scope: bytes, dimensions: int) -> None:
        """Take in what the store's stream of `scope` gained since it was last read (other nodes' questions)."""
        if self.store is None:
            return
        with self._lock:
            after = self._scope(scope).read_up_to
        entries = self.store.xread(STREAM_PREFIX + scope, after, QUESTIONS_PER_SCOPE, block_ms=None)
        kept = [question for question in (decode(fields, dimensions) for _, fields in entries) if question]
        with self._lock:
            entry = self._keep(scope, kept)
            if entries:
                entry.read_up_to = entries[-1][0]


def decode(fields: dict[bytes, bytes], dimensions: int) -> KeptQuestion | None:
    """A question from the store, or None for an entry that is not one of ours (or is damaged)."""
    text, packed, answer_key = fields.get(b"q"), fields.get(b"v"), fields.get(b"a")
    if not (isinstance(text, bytes) and isinstance(packed, bytes) and isinstance(answer_key, bytes)):
        return None
    if len(packed) != 4 * dimensions or len(text) > 4 * MAX_QUESTION_CHARS or \
            not answer_key.startswith(ANSWER_PREFIX) or len(answer_key) > 128:
        return None
    try:
        question = text.decode()
    except UnicodeDecodeError:
        return None
    vector = array.array("f", packed)
    if sys.byteorder == "big":
        vector.byteswap()
    norm = math.fsum(value * value for value in vector)
    if not math.isfinite(norm) or abs(norm - 1) > 1e-3:
        return None
    return KeptQuestion(question, vector, answer_key, details(question))


class Embedder(Protocol):
    identity: str

    def embed(self, text: str) -> list[float]: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class SemanticCache:
    index: SemanticIndex
    embedder: Embedder | None  # None: the served model's own embeddings, computed by its engine


def unit_float32(vector: Sequence[float]) -> array.array:
    norm = math.sqrt(math.fsum(value * value for value in vector)) or 1.0
    return array.array("f", (value / norm for value in vector))


def little_endian(vector: array.array) -> bytes:
    if sys.byteorder == "big":
        vector = array.array("f", vector)
        vector.byteswap()
    return vector.tobytes()


log = logging.getLogger("reame.semantic")

# Holds the question's place in the rendered conversation: the scope is the conversation around it.
PLACEHOLDER = "\u2063[reame: the question]\u2063"


@dataclass(frozen=True)
class Question:
    text: str
    context: str  # the rendered prompt with PLACEHOLDER where the question is


@dataclass(frozen=True)
class Lookup:
    scope: bytes
    question: str
    vector: list[float]
    match: Match | None


def chat_question(messages: Sequence[dict[str, Any]], render: Callable[[list[dict[str, Any]]], str]) -> Question | None:
    """The last message's text as the question, if it is a user's and short enough to be one."""
    last = messages[-1]
    text = last.get("content")
    if last["role"] != "user" or not isinstance(text, str) or not text.strip() or len(text) > MAX_QUESTION_CHARS:
        return None
    return Question(text, render([*messages[:-1], {**last, "content": PLACEHOLDER}]))


def look_up(cache: SemanticCache, embed: Callable[[str], list[float] | None], question: Question,
            params: SamplingParams, shape: str) -> Lookup | None:
    """The kept question nearest to `question` in its scope (match None: none close enough); None when the
    question could not be embedded (the request is then computed as if the cache were off) or `embed` gave
    nothing (the client left while the served model embedded it)."""
    try:
        vector = embed(canonical(question.text))
    except ReameError as error:
        log.warning("semantic cache: the question was not embedded (%s)", error)
        return None
    if vector is None:
        return None
    scope = cache.index.scope(question.context, params, shape)
    return Lookup(scope, question.text, vector, cache.index.find(scope, question.text, vector))
