"""Ollama's API (`/api/*`), the parts its clients use (the `ollama` Python and JavaScript clients, Open WebUI,
editor plugins, n8n): version, tags, show, ps, generate, chat, embed, embeddings, pull. A thin shape layer
over the same engine, caches, speculation, grammars and tool-call parsing as the OpenAI routes; streamed
answers are JSON lines ending in Ollama's final record (durations in nanoseconds), errors `{"error": …}`.

A request's `model` picks one of the models the server serves (server.models; a server of one model answers
to any name, as the OpenAI routes do), loaded on demand and unloaded after `keep_alive`; `pull` fetches a
catalog model to this machine. Ollama's sampling defaults apply when a request
leaves them out (temperature 0.8, top_k 40, top_p 0.9, repeat_penalty 1.1). Options that only configure
Ollama's own runner (num_ctx, num_thread, num_gpu, mirostat, …) are accepted and ignored; an unknown one is
logged and ignored, as Ollama does.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import logging
import math
import re
import time
from typing import Any

from reame import __version__, catalog, fetch
from reame.engine import FinishEvent, SamplingParams
from reame.errors import FetchError
from reame.server import turn
from reame.server.client import Asker, HttpError, Line, Opening, Whole
from reame.server.routes import Route
from reame.semantic import chat_question
from reame.server.exchange import Asked, Options
from reame.server.models import FOREVER, ServedModel, loaded
from reame.server.service import Service, failure
from reame.server.shapes import logprob_entries
from reame.server.validation import Fields, chat_messages, embedding_count, sampling_params
from reame.structured.json_schema import JSON_OBJECT_GBNF, schema_to_gbnf
from reame.structured.requested import checked
from reame.structured.tools import ToolCall, tool_request

log = logging.getLogger("reame.server")

OLLAMA_DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.9, "repeat_penalty": 1.1}
OPTIONS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p", "seed": "seed",
           "stop": "stop", "repeat_penalty": "repeat_penalty", "presence_penalty": "presence_penalty",
           "frequency_penalty": "frequency_penalty", "num_predict": "max_tokens"}
RUNNER_OPTIONS = frozenset({"num_ctx", "num_keep", "num_batch", "num_gpu", "main_gpu", "num_thread", "use_mmap",
                            "use_mlock", "numa", "low_vram", "vocab_only", "typical_p", "repeat_last_n", "mirostat",
                            "mirostat_tau", "mirostat_eta", "penalize_newline", "tfs_z", "f16_kv", "logits_all"})
NDJSON = "application/x-ndjson"
MAX_TOP_LOGPROBS = 20  # alternatives per token, as Ollama bounds them
NEVER = datetime.datetime(2318, 1, 1, tzinfo=datetime.timezone.utc)  # Ollama's expiry of a model kept for ever
UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
DURATION = re.compile(r"-?(?:\d{1,9}(?:\.\d{1,9})?(?:ms|s|m|h)?){1,4}")  # Go's durations, as Ollama parses them
PART = re.compile(r"(\d{1,9}(?:\.\d{1,9})?)(ms|s|m|h)?")
MAX_KEEP_ALIVE_S = 366 * 86400.0


def error_body(error: HttpError) -> dict[str, Any]:
    return {"error": error.message}


def now() -> str:
    return timestamp(datetime.datetime.now(datetime.timezone.utc))


def timestamp(moment: datetime.datetime) -> str:
    """A UTC time as Ollama writes it ("…Z")."""
    return moment.isoformat().replace("+00:00", "Z")


def details(model: ServedModel) -> dict[str, Any]:
    """The model's `details` as Ollama lists them, from its file's header (loaded or not)."""
    facts = model.facts
    return {"parent_model": "", "format": "gguf", "family": facts.architecture, "families": [facts.architecture],
            "parameter_size": facts.parameter_size, "quantization_level": facts.quantization}


def listed(model: ServedModel) -> dict[str, Any]:
    """A served model as /api/tags and /api/ps list it."""
    facts = model.facts
    modified = datetime.datetime.fromtimestamp(facts.modified, datetime.timezone.utc)
    return {"name": model.name, "model": model.name, "modified_at": timestamp(modified),
            "size": facts.size_bytes,
            "digest": hashlib.sha256(f"{facts.path}:{facts.size_bytes}:{facts.modified}".encode()).hexdigest(),
            "details": details(model)}


def version(app: Service, handler: Asker, _path: str) -> None:
    handler.send(Whole(200, {"version": __version__}))


def tags(app: Service, handler: Asker, _path: str) -> None:
    handler.send(Whole(200, {"models": [listed(model) for model in app.models.models]}))


def ps(app: Service, handler: Asker, _path: str) -> None:
    """The models loaded now, with when their keep-alive ends (far in the future: never)."""
    running = []
    for model in app.models.loaded():
        entry = listed(model)
        entry.pop("modified_at")
        expires = model.expires_at()
        ends = datetime.datetime.fromtimestamp(expires, datetime.timezone.utc) if expires is not None else NEVER
        running.append({**entry, "size": model.memory_bytes or entry["size"], "size_vram": 0,
                        "expires_at": timestamp(ends), "context_length": model.context_length()})
    handler.send(Whole(200, {"models": running}))


def show(app: Service, handler: Asker, _path: str) -> None:
    """A served model's facts, from its file: it is not loaded for this."""
    fields = Fields(handler.read_json())
    model = app.served(model_name(fields))
    facts = model.facts
    engine = model.engine
    capabilities = ["completion", "tools"] + \
        (["insert"] if engine is not None and engine.backend.fim_tokens() is not None else [])
    handler.send(Whole(200, {
        "modelfile": "", "parameters": "", "template": "", "details": details(model),
        "model_info": {"general.architecture": facts.architecture,
                       f"{facts.architecture}.context_length": facts.context_train},
        "capabilities": capabilities, "modified_at": listed(model)["modified_at"]}))


