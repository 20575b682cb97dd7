"""Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`), for the `anthropic` SDK and
the tools built on it (agent SDKs, anything that lets users set ANTHROPIC_BASE_URL): system, multi-turn
text, `tool_use` and `tool_result` blocks, tools and tool_choice, stop sequences, `output_config.format`
(a JSON schema), streaming with Anthropic's event sequence, usage, Anthropic's error shape; `x-api-key`
authenticates as a bearer key does. The same engine and caches as every route (exchange.py,
turn.py). Today's SDK sends no sampling settings (Anthropic's default temperature, 1.0, applies); older
clients' `temperature`, `top_p` and `top_k` are read.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from typing import Any

from reame.engine import Engine, FinishEvent, GenerationRequest
from reame.server import turn
from reame.server.client import Asker, Client, Event, HttpError, Opening, Whole
from reame.server.routes import Route
from reame.server.exchange import Asked, Exchange
from reame.server.models import loaded
from reame.server.service import Service, failure
from reame.server.validation import Fields, chat_messages, requested_model, sampling_params
from reame.structured.json_schema import schema_to_gbnf
from reame.structured.requested import checked
from reame.structured.tools import ToolCall, ToolRequest, tool_request

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


def error_body(error: HttpError) -> dict[str, Any]:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(error.status, "api_error"), "message": error.message}}


def text_of(content: Any, where: str) -> str:
    """A string, or text blocks joined (anything else is a 400 naming it)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise HttpError(400, f"{where}: must be a string or an array of content blocks", param=where)
    texts = []
    for index, block in enumerate(content):
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            raise HttpError(400, f"{where}.{index}: only text blocks are supported here", param=where)
        texts.append(block["text"])
    return "\n".join(texts)


def conversation(body: dict[str, Any]) -> list[dict[str, Any]]:
    """Anthropic's system and messages as OpenAI-shaped chat messages (what the templates read): tool_use
    blocks become an assistant's tool_calls, tool_result blocks tool messages, an assistant's thinking blocks
    its `reasoning_content` (a client sends back the thinking it was given; redacted_thinking, encrypted by
    Anthropic for its own models, is read by none here and dropped)."""
    converted: list[dict[str, Any]] = []
    if body.get("system") is not None:
        converted.append({"role": "system", "content": text_of(body["system"], "system")})
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise HttpError(400, "messages: must be a non-empty array", param="messages")
    for index, message in enumerate(messages):
        where = f"messages.{index}"
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
            raise HttpError(400, f"{where}.role: must be 'user' or 'assistant'", param=where)
        content = message.get("content")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(blocks, list):
            raise HttpError(400, f"{where}.content: must be a string or an array of content blocks", param=where)
        texts, calls, thoughts = [], [], []
        for number, block in enumerate(blocks):
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text" and isinstance(block.get("text"), str):
                texts.append(block["text"])
            elif kind == "thinking" and message["role"] == "assistant" and isinstance(block.get("thinking"), str):
                thoughts.append(block["thinking"])
            elif kind == "redacted_thinking" and message["role"] == "assistant":
                pass
            elif kind == "tool_use" and message["role"] == "assistant" and isinstance(block.get("name"), str):
                calls.append({"id": str(block.get("id", "")), "type": "function",
                              "function": {"name": block["name"], "arguments": block.get("input") or {}}})
            elif kind == "tool_result" and message["role"] == "user":
                result = text_of(block.get("content", ""), f"{where}.content.{number}.content")
                converted.append({"role": "tool", "tool_call_id": str(block.get("tool_use_id", "")),
                                  "content": ("Error: " + result) if block.get("is_error") else result})
            else:
                raise HttpError(400, f"{where}.content.{number}: a {kind or 'malformed'} block is not supported "
                                "here (text, thinking and tool_use in assistant turns, tool_result in user turns)",
                                param=where)
        if texts or calls or thoughts:
            entry: dict[str, Any] = {"role": message["role"], "content": "\n".join(texts)}
            if calls:
                entry["tool_calls"] = calls
            if thoughts:
                entry["reasoning_content"] = "\n".join(thoughts)
            converted.append(entry)
    return chat_messages(converted)


