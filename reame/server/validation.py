"""Reading OpenAI request bodies: every field type-checked, every mistake a 400 naming the field."""

from __future__ import annotations

import math
from typing import Any, overload
from urllib.parse import parse_qs

from reame.engine import SamplingParams
from reame.engine.embeddings import MAX_INPUTS
from reame.errors import RequestError
from reame.server.client import Asker, HttpError
from reame.structured.tools import parsed_arguments

MAX_CHOICES = 16
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


class Fields:
    """Typed access to a JSON object's fields; every mistake is a 400 that names the field."""

    def __init__(self, body: Any) -> None:
        if not isinstance(body, dict):
            raise HttpError(400, "the request body must be a JSON object", code="invalid_json")
        self.body = body

    def _get(self, name: str, default: Any) -> Any:
        value = self.body.get(name)
        return default if value is None else value

    def bad(self, name: str, expected: str) -> HttpError:
        return HttpError(400, f"'{name}' must be {expected}, got {_describe(self.body.get(name))}",
                         param=name, code="invalid_type")

    def boolean(self, name: str, default: bool) -> bool:
        value = self._get(name, default)
        if not isinstance(value, bool):
            raise self.bad(name, "a boolean")
        return value

    @overload
    def integer(self, name: str, default: int, low: int | None = None, high: int | None = None) -> int: ...
    @overload
    def integer(self, name: str, default: None, low: int | None = None, high: int | None = None) -> int | None: ...

    def integer(self, name: str, default: int | None, low: int | None = None, high: int | None = None) -> int | None:
        """The field `name` (absent or null: `default`), an integer within [low, high]; 400 otherwise."""
        value = self._get(name, default)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.bad(name, "an integer")
        if (low is not None and value < low) or (high is not None and value > high):
            raise HttpError(400, f"'{name}' must be between {low} and {high}, got {value}", param=name,
                            code="invalid_value")
        return value

    def number(self, name: str, default: float, low: float, high: float) -> float:
        value = self._get(name, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise self.bad(name, "a number")
        if not low <= value <= high:
            raise HttpError(400, f"'{name}' must be between {low:g} and {high:g}, got {value}", param=name,
                            code="invalid_value")
        return float(value)

    def stop(self) -> tuple[str, ...]:
        value = self._get("stop", [])
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
            raise self.bad("stop", "a string or a list of strings")
        return tuple(item for item in value if item)

    def logit_bias(self) -> dict[int, float]:
        value = self._get("logit_bias", {})
        if not isinstance(value, dict):
            raise self.bad("logit_bias", "an object mapping token ids to numbers")
        bias: dict[int, float] = {}
        for key, amount in value.items():
            try:
                token = int(key)
            except ValueError:
                raise HttpError(400, f"'logit_bias' key {key!r} is not a token id", param="logit_bias",
                                code="invalid_value") from None
            if isinstance(amount, bool) or not isinstance(amount, (int, float)) or not -100 <= amount <= 100:
                raise HttpError(400, f"'logit_bias' value for {key} must be a number in [-100, 100]",
                                param="logit_bias", code="invalid_value")
            bias[token] = float(amount)
        return bias


def _describe(value: Any) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", int: "an integer",
             float: "a number", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def sampling_params(fields: Fields, max_tokens: int | None, seed: int | None) -> SamplingParams:
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=fields.number("temperature", 1.0, 0.0, 2.0),
            top_p=fields.number("top_p", 1.0, 0.0, 1.0) or 1e-6,
            top_k=fields.integer("top_k", 0, 0, 100_000) or 0,
            min_p=fields.number("min_p", 0.0, 0.0, 1.0),
            repeat_penalty=fields.number("repeat_penalty", 1.0, 0.01, 10.0),
            presence_penalty=fields.number("presence_penalty", 0.0, -2.0, 2.0),
            frequency_penalty=fields.number("frequency_penalty", 0.0, -2.0, 2.0),
            seed=seed, stop=fields.stop(), logit_bias=fields.logit_bias(),
            ignore_eos=fields.boolean("ignore_eos", False))
    except RequestError as error:
        raise HttpError(400, str(error), param=error.param, code="invalid_value") from None


EXTENSION_FIELDS = ("best_of", "cache", "semantic")


def extension(fields: Fields) -> Fields:
    """Reame's own extension object of a request, `"reame": {"best_of": N, "cache": false}` (empty when
    absent)."""
    value = fields.body.get("reame")
    if value is None:
        return Fields({})
    if not isinstance(value, dict):
        raise fields.bad("reame", "an object")
    unknown = sorted(set(value) - set(EXTENSION_FIELDS))
    if unknown:
        raise HttpError(400, f"'reame' has no field '{unknown[0]}' (it takes: {', '.join(EXTENSION_FIELDS)})",
                        param="reame", code="invalid_value")
    return Fields(value)


def best_of(fields: Fields, chat: bool) -> int:
    """Attempts per answer elected by the Conclave (1: none). Completions take OpenAI's `best_of`
    (equal to `n`: n plain choices, as before); chat, which has no such field, Reame's extension object
    `"reame": {"best_of": N}`."""
    n = fields.integer("n", 1, 1, MAX_CHOICES)
    if chat:
        attempts = extension(fields).integer("best_of", 1, 1, MAX_CHOICES)
    else:
        asked = fields.integer("best_of", None, 1, MAX_CHOICES)
        if asked is None or asked == n:
            return 1
        attempts = asked
    if attempts > 1 and n > 1:
        raise HttpError(400, "best_of elects one answer per prompt: use it with n = 1", param="best_of",
                        code="unsupported_parameter")
    return attempts


