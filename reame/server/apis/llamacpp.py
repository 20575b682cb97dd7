"""llama-server's own API, as llama.cpp's tools/server answers it at the pin: `POST /completion` (and
`/completions`) and `POST /infill`, for the editor plugins (llama.vim, llama.vscode), Tabby, Continue's
llama.cpp provider and the scripts written against llama-server (its routes that generate nothing are in
llamacpp_info.py). Generations run through the exchange (exchange.py)
like every family's, so the caches, speculation and grammars serve them too; this module reads
llama-server's fields (its defaults, its mixed prompts) and encodes the exchange's items as its records: a
partial record per piece, a final one with `timings`, `tokens_cached`, `truncated`, `stop_type`. Where Reame
differs, docs/api.md says so."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from collections.abc import Iterator
from typing import Any

from reame.engine import FinishEvent, ProgressEvent
from reame.engine.prompt import infill
from reame.engine.request import MAX_TOP_LOGPROBS
from reame.errors import RequestError
from reame.model.backend import Backend
from reame.model.sampling import MAX_LOGIT_BIAS, MAX_SEED, SamplingParams
from reame.server import turn
from reame.server.client import CONTEXT_EXCEEDED, Asker, Event, HttpError, Opening, Whole
from reame.server.exchange import Asked, EngineGone, Exchange, Options
from reame.server.models import ServedModel, loaded
from reame.server.prompts import is_token, llama_prompts
from reame.server.routes import Route
from reame.server.service import Service, as_http_error, failure
from reame.server.shapes import logprob_entries
from reame.server.telemetry import Telemetry, final_timings
from reame.server.validation import MAX_CHOICES, Fields, requested_model
from reame.structured.requested import requested_grammar

# llama-server's sampler names (`samplers`): Reame's chain is fixed (docs/api.md), so they are checked, not used.
SAMPLERS = frozenset({"dry", "top_k", "typ_p", "typical_p", "top_p", "min_p", "xtc", "temperature", "infill",
                      "penalties", "top_n_sigma", "adaptive_p"})
MAX_EXTRA_CHUNKS = 1024  # an editor plugin's ring holds tens (llama.vim's: 16)
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 501: "not_supported_error", 503: "unavailable_error"}


def error_body(error: HttpError) -> dict[str, Any]:
    """llama-server's error shape: {"error": {"code", "message", "type"}}, and its counts of a prompt over the
    context."""
    kind = CONTEXT_EXCEEDED if error.kind == CONTEXT_EXCEEDED else ERROR_TYPES.get(error.status, "server_error")
    return {"error": {"code": error.status, "message": error.message, "type": kind, **error.details}}


@dataclass(frozen=True)
class Limits:
    """What ends a completion besides its tokens: llama-server's `n_indent` (a new line indented less ends it,
    cut before that line's text) and `t_max_predict_ms` (past it, a new line ends it)."""

    n_indent: int = 0
    t_max_predict_ms: float = 0.0


@dataclass
class Completion:
    """One completion being encoded: its exchange, what the request asked of the records, and each choice's
    text as llama-server keeps it (cut by the limits)."""

    exchange: Exchange
    model: str
    settings: dict[str, Any]
    limits: Limits
    return_tokens: bool
    n_probs: int
    texts: list[str] = field(default_factory=list)
    cut: set[int] = field(default_factory=set)  # choices ended by a limit (their engine generation cancelled)
    first_token_at: list[float] = field(default_factory=list)
    telemetry: Telemetry = field(default_factory=Telemetry)
    post_sampling: bool = False  # the probabilities are post-sampling ones (llama-server's prob, top_probs)


def completion(app: Service, handler: Asker, _path: str) -> None:
    fields = Fields(handler.read_json())
    served = app.model(handler, requested_model(fields))
    engine = loaded(served)
    backend = engine.backend
    prompts = llama_prompts(fields.body.get("prompt"),
                            lambda text, first: backend.tokenize(text, add_special=first, parse_special=True),
                            MAX_CHOICES)
    answer(app, handler, served, fields, prompts, chat=False)


