"""What every API family shares: the engine (None while the model loads), the sessions, the exact answer
cache, the metrics, and the small rules of waiting on the engine. The App (app.py) is a Service with routes."""

from __future__ import annotations

import queue
import time
from collections.abc import Callable
from typing import Any

from reame.engine import Engine, FinishEvent
from reame.errors import EngineUnavailable, ModelError, OverloadedError, RequestError
from reame.answers import AnswerCache
from reame.semantic import SemanticCache
from reame.server.conversations import Conversations
from reame.server.http import Handler, HttpError, ServerSettings
from reame.server.metrics import Metrics
from reame.server.sessions import SessionError, Sessions
from reame.server.shapes import Choice

POLL_S = 0.25  # how often a waiting request checks that its client and the engine are still there


class Service:
    """The state the routes share: set up once, read by many HTTP threads (the engine is swapped in once,
    when the model has loaded)."""

    def __init__(self, settings: ServerSettings, metrics: Metrics | None = None,
                 sessions: Sessions | None = None, answers: AnswerCache | None = None,
                 semantic: SemanticCache | None = None) -> None:
        """`answers`: the exact answer cache (None: cache.answers is off); `semantic`: the semantic one
        (None: cache.semantic is off), which keeps its answers in `answers`."""
        self.settings = settings
        self.engine: Engine | None = None
        self.sessions = sessions
        self.answers = answers
        self.semantic = semantic if answers is not None else None
        self.conversations = Conversations()  # the Responses API's stored responses
        self.metrics = metrics or Metrics()
        self.created = int(time.time())  # what /v1/models reports: when this server started
        self.metrics.describe("reame_requests_total", "counter", "HTTP responses by status")
        self.metrics.describe("reame_generations_total", "counter", "answers (choices) finished")
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
        self.metrics.describe("reame_prompt_seconds_total", "counter", "seconds from admission to first token")
        self.metrics.describe("reame_generation_seconds_total", "counter", "seconds from first token to the end")
        self.metrics.gauge("reame_queue_depth", "requests waiting for a sequence slot",
                           lambda: self.engine.load()[0] if self.engine else 0)
        self.metrics.gauge("reame_busy_slots", "sequence slots generating",
                           lambda: self.engine.load()[1] if self.engine else 0)
        self.metrics.gauge("reame_kv_tokens_recorded", "KV cells the engine's slots account for",
                           lambda: self.engine.status.kv_recorded if self.engine else 0)
        self.metrics.gauge("reame_kv_tokens_in_memory", "KV cells the model's memory holds (more than recorded: "
                           "a leak)", lambda: self.engine.status.kv_in_memory if self.engine else 0)

    def ready_engine(self) -> Engine:
        if self.engine is None:
            raise HttpError(503, "the model is still loading, retry shortly", "server_error", "loading",
                            headers={"Retry-After": "5"})
        return self.engine

    def check_engine(self) -> None:
        """EngineUnavailable once the engine has failed: a waiting handler answers instead of hanging."""
        if self.engine is not None and self.engine.status.dead:
            raise EngineUnavailable(f"the engine failed: {self.engine.status.dead}")

    def ready_sessions(self) -> Sessions:
        if self.sessions is None:
            raise HttpError(404, "sessions are not enabled on this server", code="not_found")
        return self.sessions

    @staticmethod
    def submit_checked(submit: Callable[[], Any]) -> Any:
        """Run an engine call that validates a request; its refusals become 400 or 429."""
        try:
            return submit()
        except (RequestError, OverloadedError) as error:
            raise refusal(error) from None

    def embeddings(self, handler: Handler, engine: Engine, inputs: list[list[int]]) -> list[list[float]] | None:
        """Unit vectors of token inputs, computed by the engine between its steps; None when the client left
        meanwhile (its connection is then closed). 400/429 when refused, 500 when the model failed."""
        job = self.submit_checked(lambda: engine.embed(inputs))
        while not job.done.wait(POLL_S):
            self.check_engine()
            if handler.client_gone():
                handler.close_connection = True
                return None
        try:
            return job.result(0)
        except ModelError as error:
            raise HttpError(500, f"embedding failed: {error}", "server_error", "embedding_failed") from None

    def next_event(self, sink: queue.SimpleQueue) -> tuple[int, Any]:
        """The next (tag, event) of a request's sink, or (-1, None) after POLL_S without one. Never waits
        forever: EngineUnavailable when the engine failed meanwhile."""
        try:
            return sink.get(timeout=POLL_S)
        except queue.Empty:
            self.check_engine()
            return -1, None

    def account(self, choices: list[Choice]) -> None:
        for choice in choices:
            if choice.finish is None or not choice.computed:
                continue  # a kept answer counts in reame_answers_hits_total only
            usage = choice.finish.usage
            self.metrics.add("reame_generations_total")
            self.metrics.add("reame_prompt_tokens_total", usage.prompt_tokens)
            self.metrics.add("reame_prompt_tokens_cached_total", usage.cached_tokens)
            self.metrics.add("reame_generated_tokens_total", usage.completion_tokens)
            self.metrics.add("reame_prompt_seconds_total", usage.prompt_seconds)
            self.metrics.add("reame_generation_seconds_total", usage.decode_seconds)

    def model_card(self) -> dict[str, Any]:
        return {"id": self.settings.model_id, "object": "model", "created": self.created, "owned_by": "reame"}


def as_http_error(error: HttpError | SessionError | EngineUnavailable | RequestError) -> HttpError:
    """The HTTP answer to an error of the layers below: bad input (a RequestError, from structured output
    say) is a 400 naming its field."""
    if isinstance(error, RequestError):
        return HttpError(400, str(error), param=error.param, code=error.code)
    if isinstance(error, SessionError):
        return HttpError(error.status, str(error), param=error.param, code=error.code, headers=error.headers)
    if isinstance(error, EngineUnavailable):
        return HttpError(503, str(error), "server_error", "engine_unavailable", headers={"Retry-After": "5"})
    return error


def failure(finish: FinishEvent) -> HttpError | None:
    """The HTTP error of an answer that failed or timed out (None for one that ended well)."""
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
    param = prompt_param if error.param in (None, "prompt") else error.param
    return HttpError(400, str(error), param=param, code=error.code)
