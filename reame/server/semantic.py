"""The semantic answer cache (reame/semantic.py) as the chat route uses it: the question and its scope from
the messages, the question's embedding, and what a lookup found."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from reame.engine import Engine, SamplingParams
from reame.errors import ReameError
from reame.semantic import MAX_QUESTION_CHARS, Match, canonical
from reame.server.http import Handler
from reame.server.service import POLL_S, Service

log = logging.getLogger("reame.server")

# Holds the question's place in the rendered conversation: the scope is the conversation around it.
PLACEHOLDER = "\u2063[reame: the question]\u2063"
EMBEDDING_WAIT_S = 30.0  # the served model embeds between its steps; past this the lookup is skipped


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


def look_up(app: Service, engine: Engine, handler: Handler, question: Question, params: SamplingParams,
            shape: str) -> Lookup | None:
    """The kept question nearest to `question` in its scope (match None: none close enough); None when the
    question could not be embedded (the request is then computed as if the cache were off)."""
    assert app.semantic is not None
    try:
        embedder = app.semantic.embedder
        text = canonical(question.text)
        vector = embedder.embed(text) if embedder else served_embedding(app, engine, handler, text)
    except (ReameError, TimeoutError) as error:
        log.warning("semantic cache: the question was not embedded (%s)", error)
        return None
    if vector is None:
        return None
    index = app.semantic.index
    scope = index.scope(question.context, params, shape)
    return Lookup(scope, question.text, vector, index.find(scope, question.text, vector))


def served_embedding(app: Service, engine: Engine, handler: Handler, text: str) -> list[float] | None:
    """The served model's embedding of `text`, computed by its engine between steps (None: the client left)."""
    tokens = engine.backend.tokenize(text, add_special=True, parse_special=False)
    job = engine.embed([tokens[:engine.backend.embedding_context_tokens]])
    waited = 0.0
    while not job.done.wait(POLL_S):
        app.check_engine()
        waited += POLL_S
        if handler.client_gone() or waited >= EMBEDDING_WAIT_S:
            return None
    return job.result(0)[0]