def tools_of(body: dict[str, Any]) -> ToolRequest | None:
    """Anthropic's tools and tool_choice as the OpenAI ones the tool layer reads."""
    tools = body.get("tools")
    if not tools:
        return None
    if not isinstance(tools, list):
        raise HttpError(400, "tools: must be an array", param="tools")
    functions = []
    for index, tool in enumerate(tools):
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
            raise HttpError(400, f"tools.{index}: a tool needs a name and an input_schema", param="tools")
        functions.append({"type": "function", "function": {"name": tool["name"],
                                                          "description": tool.get("description", ""),
                                                          "parameters": tool.get("input_schema", {})}})
    choice = body.get("tool_choice") or {"type": "auto"}
    if not isinstance(choice, dict) or choice.get("type") not in ("auto", "any", "tool", "none"):
        raise HttpError(400, "tool_choice: must be {type: auto|any|tool|none}", param="tool_choice")
    if choice["type"] == "none":
        return None
    openai_choice: Any = {"auto": "auto", "any": "required"}.get(choice["type"]) or \
        {"type": "function", "function": {"name": choice.get("name")}}
    return tool_request({"tools": functions, "tool_choice": openai_choice,
                         "parallel_tool_calls": not choice.get("disable_parallel_tool_use", False)})


def thinking_switch(body: dict[str, Any], switchable: bool) -> bool | None:
    """`thinking` ({"type": "enabled" | "disabled" | "adaptive"}) for a template that can turn the model's
    thinking off; None otherwise (the template's default)."""
    thinking = body.get("thinking")
    if thinking is None:
        return None
    if not isinstance(thinking, dict) or thinking.get("type") not in ("enabled", "disabled", "adaptive"):
        raise HttpError(400, "thinking: must be {\"type\": \"enabled\" | \"disabled\" | \"adaptive\"}",
                        param="thinking")
    return thinking["type"] != "disabled" if switchable else None


def prompt_of(engine: Engine, body: dict[str, Any]) -> tuple[str, ToolRequest | None]:
    """The prompt of a Messages request; a last assistant message is the answer's beginning (Anthropic's
    prefill), which the model continues."""
    tools, messages = tools_of(body), conversation(body)
    prefilled = messages[-1]["role"] == "assistant" and not messages[-1].get("tool_calls")
    return turn.chat_prompt(engine, messages, tools, thinking_switch(body, engine.backend.template_thinks[1]),
                            prefilled), tools


def messages(app: Service, handler: Asker, _path: str) -> None:
    fields = Fields(handler.read_json())
    body = fields.body
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise HttpError(400, "model: field required", param="model")
    max_tokens = fields.integer("max_tokens", None, 1, None)
    if max_tokens is None:
        raise HttpError(400, "max_tokens: field required", param="max_tokens")
    served = app.model(handler, model)
    engine = loaded(served)
    prompt, tools = prompt_of(engine, body)
    sampling = Fields({"temperature": body.get("temperature", 1.0), "top_p": body.get("top_p", 1.0),
                       "top_k": body.get("top_k", 0), "stop": body.get("stop_sequences")})
    params = sampling_params(sampling, max_tokens, None)
    grammar = turn.answer_grammar(tools, output_grammar(body.get("output_config")), "output_config.format")
    stream = fields.boolean("stream", False)
    current = turn.start(app, handler, served, Asked([prompt], dataclasses.replace(params, grammar=grammar),
                                                     streamed=stream, tools=tools,
                                                     thinks=engine.backend.template_thinks[0]))
    reply = Reply(model, current)
    if stream:
        reply.stream(app, handler)
    else:
        reply.whole(app, handler)


def output_grammar(config: Any) -> str | None:
    """`output_config.format` ({"type": "json_schema", "schema": {…}}): the grammar the answer must follow.
    (`effort`, and `thinking` elsewhere, are Claude's own: accepted and ignored.)"""
    if config is None:
        return None
    if not isinstance(config, dict):
        raise HttpError(400, "output_config: must be an object", param="output_config")
    spec = config.get("format")
    if spec is None:
        return None
    if not isinstance(spec, dict) or spec.get("type") != "json_schema" or not isinstance(spec.get("schema"), dict):
        raise HttpError(400, "output_config.format: must be {\"type\": \"json_schema\", \"schema\": {…}}",
                        param="output_config")
    return checked(schema_to_gbnf(spec["schema"], param="output_config.format.schema"))