def infill_route(app: Service, handler: Asker, _path: str) -> None:
    fields = Fields(handler.read_json())
    served = app.model(handler, requested_model(fields))
    engine = loaded(served)
    body = fields.body
    for name in ("input_prefix", "input_suffix"):
        if name not in body:
            raise HttpError(400, f'"{name}" is required', param=name)
        if not isinstance(body[name], str):
            raise fields.bad(name, "a string")
    extra = body.get("input_extra", [])
    if not isinstance(extra, list):
        raise HttpError(400, '"input_extra" must be an array of {"filename": string, "text": string}',
                        param="input_extra")
    if len(extra) > MAX_EXTRA_CHUNKS:  # (each is tokenized: bounded before any is)
        raise HttpError(400, f'"input_extra" holds at most {MAX_EXTRA_CHUNKS} chunks', param="input_extra")
    chunks = []
    for index, chunk in enumerate(extra):
        if not isinstance(chunk, dict) or not isinstance(chunk.get("text"), str):
            raise HttpError(400, 'extra_context chunk must contain a "text" field with a string value',
                            param=f"input_extra[{index}]")
        filename = chunk.get("filename", "tmp")
        if not isinstance(filename, str):
            raise HttpError(400, "extra_context chunk's \"filename\" field must be a string",
                            param=f"input_extra[{index}]")
        chunks.append((filename, chunk["text"]))
    middle = body.get("prompt", "")
    if not isinstance(middle, str):
        raise HttpError(400, '"prompt" must be a string', param="prompt")
    backend = engine.backend
    try:
        # llama-server sizes the extra context with its own n_predict (-1 by default), not the request's.
        tokens = infill(backend, body["input_prefix"], body["input_suffix"], chunks,
                        backend.tokenize(middle, add_special=False, parse_special=True) if middle else [], -1,
                        engine.context_per_request)
    except RequestError as error:
        raise HttpError(501, f"Infill is not supported by this model: {error}", "not_supported_error") from None
    answer(app, handler, served, fields, [tokens], chat=False)


def sampling(fields: Fields, n_predict: int | None, backend: Backend, defaults: SamplingParams) -> SamplingParams:
    """llama-server's sampling fields over the server's defaults ([generation], as llama-server's come from
    its command line; the seed among them, so a request without one is repeatable): a temperature at or below
    0 is greedy, a top_k at or below 0 and a top_p of 1 are off."""
    body = fields.body
    samplers = body.get("samplers")
    if samplers is not None and (not isinstance(samplers, list) or
                                 not all(isinstance(name, str) and name in SAMPLERS for name in samplers)):
        raise HttpError(400, f"samplers must be a list of sampler names ({', '.join(sorted(SAMPLERS))})",
                        param="samplers")
    seed = fields.integer("seed", defaults.seed if defaults.seed is not None else -1, -1, 2**32 - 1)
    try:
        return SamplingParams(
            max_tokens=n_predict,
            temperature=min(max(fields.number("temperature", defaults.temperature, -math.inf, math.inf), 0.0), 100.0),
            top_k=max(fields.integer("top_k", defaults.top_k), 0),
            top_p=min(max(fields.number("top_p", defaults.top_p, -math.inf, math.inf), 1e-6), 1.0),
            min_p=min(max(fields.number("min_p", defaults.min_p, -math.inf, math.inf), 0.0), 1.0),
            repeat_penalty=fields.number("repeat_penalty", defaults.repeat_penalty, 0.01, 10.0),
            repeat_last_n=fields.integer("repeat_last_n", 64, -1, None),
            presence_penalty=fields.number("presence_penalty", 0.0, -2.0, 2.0),
            frequency_penalty=fields.number("frequency_penalty", 0.0, -2.0, 2.0),
            seed=None if seed in (-1, 2**32 - 1) else seed % (MAX_SEED + 1), stop=fields.stop(),
            ignore_eos=fields.boolean("ignore_eos", False), grammar=grammar_of(fields),
            logit_bias=logit_bias(body.get("logit_bias"), backend))
    except RequestError as error:
        raise HttpError(400, str(error), param=error.param) from None


def logit_bias(value: Any, backend: Backend) -> dict[int, float]:
    """llama-server's `logit_bias`: [token or text, bias] pairs or an object of them, `false` banning the
    token; a text biases each of its tokens. Like llama-server, a pair it cannot read is skipped."""
    pairs = value if isinstance(value, list) else list(value.items()) if isinstance(value, dict) else []
    if len(pairs) > MAX_LOGIT_BIAS:  # (each text is tokenized: bounded before any is)
        raise HttpError(400, f"logit_bias holds at most {MAX_LOGIT_BIAS} entries", param="logit_bias")
    bias: dict[int, float] = {}
    for pair in pairs:
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            continue
        key, amount = pair
        if amount is False:
            amount = -math.inf
        elif isinstance(amount, bool) or not isinstance(amount, (int, float)) or math.isnan(amount):
            continue
        if isinstance(key, str) and key.lstrip("-").isdigit():
            key = int(key)
        if is_token(key):
            if 0 <= key < backend.n_vocab:
                bias[key] = float(amount)
        elif isinstance(key, str):
            bias.update(dict.fromkeys(backend.tokenize(key, add_special=False, parse_special=False), float(amount)))
    return bias


