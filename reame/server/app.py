"""The HTTP application: the Service with its routes, dispatched with auth and method checks, and the
routes of the server itself (health, the web page, metrics). The API families live in apis/."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from importlib import resources
from typing import Any

from reame.cache import prefix, remote
from reame.errors import EngineUnavailable, RequestError
from reame.server.apis import anthropic, batches, llamacpp, llamacpp_info, ollama, openai, responses, sessions
from reame.server.batches import Batches, BatchesBusy
from reame.server.filestore import FileStore
from reame.server.line_client import LineClient
from reame.server.forgery import allowed_hosts, forged
from reame.server.client import Client, HttpError, Whole
from reame.server.exchange import BACKGROUND
from reame.server.http import Handler
from reame.server.settings import ServerSettings
from reame.server.metrics import Metrics, Sample
from reame.server.models import ModelPool
from reame.server.routes import Route, Router
from reame.server.service import Service, as_http_error
from reame.server.sessions import SessionError
from reame.speculative import Speculation

log = logging.getLogger("reame.server")
WEB_PAGE = resources.files("reame.web").joinpath("index.html").read_bytes()


class App(Service):
    """Routes requests to the served models. Until the first model has loaded, /health says 503."""

    def __init__(self, settings: ServerSettings, models: ModelPool, metrics: Metrics | None = None) -> None:
        super().__init__(settings, models, metrics)
        self.hosts = allowed_hosts(settings.host, settings.allowed_hosts)
        limits = settings.batches
        if limits.directory is not None:
            files = FileStore(limits.directory / "files", limits.storage_bytes)
            try:
                self.batches = Batches(limits.directory / "batches", files, limits, self.answer_line,
                                       self.room_for_batch_line)
                self.files = files
            except BatchesBusy as busy:
                log.warning("the Files and Batch APIs are off: %s (server.batch_dir names another)", busy)
        self.metrics.collector(self.cache_samples)
        self.metrics.collector(self.speculation_samples)
        self.metrics.collector(lambda: llamacpp_info.metric_samples(self))
        self.metrics.collector(self.batch_samples)

    def cache_samples(self) -> list[Sample]:
        """Each loaded model's prefix cache (and its share of a fleet's store), labelled with the model."""
        samples = []
        for model in self.models.loaded():
            cache = model.engine.cache if model.engine is not None else None
            if cache is None:
                continue
            labels = {"model": model.name}
            stats, shared = cache.stats(), cache.remote_stats()
            samples += [Sample(f"reame_prefix_cache_{name}_total", "counter", text, labels, stats[name])
                        for name, text in prefix.STATS.items()]
            samples += [Sample(f"reame_prefix_cache_{name}", "gauge", text, labels, stats[name])
                        for name, text in prefix.GAUGES.items()]
            samples += [Sample(f"reame_kv_remote_{name}_total", "counter", text, labels, shared[name])
                        for name, text in remote.STATS.items() if shared]
        return samples

    def batch_samples(self) -> list[Sample]:
        """Each unfinished batch's requests (answered, failed, left) and its estimate of the time left, by batch id
        (never by its owner)."""
        samples = []
        for batch in self.batches.unfinished() if self.batches is not None else []:
            counts = batch["request_counts"]
            left = counts["total"] - counts["completed"] - counts["failed"]
            for state, value in (("completed", counts["completed"]), ("failed", counts["failed"]), ("left", left)):
                samples.append(Sample("reame_batch_requests", "gauge", "requests of each unfinished batch, by state",
                                      {"batch": batch["id"], "state": state}, value))
            if batch["estimated_seconds_left"] is not None:
                samples.append(Sample("reame_batch_seconds_left", "gauge", "an unfinished batch's seconds left at "
                                      "its pace so far", {"batch": batch["id"]}, batch["estimated_seconds_left"]))
        return samples

    def speculation_samples(self) -> list[Sample]:
        samples = []
        for model in self.models.loaded():
            speculation = model.engine.speculation if model.engine is not None else None
            if speculation is not None:
                samples += self.model_speculation_samples(speculation, model.name)
        return samples

    @staticmethod
    def model_speculation_samples(speculation: Speculation, name: str) -> list[Sample]:
        stats = speculation.stats.snapshot()
        samples = []
        for source, counts in sorted(stats.sources.items()):
            for what, value in (("drafted", counts.drafted), ("accepted", counts.accepted)):
                samples.append(Sample(f"reame_spec_decode_{what}_total", "counter", f"draft tokens {what}, by draft "
                                      "source", {"model": name, "source": source}, value))
        for kind, value in (("plain", stats.steps_plain), ("speculative", stats.steps_speculative)):
            samples.append(Sample("reame_spec_decode_steps_total", "counter", "engine steps with and without drafts",
                                  {"model": name, "kind": kind}, value))
        for position, (drafted, accepted) in enumerate(zip(stats.drafted_at, stats.accepted_at)):
            if position and drafted:
                samples.append(Sample("reame_spec_decode_acceptance", "gauge",
                                      "share of drafts at this position the model accepted",
                                      {"model": name, "position": str(position)}, accepted / drafted))
        samples.append(Sample("reame_spec_decode_draft_length", "gauge", "tokens in the latest draft",
                              {"model": name}, stats.last_draft_length))
        for source, seconds in sorted(speculation.seconds_per_draft().items()):
            samples.append(Sample("reame_spec_decode_draft_seconds_per_token", "gauge",
                                  "recent drafting time per drafted token, by draft source",
                                  {"model": name, "source": source}, seconds))
        for source, acceptance in sorted(speculation.acceptance().items()):
            samples.append(Sample("reame_spec_decode_source_acceptance", "gauge",
                                  "recent acceptance per draft token, verified or guessed, by draft source",
                                  {"model": name, "source": source}, acceptance))
        return samples

    def count_response(self, status: int) -> None:
        self.metrics.add("reame_requests_total", status=str(status))

    def dispatch(self, handler: Handler) -> None:
        route, path = ROUTER.find(handler.path.split("?", 1)[0])
        try:
            refusal = forged(handler.command, handler.headers, bool(handler.body), self.hosts,
                             self.settings.cors_origin, route is not None and route.multipart)
            if refusal is not None:
                raise refusal
            if (route is None or not route.public) and not handler.authorized():
                raise HttpError(401, "missing or invalid API key (send 'Authorization: Bearer KEY' or "
                                "'x-api-key: KEY')", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
            if route is None:
                raise HttpError(404, f"unknown endpoint: {handler.command} {path}", code="not_found")
            if handler.command not in route.methods:
                raise HttpError(405, f"{handler.command} is not allowed here; use {' or '.join(route.methods)}",
                                code="method_not_allowed", headers={"Allow": ", ".join(route.methods)})
        except HttpError as error:
            handler.discard_body()
            answer_error(handler, route, error)
            return
        self.answer(route, handler, path)

    def answer_line(self, owner: str, url: str, body: bytes, gone: Callable[[], bool]) -> tuple[int, Any] | None:
        """A batch's line answered by its route, as an HTTP request of its owner would be: (status, body), or
        None when the route gave up because `gone` said the batch no longer wants it."""
        route, path = ROUTER.find(url)
        assert route is not None  # batches.ENDPOINTS are routes
        client = LineClient(path, owner, body, gone)
        background = BACKGROUND.set(True)
        try:
            self.answer(route, client, path)
        finally:
            BACKGROUND.reset(background)
        return None if client.status is None else (client.status, client.payload)

    def room_for_batch_line(self) -> bool:
        """Interactive requests first: a batch's line starts only while no request waits for a slot of a loaded
        model and each has a slot free."""
        for model in self.models.loaded():
            engine = model.engine
            if engine is not None:
                waiting, busy = engine.load()
                if waiting or busy >= engine.backend.n_seq_max:
                    return False
        return True

    def answer(self, route: Route, handler: Handler | LineClient, path: str) -> None:
        """Run the route for a request that passed the server's checks, and answer what it raises in the route's
        family's error shape: an HTTP request's, or a batch's line (which has no socket to lose)."""
        try:
            try:
                route.handler(self, handler, path)
            finally:
                self.release_models(handler)
        except (HttpError, SessionError, EngineUnavailable, RequestError) as error:
            handler.discard_body()  # before answering: the client may still be sending it
            answer_error(handler, route, as_http_error(error))
        except (BrokenPipeError, ConnectionResetError):
            handler.close_connection = True
        except RecursionError:  # input nested deeper than a check below foresaw: the input's fault, not a bug
            handler.close_connection = True
            if not handler.response_started:
                answer_error(handler, route, HttpError(400, "the request is nested too deeply", code="invalid_value"))
        except Exception:  # a bug: the client gets a 500 in OpenAI's shape, the log the traceback, once
            log.exception("unexpected error answering %s %s", handler.command, path)
            handler.close_connection = True
            if not handler.response_started:
                answer_error(handler, route, HttpError(500, "internal server error (see the server log)",
                                                       "server_error", "internal_error"))

    def health(self, handler: Handler, _path: str = "/health") -> None:
        """Liveness, and whether the other endpoints need a key (the web page asks for one only then)."""
        auth = bool(self.settings.api_keys)
        dead = [(model.name, model.engine.status.dead) for model in self.models.loaded()
                if model.engine is not None and model.engine.status.dead]
        if not self.ready:
            handler.send(Whole(503, {"status": "loading", "auth": auth}, {"Retry-After": "5"}))
        elif dead:
            handler.send(Whole(503, {"status": "error", "message": dead[0][1], "model": dead[0][0], "auth": auth}))
        else:
            handler.send(Whole(200, {"status": "ok", "auth": auth}))

    def web_page(self, handler: Handler, _path: str) -> None:
        """The built-in page (reame/web/index.html): chat playground and live dashboard (404 when off)."""
        if not self.settings.web_page:
            raise HttpError(404, "the web page is off on this server (server.web_page = false)", code="not_found")
        handler.send(Whole(200, WEB_PAGE, {"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff",
                                           "Content-Security-Policy": "default-src 'self'; script-src "
                                           "'unsafe-inline'; style-src 'unsafe-inline'; img-src 'self' data:"},
                           "text/html; charset=utf-8"))

    def stats(self, handler: Handler, _path: str) -> None:
        """Every metric as JSON, with the model and the server's clock: what the dashboard polls."""
        if not self.settings.metrics:
            raise HttpError(404, "metrics are off on this server (server.metrics = false)", code="not_found")
        handler.send(Whole(200, {"model": self.models.default.name, "time": time.time(),
                                "samples": self.metrics.as_json()}))

    def metrics_text(self, handler: Handler, _path: str) -> None:
        """Prometheus' text: Reame's metrics and llama-server's names over them; off, a 501 as llama-server's."""
        if not self.settings.metrics:
            raise HttpError(501, "metrics are off on this server (server.metrics = false)", "not_supported_error",
                            "not_supported")
        handler.send(Whole(200, self.metrics.render().encode(), {"Process-Start-Time-Unix": str(self.created)},
                           content_type="text/plain; version=0.0.4; charset=utf-8"))



def answer_error(handler: Client, route: Route | None, error: HttpError) -> None:
    """The error in the shape of the route's API family (OpenAI's unless the route says otherwise)."""
    if route is not None and route.error_body is not None:
        handler.send(Whole(error.status, route.error_body(error), error.headers))
    else:
        handler.send(error.whole())


ROUTER = Router([
    Route("/health", ("GET", "HEAD"), App.health, public=True),
    Route("/", ("GET", "HEAD"), App.web_page, public=True),
    Route("/index.html", ("GET", "HEAD"), App.web_page, public=True),
    Route("/metrics", ("GET",), App.metrics_text),
    Route("/stats", ("GET",), App.stats),
    *openai.ROUTES,
    *ollama.ROUTES,
    *anthropic.ROUTES,
    *responses.ROUTES,
    *sessions.ROUTES,
    *llamacpp.ROUTES,
    *llamacpp_info.ROUTES,
    *batches.ROUTES,
])