def keep_alive_of(body: dict[str, Any]) -> float | None:
    """`keep_alive` as Ollama takes it: seconds, or a duration ("5m", "1h30m", "45s", "0"); negative = for ever;
    None: the server's (server.keep_alive_seconds)."""
    value = body.get("keep_alive")
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        seconds = float(value)
    elif isinstance(value, str) and len(value) <= 64 and value.strip() and DURATION.fullmatch(value.strip()):
        text = value.strip()
        sign = -1.0 if text.startswith("-") else 1.0
        seconds = sign * sum(float(number) * UNIT_SECONDS[unit or "s"] for number, unit in PART.findall(text))
    else:
        raise HttpError(400, "keep_alive must be a number of seconds or a duration such as \"5m\"",
                        param="keep_alive")
    return FOREVER if seconds < 0 else min(seconds, MAX_KEEP_ALIVE_S)


def model_name(fields: Fields) -> str:
    name = fields.body.get("model", fields.body.get("name"))
    if not isinstance(name, str) or not name:
        raise HttpError(400, "model is required", param="model")
    return name


def options_of(body: dict[str, Any]) -> tuple[SamplingParams, int | None]:
    """The request's sampling settings from `options`, over Ollama's defaults; and its seed."""
    options = body.get("options") or {}
    if not isinstance(options, dict):
        raise HttpError(400, "options must be an object", param="options")
    mapped: dict[str, Any] = dict(OLLAMA_DEFAULTS)
    for name, value in options.items():
        if name in OPTIONS:
            mapped[OPTIONS[name]] = value
        elif name not in RUNNER_OPTIONS:  # as Ollama does: a warning, not a refusal
            log.warning("Ollama request: invalid option provided: %s", str(name)[:64])
    fields = Fields(mapped)
    predict = fields.integer("max_tokens", None, -2, None)
    seed = fields.integer("seed", None, -1, 2**32 - 2)
    seed = None if seed == -1 else seed
    params = sampling_params(fields, None if predict is None or predict < 0 else max(predict, 1), seed)
    return params, seed


