"""llama-server's routes that generate nothing, as its tools/server answers them at the pin: `/tokenize`,
`/detokenize`, `/apply-template`, `GET /props` and `/slots`; and its metric names (llamacpp:*) over Reame's
counters, for the dashboards and exporters written against llama-server. Its generating routes are in
llamacpp.py; where Reame differs, docs/api.md says so."""

from __future__ import annotations

from reame.engine import Engine
from reame.native import LLAMA_COMMIT
from reame.server import turn
from reame.server.apis import openai
from reame.server.apis.llamacpp import error_body, generation_settings, sampling
from reame.server.client import Asker, HttpError, Whole
from reame.server.metrics import Sample
from reame.server.models import loaded
from reame.server.prompts import is_token
from reame.server.routes import Route
from reame.server.service import Service
from reame.server.validation import Fields, chat_messages, query_model, requested_model


def tokenize(app: Service, handler: Asker, _path: str) -> None:
    """`content` (a string, or strings and token ids mixed) as tokens; `with_pieces`: each with its piece,
    a string, or its bytes when they are not UTF-8 on their own."""
    fields = Fields(handler.read_json())
    content = fields.body.get("content")
    if not isinstance(content, (str, list)):
        raise fields.bad("content", "a string")
    add_special, parse_special = fields.boolean("add_special", False), fields.boolean("parse_special", True)
    backend = loaded(app.model(handler, requested_model(fields))).backend
    tokens: list[int] = []
    for index, item in enumerate([content] if isinstance(content, str) else content):
        if isinstance(item, str):
            tokens += backend.tokenize(item, add_special=add_special and index == 0, parse_special=parse_special)
        elif is_token(item):
            tokens.append(item)
        else:
            raise fields.bad("content", "a string, or a list of strings and token ids")
    if not fields.boolean("with_pieces", False):
        handler.send(Whole(200, {"tokens": tokens}))
        return
    handler.send(Whole(200, {"tokens": [{"id": token, "piece": piece(backend.token_piece(token))}
                                        for token in tokens]}))


def piece(raw: bytes) -> str | list[int]:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return list(raw)


def detokenize(app: Service, handler: Asker, _path: str) -> None:
    fields = Fields(handler.read_json())
    tokens = fields.body.get("tokens", [])
    backend = loaded(app.model(handler, requested_model(fields))).backend
    if not isinstance(tokens, list) or not all(is_token(token) for token in tokens):
        raise fields.bad("tokens", "an array of token ids")
    if any(not 0 <= token < backend.n_vocab for token in tokens):
        raise HttpError(400, f"'tokens' holds an id outside the vocabulary (0..{backend.n_vocab - 1})",
                        param="tokens")
    handler.send(Whole(200, {"content": backend.detokenize(tokens)}))


def metric_samples(app: Service) -> list[Sample]:
    """llama-server's own metrics (llamacpp:*), which its dashboards, exporters and tests read, computed from
    Reame's: the prompt tokens it processed (embeddings' included) apart from those found cached, the tokens
    predicted and their seconds, the decode calls, the requests running and waiting."""
    metrics = app.metrics
    prompt, cached = metrics.total("reame_prompt_tokens_total"), metrics.total("reame_prompt_tokens_cached_total")
    prompt_s, predicted = metrics.total("reame_prompt_seconds_total"), metrics.total("reame_generated_tokens_total")
    predicted_s = metrics.total("reame_generation_seconds_total")
    engines = [model.engine for model in app.models.loaded() if model.engine is not None]
    running = sum(engine.status.running for engine in engines)
    drafted = accepted = drafts = 0
    for engine in engines:
        if engine.speculation is not None:
            stats = engine.speculation.stats.snapshot()
            drafted += sum(counts.drafted for counts in stats.sources.values())
            accepted += sum(counts.accepted for counts in stats.sources.values())
            drafts += stats.steps_speculative
    values = [
        ("prompt_tokens_total", "counter", "prompt tokens processed", prompt - cached +
         metrics.total("reame_embedding_tokens_total")),
        ("prompt_tokens_cached_total", "counter", "prompt tokens found cached", cached),
        ("prompt_seconds_total", "counter", "prompt processing seconds", prompt_s),
        ("tokens_predicted_total", "counter", "tokens generated", predicted),
        ("tokens_predicted_seconds_total", "counter", "generation seconds", predicted_s),
        ("n_decode_total", "counter", "decode calls", sum(engine.status.kv.decodes for engine in engines)),
        ("n_tokens_max", "counter", "the most tokens a slot holds now", max(
            (max(map(len, engine.status.idle_prefixes), default=0) for engine in engines), default=0)),
        ("spec_decode_num_draft_tokens_total", "counter", "draft tokens proposed", drafted),
        ("spec_decode_num_accepted_tokens_total", "counter", "draft tokens accepted", accepted),
        ("spec_decode_num_drafts_total", "counter", "steps that verified drafts", drafts),
        ("prompt_tokens_seconds", "gauge", "prompt tokens per second", (prompt - cached) / prompt_s if prompt_s else 0),
        ("predicted_tokens_seconds", "gauge", "tokens generated per second", predicted / predicted_s if predicted_s
         else 0),
        ("requests_processing", "gauge", "requests generating", running),
        ("requests_deferred", "gauge", "requests waiting for a slot", sum(e.status.waiting for e in engines)),
        ("n_busy_slots_per_decode", "gauge", "slots busy per decode", running)]
    return [Sample(f"llamacpp:{name}", kind, text, {}, value) for name, kind, text, value in values]