def grammar_of(fields: Fields) -> str | None:
    """`grammar` (GBNF) or `json_schema`, as llama-server takes them."""
    body = fields.body
    if body.get("grammar") and body.get("json_schema") is not None:
        raise HttpError(400, "Either 'json_schema' or 'grammar' can be specified, but not both", param="grammar")
    if body.get("json_schema") is not None:
        return requested_grammar({"response_format": {"type": "json_schema",
                                                      "json_schema": {"schema": body["json_schema"]}}})
    grammar = body.get("grammar")
    if grammar in (None, ""):
        return None
    if not isinstance(grammar, str):
        raise fields.bad("grammar", "a GBNF string")
    return requested_grammar({"grammar": grammar})


def answer(app: Service, handler: Asker, served: ServedModel, fields: Fields, prompts: list[Any],
           chat: bool) -> None:
    """Generate for each prompt (`n_cmpl` each) and answer as llama-server does: SSE records while it
    streams (no [DONE]), else one object, or an array of them for several."""
    default_predict = app.settings.sampling.max_tokens  # the server's default, as llama-server's --n-predict
    predict = fields.integer("n_predict", default_predict if default_predict is not None else -1, -1, None)
    n_cmpl = fields.integer("n_cmpl", 1, 1, MAX_CHOICES)
    if len(prompts) * n_cmpl > MAX_CHOICES:
        raise HttpError(400, f"a request asks at most {MAX_CHOICES} completions in all (prompts × n_cmpl)",
                        param="n_cmpl")
    n_probs = fields.integer("n_probs", 0, 0, MAX_TOP_LOGPROBS)
    post_sampling = fields.boolean("post_sampling_probs", False)
    stream = fields.boolean("stream", False)
    telemetry = Telemetry.asked(fields)
    params = sampling(fields, None if predict < 0 else max(predict, 1), loaded(served).backend,
                      app.settings.sampling)
    limits = Limits(fields.integer("n_indent", 0, 0, None), fields.number("t_max_predict_ms", 0.0, 0.0, math.inf))
    return_tokens = fields.boolean("return_tokens", False)
    response_fields = fields.body.get("response_fields", [])
    if not isinstance(response_fields, list) or not all(isinstance(name, str) for name in response_fields):
        raise fields.bad("response_fields", "a list of field names")
    # llama-server reuses a cached prompt only with cache_prompt (its default): runs move only then.
    reuse = fields.integer("n_cache_reuse", app.settings.cache_reuse, 0, None) \
        if fields.boolean("cache_prompt", True) else 0
    # n_predict 0: the prompt is only evaluated into the cache (llama.vim warms its extra chunks so).
    asked = Asked(prompts, params, Options(n=n_cmpl, seed=params.seed, logprobs=n_probs or None,
                                           post_sampling=post_sampling), chat=chat,
                  streamed=stream, warm=predict == 0, cache_reuse=reuse,
                  progress=stream and telemetry.watches_prefill)
    exchange = turn.start(app, handler, served, asked, "prompt")
    settings = generation_settings(params, predict, stream, n_probs, served.name)
    encoded = Completion(exchange, served.name, settings, limits, return_tokens or stream, n_probs,
                         [""] * len(exchange.choices), first_token_at=[0.0] * len(exchange.choices),
                         telemetry=telemetry, post_sampling=post_sampling)
    if stream:
        stream_records(handler, encoded)
        return
    records = whole_records(encoded)
    if records is None:
        return  # the client left
    if response_fields:
        records = [picked(record, response_fields) for record in records]
    handler.send(Whole(200, records[0] if len(records) == 1 else records))


