"""The semantic answer cache (reame/semantic.py) as the chat route uses it: the question and its scope from
the messages, the question's embedding, and what a lookup found."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from reame.engine import SamplingParams
from reame.errors import ReameError
from reame.semantic import MAX_QUESTION_CHARS, Match, canonical
from reame.server.models import ServedModel, loaded

log = logging.getLogger("reame.server")

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


def look_up(model: ServedModel, served_embedding: Callable[[list[int]], list[list[float]] | None],
            question: Question, params: SamplingParams, shape: str) -> Lookup | None:
    """The kept question nearest to `question` in its scope (match None: none close enough); None when the
    question could not be embedded (the request is then computed as if the cache were off). Without an
    embedder of its own, the cache asks `served_embedding` for the served model's (None: the client left)."""
    semantic = model.semantic
    assert semantic is not None
    try:
        embedder = semantic.embedder
        text = canonical(question.text)
        if embedder is not None:
            vector = embedder.embed(text)
        else:  # the served model's embedding, computed by its engine between steps
            backend = loaded(model).backend
            tokens = backend.tokenize(text, add_special=True, parse_special=False)
            vectors = served_embedding(tokens[:backend.embedding_context_tokens])
            if vectors is None:
                return None  # the client left
            vector = vectors[0]
    except ReameError as error:
        log.warning("semantic cache: the question was not embedded (%s)", error)
        return None
    index = semantic.index
    scope = index.scope(question.context, params, shape)
    return Lookup(scope, question.text, vector, index.find(scope, question.text, vector))
