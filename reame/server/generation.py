"""Generations over the engine, as OpenAI's completions and chat shape them: prompts and their choices (or the
Conclave's attempts) submitted together, answered from the exact answer cache where one is kept, a session
reserved and released as soon as its turn ends, and the events streamed as SSE or collected into one answer
while the client is still there."""

from __future__ import annotations

import dataclasses
import queue
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from reame.conclave import Ballot, attempts
from reame.engine import Engine, GenerationRequest, SamplingParams
from reame.errors import OverloadedError, RequestError
from reame.model.sampling import MAX_SEED
from reame.server.exchange import EngineGone, Said, StoredAnswer, Submitted, said, shape, submit
from reame.server.client import Asker, Client, Event, Header, HttpError, Opening, Whole
from reame.server.models import ServedModel, loaded
from reame.semantic import Question
from reame.server.service import Service, as_http_error, failure, refusal
from reame.server.shapes import Choice, Response
from reame.server.validation import (MAX_CHOICES, Fields, answer_cache_allowed, sampling_params,
                                     semantic_cache_allowed, stream_usage)
from reame.structured.thinking import ThinkingSplitter
from reame.structured.tools import ToolRequest, tool_parser


CACHE_HEADER = "X-Reame-Cache"  # where the answer came from (exchange.CACHE_ states)


@dataclass(frozen=True)
class Ask:
    """What a completion or chat request asks once its route has read it: its prompts (several for a
    completion's prompt list), whether it is a chat, and what shapes its answers. `elect_among` > 1: each
    prompt's answer is elected by the Conclave among that many attempts; `question`: the chat's last question,
    for the semantic cache; `thinks`: the model thinks in <think>…</think> (its answers are split into
    reasoning_content and content). The fields every such request shares (n, stream, seed, session, sampling)
    `generate` reads itself."""

    prompts: list[Any]
    max_tokens: int | None
    chat: bool
    echo: bool = False
    logprobs: int | None = None
    tools: ToolRequest | None = None
    suffix: str | None = None
    grammar: str | None = None
    elect_among: int = 1
    question: Question | None = None
    thinks: bool = False


def generate(app: Service, handler: Asker, fields: Fields, model: ServedModel, ask: Ask) -> None:
    """Answer `ask` with `model`: streamed or whole, its session reserved for as long as its turn runs."""
    n = fields.integer("n", 1, 1, MAX_CHOICES)
    generations = len(ask.prompts) * max(n, ask.elect_among)
    if generations > MAX_CHOICES:
        raise HttpError(400, f"a request asks at most {MAX_CHOICES} generations in all (prompts × n × best_of); "
                        f"this one asks {generations}", param="n", code="invalid_value")
    stream = fields.boolean("stream", False)
    include_usage = stream_usage(fields)
    seed = fields.integer("seed", None, 0, 2**32 - 2)
    if ask.elect_among > 1 and stream:
        raise HttpError(400, "best_of answers are elected once every attempt has ended: they cannot be "
                        "streamed", param="best_of", code="unsupported_parameter")
    reserved = session_for(model, handler.owner, fields, max(n, ask.elect_among), ask.prompts)
    released = False

    def release_session() -> None:
        # As soon as every choice has finished (the engine has stored the session's state), not
        # after the answer is written: a client's next turn may arrive before this thread returns.
        # Once only: by the `finally` below, that next turn may hold the session.
        nonlocal released
        if reserved and not released:
            released = True
            app.ready_sessions(model).release(handler.owner, reserved[0])
    try:
        submitted = submitted_ask(app, handler, fields, model, ask, n, seed, stream, reserved[1] if reserved else None)
        answer = answer_for(app, handler, model, ask, submitted, release_session)
        if stream:
            stream_answer(answer, include_usage)
        else:
            collect_answer(answer, Ballot(submitted.handles, ask.elect_among) if ask.elect_among > 1 else None)
    finally:
        release_session()