class Reply:
    """One Messages answer: whole, or as Anthropic's event stream."""

    def __init__(self, model: str, current: Exchange) -> None:
        self.model = model
        self.turn = current
        self.id = "msg_" + uuid.uuid4().hex[:24]

    def usage(self, finish: FinishEvent | None) -> dict[str, int]:
        cached = self.turn.prompt_tokens if self.turn.cached else (finish.usage.cached_tokens if finish else 0)
        return {"input_tokens": self.turn.prompt_tokens - cached, "output_tokens":
                finish.usage.completion_tokens if finish else 0, "cache_read_input_tokens": cached,
                "cache_creation_input_tokens": 0}

    def stop(self, finish: FinishEvent, calls: bool) -> tuple[str, str | None]:
        if calls:
            return "tool_use", None
        if finish.reason == "length":
            return "max_tokens", None
        if finish.stop_sequence:
            return "stop_sequence", finish.stop_sequence
        return "end_turn", None

    def whole(self, app: Service, client: Client) -> None:
        ended = turn.whole(self.turn)
        if ended is None:
            return  # the client left
        calls, finish = ended
        text, thinking = self.turn.choice.text, "".join(self.turn.choice.thinking)
        content = ([{"type": "thinking", "thinking": thinking, "signature": ""}] if thinking else []) + \
            ([{"type": "text", "text": text}] if text else []) + [tool_use(call) for call in calls]
        reason, sequence = self.stop(finish, bool(calls))
        client.send(Whole(200, {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                                "content": content, "stop_reason": reason, "stop_sequence": sequence,
                                "usage": self.usage(finish)}))

    def stream(self, app: Service, client: Client) -> None:
        client.send(Opening())

        def send(name: str, payload: dict[str, Any]) -> None:
            client.send(Event(payload, name))
        index, text_open, thinking_open, calls = 0, False, False, False
        try:
            send("message_start", {"type": "message_start", "message": {
                "id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": [],
                "stop_reason": None, "stop_sequence": None, "usage": self.usage(None)}})
            for said in turn.said(self.turn):
                if said.thinking:
                    if not thinking_open:
                        send("content_block_start", {"type": "content_block_start", "index": index,
                                                     "content_block": {"type": "thinking", "thinking": "",
                                                                       "signature": ""}})
                        thinking_open = True
                    send("content_block_delta", {"type": "content_block_delta", "index": index,
                                                 "delta": {"type": "thinking_delta", "thinking": said.thinking}})
                    continue
                if thinking_open and (said.text or said.call is not None or said.finish is not None):
                    send("content_block_stop", {"type": "content_block_stop", "index": index})
                    index, thinking_open = index + 1, False
                if said.text:
                    if not text_open:
                        send("content_block_start", {"type": "content_block_start", "index": index,
                                                     "content_block": {"type": "text", "text": ""}})
                        text_open = True
                    send("content_block_delta", {"type": "content_block_delta", "index": index,
                                                 "delta": {"type": "text_delta", "text": said.text}})
                elif said.call is not None:
                    if text_open:
                        send("content_block_stop", {"type": "content_block_stop", "index": index})
                        index, text_open = index + 1, False
                    block = tool_use(said.call)
                    send("content_block_start", {"type": "content_block_start", "index": index,
                                                 "content_block": {**block, "input": {}}})
                    send("content_block_delta", {"type": "content_block_delta", "index": index, "delta": {
                        "type": "input_json_delta", "partial_json": json.dumps(block["input"], ensure_ascii=False)}})
                    send("content_block_stop", {"type": "content_block_stop", "index": index})
                    index, calls = index + 1, True
                elif said.finish is not None:
                    failed = failure(said.finish)
                    if failed is not None:
                        send("error", error_body(failed))
                        return
                    if text_open:
                        send("content_block_stop", {"type": "content_block_stop", "index": index})
                    reason, sequence = self.stop(said.finish, calls)
                    usage = self.usage(said.finish)
                    send("message_delta", {"type": "message_delta", "delta": {"stop_reason": reason,
                                                                              "stop_sequence": sequence},
                                           "usage": usage})  # cumulative, as Anthropic's now are
                    send("message_stop", {"type": "message_stop"})
        except OSError:  # the client went away: stop generating for it
            self.turn.cancel()


def tool_use(call: ToolCall) -> dict[str, Any]:
    try:
        arguments = json.loads(call.arguments)
    except ValueError:
        arguments = {}
    return {"type": "tool_use", "id": "toolu_" + call.id.removeprefix("call_"), "name": call.name,
            "input": arguments if isinstance(arguments, dict) else {}}


def count_tokens(app: Service, handler: Asker, _path: str) -> None:
    """The prompt's tokens as /v1/messages would render it (system, messages, tools)."""
    fields = Fields(handler.read_json())
    engine = loaded(app.model(handler, requested_model(fields)))
    prompt, _ = prompt_of(engine, fields.body)
    handler.send(Whole(200, {"input_tokens": len(engine.prompt_tokens(GenerationRequest(prompt)))}))


ROUTES = [Route("/v1/messages", ("POST",), messages, error_body=error_body),
          Route("/v1/messages/count_tokens", ("POST",), count_tokens, error_body=error_body)]