def generation_settings(params: SamplingParams, predict: int, stream: bool, n_probs: int,
                        model: str) -> dict[str, Any]:
    """The options a completion ran with, as llama-server's final record lists them (Reame's own subset)."""
    return {"seed": params.seed if params.seed is not None else -1, "temperature": params.temperature,
            "top_k": params.top_k, "top_p": params.top_p, "min_p": params.min_p,
            "repeat_last_n": params.repeat_last_n, "repeat_penalty": params.repeat_penalty,
            "presence_penalty": params.presence_penalty, "frequency_penalty": params.frequency_penalty,
            "max_tokens": predict, "n_predict": predict, "ignore_eos": params.ignore_eos, "stream": stream,
            "n_probs": n_probs, "stop": list(params.stop), "model": model,
            "samplers": ["penalties", "top_k", "top_p", "min_p", "temperature"]}  # Reame's chain, always


def picked(record: dict[str, Any], paths: list[str]) -> dict[str, Any]:
    """llama-server's `response_fields`: only the named fields, a nested one under its whole path."""
    kept: dict[str, Any] = {}
    for path in paths:
        value: Any = record
        for key in path.split("/"):
            if not isinstance(value, dict) or key not in value:
                break
            value = value[key]
        else:
            kept[path] = value
    return kept


Piece = tuple[int, str, list[int], list[dict[str, Any]], FinishEvent | None]


def pieces(encoded: Completion) -> Iterator[Piece | EngineGone | tuple[int, ProgressEvent]]:
    """The exchange's items for the records: (tag, text, ids, logprob entries, finish) as they come, with the
    limits applied (a choice they end is cancelled, its text cut, its end a limit); (tag, progress) as a
    prompt's prefill goes, when the request asked (Telemetry)."""
    exchange = encoded.exchange
    token_piece = loaded(exchange.model).backend.token_piece
    for item in exchange.said():
        if isinstance(item, EngineGone):
            yield item
            return
        if item.progress is not None:
            yield item.tag, item.progress
            continue
        tag, choice = item.tag, exchange.choices[item.tag]
        ids, choice.ids = choice.ids, []
        probs = logprob_entries(token_piece, choice.tokens, ids=True,
                                probabilities=encoded.post_sampling) if choice.tokens else []
        choice.tokens = []
        if item.finish is not None:
            yield tag, "", ids, probs, item.finish
            continue
        if tag in encoded.cut or not item.text:
            continue
        if not encoded.first_token_at[tag]:
            encoded.first_token_at[tag] = time.perf_counter()
        text = limited(encoded, tag, item.text)
        yield tag, text, ids, probs, None


def limited(encoded: Completion, tag: int, text: str) -> str:
    """`text` as far as the limits let choice `tag` go; once one ends it, the generation is cancelled."""
    limits, before = encoded.limits, encoded.texts[tag]
    whole = before + text
    cut = indent_cut(whole, len(before), limits.n_indent) if limits.n_indent > 0 else None
    if cut is not None:
        whole = whole[:cut]
    elif limits.t_max_predict_ms > 0 and "\n" in text and \
            (time.perf_counter() - encoded.first_token_at[tag]) * 1000 > limits.t_max_predict_ms:
        cut = len(whole)
    if cut is not None:
        encoded.cut.add(tag)
        encoded.exchange.submitted.handles[tag].cancel()
    encoded.texts[tag] = whole
    return whole[len(before):]


def indent_cut(text: str, start: int, n_indent: int) -> int | None:
    """Where llama-server cuts a completion asked for lines indented by at least `n_indent`: before the first
    character of a line (after a newline) that follows less indentation, the line's spaces kept; None when no
    line of `text` that `start` reaches into is such a line."""
    line = text.find("\n", max(0, text.rfind("\n", 0, start)))
    while line != -1:
        column = line + 1
        while column < len(text) and text[column] in " \t":
            column += 1
        if column < len(text) and column - line - 1 < n_indent:
            return column
        line = text.find("\n", line + 1)
    return None


def final_record(encoded: Completion, tag: int, finish: FinishEvent, ids: list[int],
                 probs: list[dict[str, Any]]) -> dict[str, Any]:
    """llama-server's final record of one completion."""
    exchange, usage = encoded.exchange, finish.usage
    limited_stop = tag in encoded.cut or finish.reason == "length" or encoded.settings["n_predict"] == 0
    stop_type = "limit" if limited_stop else ("word" if finish.stop_sequence else "eos")
    cached = exchange.cached_tokens(usage)
    record: dict[str, Any] = {
        "index": tag, "content": encoded.texts[tag], "tokens": ids if encoded.return_tokens else [],
        "id_slot": -1, "stop": True, "model": encoded.model, "tokens_predicted": usage.completion_tokens,
        "tokens_evaluated": usage.prompt_tokens, "generation_settings": encoded.settings,
        "prompt": exchange.prompt_text(tag), "has_new_line": "\n" in encoded.texts[tag],
        "truncated": finish.reason == "length" and bool(finish.message), "stop_type": stop_type,
        "stopping_word": finish.stop_sequence, "tokens_cached": cached,
        "timings": final_timings(usage, cached)}
    if probs:
        record["completion_probabilities"] = probs
    return record


