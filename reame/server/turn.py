"""What every API family does around the exchange (exchange.py): a chat's prompt, a forced tool call's grammar,
the exchange started (the engine's refusals made the family's 400 or 429, the cache header sent); and for the
families that answer one generation (Ollama's, Anthropic's, Responses) what its lone choice says as it comes
(text, thinking, tool calls, an engine's death as an error end), or the whole of it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from reame.engine import Engine, FinishEvent
from reame.errors import OverloadedError, RequestError
from reame.server.client import Client, Header, HttpError
from reame.server.exchange import Asked, EngineGone, Exchange, Said, begin
from reame.server.models import ServedModel
from reame.server.service import Service, failure, refusal
from reame.structured.requested import forced_tool_grammar
from reame.structured.tools import ToolCall, ToolRequest, template_messages

CACHE_HEADER = "X-Reame-Cache"  # where the answer came from (exchange.CACHE_ states)


def chat_prompt(engine: Engine, messages: list[dict[str, Any]], tools: ToolRequest | None,
                enable_thinking: bool | None = None, continued: bool = False) -> str:
    """A chat turn's prompt: the model's template over `messages` (tools laid out by the template, or described
    in a message of Reame's when it has no place for them), then the start of a forced tool call. `continued`
    (see `continues_final`): the last message is an assistant's answer begun, which the model goes on with:
    the template over the others, then its text."""
    begun = ""
    if continued:
        if tools is not None and tools.forced is not None:
            raise HttpError(400, "a forced tool call cannot continue an assistant message: drop the last message "
                            "or the tool_choice", param="messages", code="invalid_value")
        begun, messages = messages[-1]["content"], messages[:-1]
    in_template = engine.backend.template_supports_tools
    prompt = engine.chat_prompt(template_messages(messages, tools, in_template),
                                tools.tools if tools and in_template else None, enable_thinking)
    return prompt + begun + (tools.prefill if tools is not None else "")


def continues_final(messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    continue_final_message: Any = None) -> bool:
    """Whether a chat's last message, an assistant's, is continued rather than answered, as llama-server
    decides it (and vLLM's `continue_final_message`, Anthropic's prefill): asked with `continue_final_message`
    (true, or "content"), else whenever the last message is an assistant's. 400 for what llama-server refuses:
    two assistant messages at the end, `add_generation_prompt` beside a continuation, a continued message with
    tool calls, a continuation asked with no assistant message last."""
    last = messages[-1] if messages else {}
    asked = continue_final_message is True or continue_final_message == "content"
    if continue_final_message not in (None, False, True, "content"):
        raise HttpError(400, "'continue_final_message' must be a boolean or \"content\"",
                        param="continue_final_message", code="invalid_value")
    if not asked and last.get("role") == "assistant":
        if len(messages) >= 2 and messages[-2]["role"] == "assistant":
            raise HttpError(400, "Cannot have 2 or more assistant messages at the end of the list.",
                            param="messages", code="invalid_value")
        return not last.get("tool_calls")
    if asked:
        if add_generation_prompt:
            raise HttpError(400, "Cannot set both add_generation_prompt and continue_final_message to true.",
                            param="continue_final_message", code="invalid_value")
        if last.get("role") != "assistant" or last.get("tool_calls"):
            raise HttpError(400, "continue_final_message continues a last assistant message without tool calls",
                            param="continue_final_message", code="invalid_value")
    return asked


def answer_grammar(tools: ToolRequest | None, requested: str | None, field: str) -> str | None:
    """The grammar an answer follows: a forced tool call's, else the one the request asked for in `field`;
    both is a 400 naming that field."""
    if tools is None or tools.forced is None:
        return requested
    if requested is not None:
        raise HttpError(400, f"a forced tool call already fixes the answer's shape: drop {field}",
                        param=field.split(".")[0], code="invalid_value")
    return forced_tool_grammar(tools)


def start(app: Service, client: Client, model: ServedModel, asked: Asked, prompt_param: str = "messages") -> Exchange:
    """Submit what a request `asked` through the exchange (from the caches when it may be, and kept); the
    X-Reame-Cache header says where its answer comes from. 400/429 naming `prompt_param` when the engine
    refuses it."""
    try:
        exchange = begin(app, model, asked, client.gone)
    except (RequestError, OverloadedError) as error:
        raise refusal(error, prompt_param) from None
    client.send(Header(CACHE_HEADER, exchange.submitted.cache))
    return exchange


def said(exchange: Exchange) -> Iterator[Said]:
    """The lone choice's pieces as they come, then one with its end (counted in the metrics; an engine that
    died meanwhile ends it as an error, engine_unavailable). Stops, cancelling the generation, when the
    client goes away."""
    for item in exchange.said():
        if isinstance(item, EngineGone):  # the answer ends in an error every family can say
            exchange.choice.finish = item.finish(exchange.prompt_tokens)
            yield Said(finish=exchange.choice.finish)
            return
        yield item


def whole(exchange: Exchange) -> tuple[list[ToolCall], FinishEvent] | None:
    """The whole answer's tool calls and end (its text is `exchange.choice.text`, its thinking
    `exchange.choice.thinking`); None when the client left. Raises the HTTP error of an answer that failed."""
    calls: list[ToolCall] = []
    finish: FinishEvent | None = None
    for piece in said(exchange):
        if piece.call is not None:
            calls.append(piece.call)
        finish = piece.finish or finish
    if finish is None:
        return None
    failed = failure(finish)
    if failed is not None:
        raise failed
    return calls, finish