def format_grammar(value: Any) -> str | None:
    """`format`: "json" (any JSON object) or a JSON schema the answer must match."""
    if value in (None, ""):
        return None
    if value == "json":
        return JSON_OBJECT_GBNF
    if isinstance(value, dict):
        return checked(schema_to_gbnf(value, param="format"))
    raise HttpError(400, "format must be \"json\" or a JSON schema object", param="format")


def no_images(message: dict[str, Any], where: str) -> None:
    if message.get("images"):
        raise HttpError(400, f"{where}.images: this model reads text only", param=f"{where}.images")


def generate(app: Service, handler: Asker, _path: str) -> None:
    fields = Fields(handler.read_json())
    body = fields.body
    name = model_name(fields)
    keep_alive = keep_alive_of(body)
    no_images(body, "request")
    prompt = body.get("prompt", "")
    system, suffix = body.get("system"), body.get("suffix")
    for field_name, value in (("prompt", prompt), ("system", system), ("suffix", suffix)):
        if value is not None and not isinstance(value, str):
            raise fields.bad(field_name, "a string")
    if not prompt and not suffix:  # Ollama's way to load a model (and, with keep_alive 0, to unload it)
        served = app.served(name)
        if keep_alive == 0:
            app.models.unload_idle(served)
            reason = "load" if served.pinned else "unload"  # the first model stays: it is everyone's
        else:
            app.model(handler, name, keep_alive)
            reason = "load"
        handler.send(Whole(200, {"model": name, "created_at": now(), "response": "", "done": True,
                                "done_reason": reason}))
        return
    params, seed = options_of(body)
    served, waited = held(app, handler, name, keep_alive)
    engine = loaded(served)
    if fields.boolean("raw", False) or not engine.backend.has_chat_template or suffix:
        text = (system + "\n\n" if system and not fields.boolean("raw", False) else "") + prompt
    else:
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        text = engine.chat_prompt(messages, enable_thinking=think_switch(body, engine))
    asked = Asked([text], dataclasses.replace(params, grammar=format_grammar(body.get("format"))),
                  answer_options(fields, seed), chat=False, streamed=fields.boolean("stream", True),
                  thinks=engine.backend.template_thinks[0] and not suffix, suffix=suffix or None)
    answer(app, handler, Routed(served, name, waited, asked))


def chat(app: Service, handler: Asker, _path: str) -> None:
    fields = Fields(handler.read_json())
    body = fields.body
    name = model_name(fields)
    keep_alive = keep_alive_of(body)
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise HttpError(400, "messages must be a non-empty array", param="messages")
    converted = []
    for index, message in enumerate(raw):
        if not isinstance(message, dict):
            raise HttpError(400, f"messages[{index}] must be an object", param=f"messages[{index}]")
        no_images(message, f"messages[{index}]")
        entry = {key: message[key] for key in ("role", "content", "tool_calls") if message.get(key) is not None}
        if message.get("tool_name") is not None:
            entry["name"] = message["tool_name"]
        if message.get("thinking") is not None:  # an assistant's thinking, sent back as it was given
            if not isinstance(message["thinking"], str):
                raise HttpError(400, f"messages[{index}].thinking must be a string", param=f"messages[{index}]")
            entry["reasoning_content"] = message["thinking"]
        converted.append(entry)
    messages = chat_messages(converted)
    tools = tool_request({"tools": body["tools"]}) if body.get("tools") else None
    params, seed = options_of(body)
    served, waited = held(app, handler, name, keep_alive)
    engine = loaded(served)
    enable_thinking = think_switch(body, engine)

    def render(conversation: list[dict[str, Any]]) -> str:
        return turn.chat_prompt(engine, conversation, tools, enable_thinking)
    question = chat_question(messages, render) if served.semantic is not None else None
    grammar = format_grammar(body.get("format"))
    asked = Asked([render(messages)], dataclasses.replace(params, grammar=grammar), answer_options(fields, seed),
                  streamed=fields.boolean("stream", True), tools=tools, thinks=engine.backend.template_thinks[0],
                  question=question)
    answer(app, handler, Routed(served, name, waited, asked))


