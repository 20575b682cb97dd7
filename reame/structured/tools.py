"""OpenAI function calling: tools and tool_choice in, the model's tool calls out as `tool_calls`.

Requests: `tools` (function tools), `tool_choice` (`none`, `auto`, `required`
or a named function) and `parallel_tool_calls` are validated here. A template
that lays tools out itself (Qwen2.5's and other Hermes-style templates) gets
them as they are; for any other template the same instructions go in a system
message, and earlier tool calls and results are written as the text the model
is asked to produce. `required` and a named function prefill the start of the
call (`<tool_call>\\n{"name": "`), so the model can only continue it.

Answers: the model writes `<tool_call>{"name": …, "arguments": …}</tool_call>`
(Hermes, Qwen2.5), or a bare JSON object `{"name": …, "arguments"|"parameters": …}`,
possibly after `<|python_tag|>` (Llama 3) or in a ```json fence (what small models such as
Qwen2.5-Coder-1.5B often write instead of the tags). `ToolCallParser` turns the text into
content and calls, streamed: text that may start a call is held back, never
shown as content and then taken back.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from reame.structured.json_schema import literal, render, schema_rules
from reame.errors import RequestError

NAME_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,64}")
MAX_TOOLS = 128
OPEN, CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
FENCE = "```"
# Tool instructions for templates without their own, in the Hermes wording Qwen2.5 was trained on.
INSTRUCTIONS = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n"
                "</tools>\n\nFor each function call, return a json object with function name and arguments "
                "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
                '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>')


@dataclass(frozen=True)
class ToolRequest:
    """What a chat request asks about tools. `forced`: the function it must call (named
    tool_choice), or "" for any one (`required`), or None when calling is the model's choice."""

    tools: tuple[dict[str, Any], ...]
    forced: str | None = None
    parallel: bool = True

    @property
    def prefill(self) -> str:
        """Text the answer starts with, written for the model: the start of a forced call."""
        if self.forced is None:
            return ""
        return OPEN + '\n{"name": "' + (self.forced + '", "arguments": ' if self.forced else "")


def forced_call_grammar(tools: ToolRequest) -> str | None:
    """For a forced call, the GBNF of what the model writes after the prefill: the call, its arguments
    matching the function's parameter schema, the closing tag (then more calls when parallel calls are
    allowed and any function may be called); None when calling is the model's choice."""
    if tools.forced is None:
        return None
    rules: dict[str, str] = {}
    calls = []
    for index, tool in enumerate(tools.tools):
        function = tool["function"]
        if tools.forced and function["name"] != tools.forced:
            continue
        rules.update(schema_rules(function.get("parameters", {"type": "object"}),
                                  param=f"tools[{index}].function.parameters", top=f"args-{index}"))
        name = "" if tools.forced else literal(function["name"] + '", "arguments": ')
        calls.append(f"{name} args-{index}".strip())
    end = literal("}\n" + CLOSE)
    if tools.forced:
        root = f"{calls[0]} ws {end}"
    else:
        rules["call"] = " | ".join(calls)
        another = literal("\n" + OPEN + '\n{"name": "')
        more = f" ( {another} call ws {end} )*" if tools.parallel else ""
        root = f"call ws {end}{more}"
    rules["ws"] = rules.get("ws", '| " " | "\\n" [ \\t]{0,20}')
    return render({"root": root, **rules})