def submitted_ask(app: Service, client: Client, fields: Fields, model: ServedModel, ask: Ask, n: int,
                  seed: int | None, stream: bool, session: Any) -> Submitted:
    """Every generation `ask` needs (n choices or the Conclave's attempts per prompt, seeded per choice from
    `seed`), submitted through the exchange; the cache header says where the answer comes from. The last
    fields are read before anything is submitted: a 400 after it would leave generations running."""
    base = dataclasses.replace(sampling_params(fields, ask.max_tokens, None), grammar=ask.grammar)
    requests = [GenerationRequest(prompt, params, logprobs=ask.logprobs, session=session, suffix=ask.suffix,
                                  streamed=stream)
                for prompt_index, prompt in enumerate(ask.prompts)
                for params in attempt_params(base, seed, prompt_index, n, ask.elect_among)]
    # One deterministic answer (greedy, or an explicit seed) may have been kept.
    cacheable = len(requests) == 1 and session is None and ask.logprobs is None and \
        (base.temperature == 0 or seed is not None) and answer_cache_allowed(fields)
    try:
        submitted = submit(app, model, requests, queue.SimpleQueue(), cacheable, shape(ask.chat, ask.tools),
                           ask.question if semantic_cache_allowed(fields) else None, client.gone)
    except (RequestError, OverloadedError) as error:
        raise refusal(error, "messages" if ask.chat else "prompt") from None
    client.send(Header(CACHE_HEADER, submitted.cache))
    return submitted


