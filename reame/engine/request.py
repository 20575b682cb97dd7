"""What a caller asks of the engine and what it gets back.

`SamplingParams` and `GenerationRequest` are validated in the caller's thread,
so bad input is a RequestError before the engine does any work. A `Handle` is
the caller's end of one generation: it yields events as the engine thread
produces them and can be cancelled from any thread.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Union

from reame.cache.store import Snapshot
from reame.errors import RequestError
from reame.model.sampling import SamplingParams
from reame.structured.grammar import Grammar

MAX_TOP_LOGPROBS = 20


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
    # With logprobs: under the distribution the request's sampler chain draws from (its bias, penalties,
    # truncations and temperature: llama-server's `post_sampling_probs`), not the model's own.
    post_sampling: bool = False
    session: Session | None = None
    warm: bool = False  # only prefill the prompt into the prefix cache: no token is generated
    suffix: str | None = None  # fill in the middle: the text after the gap; the prompt is the text before it
    # The caller sends tokens on as they come and calls `Handle.delivered()` once it has: the engine waits
    # for that (briefly) before the step after the first token, so writing it does not compete with that step.
    streamed: bool = False
    # llama-server's cache reuse (`n_cache_reuse`): runs of at least this many tokens of what the slot holds
    # that the prompt has later than the slot had them are moved into place instead of prefilled (0: never).
    # The moved keys are re-rotated, not recomputed, so the answer may differ from a fresh prefill's.
    cache_reuse: int = 0
    # Work nobody waits on (a batch's line): while another request's prompt is being prefilled, this one's
    # rows step aside, so a person's first token does not wait on it.
    background: bool = False
    # Say how the prompt's prefill goes (llama-server's `return_progress`): a ProgressEvent once the request
    # has its slot (what it found cached), then one after each step that fed some of its prompt.
    progress: bool = False

    def __post_init__(self) -> None:
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or isinstance(self.logprobs, bool)
                                          or not 0 <= self.logprobs <= MAX_TOP_LOGPROBS):
            raise RequestError(f"logprobs must be an integer between 0 and {MAX_TOP_LOGPROBS}", param="logprobs")
        if self.post_sampling and self.params.grammar is not None:
            raise RequestError("post-sampling probabilities are not given beside a grammar or a schema",
                               param="post_sampling_probs")
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
        if not isinstance(self.cache_reuse, int) or isinstance(self.cache_reuse, bool) or self.cache_reuse < 0:
            raise RequestError("n_cache_reuse must be an integer of at least 0", param="n_cache_reuse")


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


@dataclass(frozen=True, slots=True)
class ProgressEvent:
    """How far a prompt's prefill is: `processed` of its `total` tokens are in the KV, `cache` of them found
    there (not computed), `seconds` after the request got its slot. Sent only to a request that asked."""

    total: int
    cache: int
    processed: int
    seconds: float
    text: str = ""  # (an event's text: a progress adds none to the answer)


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
    # For an "error" the request itself caused (its grammar, say): what a client is told to fix; the server
    # also ends an answer whose engine died with one (engine_unavailable, server/service.py).
    code: str = ""
    stop_sequence: str = ""  # for a "stop" at one of the request's stop strings: which


Event = Union[TokenEvent, FinishEvent, ProgressEvent]


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


@dataclass(frozen=True)
class Completion:
    text: str
    tokens: list[int]
    finish: FinishEvent