def tool_request(body: Mapping[str, Any]) -> ToolRequest | None:
    """The request's tools, validated (400s name the field); None when no tool may be called."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise _bad("parallel_tool_calls", "must be a boolean")
    if tools is None:
        if choice not in (None, "none", "auto"):
            raise _bad("tool_choice", "needs 'tools'")
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise _bad("tools", f"must be an array of at most {MAX_TOOLS} function tools")
    names = []
    for index, tool in enumerate(tools):
        names.append(_check_tool(tool, f"tools[{index}]"))
    if len(set(names)) != len(names):
        raise _bad("tools", "has two functions with the same name")
    if choice in (None, "auto"):
        forced = None
    elif choice == "none":
        return None
    elif choice == "required":
        forced = ""
    elif isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        forced = choice["function"].get("name")
        if forced not in names:
            raise _bad("tool_choice", f"names a function that is not in 'tools': {forced!r}")
    else:
        raise _bad("tool_choice", "must be 'none', 'auto', 'required' or {\"type\": \"function\", "
                                  "\"function\": {\"name\": …}}")
    return ToolRequest(tuple(tools), forced, parallel) if tools else None


def _check_tool(tool: Any, where: str) -> str:
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        raise _bad(where, "must be {\"type\": \"function\", \"function\": {…}}")
    function = tool["function"]
    name = function.get("name")
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
        raise _bad(f"{where}.function.name", "must be 1-64 letters, digits, '_' or '-'")
    if not isinstance(function.get("description", ""), str):
        raise _bad(f"{where}.function.description", "must be a string")
    if not isinstance(function.get("parameters", {}), dict):
        raise _bad(f"{where}.function.parameters", "must be a JSON schema object")
    return name


def _bad(param: str, what: str) -> RequestError:
    return RequestError(f"'{param}' {what}", param=param)


# --- the prompt ---------------------------------------------------------------------------

def template_messages(messages: Sequence[Mapping[str, Any]], tools: ToolRequest | None,
                      template_has_tools: bool) -> list[dict[str, Any]]:
    """Messages for a template that does not lay tools out itself: tool instructions in the system
    message, earlier calls and results as the text the model writes and reads."""
    if template_has_tools:
        return [dict(message) for message in messages]
    result = []
    for message in messages:
        role, content = message["role"], message.get("content") or ""
        if role == "assistant" and message.get("tool_calls"):
            calls = "\n".join(f"{OPEN}\n{json.dumps(call_json(call), ensure_ascii=False)}\n{CLOSE}"
                              for call in message["tool_calls"])
            result.append(thought_kept(message, {"role": "assistant",
                                                 "content": (content + "\n" if content else "") + calls}))
        elif role == "tool":
            result.append({"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"})
        else:
            result.append(thought_kept(message, {"role": role, "content": content}))
    if tools is not None:
        described = INSTRUCTIONS.format(tools="\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools.tools))
        if result and result[0]["role"] == "system":
            result[0] = {"role": "system", "content": result[0]["content"] + "\n\n" + described}
        else:
            result.insert(0, {"role": "system", "content": described})
    return result


def thought_kept(message: Mapping[str, Any], rewritten: dict[str, Any]) -> dict[str, Any]:
    """`rewritten` with `message`'s thinking (an assistant's `reasoning_content`), for the template to render."""
    if message.get("reasoning_content"):
        rewritten["reasoning_content"] = message["reasoning_content"]
    return rewritten


def call_json(call: Mapping[str, Any]) -> dict[str, Any]:
    """An OpenAI tool call as the model writes it: {"name", "arguments": object}."""
    function = call["function"]
    return {"name": function["name"], "arguments": parsed_arguments(function.get("arguments"))}


def parsed_arguments(arguments: Any) -> Any:
    """OpenAI sends arguments as a JSON string; templates want the object (as Hugging Face's do)."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


# --- the answer ---------------------------------------------------------------------------

@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    def shaped(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def new_call(name: str, arguments: Any) -> ToolCall:
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return ToolCall("call_" + secrets.token_hex(12), name, text)


def call_from_json(text: str, names: frozenset[str]) -> ToolCall | None:
    """A call from the JSON the model wrote, when it names a known function; else None."""
    try:
        value = json.loads(text)
    except ValueError:
        # Qwen2.5-Coder-1.5B's template shows the call as {{"name": …}} (a typo upstream) and the model
        # copies it: one doubled pair of braces is read through.
        if not (text.startswith("{{") and text.endswith("}}")):
            return None
        return call_from_json(text[1:-1], names)
    if not isinstance(value, dict) or value.get("name") not in names:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        arguments = parsed_arguments(arguments)
    if not isinstance(arguments, dict):
        return None
    return new_call(value["name"], arguments)


@dataclass
class ToolCallParser:
    """Splits an answer, as it streams, into content and tool calls. `feed` and `finish` return
    what can be shown now: ("content", text) and ("call", ToolCall) items, in order."""

    names: frozenset[str]
    parallel: bool = True
    prefill: str = ""  # text the prompt already wrote for the model: the answer continues it
    calls: list[ToolCall] = field(default_factory=list)
    _pending: str = ""
    _bare: bool = False  # the answer is a bare JSON call (decided at its start): held to the end
    _started: bool = False

    def __post_init__(self) -> None:
        self._pending = self.prefill

    def feed(self, text: str) -> list[tuple[str, Any]]:
        self._pending += text
        if not self._started:
            bare = _starts_bare_call(self._pending.lstrip())
            if bare is None:
                return []
            self._started, self._bare = True, bare
        return [] if self._bare else self._scan(final=False)

    def finish(self) -> list[tuple[str, Any]]:
        if self._bare:
            text = self._pending.strip().removeprefix(PYTHON_TAG)
            text = text.strip().removeprefix(FENCE).removeprefix("json").removesuffix(FENCE).strip()
            call = call_from_json(text, self.names)
            self._pending = ""
            if call is None:
                return [("content", text)] if text else []
            return self._accept(call)
        return self._scan(final=True)

    def _scan(self, final: bool) -> list[tuple[str, Any]]:
        out: list[tuple[str, Any]] = []
        while self._pending:
            start = self._pending.find(OPEN)
            if start < 0:
                keep = 0 if final else _partial_suffix(self._pending, OPEN)
                self._emit_content(out, self._pending[:len(self._pending) - keep])
                self._pending = self._pending[len(self._pending) - keep:]
                break
            if self._pending[:start].strip():  # whitespace before a call is not content
                self._emit_content(out, self._pending[:start])
            end = self._pending.find(CLOSE, start)
            if end < 0 and not final:
                self._pending = self._pending[start:]
                break
            body = self._pending[start + len(OPEN):end if end >= 0 else len(self._pending)]
            call = call_from_json(body.strip(), self.names)
            if call is None:  # not a call after all: it was text
                self._emit_content(out, self._pending[start:end + len(CLOSE) if end >= 0 else None])
            else:
                out.extend(self._accept(call))
            self._pending = self._pending[end + len(CLOSE):] if end >= 0 else ""
        return out

    def _accept(self, call: ToolCall) -> list[tuple[str, Any]]:
        if self.calls and not self.parallel:
            return []  # one call asked for: later ones are dropped
        self.calls.append(call)
        return [("call", call)]

    def _emit_content(self, out: list[tuple[str, Any]], text: str) -> None:
        if not text:
            return
        if self.calls and not text.strip():
            return  # whitespace between calls is not content
        out.append(("content", text))


def _starts_bare_call(head: str) -> bool | None:
    """Whether an answer starting with `head` is a bare JSON call (a JSON object, after `<|python_tag|>`
    or a ```json fence, as small models write them), or None while its first characters cannot tell."""
    if not head or (len(head) < len(PYTHON_TAG) and PYTHON_TAG.startswith(head)):
        return None
    if head.startswith(PYTHON_TAG) or head.startswith("{"):
        return True
    if not head.startswith(FENCE):
        return None if FENCE.startswith(head) else False  # "`" or "``" may still become a fence
    first_line, newline, rest = head.partition("\n")
    if not newline or not rest.strip():
        return None
    return first_line.strip() in (FENCE, FENCE + "json") and rest.lstrip().startswith("{")


def tool_parser(tools: ToolRequest | None) -> ToolCallParser | None:
    """A parser for one choice of a request that offered tools (None: the answer is all content)."""
    if tools is None:
        return None
    names = frozenset(tool["function"]["name"] for tool in tools.tools)
    return ToolCallParser(names, tools.parallel, tools.prefill)


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a start of `marker` (held back: it may become one)."""
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0
