"""What every API family shares: the served models (each with its engine while loaded, its sessions and answer
caches), the metrics, and the HTTP answers to what the layers below raise. The App (app.py) is a Service with
routes."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from reame.engine import FinishEvent
from reame.engine.kv import KvStats
from reame.errors import ContextExceeded, EngineUnavailable, ModelError, OverloadedError, RequestError
from reame.server.batches import Batches
from reame.server.conversations import Conversations
from reame.server.filestore import FileStore
from reame.server.exchange import ENGINE_UNAVAILABLE, embedded
from reame.server.client import CONTEXT_EXCEEDED, Asker, HttpError
from reame.server.settings import ServerSettings
from reame.server.metrics import Metrics, Sample
from reame.server.models import ModelPool, ModelUnavailable, ServedModel, UnknownModel
from reame.server.sessions import SessionError, Sessions


class Service:
    """The state the routes share: set up once, read by many HTTP threads. The pool owns the models' loaded
    state; `ready` turns true once the first model has loaded (until then /health says loading)."""

    def __init__(self, settings: ServerSettings, models: ModelPool, metrics: Metrics | None = None) -> None:
        self.settings = settings
        self.models = models
        self.ready = False
        self.conversations = Conversations()  # the Responses API's stored responses
        self.files: FileStore | None = None  # the Files API's, when batches are on (App)
        self.batches: Batches | None = None
        self.metrics = metrics or Metrics()
        self.created = int(time.time())  # what /v1/models reports: when this server started
        self.metrics.describe("reame_requests_total", "counter", "HTTP responses by status")
        self.metrics.describe("reame_generations_total", "counter", "answers (choices) finished, by model")
        self.metrics.describe("reame_prompt_tokens_total", "counter", "prompt tokens processed")
        self.metrics.describe("reame_prompt_tokens_cached_total", "counter",
                              "prompt tokens found in the KV (slot, session, prefix cache, a twin request's "
                              "prefill) instead of computed")
        self.metrics.describe("reame_conclave_elections_total", "counter", "best_of answers elected")
        self.metrics.describe("reame_answers_hits_total", "counter",
                              "deterministic requests answered from the exact answer cache")
        self.metrics.describe("reame_answers_misses_total", "counter",
                              "deterministic requests looked up in the exact answer cache and not found")
        self.metrics.describe("reame_answers_stored_total", "counter", "answers kept in the exact answer cache")
        self.metrics.describe("reame_semantic_hits_total", "counter",
                              "chat questions answered with the kept answer of a question of the same meaning")
        self.metrics.describe("reame_semantic_misses_total", "counter",
                              "chat questions looked up in the semantic cache and not found")
        self.metrics.describe("reame_conclave_early_stops_total", "counter",
                              "elections decided by a majority while attempts still ran (those were stopped)")
        self.metrics.describe("reame_generated_tokens_total", "counter", "tokens generated")
        self.metrics.describe("reame_embedding_tokens_total", "counter", "tokens embedded")
        self.metrics.describe("reame_prompt_seconds_total", "counter", "seconds from admission to first token")
        self.metrics.describe("reame_generation_seconds_total", "counter", "seconds from first token to the end")
        self.metrics.collector(self.engine_samples)

    def engine_samples(self) -> list[Sample]:
        """Each loaded model's queue, slots and KV, and the pool's loads."""
        samples = [Sample("reame_models_loaded", "gauge", "models loaded now", {}, len(self.models.loaded())),
                   Sample("reame_model_loads_total", "counter", "models loaded (the first one's included)", {},
                          self.models.loads),
                   Sample("reame_model_unloads_total", "counter", "models unloaded (keep-alive, room, shutdown)",
                          {}, self.models.unloads)]
        for model in self.models.loaded():
            engine, labels = model.engine, {"model": model.name}
            if engine is None:
                continue
            waiting, busy = engine.load()
            samples += [Sample("reame_queue_depth", "gauge", "requests waiting for a sequence slot", labels, waiting),
                        Sample("reame_busy_slots", "gauge", "sequence slots generating", labels, busy),
                        Sample("reame_kv_tokens_recorded", "gauge", "KV cells the engine's slots account for",
                               labels, engine.status.kv_recorded),
                        Sample("reame_kv_tokens_in_memory", "gauge", "KV cells the model's memory holds (more than "
                               "recorded: a leak)", labels, engine.status.kv_in_memory),
                        *kv_samples(engine.status.kv, labels)]
        return samples

    def model(self, handler: Asker, requested: object, keep_alive_s: float | None = None) -> ServedModel:
        """The model a request's `model` names, loaded and held until the request ends (App.dispatch lets it
        go, with `keep_alive_s`: None = the server's). 404 for a model not served, 503 while the server starts
        or when the model stays busy, 500 when it fails to load."""
        model = self.served(requested)
        if not self.ready:
            raise HttpError(503, "the model is still loading, retry shortly", "server_error", "loading",
                            headers={"Retry-After": "5"})
        try:
            self.models.acquire(model, handler.gone)
        except ModelUnavailable as error:
            if error.retry:
                raise HttpError(503, str(error), "server_error", "model_busy", headers={"Retry-After": "5"}) from None
            raise HttpError(500, str(error), "server_error", "model_load_failed") from None
        handler.leases.append((model, keep_alive_s))
        self.models.check(model)
        return model

    def served(self, requested: object) -> ServedModel:
        """The model a name names, loaded or not (what /api/show describes); 404 for one not served."""
        try:
            return self.models.find(requested)
        except UnknownModel as error:
            raise HttpError(404, str(error), param="model", code="model_not_found") from None

    def release_models(self, handler: Asker) -> None:
        """Let go of the models a request held (its answer is over)."""
        for model, keep_alive_s in handler.leases:
            self.models.release(model, keep_alive_s)
        handler.leases.clear()

    @staticmethod
    def ready_sessions(model: ServedModel) -> Sessions:
        if model.sessions is None:
            raise HttpError(404, "sessions are not enabled on this server", code="not_found")
        return model.sessions

    @staticmethod
    def submit_checked(submit: Callable[[], Any]) -> Any:
        """Run an engine call that validates a request; its refusals become 400 or 429."""
        try:
            return submit()
        except (RequestError, OverloadedError) as error:
            raise refusal(error) from None

    def embeddings(self, gone: Callable[[], bool], model: ServedModel,
                   inputs: list[list[int]]) -> list[list[float]] | None:
        """exchange.embedded, its refusals 400 or 429 and a failed model 500."""
        try:
            vectors = embedded(self, model, inputs, gone)
        except (RequestError, OverloadedError) as error:
            raise refusal(error) from None
        except ModelError as error:
            raise HttpError(500, f"embedding failed: {error}", "server_error", "embedding_failed") from None
        if vectors is not None:
            self.metrics.add("reame_embedding_tokens_total", sum(map(len, inputs)), model=model.name)
        return vectors

    def model_card(self, model: ServedModel) -> dict[str, Any]:
        """A model as /v1/models lists it: OpenAI's fields, llama-server's (the names and tags its configuration
        gave it), then Reame's (loaded or not, every name it answers to, context length, file size and
        quantization)."""
        facts = model.facts
        return {"id": model.name, "object": "model", "created": self.created, "owned_by": "reame",
                "aliases": list(model.given_names), "tags": list(model.tags),
                "reame": {"loaded": model.state == "loaded", "aliases": list(model.aliases),
                          "context_length": model.context_length(),
                          "size_bytes": facts.size_bytes, "quantization": facts.quantization,
                          "architecture": facts.architecture, "parameter_size": facts.parameter_size}}


def as_http_error(error: HttpError | SessionError | EngineUnavailable | RequestError) -> HttpError:
    """The HTTP answer to an error of the layers below: bad input (a RequestError, from structured output
    say) is a 400 naming its field."""
    if isinstance(error, RequestError):
        return bad_request(error, error.param)
    if isinstance(error, SessionError):
        return HttpError(error.status, str(error), param=error.param, code=error.code, headers=error.headers)
    if isinstance(error, EngineUnavailable):
        return HttpError(503, str(error), "server_error", ENGINE_UNAVAILABLE, headers={"Retry-After": "5"})
    return error


def failure(finish: FinishEvent) -> HttpError | None:
    """The HTTP error of an answer that failed or timed out (None for one that ended well)."""
    if finish.code == ENGINE_UNAVAILABLE:
        return as_http_error(EngineUnavailable(finish.message))
    if finish.reason == "timeout":
        return HttpError(503, "the server is busy: no sequence slot became free in time, retry later",
                         "server_error", "queue_timeout", headers={"Retry-After": "5"})
    if finish.reason == "error":
        if finish.code:  # the request's own doing (its grammar): the client can fix it
            return HttpError(400, finish.message, code=finish.code)
        return HttpError(500, f"generation failed: {finish.message}", "server_error", "generation_failed")
    return None


def refusal(error: RequestError | OverloadedError, prompt_param: str = "prompt") -> HttpError:
    """The HTTP answer to an engine that refused a request: bad input 400, a full queue 429.
    `prompt_param`: what the request called its prompt (a chat's is its "messages")."""
    if isinstance(error, OverloadedError):
        return HttpError(429, str(error), "server_error", "queue_full", headers={"Retry-After": "2"})
    return bad_request(error, prompt_param if error.param in (None, "prompt") else error.param)


def bad_request(error: RequestError, param: str | None) -> HttpError:
    """The 400 of a request the engine refused. A prompt over the context keeps OpenAI's code, which its clients
    look for, in llama-server's type and with its counts, which llama.cpp's clients read (its OpenAI routes answer
    so too)."""
    if isinstance(error, ContextExceeded):
        return HttpError(400, str(error), CONTEXT_EXCEEDED, error.code, param,
                         details={"n_prompt_tokens": error.n_prompt_tokens, "n_ctx": error.n_ctx})
    return HttpError(400, str(error), param=param, code=error.code)


def kv_samples(kv: KvStats, labels: dict[str, str]) -> list[Sample]:
    """A model's KV cells, its restores by source and outcome, and what its idle slots gave up."""
    return [Sample("reame_kv_cells", "gauge", "KV cells of the model's context", labels, kv.cells),
            Sample("reame_kv_cells_used", "gauge", "KV cells held by running and idle sequences", labels,
                   kv.cells_used),
            *[Sample("reame_kv_restores_total", "counter", "saved KV states put back into the context (a prefix-cache "
                     "snapshot, a session), by outcome: restored, no_room (running sequences held the cells), "
                     "rejected (the context refused the state)", dict(labels, source=source, outcome=outcome), count)
              for source, outcome, count in kv.restores],
            Sample("reame_kv_idle_cells_given_up_total", "counter", "KV cells idle slots gave up for room or to a new "
                   "request", labels, kv.cells_given_up),
            Sample("reame_kv_idle_snapshots_total", "counter", "idle slots' KV kept in the prefix cache as they gave "
                   "it up", labels, kv.idle_snapshots),
            Sample("reame_kv_tokens_moved_total", "counter", "prompt tokens whose KV cache reuse (n_cache_reuse) moved "
                   "into place instead of prefilling them", labels, kv.tokens_moved),
            Sample("reame_decodes_interrupted_total", "counter", "decodes of a batch's lines stopped so that a request "
                   "that arrived meanwhile starts at once (the lines' rows are computed again)", labels,
                   kv.decodes_interrupted)]
