"""OpenAI's completions and chat over the exchange (exchange.py): the fields every such request shares (n,
stream, seed, session) read into its options, a session reserved and released as soon as its turn ends, and
the exchange's items encoded as OpenAI's stream chunks or its whole answer (the Conclave's elected one for
best_of)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from reame.server import turn
from reame.server.client import Asker, Client, Event, HttpError, Opening, Whole
from reame.server.exchange import Asked, EngineGone, Exchange, Said
from reame.server.models import ServedModel, loaded
from reame.server.service import Service, as_http_error, failure
from reame.server.shapes import Response
from reame.server.telemetry import Telemetry, final_timings
from reame.server.validation import (MAX_CHOICES, Fields, answer_cache_allowed, semantic_cache_allowed,
                                     stream_usage)


def generate(app: Service, handler: Asker, fields: Fields, model: ServedModel, asked: Asked) -> None:
    """Answer what a completion or chat request `asked` of `model` (its n, stream, seed and session read here),
    streamed or whole, its session reserved for as long as its turn runs."""
    options = asked.options
    n = fields.integer("n", 1, 1, MAX_CHOICES)
    generations = len(asked.prompts) * max(n, options.elect_among)
    if generations > MAX_CHOICES:
        raise HttpError(400, f"a request asks at most {MAX_CHOICES} generations in all (prompts × n × best_of); "
                        f"this one asks {generations}", param="n", code="invalid_value")
    stream = fields.boolean("stream", False)
    include_usage = stream_usage(fields)
    telemetry = Telemetry.asked(fields)
    verbose = fields.boolean("verbose", False)
    seed = fields.integer("seed", None, 0, 2**32 - 2)
    if options.elect_among > 1 and stream:
        raise HttpError(400, "best_of answers are elected once every attempt has ended: they cannot be "
                        "streamed", param="best_of", code="unsupported_parameter")
    reserved = session_for(model, handler.owner, fields, max(n, options.elect_among), asked.prompts)
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
        asked = dataclasses.replace(
            asked, options=dataclasses.replace(options, n=n, seed=seed), streamed=stream,
            session=reserved[1] if reserved else None, cacheable=answer_cache_allowed(fields),
            progress=stream and telemetry.watches_prefill,
            question=asked.question if semantic_cache_allowed(fields) else None)
        exchange = turn.start(app, handler, model, asked, "messages" if asked.chat else "prompt")
        response = Response(asked.chat, model.name,
                            loaded(model).backend.token_piece if options.logprobs is not None else None,
                            per_prompt=asked.options.per_prompt)
        answer = Answer(exchange, handler, response, release_session, telemetry, verbose)
        if stream:
            stream_answer(answer, include_usage)
        else:
            collect_answer(answer)
    finally:
        release_session()


@dataclass
class Answer:
    """One OpenAI answer being made: its exchange, whom it goes to, how it is shaped, and `finished`, called
    once every choice has ended (it releases the session)."""

    exchange: Exchange
    client: Client
    response: Response
    finished: Callable[[], None]
    telemetry: Telemetry = dataclasses.field(default_factory=Telemetry)
    verbose: bool = False  # llama-server's `verbose`: the whole answer carries `__verbose` (its prompt, as read)

    def said(self) -> Iterator[Said | EngineGone]:
        return self.exchange.said()


def collect_answer(answer: Answer) -> None:
    """The whole answer once every choice ended; with best_of, the one elected per prompt among its attempts."""
    exchange, response = answer.exchange, answer.response
    choices = exchange.choices
    for choice, echo in zip(choices, exchange.echoes):
        choice.pieces.append(echo)
    for item in answer.said():
        if isinstance(item, EngineGone):
            raise as_http_error(item.error)
    if any(choice.finish is None for choice in choices):
        return  # the client left
    answer.finished()
    # A timeout first (a retry may succeed), then an error.
    for reason in ("timeout", "error"):
        ended = next((c.finish for c in choices if c.finish and c.finish.reason == reason), None)
        failed = failure(ended) if ended is not None else None
        if failed is not None:
            raise failed
    body = response.whole(exchange.elected(), exchange.prompt_tokens)
    if exchange.ballot is not None:
        verdicts = exchange.ballot.verdicts()
        body["usage"] = response.usage(choices, exchange.prompt_tokens)  # every attempt's tokens were generated
        body["reame"] = {"conclave": [verdict.summary() for verdict in verdicts]}
        exchange.app.metrics.add("reame_conclave_elections_total", len(verdicts))
    elif exchange.marks:
        body["reame"] = exchange.marks
    if answer.verbose:
        body["__verbose"] = verbose_record(exchange)
    answer.client.send(Whole(200, body))


def verbose_record(exchange: Exchange) -> dict[str, Any]:
    """llama-server's `__verbose` object of a whole answer (its first choice): the prompt as the model read it
    (special tokens included), what it said, and its counts and timings, for debugging a template."""
    choice = exchange.choices[0]
    assert choice.finish is not None
    usage = choice.finish.usage
    cached = exchange.cached_tokens(usage)
    return {"prompt": exchange.prompt_text(0), "content": choice.text, "tokens_predicted": usage.completion_tokens,
            "tokens_evaluated": usage.prompt_tokens, "tokens_cached": cached,
            "timings": final_timings(usage, cached)}


def timed(chunk: dict[str, Any], timings: dict[str, Any] | None) -> dict[str, Any]:
    """A stream chunk with llama-server's `timings` so far, when the request asked for them on every piece."""
    if timings is not None:
        chunk["timings"] = timings
    return chunk


def stream_answer(answer: Answer, include_usage: bool) -> None:
    client, response, exchange, telemetry = answer.client, answer.response, answer.exchange, answer.telemetry
    choices = exchange.choices
    client.send(Opening())
    try:
        for index, echo in enumerate(exchange.echoes):
            first = response.first_chunk(index, echo)
            if first is not None:
                client.send(Event(first))
        remaining = len(choices)
        for item in answer.said():
            if isinstance(item, EngineGone):  # the stream has begun: the error goes in it, and it ends
                client.send(Event(as_http_error(item.error).body()))
                return
            tag, choice = item.tag, choices[item.tag]
            if item.progress is not None:
                shaped = telemetry.progressed(tag, item.progress)
                if shaped is not None:
                    client.send(Event(timed(response.progress_chunk(tag, shaped), telemetry.running(tag))))
            elif item.thinking:
                client.send(Event(response.reasoning_chunk(tag, item.thinking)))
            elif item.text and (choice.tokens or telemetry.per_token):
                # held-back tokens' logprobs ride along with the next text
                telemetry.decoded(tag, len(choice.ids))
                client.send(Event(timed(response.chunk(tag, item.text, tokens=choice.tokens),
                                        telemetry.running(tag))))
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
            usage = response.usage_chunk(choices, exchange.prompt_tokens)
            finish = choices[0].finish
            if finish is not None:  # llama-server's last chunk says the first choice's timings
                usage["timings"] = final_timings(finish.usage, exchange.cached_tokens(finish.usage))
            client.send(Event(usage))
        client.send(Event("[DONE]"))
    except OSError:  # the client went away: stop generating for it
        exchange.cancel()


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