def answer_for(app: Service, client: Client, model: ServedModel, ask: Ask, submitted: Submitted,
               finished: Callable[[], None]) -> Answer:
    """The answer to make of what was submitted: one choice per handle, each prompt's echo, its shape."""
    engine, handles = loaded(model), submitted.handles
    group = len(handles) // len(ask.prompts)  # handles per prompt: its n choices or its attempts
    prompt_tokens = sum(len(handles[i * group].prompt_tokens) for i in range(len(ask.prompts)))
    # Each prompt's text (a token prompt detokenized once), only where an echo or a thinking model needs it.
    texts = [echo_text(engine, prompt) if ask.echo or ask.thinks else "" for prompt in ask.prompts]
    response = Response(ask.chat, model.name, engine.backend.token_piece if ask.logprobs is not None else None,
                        per_prompt=group)
    choices = [Choice(parser=tool_parser(ask.tools), computed=not isinstance(handle, StoredAnswer),
                      thinker=ThinkingSplitter.for_prompt(texts[i // group]) if ask.thinks else None)
               for i, handle in enumerate(handles)]
    echoes = [texts[i // group] if ask.echo else "" for i in range(len(handles))]
    return Answer(app, client, model, submitted, response, choices, echoes, prompt_tokens, finished)


def attempt_params(base: SamplingParams, seed: int | None, prompt_index: int, n: int,
                   elect_among: int) -> list[SamplingParams]:
    """Each choice's settings (seeds follow on from the request's), or the Conclave's attempts."""
    if elect_among > 1:
        return attempts(dataclasses.replace(base, seed=None if seed is None else
                                            (seed + prompt_index) % (MAX_SEED + 1)), elect_among)
    return [dataclasses.replace(base, seed=(seed + prompt_index * n + j) % (MAX_SEED + 1) if seed is not None
                                else random.randrange(MAX_SEED + 1)) for j in range(n)]


def echo_text(engine: Engine, prompt: Any) -> str:
    return prompt if isinstance(prompt, str) else engine.backend.detokenize(prompt)


@dataclass
class Answer:
    """One OpenAI answer being made: its exchange (submitted), how it is shaped, its choices' state, and
    `finished`, called once every choice has ended (it releases the session)."""

    app: Service
    client: Client
    model: ServedModel
    submitted: Submitted
    response: Response
    choices: list[Choice]
    echoes: list[str]
    prompt_tokens: int
    finished: Callable[[], None]

    def said(self) -> Iterator[Said | EngineGone]:
        return said(self.app, self.model, self.submitted, self.choices, self.client.gone)


def collect_answer(answer: Answer, ballot: Ballot | None = None) -> None:
    """The whole answer once every choice ended; with `ballot`, one elected per prompt among its attempts
    (each votes as it ends, a prompt's others stop once its majority is certain)."""
    app, choices, response = answer.app, answer.choices, answer.response
    for choice, echo in zip(choices, answer.echoes):
        choice.pieces.append(echo)
    for item in answer.said():
        if isinstance(item, EngineGone):
            raise as_http_error(item.error)
        if item.finish is not None and ballot is not None:
            choice = choices[item.tag]
            voted = choice.text + "".join(f"{call.name}({call.arguments})" for call in choice.calls)
            if ballot.finished(item.tag, voted, item.finish.reason, item.finish.usage.completion_tokens):
                app.metrics.add("reame_conclave_early_stops_total")
    if any(choice.finish is None for choice in choices):
        return  # the client left
    answer.finished()
    # A timeout first (a retry may succeed), then an error.
    for reason in ("timeout", "error"):
        ended = next((c.finish for c in choices if c.finish and c.finish.reason == reason), None)
        failed = failure(ended) if ended is not None else None
        if failed is not None:
            raise failed
    if ballot is None:
        body = response.whole(choices, answer.prompt_tokens)
        if answer.submitted.marks:
            body["reame"] = answer.submitted.marks
        answer.client.send(Whole(200, body))
        return
    verdicts = ballot.verdicts()
    size = ballot.group
    body = response.whole([choices[i * size + verdict.winner] for i, verdict in enumerate(verdicts)],
                          answer.prompt_tokens)
    body["usage"] = response.usage(choices, answer.prompt_tokens)  # every attempt's tokens were generated
    body["reame"] = {"conclave": [verdict.summary() for verdict in verdicts]}
    app.metrics.add("reame_conclave_elections_total", len(verdicts))
    answer.client.send(Whole(200, body))


def stream_answer(answer: Answer, include_usage: bool) -> None:
    client, response, choices = answer.client, answer.response, answer.choices
    client.send(Opening())
    try:
        for index, echo in enumerate(answer.echoes):
            first = response.first_chunk(index, echo)
            if first is not None:
                client.send(Event(first))
        remaining = len(choices)
        for item in answer.said():
            if isinstance(item, EngineGone):  # the stream has begun: the error goes in it, and it ends
                client.send(Event(as_http_error(item.error).body()))
                return
            tag, choice = item.tag, choices[item.tag]
            if item.thinking:
                client.send(Event(response.reasoning_chunk(tag, item.thinking)))
            elif item.text and choice.tokens:  # held-back tokens' logprobs ride along with the next text
                client.send(Event(response.chunk(tag, item.text, tokens=choice.tokens)))
                choice.tokens = []
            elif item.text:
                client.send(Event(response.text_chunk(tag, item.text)))
            elif item.call is not None:
                client.send(Event(response.tool_call_chunk(tag, choice.calls.index(item.call), item.call)))
            elif item.finish is not None:
                remaining -= 1
                if not remaining:
                    answer.finished()
                failed = failure(item.finish)
                client.send(Event(failed.body() if failed is not None else
                                   response.chunk(tag, "", choice.finish_reason(), choice.tokens)))
        if remaining:
            return  # the client left
        if include_usage:
            client.send(Event(response.usage_chunk(choices, answer.prompt_tokens)))
        client.send(Event("[DONE]"))
    except OSError:  # the client went away: stop generating for it
        for handle in answer.submitted.handles:
            handle.cancel()


def session_for(model: ServedModel, owner: str, fields: Fields, n: int,
                prompts: list[Any]) -> tuple[str, Any] | None:
    session_id = fields.body.get("session")
    if session_id is None:
        return None
    if not isinstance(session_id, str):
        raise fields.bad("session", "a session id string")
    if n != 1 or len(prompts) != 1:
        raise HttpError(400, "a session continues one conversation: use n = 1 and one prompt", param="session",
                        code="invalid_value")
    return session_id, Service.ready_sessions(model).acquire(owner, session_id)

