"""A generation's life after its request was parsed, whatever API family asked for it: what it asks (`Asked`,
with its `Options`: n choices, the Conclave's best_of, echo, logprobs), submission through the caches (the
exact answer cache, then the semantic one; a kept answer replayed as the token-sized pieces a generation
sends, a computed one kept as it ends), which says where the answer came from as data; the one loop that
waits for the engine's events, with one clock-based check that the client is still there, the engine's death
as an item of its own, the Conclave's votes and the delivery accounting of streamed tokens. The API families
encode what it yields into their streams and whole answers (generation.py: OpenAI's completions and chat;
turn.py: what they share, and the families that answer one generation). Nothing here knows HTTP: the client
is a `gone` check.
"""

from __future__ import annotations

import dataclasses
import queue
import random
import time
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Protocol

from reame.conclave import Ballot, attempts
from reame.engine import FinishEvent, GenerationRequest, ProgressEvent, SamplingParams, TokenEvent, Usage
from reame.engine.request import FINISH_ERROR
from reame.engine.textstream import TextStream
from reame.errors import EngineUnavailable
from reame.model.backend import Backend
from reame.model.sampling import MAX_SEED
from reame.semantic import Lookup, Question, look_up
from reame.server.metrics import Metrics
from reame.server.models import ModelPool, ServedModel, loaded
from reame.server.shapes import Choice
from reame.structured.thinking import ThinkingSplitter
from reame.structured.tools import ToolCall, ToolRequest, tool_parser

POLL_S = 0.25  # how often a waiting request checks that its client and the engine are still there
ENGINE_UNAVAILABLE = "engine_unavailable"  # the error code of an answer whose model's engine died

# Where an answer came from (the X-Reame-Cache header says it): hit, semantic (a kept answer to a question of
# the same meaning), miss; bypass (a request the cache cannot or may not answer); off (no cache kept)
CACHE_OFF, CACHE_BYPASS, CACHE_MISS, CACHE_HIT, CACHE_SEMANTIC = "off", "bypass", "miss", "hit", "semantic"

Gone = Callable[[], bool]  # whether the client has left
# Set while a batch's line is answered (App.answer_line): its generations are background work for the engine.
BACKGROUND: ContextVar[bool] = ContextVar("background", default=False)
# A kept answer longer than this is streamed whole: an answer of server.max_answer_tokens (4,096) is tens of KB,
# and cutting 1 MiB of text into tokens took 1.6-5.9 s and 40-110 MB on the HTTP thread (SmolLM2's vocabulary).
REPLAY_MAX_CHARS = 64 << 10


class Host(Protocol):
    """What the exchange uses of the server (service.Service is one): its models and its metrics."""

    models: ModelPool
    metrics: Metrics


@dataclass(frozen=True)
class Options:
    """How many answers a request asks for and what each carries, whichever API family asks: `n` choices per
    prompt, or `elect_among` attempts per prompt of which the Conclave elects one (best_of: each votes as it
    ends, a prompt's others stop once its majority is certain); seeds following on from `seed`; each choice
    beginning with its prompt (`echo`); each token's logprob with `logprobs` alternatives (None: none)."""

    n: int = 1
    elect_among: int = 1
    seed: int | None = None
    echo: bool = False
    logprobs: int | None = None
    post_sampling: bool = False  # the logprobs under the request's sampler chain (GenerationRequest.post_sampling)

    @property
    def per_prompt(self) -> int:
        """Generations per prompt: its choices, or its attempts."""
        return max(self.n, self.elect_among)


@dataclass(frozen=True)
class Asked:
    """The generations a request asks for once its family has read it: its prompts (text or tokens), their
    sampling, the options above, and what else shapes the text: a chat or a completion, streamed or not, tools
    parsed out of it, a thinking model's <think>…</think> said apart, a suffix to fill in before, the session
    it continues, the question the semantic cache looks up (None: not looked up). `cacheable`: the request
    lets the answer caches answer it (a deterministic lone generation outside a session is then looked up).
    `warm`: only prefill the prompts into the prefix cache, generating nothing."""

    prompts: list[Any]
    params: SamplingParams
    options: Options = Options()
    chat: bool = True
    streamed: bool = False
    tools: ToolRequest | None = None
    thinks: bool = False
    suffix: str | None = None
    session: Any = None
    question: Question | None = None
    cacheable: bool = True
    warm: bool = False
    cache_reuse: int = 0  # GenerationRequest.cache_reuse
    progress: bool = False  # GenerationRequest.progress: each prompt's prefill said as it goes (Said.progress)