@dataclasses.dataclass(frozen=True)
class Waited:
    """How long a request waited for its model: Ollama's load_duration, and the start of its total_duration."""

    started: float  # perf_counter
    load_seconds: float


def held(app: Service, handler: Asker, name: str, keep_alive: float | None) -> tuple[ServedModel, Waited]:
    """The request's model, held for it (Service.model), and how long that took."""
    started = time.perf_counter()
    served = app.model(handler, name, keep_alive)
    return served, Waited(started, time.perf_counter() - started)


def durations(waited: Waited) -> dict[str, int]:
    """total_duration (until now) and load_duration, in nanoseconds."""
    return {"total_duration": int((time.perf_counter() - waited.started) * 1e9),
            "load_duration": int(waited.load_seconds * 1e9)}


def answer_options(fields: Fields, seed: int | None) -> Options:
    """The seed (a seeded or greedy answer may come from the cache), and `logprobs` with `top_logprobs`
    alternatives (0-20; without `logprobs` they are not asked for, as Ollama ignores them)."""
    top = fields.integer("top_logprobs", 0, 0, MAX_TOP_LOGPROBS)
    return Options(seed=seed, logprobs=top if fields.boolean("logprobs", False) else None)


@dataclasses.dataclass(frozen=True)
class Routed:
    """A generate or chat request once its route has read it: the model held for it and the name the request
    gave it (Ollama's answers repeat that name), how long the model took to be ready, and what it asks of the
    exchange."""

    model: ServedModel
    name: str
    waited: Waited
    asked: Asked


def answer(app: Service, handler: Asker, routed: Routed) -> None:
    """Run one generation and answer in Ollama's shape: JSON lines while it streams, or one object."""
    model, name, waited, chat = routed.model, routed.name, routed.waited, routed.asked.chat
    current = turn.start(app, handler, model, routed.asked, "messages" if chat else "prompt")
    key = "message" if chat else "response"
    token_piece = loaded(model).backend.token_piece

    def piece(text: str, calls: list[ToolCall] | None = None, thinking: str = "") -> dict[str, Any]:
        tokens, current.choice.tokens = current.choice.tokens, []  # each logprob sent once, with its text
        logprobs = {"logprobs": logprob_entries(token_piece, tokens)} if tokens else {}
        if not chat:
            return {"model": name, "created_at": now(), "response": text, "done": False,
                    **({"thinking": thinking} if thinking else {}), **logprobs}
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if thinking:
            message["thinking"] = thinking
        if calls:
            message["tool_calls"] = [{"function": {"name": call.name, "arguments": call_arguments(call)}}
                                     for call in calls]
        return {"model": name, "created_at": now(), "message": message, "done": False, **logprobs}
    if routed.asked.streamed:
        handler.send(Opening(NDJSON))
        try:
            for said in turn.said(current):
                if said.finish is not None:
                    final = closing(said.finish, waited, current.prompt_tokens, current.cached)
                    failed = failure(said.finish)
                    if failed is not None:
                        handler.send(Line({"error": failed.message}))
                        return
                    handler.send(Line({**piece(""), **final}))
                elif said.call is not None:
                    handler.send(Line(piece("", [said.call])))
                elif said.text or said.thinking:
                    handler.send(Line(piece(said.text, thinking=said.thinking)))
        except OSError:  # the client went away: stop generating for it
            current.cancel()
        return
    ended = turn.whole(current)
    if ended is None:
        return  # the client left
    calls, finish = ended
    whole = piece(current.choice.text, calls, "".join(current.choice.thinking))
    handler.send(Whole(200, {**whole, key: whole[key], **closing(finish, waited, current.prompt_tokens,
                                                                current.cached)}))


def think_switch(body: dict[str, Any], engine: Any) -> bool | None:
    """`think` (true, false, or a level: "low", "medium", "high") for a model whose template can turn its
    thinking off; None otherwise (the template's default)."""
    think = body.get("think")
    if think is None or not engine.backend.template_thinks[1]:
        return None
    if not isinstance(think, (bool, str)):
        raise HttpError(400, "think must be a boolean or \"low\", \"medium\", \"high\"", param="think")
    return bool(think)


