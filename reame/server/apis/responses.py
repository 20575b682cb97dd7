"""OpenAI's Responses API (`POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}`), for the newer OpenAI
clients (`client.responses.create`, the Agents SDK): `input` as a string or items (messages, function calls
and their outputs), `instructions`, `max_output_tokens`, sampling, function `tools`, `tool_choice`,
`text.format` (JSON object or schema), streaming with the Responses event types, and `previous_response_id`
over stored responses (conversations.py; `store: false` stores none). The same engine and caches as every
route (exchange.py, turn.py).
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from typing import Any

from reame.engine import FinishEvent
from reame.server import turn
from reame.server.client import Asker, Event, HttpError, Opening, Whole
from reame.server.routes import Route
from reame.server.exchange import Asked, Exchange
from reame.server.models import loaded
from reame.server.service import Service, failure
from reame.server.telemetry import Telemetry, final_timings
from reame.server.validation import Fields, chat_messages, requested_model, sampling_params
from reame.structured.requested import requested_grammar
from reame.structured.tools import ToolCall, ToolRequest, tool_request

ROLES = ("user", "assistant", "system", "developer")
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512  # OpenAI's bounds
MAX_USER = 512


def item_messages(value: Any) -> list[dict[str, Any]]:
    """`input` as chat messages: a string is one user message; items are messages (string content or
    input_text/output_text parts), function_call items (an assistant's tool calls),
    function_call_output items (tool results) and reasoning items (the thinking of the assistant message or
    calls after them: its `reasoning_content`, as a client sends back a response's output)."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise HttpError(400, "'input' must be a string or a non-empty array of items", param="input")
    messages: list[dict[str, Any]] = []
    thought = ""  # a reasoning item's text, for the assistant turn that follows it
    for index, item in enumerate(value):
        where = f"input[{index}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "reasoning":
            thought += reasoning_text(item, where)
            continue
        if kind == "message" and item.get("role") in ROLES:
            content = item.get("content")
            if isinstance(content, list):
                parts = []
                for number, part in enumerate(content):
                    if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text") \
                            or not isinstance(part.get("text"), str):
                        raise HttpError(400, f"'{where}.content[{number}]' must be a text part; this model reads "
                                        "text only", param=f"{where}.content", code="invalid_value")
                    parts.append(part["text"])
                content = "\n".join(parts)
            messages.append({"role": item["role"], "content": content})
        elif kind == "function_call" and isinstance(item.get("name"), str):
            call = {"id": str(item.get("call_id", "")), "type": "function",
                    "function": {"name": item["name"], "arguments": item.get("arguments", "{}")}}
            if messages and messages[-1]["role"] == "assistant" and not messages[-1].get("content"):
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(output, str):
                raise HttpError(400, f"'{where}.output' must be a string", param=where, code="invalid_type")
            messages.append({"role": "tool", "tool_call_id": str(item.get("call_id", "")), "content": output})
        else:
            raise HttpError(400, f"'{where}' is not a message, function_call, function_call_output or reasoning "
                            "item this server reads", param=where, code="invalid_value")
        if thought and messages[-1]["role"] == "assistant":
            messages[-1]["reasoning_content"] = messages[-1].get("reasoning_content", "") + thought
        thought = ""
    return messages


def reasoning_text(item: dict[str, Any], where: str) -> str:
    """A reasoning item's thinking: its reasoning_text parts, else its summary_text parts (an
    `encrypted_content` is another server's, and read by none here)."""
    texts = []
    for field, part_type in (("content", "reasoning_text"), ("summary", "summary_text")):
        parts = item.get(field) or []
        if not isinstance(parts, list) or not all(isinstance(part, dict) and part.get("type") == part_type and
                                                  isinstance(part.get("text"), str) for part in parts):
            raise HttpError(400, f"'{where}.{field}' must be an array of {part_type} parts", param=where,
                            code="invalid_value")
        texts.append("".join(part["text"] for part in parts))
    return texts[0] or texts[1]


def tools_of(body: dict[str, Any]) -> ToolRequest | None:
    """Responses' flat function tools and tool_choice as the chat ones the tool layer reads."""
    tools = body.get("tools")
    if not tools:
        return None
    if not isinstance(tools, list):
        raise HttpError(400, "'tools' must be an array", param="tools", code="invalid_type")
    functions = []
    for index, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("name"), str):
            raise HttpError(400, f"'tools[{index}]' must be a function tool {{\"type\": \"function\", \"name\", "
                            "\"parameters\"}} (this server runs no built-in tools)", param="tools",
                            code="invalid_value")
        functions.append({"type": "function", "function": {key: tool[key] for key in
                                                           ("name", "description", "parameters") if key in tool}})
    choice = body.get("tool_choice", "auto")
    if isinstance(choice, dict) and choice.get("type") == "function":
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    return tool_request({"tools": functions, "tool_choice": choice,
                         "parallel_tool_calls": body.get("parallel_tool_calls", True)})


def text_format(body: dict[str, Any]) -> str | None:
    """`text.format` ({"type": "text" | "json_object" | "json_schema", "name", "schema"}) as a grammar."""
    text = body.get("text")
    if text is None:
        return None
    spec = text.get("format") if isinstance(text, dict) else None
    if spec is None:
        return None
    if not isinstance(spec, dict):
        raise HttpError(400, "'text.format' must be an object", param="text.format", code="invalid_type")
    if spec.get("type") == "json_schema":
        spec = {"type": "json_schema", "json_schema": {"name": spec.get("name", "answer"), "schema": spec.get("schema"),
                                                       "strict": spec.get("strict")}}
    return requested_grammar({"response_format": spec})


def checked_metadata(metadata: Any) -> None:
    """OpenAI's bounds on `metadata`, which a stored response echoes: at most 16 string pairs, keys of at most 64
    characters, values of at most 512."""
    if metadata is None:
        return
    if not isinstance(metadata, dict) or len(metadata) > MAX_METADATA_PAIRS or not all(
            isinstance(key, str) and isinstance(value, str) and len(key) <= MAX_METADATA_KEY and
            len(value) <= MAX_METADATA_VALUE for key, value in metadata.items()):
        raise HttpError(400, f"'metadata' must be an object of at most {MAX_METADATA_PAIRS} string values, keys of "
                        f"at most {MAX_METADATA_KEY} characters and values of at most {MAX_METADATA_VALUE}",
                        param="metadata", code="invalid_value")


def create(app: Service, handler: Asker, _path: str) -> None:
    fields = Fields(handler.read_json())
    body = fields.body
    checked_metadata(body.get("metadata"))
    user = body.get("user")
    if user is not None and (not isinstance(user, str) or len(user) > MAX_USER):
        raise HttpError(400, f"'user' must be a string of at most {MAX_USER} characters", param="user",
                        code="invalid_value")
    model = requested_model(fields)
    served = app.model(handler, model)
    engine = loaded(served)
    earlier: list[dict[str, Any]] = []
    previous = body.get("previous_response_id")
    if previous is not None:
        stored = app.conversations.find(handler.owner, previous) if isinstance(previous, str) else None
        if stored is None:
            raise HttpError(404, f"Previous response with id '{previous}' not found.", param="previous_response_id",
                            code="previous_response_not_found")
        earlier = [message for message in stored.messages if message["role"] != "system"]
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise fields.bad("instructions", "a string")
    messages = chat_messages(([{"role": "system", "content": instructions}] if instructions else []) + earlier +
                             item_messages(body.get("input")))
    tools = tools_of(body)
    grammar = turn.answer_grammar(tools, text_format(body), "text.format")
    thinks, switchable = engine.backend.template_thinks
    prompt = turn.chat_prompt(engine, messages, tools, reasoning_switch(body) if switchable else None)
    params = sampling_params(fields, fields.integer("max_output_tokens", None, 1, None), None)
    stream = fields.boolean("stream", False)
    telemetry = Telemetry.asked(fields)
    current = turn.start(app, handler, served, Asked([prompt], dataclasses.replace(params, grammar=grammar),
                                                     streamed=stream, tools=tools, thinks=thinks,
                                                     progress=stream and telemetry.watches_prefill), "input")
    reply = Reply(app, handler, body, model or served.name, current, messages,
                  fields.boolean("store", True), previous, telemetry)
    if stream:
        reply.stream()
    else:
        ended = turn.whole(current)
        if ended is not None:
            handler.send(Whole(200, reply.finished(*ended)))


def reasoning_switch(body: dict[str, Any]) -> bool | None:
    """`reasoning.effort`: "none" turns a thinking model's thinking off; anything else leaves the template's
    default."""
    reasoning = body.get("reasoning")
    if reasoning is None:
        return None
    if not isinstance(reasoning, dict) or not isinstance(reasoning.get("effort", ""), (str, type(None))):
        raise HttpError(400, "'reasoning' must be an object like {\"effort\": \"low\"}", param="reasoning",
                        code="invalid_type")
    return False if reasoning.get("effort") == "none" else None


class Reply:
    """One response: its items as they come (streamed) and its whole object, stored when asked."""

    def __init__(self, app: Service, handler: Asker, body: dict[str, Any], model: str, current: Exchange,
                 messages: list[dict[str, Any]], store: bool, previous: str | None,
                 telemetry: Telemetry | None = None) -> None:
        self.app, self.handler, self.body, self.model, self.turn = app, handler, body, model, current
        self.messages, self.store, self.previous = messages, store, previous
        self.telemetry = telemetry or Telemetry()  # llama-server's: progress and timings on the stream's events
        self.id = "resp_" + uuid.uuid4().hex
        self.message_id = "msg_" + uuid.uuid4().hex
        self.created = int(time.time())
        self.sequence = 0

    def envelope(self, status: str, output: list[dict[str, Any]], finish: FinishEvent | None) -> dict[str, Any]:
        body = self.body
        incomplete = finish is not None and finish.reason == "length"
        usage = None
        if finish is not None:
            prompt = self.turn.prompt_tokens
            cached = self.turn.cached_tokens(finish.usage)
            usage = {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached},
                     "output_tokens": finish.usage.completion_tokens,
                     "output_tokens_details": {"reasoning_tokens": 0},
                     "total_tokens": prompt + finish.usage.completion_tokens}
        return {"id": self.id, "object": "response", "created_at": self.created,
                "status": "incomplete" if incomplete and status == "completed" else status, "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
                "instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
                "model": self.model, "output": output, "parallel_tool_calls": body.get("parallel_tool_calls", True),
                "previous_response_id": self.previous, "store": self.store,
                "temperature": body.get("temperature", 1.0), "text": body.get("text") or {"format": {"type": "text"}},
                "tool_choice": body.get("tool_choice", "auto"), "tools": body.get("tools") or [],
                "top_p": body.get("top_p", 1.0), "truncation": "disabled", "usage": usage,
                "user": body.get("user"), "metadata": body.get("metadata") or {}}

    def message_item(self, text: str, status: str = "completed") -> dict[str, Any]:
        content = [{"type": "output_text", "text": text, "annotations": []}] if status == "completed" else []
        return {"type": "message", "id": self.message_id, "status": status, "role": "assistant", "content": content}

    @staticmethod
    def call_item(call: ToolCall) -> dict[str, Any]:
        return {"type": "function_call", "id": "fc_" + call.id.removeprefix("call_"), "call_id": call.id,
                "name": call.name, "arguments": call.arguments, "status": "completed"}

    def finished(self, calls: list[ToolCall], finish: FinishEvent) -> dict[str, Any]:
        """The whole response (stored for previous_response_id unless `store` is false)."""
        text, thinking = self.turn.choice.text, "".join(self.turn.choice.thinking)
        output = ([{"type": "reasoning", "id": "rs_" + self.message_id[4:], "summary": [],
                    "content": [{"type": "reasoning_text", "text": thinking}]}] if thinking else []) + \
            ([self.message_item(text)] if text or not calls else []) + [self.call_item(call) for call in calls]
        response = self.envelope("completed", output, finish)
        if self.store:
            answer: dict[str, Any] = {"role": "assistant", "content": text}
            if thinking:
                answer["reasoning_content"] = thinking
            if calls:
                answer["tool_calls"] = [{"id": call.id, "type": "function",
                                         "function": {"name": call.name, "arguments": call.arguments}}
                                        for call in calls]
            self.app.conversations.keep(self.handler.owner, self.id, [*self.messages, answer], response)
        return response

    def send(self, kind: str, **payload: Any) -> None:
        self.handler.send(Event({"type": kind, "sequence_number": self.sequence, **payload}, kind))
        self.sequence += 1

    def stream(self) -> None:
        handler = self.handler
        handler.send(Opening())
        calls: list[ToolCall] = []
        text_open = False
        output_index = 0
        try:
            self.send("response.created", response=self.envelope("in_progress", [], None))
            self.send("response.in_progress", response=self.envelope("in_progress", [], None))
            for said in turn.said(self.turn):
                if said.progress is not None:
                    shaped = self.telemetry.progressed(0, said.progress)
                    if shaped is not None:
                        self.send("response.in_progress", response=self.envelope("in_progress", [], None),
                                  prompt_progress=shaped, **self.timings())
                elif said.text:
                    if not text_open:
                        self.send("response.output_item.added", output_index=output_index,
                                  item=self.message_item("", "in_progress"))
                        self.send("response.content_part.added", item_id=self.message_id, output_index=output_index,
                                  content_index=0, part={"type": "output_text", "text": "", "annotations": []})
                        text_open = True
                    self.telemetry.decoded(0, len(self.turn.choice.ids))
                    self.send("response.output_text.delta", item_id=self.message_id, output_index=output_index,
                              content_index=0, delta=said.text, logprobs=[], **self.timings())
                elif said.call is not None:
                    if text_open:
                        self.close_text(output_index)
                        output_index, text_open = output_index + 1, False
                    calls.append(said.call)
                    item = self.call_item(said.call)
                    self.send("response.output_item.added", output_index=output_index,
                              item={**item, "arguments": "", "status": "in_progress"})
                    self.send("response.function_call_arguments.delta", item_id=item["id"],
                              output_index=output_index, delta=item["arguments"])
                    self.send("response.function_call_arguments.done", item_id=item["id"],
                              output_index=output_index, arguments=item["arguments"])
                    self.send("response.output_item.done", output_index=output_index, item=item)
                    output_index += 1
                elif said.finish is not None:
                    failed = failure(said.finish)
                    if failed is not None:
                        self.send("error", code=failed.code, message=failed.message, param=None)
                        return
                    if text_open:
                        self.close_text(output_index)
                    response = self.finished(calls, said.finish)
                    usage = said.finish.usage
                    self.send("response.completed" if response["status"] == "completed" else "response.incomplete",
                              response=response, timings=final_timings(usage, self.turn.cached_tokens(usage)))
        except OSError:  # the client went away: stop generating for it
            self.turn.cancel()

    def timings(self) -> dict[str, Any]:
        """An event's llama-server `timings` so far, when the request asked for them on every event."""
        running = self.telemetry.running(0)
        return {} if running is None else {"timings": running}

    def close_text(self, output_index: int) -> None:
        text = self.turn.choice.text
        part = {"type": "output_text", "text": text, "annotations": []}
        self.send("response.output_text.done", item_id=self.message_id, output_index=output_index, content_index=0,
                  text=text, logprobs=[])
        self.send("response.content_part.done", item_id=self.message_id, output_index=output_index, content_index=0,
                  part=part)
        self.send("response.output_item.done", output_index=output_index, item=self.message_item(text))


def stored(app: Service, handler: Asker, path: str) -> None:
    """GET /v1/responses/{id}: a stored response; DELETE forgets it."""
    response_id = path[len("/v1/responses/"):]
    if handler.command == "DELETE":
        if not app.conversations.forget(handler.owner, response_id):
            raise HttpError(404, f"Response with id '{response_id}' not found.", code="not_found")
        handler.send(Whole(200, {"id": response_id, "object": "response", "deleted": True}))
        return
    found = app.conversations.find(handler.owner, response_id)
    if found is None:
        raise HttpError(404, f"Response with id '{response_id}' not found.", code="not_found")
    handler.send(Whole(200, found.response_json))


ROUTES = [Route("/v1/responses", ("POST",), create),
          Route("/v1/responses/", ("GET", "DELETE"), stored, prefix=True)]