@dataclass
class Submitted:
    handles: list  # the engine's handles, or one StoredAnswer
    events: Any  # where their events arrive (the sink, or a tap that keeps the answer when it ends)
    cache: str  # where the answer comes from: one of the CACHE_ states
    marks: dict[str, Any] = field(default_factory=dict)  # the answer's `reame` object (empty: nothing to say)


def submit(app: Host, model: ServedModel, requests: list[GenerationRequest], sink: queue.SimpleQueue,
           cacheable: bool, kind: str, question: Question | None, gone: Gone) -> Submitted:
    """Submit `requests` to the model's engine together, or answer the one cacheable request from its exact
    answer cache, then the semantic one (with `question`; embedding it stops early when the client is
    `gone`); a computed cacheable answer is kept when it ends. `kind`: the shape (chat or completion, tools
    offered), part of the key. RequestError, OverloadedError as the engine raises them."""
    engine, answers = loaded(model), model.answers
    if BACKGROUND.get():
        requests = [dataclasses.replace(request, background=True) for request in requests]
    if not cacheable or answers is None:
        return Submitted(engine.submit_together(requests, sink), sink, CACHE_OFF if answers is None else CACHE_BYPASS)
    # Tokenized once: the key is over the tokens, and the engine gets them as they are.
    tokens = engine.prompt_tokens(requests[0])
    request = dataclasses.replace(requests[0], prompt=tokens, suffix=None)
    answer_key = answers.key(tokens, request.params, kind)  # (a greedy request's seed does not count)
    handles = kept_answer(app, model, request, tokens, answer_key, sink, "answers")
    if handles is not None:
        return Submitted(handles, sink, CACHE_HIT)
    similar = look_up(model.semantic, question_embedding(app, model, gone), question, request.params, kind) \
        if question is not None and model.semantic is not None else None
    if similar is not None and similar.match is not None:
        handles = kept_answer(app, model, request, tokens, similar.match.question.answer_key, sink, "semantic")
        if handles is not None:
            return Submitted(handles, sink, CACHE_SEMANTIC, {
                "cache": "semantic", "similarity": round(similar.match.similarity, 4),
                "question": similar.match.question.text})
    elif similar is not None:
        app.metrics.add("reame_semantic_misses_total", model=model.name)
    computing = engine.submit_together([request], sink)
    return Submitted(computing, AnswerTap(sink, lambda text, finish: keep_answer(app, model, answer_key, text,
                                                                                 finish, similar)), CACHE_MISS)


def question_embedding(app: Host, model: ServedModel, gone: Gone) -> Callable[[str], list[float] | None]:
    """How the semantic cache embeds a question: with its own embedding model, or with the served model's,
    computed by its engine between steps (None when the client is `gone` meanwhile)."""
    assert model.semantic is not None
    if model.semantic.embedder is not None:
        return model.semantic.embedder.embed
    backend = loaded(model).backend

    def served(text: str) -> list[float] | None:
        if not backend.embeddings_pooled:  # a vector per token: no question's meaning (not looked up)
            return None
        tokens = backend.tokenize(text, add_special=True, parse_special=False)
        vectors = embedded(app, model, [tokens[:backend.embedding_context_tokens]], gone)
        return None if vectors is None else vectors[0]
    return served


def shape(chat: bool, tools: ToolRequest | None) -> str:
    """What else the server does with the generated text: part of a cache key."""
    return ("chat" if chat else "completion") + ("+tools" if tools is not None else "")


def kept_answer(app: Host, model: ServedModel, request: GenerationRequest, tokens: list[int], key: bytes,
                sink: queue.SimpleQueue, cache: str) -> list[StoredAnswer] | None:
    """The answer the model's cache keeps under `key` as the engine's events (for a stream, in the pieces a
    generation sends; a whole answer is joined anyway), or None on a miss (counted either way, as a lookup
    of `cache`: answers or semantic)."""
    assert model.answers is not None
    cached = model.answers.get(key)
    app.metrics.add(f"reame_{cache}_hits_total" if cached else f"reame_{cache}_misses_total", model=model.name)
    if cached is None:
        return None
    whole = [TokenEvent(-1, cached.text)]
    # A kept answer comes from a file or a shared store: one far longer than what a generation of its
    # recorded length sends (planted, or not ours) is sent whole rather than cut on the HTTP thread.
    replay = request.streamed and len(cached.text) <= REPLAY_MAX_CHARS
    for event in replayed(cached.text, loaded(model).backend, 2 * cached.completion_tokens + 16) if replay else whole:
        sink.put((0, event))
    sink.put((0, cached.finish(len(tokens))))
    return [StoredAnswer(tokens)]