def call_arguments(call: ToolCall) -> Any:
    """Ollama sends a call's arguments as an object (OpenAI as JSON text)."""
    try:
        return json.loads(call.arguments)
    except ValueError:
        return call.arguments


def closing(finish: FinishEvent, waited: Waited, prompt_tokens: int, cached: bool) -> dict[str, Any]:
    """Ollama's final record: why it ended, the counts, the durations in nanoseconds."""
    usage = finish.usage
    return {"done": True, "done_reason": "length" if finish.reason == "length" else "stop", **durations(waited),
            "prompt_eval_count": prompt_tokens if not cached else 0,
            "prompt_eval_duration": int(usage.prompt_seconds * 1e9), "eval_count": usage.completion_tokens,
            "eval_duration": int(usage.decode_seconds * 1e9)}


def embed(app: Service, handler: Asker, path: str) -> None:
    """/api/embed (`input`: a string or strings; `embeddings`) and the older /api/embeddings (`prompt`;
    `embedding`)."""
    fields = Fields(handler.read_json())
    name = model_name(fields)
    keep_alive = keep_alive_of(fields.body)
    older = path == "/api/embeddings"
    inputs = fields.body.get("prompt") if older else fields.body.get("input")
    texts = [inputs] if isinstance(inputs, str) else inputs
    if not isinstance(texts, list) or not texts or not all(isinstance(text, str) for text in texts):
        raise HttpError(400, "prompt must be a string" if older else "input must be a string or an array of "
                        "strings", param="prompt" if older else "input")
    embedding_count(len(texts))  # before tokenizing: 10 MB of one-letter inputs is millions
    served, waited = held(app, handler, name, keep_alive)
    backend = loaded(served).backend
    tokens = [backend.tokenize(text, add_special=True, parse_special=False) for text in texts]
    vectors = app.embeddings(handler.gone, served, tokens)
    if vectors is None:
        return
    if older:
        handler.send(Whole(200, {"embedding": vectors[0]}))
        return
    handler.send(Whole(200, {"model": name, "embeddings": vectors, **durations(waited),
                            "prompt_eval_count": sum(map(len, tokens))}))


def pull(app: Service, handler: Asker, _path: str) -> None:
    """Fetch a catalog model to this machine. A server serves the models its settings name
    (server.models): a model pulled here is served once they name it."""
    if not app.settings.allow_pull:  # any client could otherwise fill the disk with the catalog (~16 GB)
        raise HttpError(403, "pulling models is off on this server (server.allow_pull = true turns it on); "
                        "`reame pull NAME` fetches one on the server's machine", code="pull_disabled")
    fields = Fields(handler.read_json())
    name = model_name(fields)
    stream = fields.boolean("stream", True)
    entry = catalog.resolve(name.removesuffix(":latest"))
    if entry is None and not any(model.answers_to(name) for model in app.models.models):
        raise HttpError(404, f"pull model manifest: file does not exist: '{name}' is not in Reame's catalog "
                        f"(reame list)", code="model_not_found")
    steps = [{"status": "pulling manifest"}]
    if entry is not None:
        try:
            fetch.ensure_model(entry)
        except FetchError as error:
            raise HttpError(502, f"pull model: {error}", "server_error") from None
        steps.append({"status": "verifying sha256 digest"})
    steps.append({"status": "success"})
    if not stream:
        handler.send(Whole(200, steps[-1]))
        return
    handler.send(Opening(NDJSON))
    for step in steps:
        handler.send(Line(step))


ROUTES = [Route(path, methods, function, error_body=error_body) for path, methods, function in (
    ("/api/version", ("GET",), version), ("/api/tags", ("GET",), tags), ("/api/ps", ("GET",), ps),
    ("/api/show", ("POST",), show), ("/api/generate", ("POST",), generate), ("/api/chat", ("POST",), chat),
    ("/api/embed", ("POST",), embed), ("/api/embeddings", ("POST",), embed), ("/api/pull", ("POST",), pull))]
