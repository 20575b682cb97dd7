"""One answer, as the API families after OpenAI's completions shape it (Ollama's, Anthropic's, Responses): a
single generation submitted through the exchange (exchange.py), and what it says as it comes — text,
thinking, tool calls — then how it ended. Each family turns these into its own stream or whole answer."""

from __future__ import annotations

import queue
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from reame.engine import Engine, FinishEvent, GenerationRequest
from reame.errors import OverloadedError, RequestError
from reame.server.exchange import StoredAnswer
from reame.server.exchange import EngineGone, Said, Submitted, submit
from reame.server.exchange import said as said_by_choices
from reame.server.generation import CACHE_HEADER
from reame.server.client import Client, Header, HttpError
from reame.server.models import ServedModel
from reame.semantic import Question
from reame.server.service import Service, failure, refusal
from reame.server.shapes import Choice
from reame.structured.thinking import ThinkingSplitter
from reame.structured.requested import forced_tool_grammar
from reame.structured.tools import ToolCall, ToolRequest, template_messages, tool_parser


@dataclass
class Turn:
    model: ServedModel
    submitted: Submitted
    choice: Choice

    @property
    def handle(self) -> Any:
        return self.submitted.handles[0]

    @property
    def prompt_tokens(self) -> int:
        return len(self.handle.prompt_tokens)

    @property
    def marks(self) -> dict[str, Any]:
        """Where a kept answer came from."""
        return self.submitted.marks

    @property
    def cached(self) -> bool:
        """Answered from a cache: no token was generated for it."""
        return isinstance(self.handle, StoredAnswer)


def chat_prompt(engine: Engine, messages: list[dict[str, Any]], tools: ToolRequest | None,
                enable_thinking: bool | None = None) -> str:
    """A chat turn's prompt: the model's template over `messages` (tools laid out by the template, or described
    in a message of Reame's when it has no place for them), then the start of a forced tool call."""
    in_template = engine.backend.template_supports_tools
    prompt = engine.chat_prompt(template_messages(messages, tools, in_template),
                                tools.tools if tools and in_template else None, enable_thinking)
    return prompt + (tools.prefill if tools is not None else "")


def answer_grammar(tools: ToolRequest | None, requested: str | None, field: str) -> str | None:
    """The grammar an answer follows: a forced tool call's, else the one the request asked for in `field`;
    both is a 400 naming that field."""
    if tools is None or tools.forced is None:
        return requested
    if requested is not None:
        raise HttpError(400, f"a forced tool call already fixes the answer's shape: drop {field}",
                        param=field.split(".")[0], code="invalid_value")
    return forced_tool_grammar(tools)


def start(app: Service, client: Client, model: ServedModel, request: GenerationRequest, tools: ToolRequest | None,
          cacheable: bool, kind: str, question: Question | None = None, prompt_param: str = "messages",
          thinks: bool = False) -> Turn:
    """Submit one generation (from the caches when `cacheable` and kept); 400/429 when the engine refuses.
    `thinks`: the model thinks in <think>…</think>, said apart from the answer."""
    try:
        submitted = submit(app, model, [request], queue.SimpleQueue(), cacheable, kind, question, client.gone)
    except (RequestError, OverloadedError) as error:
        raise refusal(error, prompt_param) from None
    client.send(Header(CACHE_HEADER, submitted.cache))
    handle = submitted.handles[0]
    thinker = ThinkingSplitter.for_prompt(request.prompt) if thinks and isinstance(request.prompt, str) else None
    choice = Choice(parser=tool_parser(tools), computed=not isinstance(handle, StoredAnswer), thinker=thinker)
    return Turn(model, submitted, choice)


def said(app: Service, client: Client, turn: Turn) -> Iterator[Said]:
    """The answer's pieces as they come, then one with its end (counted in the metrics; an engine that died
    meanwhile ends it as an error, engine_unavailable). Stops, cancelling the generation, when the client
    goes away."""
    choice = turn.choice
    for item in said_by_choices(app, turn.model, turn.submitted, [choice], client.gone):
        if isinstance(item, EngineGone):  # the answer ends in an error every family can say
            choice.finish = item.finish(turn.prompt_tokens)
            yield Said(finish=choice.finish)
            return
        yield item


def whole(app: Service, client: Client, turn: Turn) -> tuple[list[ToolCall], FinishEvent] | None:
    """The whole answer's tool calls and end (its text is `turn.choice.text`, its thinking
    `turn.choice.thinking`); None when the client left.
    Raises the HTTP error of an answer that failed."""
    calls: list[ToolCall] = []
    finish: FinishEvent | None = None
    for piece in said(app, client, turn):
        if piece.call is not None:
            calls.append(piece.call)
        finish = piece.finish or finish
    if finish is None:
        return None
    failed = failure(finish)
    if failed is not None:
        raise failed
    return calls, finish
