"""What a caller asks of the engine and what it gets back.

`SamplingParams` and `GenerationRequest` are validated in the caller's thread,
so bad input is a RequestError before the engine does any work. A `Handle` is
the caller's end of one generation: it yields events as the engine thread
produces them and can be cancelled from any thread.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Union

from reame.cache.store import Snapshot
from reame.engine.grammar import Grammar
from reame.errors import ModelError, RequestError

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256  # the longest stop string: text that may begin one is held back and rescanned every token
MAX_LOGIT_BIAS = 1024  # biased tokens: each is applied to every token's draw
MAX_SEED = 2**32 - 2  # 0xFFFFFFFF means "random" to llama.cpp
MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token. temperature 0 means greedy (argmax)."""

    max_tokens: int | None = None  # None: until end of generation or the context is full
    temperature: float = 0.7
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off
    repeat_penalty: float = 1.0  # 1 = off
    repeat_last_n: int = 64  # window of the three penalties; -1 = whole context
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None  # None: a random seed per request
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    grammar: str | None = None  # GBNF the output must match (checked by the caller: engine/grammar.py)

    def __post_init__(self) -> None:
        _check_int("max_tokens", self.max_tokens, minimum=1, optional=True)
        _check_float("temperature", self.temperature, 0.0, 100.0)
        _check_int("top_k", self.top_k, minimum=0)
        _check_float("top_p", self.top_p, 0.0, 1.0)
        if self.top_p == 0.0:
            raise RequestError("top_p must be greater than 0", param="top_p")
        _check_float("min_p", self.min_p, 0.0, 1.0)
        _check_float("repeat_penalty", self.repeat_penalty, 0.0, 10.0)
        if self.repeat_penalty == 0.0:
            raise RequestError("repeat_penalty must be greater than 0", param="repeat_penalty")
        _check_int("repeat_last_n", self.repeat_last_n, minimum=-1)
        _check_float("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_float("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _check_int("seed", self.seed, minimum=0, maximum=MAX_SEED, optional=True)
        if isinstance(self.stop, (str, bytes)) or not isinstance(self.stop, tuple):
            raise RequestError("stop must be a tuple of strings", param="stop")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise RequestError(f"at most {MAX_STOP_STRINGS} stop strings are allowed", param="stop")
        for stop in self.stop:
            if not isinstance(stop, str) or not stop:
                raise RequestError("every stop string must be a non-empty string", param="stop")
            if len(stop) > MAX_STOP_CHARS:
                raise RequestError(f"a stop string is at most {MAX_STOP_CHARS} characters", param="stop")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise RequestError(f"logit_bias holds at most {MAX_LOGIT_BIAS} tokens", param="logit_bias")
        if not isinstance(self.ignore_eos, bool):
            raise RequestError("ignore_eos must be a boolean", param="ignore_eos")
        for token, bias in self.logit_bias.items():
            if not isinstance(token, int) or isinstance(token, bool) or token < 0:
                raise RequestError(f"logit_bias key {token!r} is not a token id", param="logit_bias")
            if isinstance(bias, bool) or not isinstance(bias, (int, float)) or math.isnan(bias):
                raise RequestError(f"logit_bias value for token {token} is not a number",
                                   param="logit_bias")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalised(self) -> bool:
        return (self.repeat_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0) and self.repeat_last_n != 0


def _check_int(name: str, value: object, *, minimum: int, maximum: int | None = None,
               optional: bool = False) -> None:
    if value is None and optional:
        return
    if not isinstance(value, int) or isinstance(value, bool):
        raise RequestError(f"{name} must be an integer, got {value!r}", param=name)
    if value < minimum or (maximum is not None and value > maximum):
        bound = f"between {minimum} and {maximum}" if maximum is not None else f">= {minimum}"
        raise RequestError(f"{name} must be {bound}, got {value}", param=name)


def _check_float(name: str, value: object, low: float, high: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RequestError(f"{name} must be a number, got {value!r}", param=name)
    if not (low <= value <= high):  # also rejects NaN
        raise RequestError(f"{name} must be between {low:g} and {high:g}, got {value}", param=name)


Prompt = Union[str, Sequence[int]]


@dataclass(frozen=True)
class SessionState:
    """A conversation's KV at one moment: the tokens it covers and the sequence state blob that holds them."""

    tokens: tuple[int, ...] = ()
    blob: bytes | memoryview = b""


class Session:
    """A conversation's KV kept between requests. A request that carries it restores `state` and
    prefills only the tokens its prompt adds; when the request ends, the engine thread swaps in the grown
    state in one assignment, so a reader (a save) always gets tokens and blob that belong together."""

    def __init__(self, state: SessionState | None = None) -> None:
        self.state = state or SessionState()


@dataclass(frozen=True)
class GenerationRequest:
    """A prompt (text, or token ids) and how to continue it.

    Text prompts are tokenized with the model's special tokens parsed and its
    BOS added when the model wants one (`add_special`).
    """

    prompt: Prompt
    params: SamplingParams = field(default_factory=SamplingParams)
    add_special: bool = True
    logprobs: int | None = None  # report each token's log-probability and this many alternatives
    session: Session | None = None
    warm: bool = False  # only prefill the prompt into the prefix cache: no token is generated
    suffix: str | None = None  # fill in the middle: the text after the gap; the prompt is the text before it
    # The caller sends tokens on as they come and calls `Handle.delivered()` once it has: the engine waits
    # for that (briefly) before the step after the first token, so writing it does not compete with that step.
    streamed: bool = False

    def __post_init__(self) -> None:
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or isinstance(self.logprobs, bool)
                                          or not 0 <= self.logprobs <= MAX_TOP_LOGPROBS):
            raise RequestError(f"logprobs must be an integer between 0 and {MAX_TOP_LOGPROBS}", param="logprobs")
        if isinstance(self.prompt, str):
            if not self.prompt:
                raise RequestError("the prompt is empty", param="prompt")
        elif isinstance(self.prompt, (list, tuple)):
            if not self.prompt:
                raise RequestError("the prompt is empty", param="prompt")
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in self.prompt):
                raise RequestError("a token prompt must be a list of integers", param="prompt")
        else:
            raise RequestError("the prompt must be a string or a list of token ids", param="prompt")
        if not isinstance(self.params, SamplingParams):
            raise RequestError("params must be SamplingParams")
        if self.suffix is not None and not isinstance(self.suffix, str):
            raise RequestError("suffix must be a string", param="suffix")