def keep_answer(app: Host, model: ServedModel, key: bytes, text: str, finish: FinishEvent,
                question: Lookup | None) -> None:
    """Keep a computed answer; with `question` (the semantic cache looked it up), the question too."""
    assert model.answers is not None
    if model.answers.put(key, text, finish):
        app.metrics.add("reame_answers_stored_total", model=model.name)
        if question is not None and model.semantic is not None:
            model.semantic.index.add(question.scope, question.question, question.vector, key)


class StoredAnswer:
    """Stands where the engine's handle would for an answer served from the store: nothing to cancel."""

    def __init__(self, prompt_tokens: list[int]) -> None:
        self.prompt_tokens = prompt_tokens
        self.finish: FinishEvent | None = None

    def cancel(self) -> None:
        pass

    def delivered(self) -> None:
        pass


def replayed(text: str, backend: Backend, max_pieces: int | None = None) -> list[TokenEvent]:
    """A kept answer as the events a generation of it streams: one per token, each with the text that
    token completes (a character split across tokens arrives whole, as the engine sends it). Clients and
    the thinking and tool-call parsers then see a kept answer arrive as a computed one does. A text that
    does not tokenize back to itself (a tokenizer that adds a leading space, say), or into more than
    `max_pieces` tokens, arrives as one piece."""
    tokens = backend.tokenize(text, add_special=False, parse_special=False)
    if max_pieces is not None and len(tokens) > max_pieces:
        return [TokenEvent(-1, text)]
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

    def get(self, block: bool = True,
            timeout: float | None = None) -> tuple[int, TokenEvent | FinishEvent | ProgressEvent]:
        tag, event = self.events.get(block, timeout)
        self.pieces.append(event.text)  # a finish carries the text held back until the end
        if isinstance(event, FinishEvent):
            self.keep("".join(self.pieces), event)
        return tag, event


@dataclass(frozen=True)
class EngineGone:
    """The model's engine died before the generations ended: each family ends its answer with this error."""

    error: EngineUnavailable

    def finish(self, prompt_tokens: int) -> FinishEvent:
        """How the answer ends: an error that service.failure makes a 503."""
        return FinishEvent(FINISH_ERROR, Usage(prompt_tokens, 0, 0.0, 0.0), message=str(self.error),
                           code=ENGINE_UNAVAILABLE)


def events(app: Host, model: ServedModel, submitted: Submitted,
           gone: Gone) -> Iterator[tuple[int, TokenEvent | FinishEvent | ProgressEvent] | EngineGone]:
    """Every handle's events, tagged, as they arrive, until each has ended. Every POLL_S on the clock, events
    or not, the client is checked: once it is `gone`, every handle is cancelled and the iteration ends early
    (the caller sees handles without their end). An engine that died ends it with one EngineGone. A token is
    counted as delivered once the caller asks for the next item (it has sent it on, when it streams)."""
    handles = submitted.handles
    remaining = len(handles)
    checked = time.monotonic()
    while remaining:
        try:
            tag, event = next_event(app, model, submitted.events)
        except EngineUnavailable as error:
            yield EngineGone(error)
            return
        if time.monotonic() - checked >= POLL_S:
            checked = time.monotonic()
            if gone():
                for handle in handles:
                    handle.cancel()
                return
        if event is None:
            continue
        if isinstance(event, FinishEvent):
            remaining -= 1
        yield tag, event
        if isinstance(event, TokenEvent):
            handles[tag].delivered()


def next_event(app: Host, model: ServedModel, sink: Any) -> tuple[int, Any]:
    """The next (tag, event) of a request's sink, or (-1, None) after POLL_S without one. Never waits
    forever: EngineUnavailable when the model's engine failed meanwhile."""
    try:
        return sink.get(timeout=POLL_S)
    except queue.Empty:
        app.models.check(model)
        return -1, None


