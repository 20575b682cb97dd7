"""OpenAI's API: completions, chat completions, embeddings, models, and Reame's warm. Request bodies are
read by validation.py (a wrong type is a 400 naming the field, never a crash), generations run through
generation.py and are shaped by shapes.py, so the official SDKs work unchanged."""

from __future__ import annotations

import array
import dataclasses
import base64
import queue
import sys
from typing import Any

from reame.engine import FinishEvent, GenerationRequest
from reame.server import generation, turn
from reame.server.exchange import CACHE_BYPASS, Asked, EngineGone, Options, Submitted, events
from reame.server.client import Asker, HttpError, Whole
from reame.server.routes import Route
from reame.semantic import chat_question
from reame.engine.embeddings import MAX_INPUTS
from reame.server.models import ServedModel, loaded
from reame.server.prompts import llama_prompts
from reame.server.service import Service, as_http_error
from reame.server.validation import (Fields, best_of, chat_messages, completion_prompts,
                                     requested_model, sampling_params)
from reame.structured.requested import requested_grammar
from reame.structured.tools import tool_request


def models(app: Service, handler: Asker, _path: str) -> None:
    handler.send(Whole(200, {"object": "list", "data": [app.model_card(model) for model in app.models.models]}))


def model(app: Service, handler: Asker, path: str) -> None:
    """One served model's card, by its name or an alias."""
    wanted = path[len("/v1/models/"):]
    found = next((served for served in app.models.models if served.answers_to(wanted)), None)
    if found is None:
        raise HttpError(404, f"the model '{wanted[:100]}' does not exist; this server serves "
                        f"{', '.join(repr(served.name) for served in app.models.models)}", param="model",
                        code="model_not_found")
    handler.send(Whole(200, app.model_card(found)))


def warm(app: Service, handler: Asker, _path: str) -> None:
    """Prefill a prompt (or a chat's messages, without the assistant turn) into the prefix cache."""
    fields = Fields(handler.read_json())
    served = app.model(handler, requested_model(fields))
    engine = loaded(served)
    if "messages" in fields.body:
        prompt: Any = engine.backend.apply_chat_template(chat_messages(fields.body["messages"]),
                                                         add_assistant=False)
    else:
        prompts = completion_prompts(fields.body.get("prompt"))
        if len(prompts) != 1:
            raise HttpError(400, "warm one prompt per request", param="prompt", code="invalid_value")
        prompt = prompts[0]
    request = GenerationRequest(prompt, warm=True)
    if engine.cache is None:
        tokens = app.submit_checked(lambda: engine.prompt_tokens(request))
        handler.send(Whole(200, {"object": "warm", "warmed": False, "tokens": len(tokens), "cached_tokens": 0,
                                "message": "the prefix cache is off on this server"}))
        return
    sink: queue.SimpleQueue = queue.SimpleQueue()
    handle = app.submit_checked(lambda: engine.submit(request, sink))
    finish = None
    for item in events(app, served, Submitted([handle], sink, CACHE_BYPASS), handler.gone):
        if isinstance(item, EngineGone):
            raise as_http_error(item.error)
        finish = item[1] if isinstance(item[1], FinishEvent) else finish
    if finish is None:
        return  # the client left
    if finish.reason != "stop":
        raise HttpError(503 if finish.reason == "timeout" else 500, finish.message or f"warming {finish.reason}",
                        "server_error", "warm_failed")
    usage = finish.usage
    shared = engine.cache.share(handle.prompt_tokens)  # a fleet's store then holds it for every node
    handler.send(Whole(200, {"object": "warm", "warmed": True, "tokens": usage.prompt_tokens,
                            "cached_tokens": usage.cached_tokens, "seconds": round(usage.prompt_seconds, 3),
                            "shared": shared}))


def embeddings(app: Service, handler: Asker, _path: str) -> None:
    """OpenAI's embeddings: one unit-length vector per input, from the model's embedding context."""
    served, inputs, encoding = embedding_request(app, handler)
    if not loaded(served).backend.embeddings_pooled:
        raise HttpError(400, "Pooling type 'none' is not OpenAI-compatible: this model's embeddings are a vector "
                        "per token, which llama-server's /embeddings gives", param="input", code="invalid_value")
    answer_embeddings(app, handler, served, inputs, encoding)


def answer_embeddings(app: Service, handler: Asker, served: ServedModel, inputs: list[list[int]],
                      encoding: str) -> None:
    """One vector per input, in OpenAI's shape."""
    vectors = app.embeddings(handler.gone, served, inputs)
    if vectors is None:
        return
    data = [{"object": "embedding", "index": index, "embedding": encode_vector(vector, encoding)}
            for index, vector in enumerate(vectors)]
    used = sum(len(tokens) for tokens in inputs)
    handler.send(Whole(200, {"object": "list", "data": data, "model": served.name,
                            "usage": {"prompt_tokens": used, "total_tokens": used}}))


def embedding_request(app: Service, handler: Asker) -> tuple[ServedModel, list[list[int]], str]:
    """An embeddings request's model, its inputs as tokens (llama-server's shapes, a superset of OpenAI's:
    mixed ids and text, objects of text parts) and the encoding asked for."""
    fields = Fields(handler.read_json())
    served = app.model(handler, requested_model(fields))
    engine = loaded(served)
    encoding = fields.body.get("encoding_format", "float")
    if encoding not in ("float", "base64"):
        raise HttpError(400, "'encoding_format' must be 'float' or 'base64'", param="encoding_format",
                        code="invalid_value")
    dimensions = fields.integer("dimensions", None, 1, None)
    if dimensions not in (None, engine.backend.n_embd):
        raise HttpError(400, f"this model's embeddings have {engine.backend.n_embd} dimensions and cannot be "
                        f"shortened to {dimensions}", param="dimensions", code="unsupported_parameter")
    backend = engine.backend

    def tokenize(text: str, first: bool = True) -> list[int]:
        return backend.tokenize(text, add_special=first, parse_special=False)
    # llama-server's input shapes, a superset of OpenAI's (mixed ids and text, objects of text parts).
    inputs = [tokenize(item) if isinstance(item, str) else item
              for item in llama_prompts(fields.body.get("input"), tokenize, MAX_INPUTS, "input")]
    if any(not tokens for tokens in inputs):
        raise HttpError(400, "'input' holds a text of no tokens", param="input", code="invalid_value")
    return served, inputs, encoding