# --- events -------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class TokenEvent:
    """One generated token and the text it completes (may be empty while held back).

    With `GenerationRequest.logprobs`, `logprob` is the token's log-probability under the
    model (log-softmax of its logits) and `top` the most likely tokens with theirs.
    """

    token: int
    text: str
    logprob: float | None = None
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    prompt_seconds: float  # admission to first sampled token
    decode_seconds: float  # first sampled token to finish
    cached_tokens: int = 0  # prompt tokens found in the KV (slot reuse, session, prefix cache), not prefilled
    draft_tokens: int = 0  # tokens speculative decoding proposed for this answer
    accepted_draft_tokens: int = 0  # of which the model confirmed these

    @property
    def prompt_tokens_per_second(self) -> float:
        return self.prompt_tokens / self.prompt_seconds if self.prompt_seconds > 0 else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        # The first token comes out of the prompt pass: decode speed counts the rest.
        n = self.completion_tokens - 1
        return n / self.decode_seconds if n > 0 and self.decode_seconds > 0 else 0.0

    @property
    def tokens_per_step(self) -> float:
        """Tokens each model pass emitted on average: its own draw plus the drafts it accepted
        (1.0 without speculation), i.e. speculative decoding's speed-up in steps."""
        passes = self.completion_tokens - self.accepted_draft_tokens
        return self.completion_tokens / passes if passes > 0 else 1.0


FINISH_STOP = "stop"  # end-of-generation token or a stop string
FINISH_LENGTH = "length"  # max_tokens or the context is full
FINISH_CANCELLED = "cancelled"
FINISH_ERROR = "error"
FINISH_TIMEOUT = "timeout"  # waited longer than the queue timeout for a sequence slot


@dataclass(frozen=True)
class FinishEvent:
    reason: str
    usage: Usage
    message: str = ""  # why, for "error" and for a length stop that hit the context
    text: str = ""  # text held back until the end (an unfinished character or stop-string prefix)
    # For an "error" the request itself caused (its grammar, say): what a client is told to fix.
    code: str = ""


Event = Union[TokenEvent, FinishEvent]


class Handle:
    """The caller's end of one generation. Iterate it for events; `cancel()` from anywhere."""

    def __init__(self, request: GenerationRequest, prompt_tokens: list[int],
                 sink: "queue.SimpleQueue[tuple[int, Event]] | None" = None, tag: int = 0) -> None:
        self.request = request
        self.prompt_tokens = prompt_tokens
        self.cancelled = False
        self._events: queue.SimpleQueue[Event] = queue.SimpleQueue()
        self._sink = sink
        self.tag = tag
        self.finish: FinishEvent | None = None
        self.submitted_at = time.monotonic()
        self.snapshot: Snapshot | None = None  # from the prefix cache, found at submission
        self.grammar: Grammar | None = None  # the request's grammar, compiled at submission
        self.queued = True  # counted against the engine's max_queue until admitted or answered
        self.first_delivered = threading.Event()  # see GenerationRequest.streamed

    def cancel(self) -> None:
        """Stop the generation at the engine's next step and free its KV."""
        self.cancelled = True
        self.first_delivered.set()

    def delivered(self) -> None:
        """The caller has sent on the tokens it got so far (a streamed request's first one matters)."""
        self.first_delivered.set()

    def _put(self, event: Event) -> None:  # engine thread only
        if self._sink is not None:
            # Several handles share one sink, tagged, so one reader can follow them all (n > 1).
            if isinstance(event, FinishEvent):
                self.finish = event
            self._sink.put((self.tag, event))
        else:
            self._events.put(event)

    def events(self, timeout_s: float | None = None) -> Iterator[Event]:
        """Yield events until (and including) the FinishEvent."""
        while self.finish is None:
            event = self._events.get(timeout=timeout_s)
            if isinstance(event, FinishEvent):
                self.finish = event
            yield event

    def __iter__(self) -> Iterator[Event]:
        return self.events()

    def result(self, timeout_s: float | None = None) -> Completion:
        """Wait for the end and return the whole generation."""
        pieces: list[str] = []
        tokens: list[int] = []
        for event in self.events(timeout_s):
            if isinstance(event, TokenEvent):
                pieces.append(event.text)
                tokens.append(event.token)
        assert self.finish is not None
        pieces.append(self.finish.text)
        return Completion("".join(pieces), tokens, self.finish)


class EmbeddingJob:
    """Token inputs to embed, and the caller's end of the job: the engine thread fills `vectors`
    (unit length, in input order) or `error`, then sets `done`."""

    def __init__(self, inputs: list[list[int]]) -> None:
        self.inputs = inputs
        self.vectors: list[list[float]] = []
        self.error = ""
        self.done = threading.Event()

    def result(self, timeout_s: float | None = None) -> list[list[float]]:
        if not self.done.wait(timeout_s):
            raise TimeoutError("the embeddings were not ready in time")
        if self.error:
            raise ModelError(self.error)
        return self.vectors


@dataclass(frozen=True)
class Completion:
    text: str
    tokens: list[int]
    finish: FinishEvent
