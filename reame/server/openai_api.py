"""OpenAI's API over the engine: validate requests, run them, shape responses.

Every field is type-checked; a wrong type is a 400 naming the field, never a
crash. Responses, stream chunks and errors follow OpenAI's shapes, so the
official SDKs work unchanged.
"""

from __future__ import annotations

import math
import queue
import random
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from reame import __version__
from reame.engine import Engine, FinishEvent, GenerationRequest, SamplingParams, TokenEvent
from reame.errors import OverloadedError, RequestError
from reame.server.http import Handler, HttpError, ServerSettings
from reame.server.metrics import Metrics
from reame.server.sessions import Sessions

MAX_CHOICES = 16
POLL_S = 0.25  # how often a waiting non-streamed request checks that its client is still there
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


# --- field validation ---------------------------------------------------------------------

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

    def integer(self, name: str, default: int | None, low: int | None = None, high: int | None = None) -> int | None:
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


# --- the application ------------------------------------------------------------------------

@dataclass
class Choice:
    text: str = ""
    finish: FinishEvent | None = None
    tokens: list[TokenEvent] = field(default_factory=list)  # kept only when logprobs were asked for


class App:
    """Routes requests to the engine. `engine` is None while the model loads (/health says 503)."""

    def __init__(self, settings: ServerSettings, metrics: Metrics | None = None,
                 sessions: Sessions | None = None) -> None:
        self.settings = settings
        self.engine: Engine | None = None
        self.sessions = sessions
        self.metrics = metrics or Metrics()
        self.metrics.describe("reame_requests_total", "counter", "HTTP responses by status")
        self.metrics.describe("reame_prompt_tokens_total", "counter", "prompt tokens processed")
        self.metrics.describe("reame_generated_tokens_total", "counter", "tokens generated")
        self.metrics.describe("reame_prompt_seconds_total", "counter", "seconds from admission to first token")
        self.metrics.describe("reame_generation_seconds_total", "counter", "seconds from first token to the end")
        self.metrics.gauge("reame_queue_depth", "requests waiting for a sequence slot",
                           lambda: self.engine.load()[0] if self.engine else 0)
        self.metrics.gauge("reame_busy_slots", "sequence slots generating",
                           lambda: self.engine.load()[1] if self.engine else 0)

    def count_response(self, status: int) -> None:
        self.metrics.add("reame_requests_total", status=str(status))

    # --- routing ---

    def dispatch(self, handler: Handler) -> None:
        path = handler.path.split("?", 1)[0]
        try:
            if path == "/health":
                self.require(handler, "GET", "HEAD")
                if self.engine is None:
                    handler.send_json(503, {"status": "loading"}, {"Retry-After": "5"})
                else:
                    handler.send_json(200, {"status": "ok"})
                return
            if not handler.authorized():
                raise HttpError(401, "missing or invalid API key (send 'Authorization: Bearer KEY')",
                                code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
            route = ROUTES.get(path)
            if route is None and path.startswith("/v1/models/"):
                route = App.model
            if route is None and path.startswith("/v1/sessions/"):
                route = App.session
            if route is None:
                raise HttpError(404, f"unknown endpoint: {handler.command} {path}", code="not_found")
            route(self, handler, path)
        except HttpError as error:
            handler.send_error_json(error)
        except (BrokenPipeError, ConnectionResetError):
            handler.close_connection = True

    @staticmethod
    def require(handler: Handler, *methods: str) -> None:
        if handler.command not in methods:
            raise HttpError(405, f"{handler.command} is not allowed here; use {' or '.join(methods)}",
                            code="method_not_allowed", headers={"Allow": ", ".join(methods)})

    def ready_engine(self) -> Engine:
        if self.engine is None:
            raise HttpError(503, "the model is still loading, retry shortly", "server_error", "loading",
                            headers={"Retry-After": "5"})
        return self.engine

    # --- small endpoints ---

    def health_metrics(self, handler: Handler, _path: str) -> None:
        self.require(handler, "GET")
        handler.send_body(200, self.metrics.render().encode(), "text/plain; version=0.0.4; charset=utf-8")

    def models(self, handler: Handler, _path: str) -> None:
        self.require(handler, "GET")
        handler.send_json(200, {"object": "list", "data": [self.model_card()]})

    def model(self, handler: Handler, path: str) -> None:
        self.require(handler, "GET")
        if path[len("/v1/models/"):] != self.settings.model_id:
            raise HttpError(404, f"the model '{path[len('/v1/models/'):]}' does not exist; this server "
                            f"serves '{self.settings.model_id}'", param="model", code="model_not_found")
        handler.send_json(200, self.model_card())

    def model_card(self) -> dict[str, Any]:
        return {"id": self.settings.model_id, "object": "model", "created": 0, "owned_by": "reame"}

    def tokenize(self, handler: Handler, _path: str) -> None:
        self.require(handler, "POST")
        fields = Fields(handler.read_json())
        content = fields.body.get("content")
        if not isinstance(content, str):
            raise fields.bad("content", "a string")
        tokens = self.ready_engine().backend.tokenize(content, add_special=fields.boolean("add_special", False))
        handler.send_json(200, {"tokens": tokens})

    def detokenize(self, handler: Handler, _path: str) -> None:
        self.require(handler, "POST")
        fields = Fields(handler.read_json())
        tokens = fields.body.get("tokens")
        backend = self.ready_engine().backend
        if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            raise fields.bad("tokens", "an array of token ids")
        if any(not 0 <= t < backend.n_vocab for t in tokens):
            raise HttpError(400, f"'tokens' holds an id outside the vocabulary (0..{backend.n_vocab - 1})",
                            param="tokens", code="invalid_value")
        handler.send_json(200, {"content": backend.detokenize(tokens)})

    # --- sessions ---

    def ready_sessions(self) -> Sessions:
        if self.sessions is None:
            raise HttpError(404, "sessions are not enabled on this server", code="not_found")
        return self.sessions

    def create_session(self, handler: Handler, _path: str) -> None:
        self.require(handler, "POST")
        sessions = self.ready_sessions()
        body = handler.read_json() if handler.headers.get("Content-Length") not in (None, "0") else {}
        wanted = Fields(body).body.get("id")
        if wanted is not None and not isinstance(wanted, str):
            raise Fields(body).bad("id", "a string")
        session_id = sessions.create(wanted)
        handler.send_json(200, {"id": session_id, "object": "session"})

    def session(self, handler: Handler, path: str) -> None:
        sessions = self.ready_sessions()
        session_id, _, action = path[len("/v1/sessions/"):].partition("/")
        if action == "" and handler.command == "GET":
            handler.send_json(200, sessions.describe(session_id))
        elif action == "" and handler.command == "DELETE":
            sessions.delete(session_id)
            handler.send_json(200, {"id": session_id, "deleted": True})
        elif action == "save" and handler.command == "POST":
            sessions.save(session_id)
            handler.send_json(200, sessions.describe(session_id))
        elif action == "load" and handler.command == "POST":
            sessions.load(session_id)
            handler.send_json(200, sessions.describe(session_id))
        elif action in ("", "save", "load"):
            raise HttpError(405, f"{handler.command} is not allowed on this session path", code="method_not_allowed")
        else:
            raise HttpError(404, f"unknown session action: {action}", code="not_found")

    def session_for(self, fields: Fields, n: int, prompts: list[Any]) -> tuple[str, Any] | None:
        session_id = fields.body.get("session")
        if session_id is None:
            return None
        if not isinstance(session_id, str):
            raise fields.bad("session", "a session id string")
        if n != 1 or len(prompts) != 1:
            raise HttpError(400, "a session continues one conversation: use n = 1 and one prompt", param="session",
                            code="invalid_value")
        return session_id, self.ready_sessions().acquire(session_id)

    # --- generation ---

    def completions(self, handler: Handler, _path: str) -> None:
        self.require(handler, "POST")
        fields = Fields(handler.read_json())
        engine = self.ready_engine()
        check_model(fields)
        if fields.integer("best_of", None, 1, MAX_CHOICES) not in (None, fields.integer("n", 1, 1, MAX_CHOICES)):
            raise HttpError(400, "'best_of' other than n is not supported", param="best_of",
                            code="unsupported_parameter")
        prompts = completion_prompts(fields.body.get("prompt"))
        suffix = fields.body.get("suffix")
        if suffix is not None:
            if not isinstance(suffix, str):
                raise fields.bad("suffix", "a string")
            prompts = [fill_in_the_middle(engine, prompt, suffix) for prompt in prompts]
        echo = fields.boolean("echo", False)
        logprobs = fields.integer("logprobs", None, 0, 5)
        if echo and logprobs is not None:
            raise HttpError(400, "'logprobs' of an echoed prompt are not supported", param="echo",
                            code="unsupported_parameter")
        max_tokens = fields.integer("max_tokens", 16, 1, None)
        self.generate(handler, fields, engine, prompts, max_tokens, chat=False, echo=echo, logprobs=logprobs)

    def chat_completions(self, handler: Handler, _path: str) -> None:
        self.require(handler, "POST")
        fields = Fields(handler.read_json())
        engine = self.ready_engine()
        check_model(fields)
        for unsupported in ("tools", "functions", "tool_choice", "function_call"):
            if fields.body.get(unsupported):
                raise HttpError(400, f"'{unsupported}' is not supported", param=unsupported,
                                code="unsupported_parameter")
        top_logprobs = fields.integer("top_logprobs", None, 0, 20)
        logprobs = (top_logprobs or 0) if fields.boolean("logprobs", False) else None
        if top_logprobs is not None and logprobs is None:
            raise HttpError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs",
                            code="invalid_value")
        response_format = fields.body.get("response_format")
        if response_format is not None:
            if not isinstance(response_format, dict) or response_format.get("type") not in ("text",):
                raise HttpError(400, "only response_format {\"type\": \"text\"} is supported for now",
                                param="response_format", code="unsupported_parameter")
        messages = chat_messages(fields.body.get("messages"))
        max_tokens = fields.integer("max_completion_tokens", None, 1, None)
        if max_tokens is None:
            max_tokens = fields.integer("max_tokens", None, 1, None)
        prompt = engine.chat_prompt(messages)  # the model's template, or role-prefixed lines without one
        self.generate(handler, fields, engine, [prompt], max_tokens, chat=True, echo=False, logprobs=logprobs)

    def generate(self, handler: Handler, fields: Fields, engine: Engine, prompts: list[Any],
                 max_tokens: int | None, chat: bool, echo: bool, logprobs: int | None) -> None:
        n = fields.integer("n", 1, 1, MAX_CHOICES)
        stream = fields.boolean("stream", False)
        include_usage = stream_usage(fields)
        seed = fields.integer("seed", None, 0, 2**32 - 2)
        reserved = self.session_for(fields, n, prompts)
        session = reserved[1] if reserved else None
        try:
            sink: queue.SimpleQueue = queue.SimpleQueue()
            handles = []
            try:
                for prompt_index, prompt in enumerate(prompts):
                    for j in range(n):
                        choice_seed = seed + prompt_index * n + j if seed is not None else \
                            random.randrange(2**32 - 1)
                        params = sampling_params(fields, max_tokens, choice_seed % (2**32 - 1))
                        request = GenerationRequest(prompt, params, logprobs=logprobs, session=session)
                        handles.append(engine.submit(request, sink, len(handles)))
            except RequestError as error:
                for handle in handles:
                    handle.cancel()
                raise HttpError(400, str(error), param=error.param or "prompt", code="invalid_value") from None
            except OverloadedError as error:
                for handle in handles:
                    handle.cancel()
                raise HttpError(429, str(error), "server_error", "queue_full", headers={"Retry-After": "2"}) from None
            prompt_tokens = sum(len(handles[i * n].prompt_tokens) for i in range(len(prompts)))
            echoes = [self.echo_text(engine, prompts[i // n]) if echo else "" for i in range(len(handles))]
            response = Response(chat, self.settings.model_id, engine.backend.token_piece if logprobs is not None
                                else None)
            if stream:
                self.stream(handler, response, sink, handles, echoes, prompt_tokens, include_usage)
            else:
                self.collect(handler, response, sink, handles, echoes, prompt_tokens)
        finally:
            if reserved:
                self.ready_sessions().release(reserved[0])

    @staticmethod
    def echo_text(engine: Engine, prompt: Any) -> str:
        return prompt if isinstance(prompt, str) else engine.backend.detokenize(prompt)

    def collect(self, handler: Handler, response: "Response", sink: queue.SimpleQueue, handles: list,
                echoes: list[str], prompt_tokens: int) -> None:
        choices = [Choice(text=echo) for echo in echoes]
        remaining = len(handles)
        checked = time.monotonic()
        while remaining:
            try:
                tag, event = sink.get(timeout=POLL_S)
            except queue.Empty:
                tag, event = -1, None
            if time.monotonic() - checked >= POLL_S:
                checked = time.monotonic()
                if handler.client_gone():
                    for handle in handles:
                        handle.cancel()
                    handler.close_connection = True
                    return
            if event is None:
                continue
            choices[tag].text += event.text
            if isinstance(event, TokenEvent):
                if event.logprob is not None:
                    choices[tag].tokens.append(event)
            else:
                choices[tag].finish = event
                remaining -= 1
        self.account(choices)
        if any(c.finish and c.finish.reason == "timeout" for c in choices):
            raise HttpError(503, "the server is busy: no sequence slot became free in time, retry later",
                            "server_error", "queue_timeout", headers={"Retry-After": "5"})
        failed = next((c.finish for c in choices if c.finish and c.finish.reason == "error"), None)
        if failed is not None:
            raise HttpError(500, f"generation failed: {failed.message}", "server_error", "generation_failed")
        handler.send_json(200, response.whole(choices, prompt_tokens))

    def stream(self, handler: Handler, response: "Response", sink: queue.SimpleQueue, handles: list,
               echoes: list[str], prompt_tokens: int, include_usage: bool) -> None:
        handler.start_sse()
        choices = [Choice() for _ in handles]
        try:
            for index, echo in enumerate(echoes):
                first = response.first_chunk(index, echo)
                if first is not None:
                    handler.send_event(first)
            remaining = len(handles)
            while remaining:
                tag, event = sink.get()
                choice = choices[tag]
                if isinstance(event, TokenEvent):
                    choice.text += event.text
                    if event.logprob is not None:
                        choice.tokens.append(event)
                    if event.text:  # held-back tokens ride along with the next chunk
                        handler.send_event(response.chunk(tag, event.text, tokens=choice.tokens))
                        choice.tokens = []
                    continue
                choice.finish = event
                remaining -= 1
                if event.reason in ("error", "timeout"):
                    handler.send_event({"error": {"message": event.message, "type": "server_error", "param": None,
                                                  "code": "generation_failed" if event.reason == "error"
                                                  else "queue_timeout"}})
                    continue
                handler.send_event(response.chunk(tag, event.text, finish_reason(event), choice.tokens))
            self.account(choices)
            if include_usage:
                handler.send_event(response.usage_chunk(choices, prompt_tokens))
            handler.send_event("[DONE]")
        except OSError:  # the client went away: stop generating for it
            for handle in handles:
                handle.cancel()

    def account(self, choices: list[Choice]) -> None:
        for choice in choices:
            if choice.finish is None:
                continue
            usage = choice.finish.usage
            self.metrics.add("reame_prompt_tokens_total", usage.prompt_tokens)
            self.metrics.add("reame_generated_tokens_total", usage.completion_tokens)
            self.metrics.add("reame_prompt_seconds_total", usage.prompt_seconds)
            self.metrics.add("reame_generation_seconds_total", usage.decode_seconds)


ROUTES = {
    "/metrics": App.health_metrics,
    "/v1/sessions": App.create_session,
    "/v1/models": App.models,
    "/v1/completions": App.completions,
    "/v1/chat/completions": App.chat_completions,
    "/tokenize": App.tokenize,
    "/detokenize": App.detokenize,
}


def fill_in_the_middle(engine: Engine, prompt: Any, suffix: str) -> list[int]:
    """Prefix-suffix-middle tokens, as code editors send `prompt` + `suffix`: the model writes the middle.

    User text is tokenized without parsing special tokens, so it cannot forge FIM markers.
    """
    backend = engine.backend
    fim = backend.fim_tokens()
    if fim is None:
        raise HttpError(400, "this model has no fill-in-the-middle tokens; 'suffix' needs a code model such as "
                        "qwen2.5-coder", param="suffix", code="unsupported_parameter")
    pre, suf, mid = fim
    prefix = backend.tokenize(prompt, add_special=False, parse_special=False) if isinstance(prompt, str) \
        else list(prompt)
    bos = [backend.bos_token] if getattr(backend, "add_bos", False) and backend.bos_token >= 0 else []
    return bos + [pre] + prefix + [suf] + backend.tokenize(suffix, add_special=False, parse_special=False) + [mid]


def check_model(fields: Fields) -> None:
    """`model` is accepted whatever it names (one server serves one model) but must be a string."""
    model = fields.body.get("model")
    if model is not None and not isinstance(model, str):
        raise fields.bad("model", "a string")


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


def chat_messages(messages: Any) -> list[dict[str, str]]:
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
        result.append({"role": "system" if role == "developer" else role,
                       "content": message_text(message.get("content"), f"{where}.content")})
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


def finish_reason(event: FinishEvent) -> str:
    return "length" if event.reason == "length" else "stop"


class Response:
    """OpenAI shapes for one request: the whole answer, or its stream chunks."""

    def __init__(self, chat: bool, model: str, token_piece: Any = None) -> None:
        self.chat = chat
        self.model = model
        self.token_piece = token_piece  # set when logprobs were asked for
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"

    def _envelope(self, object_name: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": object_name, "created": self.created, "model": self.model,
                "system_fingerprint": f"reame-{__version__}", "choices": choices}

    def whole(self, choices: list[Choice], prompt_tokens: int) -> dict[str, Any]:
        shaped = []
        for index, choice in enumerate(choices):
            assert choice.finish is not None
            item: dict[str, Any] = {"index": index, "logprobs": self.logprobs(choice.tokens),
                                    "finish_reason": finish_reason(choice.finish)}
            if self.chat:
                item["message"] = {"role": "assistant", "content": choice.text}
            else:
                item["text"] = choice.text
            shaped.append(item)
        body = self._envelope(self.object, shaped)
        body["usage"] = self.usage(choices, prompt_tokens)
        return body

    def first_chunk(self, index: int, echo: str) -> dict[str, Any] | None:
        if self.chat:
            delta = {"role": "assistant", "content": ""}
            return self._envelope("chat.completion.chunk", [
                {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}])
        return self.chunk(index, echo) if echo else None

    def chunk(self, index: int, text: str, finish: str | None = None,
              tokens: list[TokenEvent] | None = None) -> dict[str, Any]:
        logprobs = self.logprobs(tokens or [])
        if self.chat:
            delta = {"content": text} if text or finish is None else {}
            item: dict[str, Any] = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
            return self._envelope("chat.completion.chunk", [item])
        item = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
        return self._envelope("text_completion", [item])

    def logprobs(self, tokens: list[TokenEvent]) -> dict[str, Any] | None:
        """OpenAI's logprobs object: `content` entries for chat, parallel arrays for completions."""
        if self.token_piece is None:
            return None
        piece = self.token_piece
        if self.chat:
            def entry(token: int, logprob: float) -> dict[str, Any]:
                raw = piece(token)
                return {"token": raw.decode("utf-8", "replace"), "logprob": logprob, "bytes": list(raw)}
            return {"content": [dict(entry(e.token, e.logprob), top_logprobs=[entry(t, lp) for t, lp in e.top])
                                for e in tokens], "refusal": None}
        texts = [piece(e.token).decode("utf-8", "replace") for e in tokens]
        offsets, position = [], 0
        for text in texts:
            offsets.append(position)
            position += len(text)
        return {"tokens": texts, "token_logprobs": [e.logprob for e in tokens],
                "top_logprobs": [{piece(t).decode("utf-8", "replace"): lp for t, lp in e.top} for e in tokens],
                "text_offset": offsets}

    def usage_chunk(self, choices: list[Choice], prompt_tokens: int) -> dict[str, Any]:
        body = self._envelope("chat.completion.chunk" if self.chat else "text_completion", [])
        body["usage"] = self.usage(choices, prompt_tokens)
        return body

    def usage(self, choices: list[Choice], prompt_tokens: int) -> dict[str, Any]:
        completion = sum(c.finish.usage.completion_tokens for c in choices if c.finish is not None)
        shaped: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                                  "total_tokens": prompt_tokens + completion}
        cached = sum(c.finish.usage.cached_tokens for c in choices if c.finish is not None)
        shaped["prompt_tokens_details"] = {"cached_tokens": cached}
        return shaped