def slot_context(engine: Engine) -> int:
    """The context a slot is sure of, as llama-server reports it: the whole context over the slots (with a
    unified KV, one request alone may use more, up to server.context_per_request)."""
    return min(engine.backend.n_ctx // engine.backend.n_seq_max, engine.context_per_request)


def slots(app: Service, handler: Asker, _path: str) -> None:
    """llama-server's slot monitor: each sequence slot of the model (`?model=`, else the first) and whether it
    is generating; `?fail_on_no_slot=1`: a 503 when none is free."""
    if not app.settings.slots:
        raise HttpError(501, "This server does not support slots endpoint. Start it with `--slots`",
                        "not_supported_error")
    served = app.model(handler, query_model(handler) or app.models.default.name)
    engine = loaded(served)
    status, backend = engine.status, engine.backend
    if "fail_on_no_slot=" in handler.path.partition("?")[2] and status.running >= backend.n_seq_max:
        raise HttpError(503, "no slot available", "unavailable_error")
    handler.send(Whole(200, [{"id": slot, "id_task": -1, "n_ctx": slot_context(engine),
                              "speculative": engine.speculation is not None, "is_processing": slot < status.running}
                             for slot in range(backend.n_seq_max)]))


def apply_template(app: Service, handler: Asker, _path: str) -> None:
    """The chat template over `messages`, the assistant's turn opened (or a last assistant message continued,
    as a chat completion would): {"prompt": text}."""
    fields = Fields(handler.read_json())
    engine = loaded(app.model(handler, requested_model(fields)))
    messages = chat_messages(fields.body.get("messages"))
    continued = turn.continues_final(messages, fields.boolean("add_generation_prompt", True),
                                     fields.body.get("continue_final_message"))
    handler.send(Whole(200, {"prompt": turn.chat_prompt(engine, messages, None, continued=continued)}))


def props(app: Service, handler: Asker, _path: str) -> None:
    """The server's properties as llama-server's GET /props gives them (what the plugins and web UIs read);
    POST /props is refused as llama-server started without `--props` refuses it."""
    if handler.command == "POST":
        raise HttpError(403, "This server does not support changing global properties. Start it with `--props`",
                        "permission_error")
    served = app.model(handler, query_model(handler) or app.models.default.name)
    engine = loaded(served)
    backend = engine.backend
    defaults = generation_settings(sampling(Fields({}), None, backend, app.settings.sampling), -1, False, 0,
                                   served.name)
    handler.send(Whole(200, {
        "default_generation_settings": {"id": 0, "id_task": -1, "n_ctx": slot_context(engine),
                                        "speculative": False,
                                        "is_processing": False, "params": defaults},
        "total_slots": backend.n_seq_max, "model_alias": served.name, "model_path": served.facts.path,
        "modalities": {"vision": False, "audio": False}, "endpoint_slots": app.settings.slots,
        "endpoint_props": False, "endpoint_metrics": app.settings.metrics, "webui": app.settings.web_page,
        "chat_template": "",
        "bos_token": backend.token_piece(backend.bos_token).decode("utf-8", "replace")
        if backend.bos_token >= 0 else "",
        "eos_token": "", "build_info": f"reame (llama.cpp {LLAMA_COMMIT})", "is_sleeping": False}))


def embeddings(app: Service, handler: Asker, path: str) -> None:
    """llama-server's /embeddings. A model whose embeddings are pooled answers in OpenAI's shape, as
    /v1/embeddings does (what a client whose base URL lacks /v1 reads); one with pooling "none" in
    llama-server's: [{"index", "embedding": [a vector per token]}], as the model computed them."""
    served, inputs, encoding = openai.embedding_request(app, handler)
    if loaded(served).backend.embeddings_pooled:
        openai.answer_embeddings(app, handler, served, inputs, encoding)
        return
    vectors = app.embeddings(handler.gone, served, inputs)
    if vectors is None:
        return
    answer, start = [], 0
    for index, tokens in enumerate(inputs):
        answer.append({"index": index, "embedding": vectors[start:start + len(tokens)]})
        start += len(tokens)
    handler.send(Whole(200, answer))


ROUTES = [Route("/tokenize", ("POST",), tokenize, error_body=error_body),
          Route("/embeddings", ("POST",), embeddings),
          Route("/detokenize", ("POST",), detokenize, error_body=error_body),
          Route("/apply-template", ("POST",), apply_template, error_body=error_body),
          Route("/props", ("GET", "POST"), props, error_body=error_body),
          Route("/slots", ("GET",), slots, error_body=error_body)]