def answer_cache_allowed(fields: Fields) -> bool:
    """False when the request opts out of the exact answer cache, `"reame": {"cache": false}`: it is
    computed afresh, and its answer is not kept."""
    return extension(fields).boolean("cache", True)


def semantic_cache_allowed(fields: Fields) -> bool:
    """False when the request wants an exact answer or none, `"reame": {"semantic": false}`: the semantic
    cache neither answers it nor keeps its question."""
    return extension(fields).boolean("semantic", True)


def requested_model(fields: Fields) -> str | None:
    """The model a request names (None: it names none), which must be a string; which model that is, the
    server's pool says (server/models.py)."""
    model = fields.body.get("model")
    if model is not None and not isinstance(model, str):
        raise fields.bad("model", "a string")
    return model


def stream_usage(fields: Fields) -> bool:
    options = fields.body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict):
        raise fields.bad("stream_options", "an object")
    return Fields(options).boolean("include_usage", False)


def completion_prompts(prompt: Any) -> list[Any]:
    """`prompt` as OpenAI allows it: a string, strings, token ids, or lists of token ids."""
    def is_tokens(value: Any) -> bool:
        return isinstance(value, list) and bool(value) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in value)

    if isinstance(prompt, str):
        prompts: list[Any] = [prompt]
    elif is_tokens(prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        prompts = list(prompt)
    elif isinstance(prompt, list) and prompt and all(is_tokens(p) for p in prompt):
        prompts = list(prompt)
    else:
        raise HttpError(400, "'prompt' must be a string, an array of strings, an array of token ids or an "
                        f"array of token-id arrays, got {_describe(prompt)}", param="prompt", code="invalid_type")
    if len(prompts) > MAX_CHOICES:
        raise HttpError(400, f"at most {MAX_CHOICES} prompts per request", param="prompt", code="invalid_value")
    if any(isinstance(p, str) and not p for p in prompts):
        raise HttpError(400, "'prompt' must not be empty", param="prompt", code="invalid_value")
    return prompts


def embedding_count(count: int) -> None:
    """The engine's bound on a request's embedding inputs (OpenAI's), checked before anything is tokenized."""
    if count > MAX_INPUTS:
        raise HttpError(400, f"at most {MAX_INPUTS} inputs per request", param="input", code="invalid_value")


def chat_messages(messages: Any) -> list[dict[str, Any]]:
    """Messages as templates read them: role, text content, and an assistant's earlier tool calls (their
    arguments as objects) and thinking (`reasoning_content`, which thinking models' templates render, as
    Qwen3's does in a tool-call loop), or a tool result's call id."""
    if not isinstance(messages, list) or not messages:
        raise HttpError(400, "'messages' must be a non-empty array", param="messages", code="invalid_type")
    result = []
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            raise HttpError(400, f"'{where}' must be an object, got {_describe(message)}", param=where,
                            code="invalid_type")
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise HttpError(400, f"'{where}.role' must be one of {', '.join(CHAT_ROLES)}", param=f"{where}.role",
                            code="invalid_value")
        entry: dict[str, Any] = {"role": "system" if role == "developer" else role,
                                 "content": message_text(message.get("content"), f"{where}.content")}
        if role == "assistant" and message.get("tool_calls") is not None:
            entry["tool_calls"] = history_calls(message["tool_calls"], f"{where}.tool_calls")
        if role == "assistant" and message.get("reasoning_content") is not None:
            if not isinstance(message["reasoning_content"], str):
                raise HttpError(400, f"'{where}.reasoning_content' must be a string",
                                param=f"{where}.reasoning_content", code="invalid_type")
            if message["reasoning_content"]:
                entry["reasoning_content"] = message["reasoning_content"]
        if role == "tool":
            for name in ("tool_call_id", "name"):
                if message.get(name) is not None:
                    if not isinstance(message[name], str):
                        raise HttpError(400, f"'{where}.{name}' must be a string", param=f"{where}.{name}",
                                        code="invalid_type")
                    entry[name] = message[name]
        result.append(entry)
    return result


def history_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's tool calls: OpenAI's shape, arguments parsed from their JSON text."""
    if not isinstance(calls, list):
        raise HttpError(400, f"'{where}' must be an array", param=where, code="invalid_type")
    result = []
    for index, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or \
                not isinstance(function.get("arguments", ""), (str, dict)):
            raise HttpError(400, f"'{where}[{index}]' must be {{\"id\", \"type\": \"function\", \"function\": "
                            f"{{\"name\", \"arguments\"}}}}", param=f"{where}[{index}]", code="invalid_value")
        result.append({"id": call.get("id") if isinstance(call.get("id"), str) else "", "type": "function",
                       "function": {"name": function["name"],
                                    "arguments": parsed_arguments(function.get("arguments", {}))}})
    return result


def message_text(content: Any, where: str) -> str:
    """String content, or the text parts of an array of content parts, joined."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for index, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise HttpError(400, f"'{where}[{index}]' must be a text part {{\"type\": \"text\", \"text\": …}}; "
                                "this model reads text only", param=f"{where}[{index}]", code="invalid_value")
            texts.append(part["text"])
        return "\n".join(texts)
    raise HttpError(400, f"'{where}' must be a string or an array of text parts, got {_describe(content)}",
                    param=where, code="invalid_type")


def query_model(handler: Asker) -> str | None:
    """The `?model=` of a request's path (None: none): a session's, or GET /props's."""
    return query_value(handler, "model")


def query_value(handler: Asker, name: str) -> str | None:
    """The query parameter `name` of a request's path (its first value; None: none)."""
    try:
        named = parse_qs(handler.path.partition("?")[2], max_num_fields=16).get(name)
    except ValueError:
        raise HttpError(400, "too many query parameters", param=name) from None
    return named[0] if named else None