def account(app: Host, model: ServedModel, choices: list[Choice]) -> None:
    """The metrics of what was generated (a kept answer counts in reame_answers_hits_total only)."""
    for choice in choices:
        if choice.finish is None or not choice.computed:
            continue
        usage = choice.finish.usage
        app.metrics.add("reame_generations_total", model=model.name)
        app.metrics.add("reame_prompt_tokens_total", usage.prompt_tokens, model=model.name)
        app.metrics.add("reame_prompt_tokens_cached_total", usage.cached_tokens, model=model.name)
        app.metrics.add("reame_generated_tokens_total", usage.completion_tokens, model=model.name)
        app.metrics.add("reame_prompt_seconds_total", usage.prompt_seconds, model=model.name)
        app.metrics.add("reame_generation_seconds_total", usage.decode_seconds, model=model.name)


def embedded(app: Host, model: ServedModel, inputs: list[list[int]], gone: Gone) -> list[list[float]] | None:
    """Unit vectors of token inputs, computed by the model's engine between its steps; None when the client
    is `gone` meanwhile. RequestError, OverloadedError when the engine refuses them, EngineUnavailable when it
    died, ModelError when the model failed."""
    job = loaded(model).embed(inputs)
    try:
        while not job.done.wait(POLL_S):
            app.models.check(model)
            if gone():
                return None
    finally:
        if not job.done.is_set():
            job.cancel()  # no one waits for the rest: the engine drops it before its next batch
    return job.result(0)


@dataclass
class Said:
    """A piece of choice `tag`'s answer: its text, its thinking, a finished tool call, its prompt's progress, or
    (last) its end."""

    tag: int = 0
    text: str = ""
    thinking: str = ""  # a thinking model's text between <think> and </think>
    call: ToolCall | None = None
    finish: FinishEvent | None = None
    progress: ProgressEvent | None = None  # how far its prompt's prefill is (Asked.progress)


def said(app: Host, model: ServedModel, submitted: Submitted, choices: list[Choice],
         gone: Gone) -> Iterator[Said | EngineGone]:
    """What each choice says as its events arrive: thinking split from the answer, tool calls parsed out of
    it, the content kept in the choice, the tokens whose logprobs were asked for kept until an encoder sends
    them; then each choice's end, counted in the metrics. An engine that died ends it with an EngineGone;
    a client `gone` ends it early (choices without their end)."""
    for item in events(app, model, submitted, gone):
        if isinstance(item, EngineGone):
            yield item
            return
        tag, event = item
        if isinstance(event, ProgressEvent):
            yield Said(tag, progress=event)
            continue
        choice, final = choices[tag], isinstance(event, FinishEvent)
        thinking, text = choice.split(event.text, final)
        if thinking:
            yield Said(tag, thinking=thinking)
        if isinstance(event, TokenEvent):
            if event.token >= 0:  # (a kept answer sent whole has no token ids)
                choice.ids.append(event.token)
            if event.logprob is not None:
                choice.tokens.append(event)
        parser = choice.parser
        pieces: list[tuple[str, Any]] = [("content", text)] if parser is None else \
            parser.feed(text) + (parser.finish() if final else [])
        for kind, piece in pieces:
            if kind == "content" and piece:
                choice.pieces.append(piece)
                yield Said(tag, text=piece)
            elif kind != "content":
                yield Said(tag, call=piece)
        if isinstance(event, FinishEvent):
            choice.finish = event
            account(app, model, [choice])
            yield Said(tag, finish=event)


def attempt_params(base: SamplingParams, options: Options, prompt_index: int) -> list[SamplingParams]:
    """Each choice's settings for one prompt (seeds follow on from the request's), or the Conclave's
    attempts."""
    seed, n = options.seed, options.n
    if options.elect_among > 1:
        return attempts(dataclasses.replace(base, seed=None if seed is None else
                                            (seed + prompt_index) % (MAX_SEED + 1)), options.elect_among)
    return [dataclasses.replace(base, seed=(seed + prompt_index * n + j) % (MAX_SEED + 1) if seed is not None
                                else random.randrange(MAX_SEED + 1)) for j in range(n)]