def whole_records(encoded: Completion) -> list[dict[str, Any]] | None:
    """Every completion's final record once all have ended (None when the client left)."""
    records: list[dict[str, Any] | None] = [None] * len(encoded.exchange.choices)
    ids: list[list[int]] = [[] for _ in records]
    probs: list[list[dict[str, Any]]] = [[] for _ in records]
    for item in pieces(encoded):
        if isinstance(item, EngineGone):
            raise as_http_error(item.error)
        if isinstance(item[1], ProgressEvent):
            continue  # a prompt's progress: only streamed
        tag, _, new_ids, new_probs, finish = item
        ids[tag] += new_ids
        probs[tag] += new_probs
        if finish is not None:
            failed = failure_of(encoded, tag, finish)
            if failed is not None:
                raise failed
            records[tag] = final_record(encoded, tag, finish, ids[tag], probs[tag])
    if any(record is None for record in records):
        return None
    return [record for record in records if record is not None]


def failure_of(encoded: Completion, tag: int, finish: FinishEvent) -> HttpError | None:
    """The HTTP error of a completion that failed (None for one that ended well, as a limit's cancel does)."""
    return None if tag in encoded.cut else failure(finish)


def stream_records(handler: Asker, encoded: Completion) -> None:
    """SSE records: one per piece (`content`, `tokens`, `stop: false`), then each completion's final record;
    an error ends the stream in llama-server's error shape."""
    handler.send(Opening())
    counts = [0] * len(encoded.exchange.choices)
    try:
        for item in pieces(encoded):
            if isinstance(item, EngineGone):
                handler.send(Event(error_body(as_http_error(item.error))))
                return
            usage_prompt = len(encoded.exchange.submitted.handles[item[0]].prompt_tokens)
            if isinstance(item[1], ProgressEvent):
                record = progress_record(encoded.telemetry, item[0], item[1], usage_prompt)
                if record is not None:
                    handler.send(Event(record))
                continue
            tag, text, ids, probs, finish = item
            if finish is not None:
                failed = failure_of(encoded, tag, finish)
                if failed is not None:
                    handler.send(Event(error_body(failed)))
                    return
                record = final_record(encoded, tag, finish, [], probs)
                record["content"] = ""  # streamed already, as llama-server's final record does
                handler.send(Event(record))
                continue
            counts[tag] += len(ids)
            encoded.telemetry.decoded(tag, counts[tag])
            partial = partial_record(tag, text, ids, counts[tag], usage_prompt)
            if probs:
                partial["completion_probabilities"] = probs
            running = encoded.telemetry.running(tag)
            if running is not None:
                partial["timings"] = running
            handler.send(Event(partial))
    except OSError:  # the client went away: stop generating for it
        encoded.exchange.cancel()


def partial_record(tag: int, text: str, ids: list[int], predicted: int, evaluated: int) -> dict[str, Any]:
    """llama-server's streamed record of a piece of completion `tag` (`text`, its token `ids`)."""
    return {"index": tag, "content": text, "tokens": ids, "stop": False, "id_slot": -1,
            "tokens_predicted": predicted, "tokens_evaluated": evaluated}


def progress_record(telemetry: Telemetry, tag: int, progress: ProgressEvent,
                    evaluated: int) -> dict[str, Any] | None:
    """llama-server's streamed record of a prompt's progress: an empty piece with its `prompt_progress` (and
    `timings`, asked for on every record); None when the request asked for no progress records."""
    shaped = telemetry.progressed(tag, progress)
    if shaped is None:
        return None
    record = partial_record(tag, "", [], 0, evaluated)
    record["prompt_progress"] = shaped
    running = telemetry.running(tag)
    if running is not None:
        record["timings"] = running
    return record


ROUTES = [Route("/completion", ("POST",), completion, error_body=error_body),
          Route("/completions", ("POST",), completion, error_body=error_body),
          Route("/infill", ("POST",), infill_route, error_body=error_body)]