def completions(app: Service, handler: Asker, _path: str) -> None:
    fields = Fields(handler.read_json())
    served = app.model(handler, requested_model(fields))
    prompts = completion_prompts(fields.body.get("prompt"))
    suffix = fields.body.get("suffix")
    if suffix is not None and not isinstance(suffix, str):
        raise fields.bad("suffix", "a string")
    echo = fields.boolean("echo", False)
    logprobs = fields.integer("logprobs", None, 0, 5)
    if echo and logprobs is not None:
        raise HttpError(400, "'logprobs' of an echoed prompt are not supported", param="echo",
                        code="unsupported_parameter")
    params = sampling_params(fields, fields.integer("max_tokens", 16, 1, None), None)
    generation.generate(app, handler, fields, served, Asked(
        prompts, dataclasses.replace(params, grammar=requested_grammar(fields.body)),
        Options(elect_among=best_of(fields, chat=False), echo=echo, logprobs=logprobs), chat=False, suffix=suffix))


def chat_completions(app: Service, handler: Asker, _path: str) -> None:
    fields = Fields(handler.read_json())
    served = app.model(handler, requested_model(fields))
    engine = loaded(served)
    for legacy in ("functions", "function_call"):
        if fields.body.get(legacy):
            raise HttpError(400, f"'{legacy}' is deprecated and not supported: use 'tools' and 'tool_choice'",
                            param=legacy, code="unsupported_parameter")
    tools = tool_request(fields.body)
    top_logprobs = fields.integer("top_logprobs", None, 0, 20)
    logprobs = (top_logprobs or 0) if fields.boolean("logprobs", False) else None
    if top_logprobs is not None and logprobs is None:
        raise HttpError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs",
                        code="invalid_value")
    grammar = turn.answer_grammar(tools, requested_grammar(fields.body), "response_format")
    messages = chat_messages(fields.body.get("messages"))
    max_tokens = fields.integer("max_completion_tokens", None, 1, None)
    if max_tokens is None:
        max_tokens = fields.integer("max_tokens", None, 1, None)
    thinks, switchable = engine.backend.template_thinks
    enable_thinking = thinking_switch(fields) if switchable else None
    continued = turn.continues_final(messages, fields.boolean("add_generation_prompt", True),
                                     fields.body.get("continue_final_message"))

    def render(messages: list[dict[str, Any]]) -> str:
        return turn.chat_prompt(engine, messages, tools, enable_thinking, continued)
    question = chat_question(messages, render) if served.semantic is not None else None
    params = dataclasses.replace(sampling_params(fields, max_tokens, None), grammar=grammar)
    generation.generate(app, handler, fields, served, Asked(
        [render(messages)], params, Options(elect_among=best_of(fields, chat=True), logprobs=logprobs),
        tools=tools, thinks=thinks, question=question))


def chat_input_tokens(app: Service, handler: Asker, _path: str) -> None:
    """llama-server's token count of a chat request: its messages (and tools) through the model's template,
    the assistant's turn opened, as /v1/chat/completions would prefill them: {"input_tokens": N}."""
    fields = Fields(handler.read_json())
    engine = loaded(app.model(handler, requested_model(fields)))
    prompt = turn.chat_prompt(engine, chat_messages(fields.body.get("messages")), tool_request(fields.body))
    handler.send(Whole(200, {"input_tokens": len(engine.prompt_tokens(GenerationRequest(prompt)))}))


def thinking_switch(fields: Fields) -> bool | None:
    """A thinking model's switch as OpenAI-compatible clients send it: `chat_template_kwargs.enable_thinking`
    (vLLM's and llama-server's), or `reasoning_effort: "none"` to turn it off; None: the template's default."""
    kwargs = fields.body.get("chat_template_kwargs")
    if kwargs is not None:
        if not isinstance(kwargs, dict) or not isinstance(kwargs.get("enable_thinking", False), bool):
            raise fields.bad("chat_template_kwargs", "an object whose enable_thinking is a boolean")
        if "enable_thinking" in kwargs:
            return kwargs["enable_thinking"]
    effort = fields.body.get("reasoning_effort")
    if effort is not None and not isinstance(effort, str):
        raise fields.bad("reasoning_effort", "a string")
    return False if effort == "none" else None


def encode_vector(vector: list[float], encoding: str) -> list[float] | str:
    """A vector as floats, or as OpenAI's base64 of little-endian float32s."""
    if encoding == "float":
        return vector
    packed = array.array("f", vector)
    if sys.byteorder == "big":
        packed.byteswap()
    return base64.b64encode(packed.tobytes()).decode("ascii")


ROUTES = [
    Route("/v1/completions", ("POST",), completions),
    Route("/v1/chat/completions", ("POST",), chat_completions),
    Route("/v1/chat/completions/input_tokens", ("POST",), chat_input_tokens),
    Route("/v1/embeddings", ("POST",), embeddings),
    Route("/v1/models", ("GET",), models),
    Route("/v1/models/", ("GET",), model, prefix=True),
    Route("/v1/warm", ("POST",), warm),
]