def begin(app: Host, model: ServedModel, asked: Asked, gone: Gone) -> Exchange:
    """Submit every generation `asked` needs, through the answer caches where it may be answered from them;
    the exchange that follows them. RequestError, OverloadedError as the engine raises them."""
    options = asked.options
    requests = [GenerationRequest(prompt, params, logprobs=options.logprobs, post_sampling=options.post_sampling,
                                  session=asked.session,
                                  suffix=asked.suffix, streamed=asked.streamed, warm=asked.warm,
                                  cache_reuse=asked.cache_reuse, progress=asked.progress)
                for index, prompt in enumerate(asked.prompts)
                for params in attempt_params(asked.params, options, index)]
    # One deterministic answer (greedy, or an explicit seed) may have been kept.
    cacheable = asked.cacheable and not asked.warm and len(requests) == 1 and asked.session is None \
        and options.logprobs is None and (asked.params.temperature == 0 or options.seed is not None)
    submitted = submit(app, model, requests, queue.SimpleQueue(), cacheable, shape(asked.chat, asked.tools),
                       asked.question, gone)
    handles, group = submitted.handles, options.per_prompt
    backend = loaded(model).backend
    # Each prompt's text (a token prompt detokenized once), only where an echo or a thinking model needs it.
    texts = [(prompt if isinstance(prompt, str) else backend.detokenize(prompt))
             if options.echo or asked.thinks else "" for prompt in asked.prompts]
    choices = [Choice(parser=tool_parser(asked.tools), computed=not isinstance(handle, StoredAnswer),
                      thinker=ThinkingSplitter.for_prompt(texts[i // group]) if asked.thinks else None)
               for i, handle in enumerate(handles)]
    echoes = [texts[i // group] if options.echo else "" for i in range(len(handles))]
    prompt_tokens = sum(len(handles[i * group].prompt_tokens) for i in range(len(asked.prompts)))
    return Exchange(app, model, submitted, choices, echoes, prompt_tokens, gone,
                    Ballot(handles, group) if options.elect_among > 1 else None)


@dataclass
class Exchange:
    """The generations of one request after submission: their choices (`per_prompt` next to each other per
    prompt), each one's echoed prompt, the prompts' tokens counted once, the client's `gone` check, and the
    Conclave's ballot when the request asked for best_of."""

    app: Host
    model: ServedModel
    submitted: Submitted
    choices: list[Choice]
    echoes: list[str]
    prompt_tokens: int
    gone: Gone
    ballot: Ballot | None = None

    @property
    def choice(self) -> Choice:
        """The one choice of a request that asked for one."""
        return self.choices[0]

    @property
    def cached(self) -> bool:
        """Answered from a cache: no token was generated for it."""
        return isinstance(self.submitted.handles[0], StoredAnswer)

    @property
    def marks(self) -> dict[str, Any]:
        """Where a kept answer came from (the answer's `reame` object; empty: nothing to say)."""
        return self.submitted.marks

    def cached_tokens(self, usage: Usage) -> int:
        """Of a choice's prompt tokens, those it found computed: all of them for a kept answer."""
        return usage.prompt_tokens if self.cached else usage.cached_tokens

    def prompt_text(self, tag: int) -> str:
        """Choice `tag`'s prompt as the model read it (its tokens' text, special tokens included)."""
        return loaded(self.model).backend.detokenize(self.submitted.handles[tag].prompt_tokens)

    def cancel(self) -> None:
        """Stop generating for a client that went away."""
        for handle in self.submitted.handles:
            handle.cancel()

    def said(self) -> Iterator[Said | EngineGone]:
        """What each choice says as it comes (exchange.said); with a ballot, each attempt votes as it ends."""
        for item in said(self.app, self.model, self.submitted, self.choices, self.gone):
            if isinstance(item, Said) and item.finish is not None and self.ballot is not None:
                choice = self.choices[item.tag]
                voted = choice.text + "".join(f"{call.name}({call.arguments})" for call in choice.calls)
                if self.ballot.finished(item.tag, voted, item.finish.reason, item.finish.usage.completion_tokens):
                    self.app.metrics.add("reame_conclave_early_stops_total")
            yield item

    def elected(self) -> list[Choice]:
        """The answer's choices once every one ended: each prompt's elected attempt with a ballot, else all."""
        if self.ballot is None:
            return self.choices
        size = self.ballot.group
        return [self.choices[i * size + verdict.winner] for i, verdict in enumerate(self.ballot.verdicts())]
