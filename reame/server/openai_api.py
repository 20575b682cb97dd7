"""OpenAI's API over the engine: route requests, run them, stream or collect the answers.

Request bodies are read by validation.py (a wrong type is a 400 naming the
field, never a crash) and answers are shaped by shapes.py, so the official
SDKs work unchanged.
"""

from __future__ import annotations

import array
from importlib import resources
import base64
import dataclasses
import logging
import queue
import sys
import random
import time
from collections.abc import Callable
from typing import Any

from reame.cache import prefix
from reame.engine import Engine, FinishEvent, GenerationRequest, SamplingParams, TokenEvent
from reame.model.sampling import MAX_SEED
from reame.conclave import Ballot, attempts
from reame.errors import EngineUnavailable, ModelError, OverloadedError, RequestError
from reame.server.http import Handler, HttpError, ServerSettings
from reame.server.answers import AnswerCache, AnswerTap, StoredAnswer
from reame.server.metrics import Metrics, Sample
from reame.server.sessions import SessionError, Sessions
from reame.server.shapes import Choice, Response
from reame.structured.requested import forced_tool_grammar, requested_grammar
from reame.structured.tools import ToolRequest, template_messages, tool_parser, tool_request
from reame.server.validation import (MAX_CHOICES, Fields, best_of, chat_messages, check_model,
                                     completion_prompts, embedding_inputs, sampling_params, stream_usage)

log = logging.getLogger("reame.server")
WEB_PAGE = resources.files("reame.web").joinpath("index.html").read_bytes()

POLL_S = 0.25  # how often a waiting non-streamed request checks that its client is still there


class App:
    """Routes requests to the engine. `engine` is None while the model loads (/health says 503)."""

    def __init__(self, settings: ServerSettings, metrics: Metrics | None = None,
                 sessions: Sessions | None = None, answers: AnswerCache | None = None) -> None:
        """`answers`: the exact answer cache in a shared store (arca.remote), if any."""
        self.settings = settings
        self.engine: Engine | None = None
        self.sessions = sessions
        self.answers = answers
        self.metrics = metrics or Metrics()
        self.created = int(time.time())  # what /v1/models reports: when this server started
        self.metrics.describe("reame_requests_total", "counter", "HTTP responses by status")
        self.metrics.describe("reame_generations_total", "counter", "answers (choices) finished")
        self.metrics.describe("reame_prompt_tokens_total", "counter", "prompt tokens processed")
        self.metrics.describe("reame_prompt_tokens_cached_total", "counter",
                              "prompt tokens found in the KV (slot, session, prefix cache, a twin request's "
                              "prefill) instead of computed")
        self.metrics.describe("reame_conclave_elections_total", "counter", "best_of answers elected")
        self.metrics.describe("reame_answer_cache_lookups_total", "counter",
                              "deterministic requests looked up in the shared store, by result (hit or miss)")
        self.metrics.describe("reame_answer_cache_stored_total", "counter", "answers written to the shared store")
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
        self.metrics.collector(self.cache_samples)
        self.metrics.collector(self.speculation_samples)

    def cache_samples(self) -> list[Sample]:
        cache = self.engine.cache if self.engine is not None else None
        stats = cache.stats() if cache is not None else dict.fromkeys({**prefix.STATS, **prefix.GAUGES}, 0)
        return [Sample(f"reame_prefix_cache_{name}_total", "counter", text, {}, stats[name])
                for name, text in prefix.STATS.items()] + \
            [Sample(f"reame_prefix_cache_{name}", "gauge", text, {}, stats[name])
             for name, text in prefix.GAUGES.items()]

    def speculation_samples(self) -> list[Sample]:
        speculation = self.engine.speculation if self.engine is not None else None
        if speculation is None:
            return []
        stats = speculation.stats.snapshot()
        samples = []
        for source, counts in sorted(stats.sources.items()):
            for what, value in (("drafted", counts.drafted), ("accepted", counts.accepted)):
                samples.append(Sample(f"reame_spec_decode_{what}_total", "counter",
                                      f"draft tokens {what}, by draft source", {"source": source}, value))
        for kind, value in (("plain", stats.steps_plain), ("speculative", stats.steps_speculative)):
            samples.append(Sample("reame_spec_decode_steps_total", "counter", "engine steps with and without drafts",
                                  {"kind": kind}, value))
        for position, (drafted, accepted) in enumerate(zip(stats.drafted_at, stats.accepted_at)):
            if position and drafted:
                samples.append(Sample("reame_spec_decode_acceptance", "gauge",
                                      "share of drafts at this position the model accepted",
                                      {"position": str(position)}, accepted / drafted))
        samples.append(Sample("reame_spec_decode_draft_length", "gauge", "tokens in the latest draft", {},
                              stats.last_draft_length))
        for source, seconds in sorted(speculation.seconds_per_draft().items()):
            samples.append(Sample("reame_spec_decode_draft_seconds_per_token", "gauge",
                                  "recent drafting time per drafted token, by draft source", {"source": source},
                                  seconds))
        for source, acceptance in sorted(speculation.acceptance().items()):
            samples.append(Sample("reame_spec_decode_source_acceptance", "gauge",
                                  "recent acceptance per draft token, verified or guessed, by draft source",
                                  {"source": source}, acceptance))
        return samples

    def count_response(self, status: int) -> None:
        self.metrics.add("reame_requests_total", status=str(status))

    # --- routing ---

    def dispatch(self, handler: Handler) -> None:
        path = canonical_path(handler.path.split("?", 1)[0])
        try:
            if path in PUBLIC_ROUTES:  # no secrets: the web page asks for the key itself
                PUBLIC_ROUTES[path](self, handler, path)
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
        except (HttpError, SessionError, EngineUnavailable, RequestError) as error:
            handler.discard_body()  # before answering: the client may still be sending it
            handler.send_error_json(as_http_error(error))
        except (BrokenPipeError, ConnectionResetError):
            handler.close_connection = True
        except RecursionError:  # input nested deeper than a check below foresaw: the input's fault, not a bug
            handler.close_connection = True
            if not handler.response_started:
                handler.send_error_json(HttpError(400, "the request is nested too deeply", code="invalid_value"))
        except Exception:  # a bug: the client gets a 500 in OpenAI's shape, the log the traceback, once
            log.exception("unexpected error answering %s %s", handler.command, path)
            handler.close_connection = True
            if not handler.response_started:
                handler.send_error_json(HttpError(500, "internal server error (see the server log)", "server_error",
                                                  "internal_error"))

    def health(self, handler: Handler, _path: str = "/health") -> None:
        """Liveness, and whether the other endpoints need a key (the web page asks for one only then)."""
        self.require(handler, "GET", "HEAD")
        auth = bool(self.settings.api_keys)
        if self.engine is None:
            handler.send_json(503, {"status": "loading", "auth": auth}, {"Retry-After": "5"})
        elif self.engine.status.dead:
            handler.send_json(503, {"status": "error", "message": self.engine.status.dead, "auth": auth})
        else:
            handler.send_json(200, {"status": "ok", "auth": auth})

    def web_page(self, handler: Handler, _path: str) -> None:
        """The built-in page (reame/web/index.html): chat playground and live dashboard."""
        self.require(handler, "GET", "HEAD")
        handler.send_body(200, WEB_PAGE, "text/html; charset=utf-8",
                          {"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff",
                           "Content-Security-Policy": "default-src 'self'; script-src 'unsafe-inline'; "
                                                      "style-src 'unsafe-inline'; img-src 'self' data:"})

    def stats(self, handler: Handler, _path: str) -> None:
        """Every metric as JSON, with the model and the server's clock: what the dashboard polls."""
        if not self.settings.metrics:
            raise HttpError(404, "metrics are off on this server (server.metrics = false)", code="not_found")
        self.require(handler, "GET")
        handler.send_json(200, {"model": self.settings.model_id, "time": time.time(),
                                "samples": self.metrics.as_json()})

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

    def metrics_text(self, handler: Handler, _path: str) -> None:
        if not self.settings.metrics:
            raise HttpError(404, "metrics are off on this server (server.metrics = false)", code="not_found")
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
        return {"id": self.settings.model_id, "object": "model", "created": self.created, "owned_by": "reame"}

    def warm(self, handler: Handler, _path: str) -> None:
        """Prefill a prompt (or a chat's messages, without the assistant turn) into the prefix cache."""
        self.require(handler, "POST")
        fields = Fields(handler.read_json())
        engine = self.ready_engine()
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
            tokens = self.submit_checked(lambda: engine.prompt_tokens(request))
            handler.send_json(200, {"object": "warm", "warmed": False, "tokens": len(tokens), "cached_tokens": 0,
                                    "message": "the prefix cache is off on this server"})
            return
        handle = self.submit_checked(lambda: engine.submit(request))
        finish = None
        while finish is None:
            try:
                finish = next(event for event in handle.events(POLL_S) if isinstance(event, FinishEvent))
            except queue.Empty:
                self.check_engine()
                if handler.client_gone():
                    handle.cancel()
                    handler.close_connection = True
                    return
        if finish.reason != "stop":
            raise HttpError(503 if finish.reason == "timeout" else 500, finish.message or f"warming {finish.reason}",
                            "server_error", "warm_failed")
        usage = finish.usage
        handler.send_json(200, {"object": "warm", "warmed": True, "tokens": usage.prompt_tokens,
                                "cached_tokens": usage.cached_tokens, "seconds": round(usage.prompt_seconds, 3)})

    @staticmethod
    def submit_checked(submit: Callable[[], Any]) -> Any:
        """Run an engine call that validates a request; its refusals become 400 or 429."""
        try:
            return submit()
        except (RequestError, OverloadedError) as error:
            raise refusal(error) from None

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

    def embeddings(self, handler: Handler, _path: str) -> None:
        """OpenAI's embeddings: one unit-length vector per input, from the model's embedding context."""
        self.require(handler, "POST")
        fields = Fields(handler.read_json())
        engine = self.ready_engine()
        check_model(fields)
        encoding = fields.body.get("encoding_format", "float")
        if encoding not in ("float", "base64"):
            raise HttpError(400, "'encoding_format' must be 'float' or 'base64'", param="encoding_format",
                            code="invalid_value")
        dimensions = fields.integer("dimensions", None, 1, None)
        if dimensions not in (None, engine.backend.n_embd):
            raise HttpError(400, f"this model's embeddings have {engine.backend.n_embd} dimensions and cannot be "
                            f"shortened to {dimensions}", param="dimensions", code="unsupported_parameter")
        inputs = [engine.backend.tokenize(item, add_special=True, parse_special=False) if isinstance(item, str)
                  else list(item) for item in embedding_inputs(fields.body.get("input"))]
        job = self.submit_checked(lambda: engine.embed(inputs))
        while not job.done.wait(POLL_S):
            self.check_engine()
            if handler.client_gone():
                handler.close_connection = True
                return
        try:
            vectors = job.result(0)
        except ModelError as error:
            raise HttpError(500, f"embedding failed: {error}", "server_error", "embedding_failed") from None
        data = [{"object": "embedding", "index": index, "embedding": encode_vector(vector, encoding)}
                for index, vector in enumerate(vectors)]
        used = sum(len(tokens) for tokens in inputs)
        handler.send_json(200, {"object": "list", "data": data, "model": self.settings.model_id,
                                "usage": {"prompt_tokens": used, "total_tokens": used}})

    # --- sessions ---

    def ready_sessions(self) -> Sessions:
        if self.sessions is None:
            raise HttpError(404, "sessions are not enabled on this server", code="not_found")
        return self.sessions

    def create_session(self, handler: Handler, _path: str) -> None:
        self.require(handler, "POST")
        sessions = self.ready_sessions()
        body = handler.read_json() if handler.read_body() else {}  # the body is optional
        wanted = Fields(body).body.get("id")
        if wanted is not None and not isinstance(wanted, str):
            raise Fields(body).bad("id", "a string")
        session_id = sessions.create(handler.owner, wanted)
        handler.send_json(200, {"id": session_id, "object": "session"})

    def session(self, handler: Handler, path: str) -> None:
        sessions, owner = self.ready_sessions(), handler.owner
        session_id, _, action = path[len("/v1/sessions/"):].partition("/")
        if action == "" and handler.command == "GET":
            handler.send_json(200, sessions.describe(owner, session_id))
        elif action == "" and handler.command == "DELETE":
            sessions.delete(owner, session_id)
            handler.send_json(200, {"id": session_id, "deleted": True})
        elif action == "save" and handler.command == "POST":
            sessions.save(owner, session_id)
            handler.send_json(200, sessions.describe(owner, session_id))
        elif action == "load" and handler.command == "POST":
            sessions.load(owner, session_id)
            handler.send_json(200, sessions.describe(owner, session_id))
        elif action in ("", "save", "load"):
            raise HttpError(405, f"{handler.command} is not allowed on this session path", code="method_not_allowed")
        else:
            raise HttpError(404, f"unknown session action: {action}", code="not_found")

    def session_for(self, owner: str, fields: Fields, n: int, prompts: list[Any]) -> tuple[str, Any] | None:
        session_id = fields.body.get("session")
        if session_id is None:
            return None
        if not isinstance(session_id, str):
            raise fields.bad("session", "a session id string")
        if n != 1 or len(prompts) != 1:
            raise HttpError(400, "a session continues one conversation: use n = 1 and one prompt", param="session",
                            code="invalid_value")
        return session_id, self.ready_sessions().acquire(owner, session_id)

    # --- generation ---

    def completions(self, handler: Handler, _path: str) -> None:
        self.require(handler, "POST")
        fields = Fields(handler.read_json())
        engine = self.ready_engine()
        check_model(fields)
        prompts = completion_prompts(fields.body.get("prompt"))
        suffix = fields.body.get("suffix")
        if suffix is not None and not isinstance(suffix, str):
            raise fields.bad("suffix", "a string")
        echo = fields.boolean("echo", False)
        logprobs = fields.integer("logprobs", None, 0, 5)
        if echo and logprobs is not None:
            raise HttpError(400, "'logprobs' of an echoed prompt are not supported", param="echo",
                            code="unsupported_parameter")
        max_tokens = fields.integer("max_tokens", 16, 1, None)
        self.generate(handler, fields, engine, prompts, max_tokens, chat=False, echo=echo, logprobs=logprobs,
                      suffix=suffix, grammar=requested_grammar(fields.body), elect_among=best_of(fields, chat=False))

    def chat_completions(self, handler: Handler, _path: str) -> None:
        self.require(handler, "POST")
        fields = Fields(handler.read_json())
        engine = self.ready_engine()
        check_model(fields)
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
        grammar = requested_grammar(fields.body)
        if tools is not None and tools.forced is not None:
            if grammar is not None:
                raise HttpError(400, "a forced tool call already fixes the answer's shape: drop response_format",
                                param="response_format", code="invalid_value")
            grammar = forced_tool_grammar(tools)
        messages = chat_messages(fields.body.get("messages"))
        max_tokens = fields.integer("max_completion_tokens", None, 1, None)
        if max_tokens is None:
            max_tokens = fields.integer("max_tokens", None, 1, None)
        in_template = engine.backend.template_supports_tools
        # The model's template (or role-prefixed lines without one), and the start of a forced tool call.
        prompt = engine.chat_prompt(template_messages(messages, tools, in_template),
                                    tools.tools if tools and in_template else None)
        if tools is not None:
            prompt += tools.prefill
        self.generate(handler, fields, engine, [prompt], max_tokens, chat=True, echo=False, logprobs=logprobs,
                      tools=tools, grammar=grammar, elect_among=best_of(fields, chat=True))

    def generate(self, handler: Handler, fields: Fields, engine: Engine, prompts: list[Any],
                 max_tokens: int | None, chat: bool, echo: bool, logprobs: int | None,
                 tools: ToolRequest | None = None, suffix: str | None = None, grammar: str | None = None,
                 elect_among: int = 1) -> None:
        """`elect_among` > 1: each prompt's answer is elected by the Conclave among that many attempts."""
        n = fields.integer("n", 1, 1, MAX_CHOICES)
        assert n is not None
        if len(prompts) * max(n, elect_among) > MAX_CHOICES:
            raise HttpError(400, f"a request asks at most {MAX_CHOICES} generations in all (prompts × n × best_of); "
                            f"this one asks {len(prompts) * max(n, elect_among)}", param="n", code="invalid_value")
        stream = fields.boolean("stream", False)
        include_usage = stream_usage(fields)
        seed = fields.integer("seed", None, 0, 2**32 - 2)
        if elect_among > 1 and stream:
            raise HttpError(400, "best_of answers are elected once every attempt has ended: they cannot be "
                            "streamed", param="best_of", code="unsupported_parameter")
        reserved = self.session_for(handler.owner, fields, max(n, elect_among), prompts)
        session = reserved[1] if reserved else None

        released = False

        def release_session() -> None:
            # As soon as every choice has finished (the engine has stored the session's state), not
            # after the answer is written: a client's next turn may arrive before this thread returns.
            # Once only: by the `finally` below, that next turn may hold the session.
            nonlocal released
            if reserved and not released:
                released = True
                self.ready_sessions().release(handler.owner, reserved[0])
        try:
            sink: queue.SimpleQueue = queue.SimpleQueue()
            base = dataclasses.replace(sampling_params(fields, max_tokens, None), grammar=grammar)  # seeded per choice
            requests = [GenerationRequest(prompt, params, logprobs=logprobs, session=session, suffix=suffix,
                                          streamed=stream)
                        for prompt_index, prompt in enumerate(prompts)
                        for params in self.attempt_params(base, seed, prompt_index, n, elect_among)]
            # One deterministic answer (greedy, or an explicit seed) may already be in the shared store.
            cacheable = self.answers is not None and len(requests) == 1 and session is None and \
                logprobs is None and (base.temperature == 0 or seed is not None)
            answer_key = None
            try:
                handles = None
                if cacheable:
                    # Tokenized once: the key is over the tokens, and the engine gets them as they are.
                    tokens = engine.prompt_tokens(requests[0])
                    requests = [dataclasses.replace(requests[0], prompt=tokens, suffix=None)]
                    answer_key = self.answer_key(tokens, requests[0].params, chat, tools, seed)
                    handles = self.from_store(tokens, answer_key, sink)
                if handles is None:
                    handles = engine.submit_together(requests, sink)
            except (RequestError, OverloadedError) as error:
                raise refusal(error, "messages" if chat else "prompt") from None
            if answer_key is not None and not isinstance(handles[0], StoredAnswer):
                sink = AnswerTap(sink, lambda text, finish: self.keep_answer(answer_key, text, finish))
            group = len(handles) // len(prompts)  # handles per prompt: its n choices or its attempts
            prompt_tokens = sum(len(handles[i * group].prompt_tokens) for i in range(len(prompts)))
            echoes = [self.echo_text(engine, prompts[i // group]) if echo else "" for i in range(len(handles))]
            response = Response(chat, self.settings.model_id, engine.backend.token_piece if logprobs is not None
                                else None, per_prompt=group)
            choices = [Choice(parser=tool_parser(tools)) for _ in handles]
            if stream:
                self.stream(handler, response, sink, handles, choices, echoes, prompt_tokens, include_usage,
                            release_session)
            else:
                ballot = Ballot(handles, elect_among) if elect_among > 1 else None
                self.collect(handler, response, sink, handles, choices, echoes, prompt_tokens, release_session,
                             ballot)
        finally:
            release_session()

    def answer_key(self, tokens: list[int], params: SamplingParams, chat: bool, tools: ToolRequest | None,
                   seed: int | None) -> bytes:
        """The request's key in the exact answer cache."""
        assert self.answers is not None
        if seed is None and params.temperature == 0:
            params = dataclasses.replace(params, seed=None)  # greedy: the random seed given to it does not count
        shape = ("chat" if chat else "completion") + ("+tools" if tools is not None else "")
        return self.answers.key(tokens, params, shape)

    def from_store(self, tokens: list[int], key: bytes, sink: queue.SimpleQueue) -> list[StoredAnswer] | None:
        """The answer from the store as the engine's events, or None on a miss (counted either way)."""
        assert self.answers is not None
        cached = self.answers.get(key)
        self.metrics.add("reame_answer_cache_lookups_total", result="hit" if cached else "miss")
        if cached is None:
            return None
        sink.put((0, TokenEvent(-1, cached.text)))
        sink.put((0, cached.finish(len(tokens))))
        return [StoredAnswer(tokens)]

    def keep_answer(self, key: bytes, text: str, finish: FinishEvent) -> None:
        assert self.answers is not None
        if self.answers.put(key, text, finish):
            self.metrics.add("reame_answer_cache_stored_total")

    @staticmethod
    def attempt_params(base: SamplingParams, seed: int | None, prompt_index: int, n: int,
                       elect_among: int) -> list[SamplingParams]:
        """Each choice's settings (seeds follow on from the request's), or the Conclave's attempts."""
        if elect_among > 1:
            return attempts(dataclasses.replace(base, seed=None if seed is None else
                                                (seed + prompt_index) % (MAX_SEED + 1)), elect_among)
        return [dataclasses.replace(base, seed=(seed + prompt_index * n + j) % (MAX_SEED + 1) if seed is not None
                                    else random.randrange(MAX_SEED + 1)) for j in range(n)]

    @staticmethod
    def echo_text(engine: Engine, prompt: Any) -> str:
        return prompt if isinstance(prompt, str) else engine.backend.detokenize(prompt)

    def collect(self, handler: Handler, response: "Response", sink: queue.SimpleQueue, handles: list,
                choices: list[Choice], echoes: list[str], prompt_tokens: int, finished: Callable[[], None],
                ballot: Ballot | None = None) -> None:
        """The whole answer once every choice ended; with `ballot`, one elected per prompt among its attempts
        (each votes as it ends, a prompt's others stop once its majority is certain)."""
        for choice, echo in zip(choices, echoes):
            choice.pieces.append(echo)
        remaining = len(handles)
        checked = time.monotonic()
        while remaining:
            tag, event = self.next_event(sink)
            if time.monotonic() - checked >= POLL_S:
                checked = time.monotonic()
                if handler.client_gone():
                    for handle in handles:
                        handle.cancel()
                    handler.close_connection = True
                    return
            if event is None:
                continue
            choices[tag].pieces.append(event.text)
            if isinstance(event, TokenEvent):
                if event.logprob is not None:
                    choices[tag].tokens.append(event)
            else:
                choices[tag].finish = event
                remaining -= 1
                if ballot is not None and ballot.finished(tag, choices[tag].text, event.reason,
                                                          event.usage.completion_tokens):
                    self.metrics.add("reame_conclave_early_stops_total")
        finished()
        self.account(choices)
        for choice in choices:
            if choice.parser is not None:  # the text becomes content and tool calls
                said = choice.parser.feed(choice.text) + choice.parser.finish()
                choice.pieces = [item for kind, item in said if kind == "content"]
        if any(c.finish and c.finish.reason == "timeout" for c in choices):
            raise HttpError(503, "the server is busy: no sequence slot became free in time, retry later",
                            "server_error", "queue_timeout", headers={"Retry-After": "5"})
        failed = next((c.finish for c in choices if c.finish and c.finish.reason == "error"), None)
        if failed is not None and failed.code:  # the request's own doing (its grammar): the client can fix it
            raise HttpError(400, failed.message, code=failed.code)
        if failed is not None:
            raise HttpError(500, f"generation failed: {failed.message}", "server_error", "generation_failed")
        if ballot is None:
            handler.send_json(200, response.whole(choices, prompt_tokens))
            return
        verdicts = ballot.verdicts()
        size = ballot.group
        body = response.whole([choices[i * size + verdict.winner] for i, verdict in enumerate(verdicts)],
                              prompt_tokens)
        body["usage"] = response.usage(choices, prompt_tokens)  # every attempt's tokens were generated
        body["reame"] = {"conclave": [verdict.summary() for verdict in verdicts]}
        self.metrics.add("reame_conclave_elections_total", len(verdicts))
        handler.send_json(200, body)

    def stream(self, handler: Handler, response: "Response", sink: queue.SimpleQueue, handles: list,
               choices: list[Choice], echoes: list[str], prompt_tokens: int, include_usage: bool,
               finished: Callable[[], None]) -> None:
        handler.start_sse()
        try:
            for index, echo in enumerate(echoes):
                first = response.first_chunk(index, echo)
                if first is not None:
                    handler.send_event(first)
            remaining = len(handles)
            while remaining:
                tag, event = self.next_event(sink)
                if event is None:
                    continue
                choice = choices[tag]
                if isinstance(event, TokenEvent):
                    if event.logprob is not None:
                        choice.tokens.append(event)
                    if choice.parser is not None:
                        self.send_said(handler, response, tag, choice, choice.parser.feed(event.text))
                    elif event.text and not choice.tokens:
                        handler.send_event(response.text_chunk(tag, event.text))
                    elif event.text:  # held-back tokens' logprobs ride along with the next chunk
                        handler.send_event(response.chunk(tag, event.text, tokens=choice.tokens))
                        choice.tokens = []
                    handles[tag].delivered()
                    continue
                choice.finish = event
                remaining -= 1
                if not remaining:
                    finished()
                if event.reason in ("error", "timeout"):
                    code = event.code or ("generation_failed" if event.reason == "error" else "queue_timeout")
                    kind = "invalid_request_error" if event.code else "server_error"
                    handler.send_event({"error": {"message": event.message, "type": kind, "param": None,
                                                  "code": code}})
                    continue
                text = event.text
                if choice.parser is not None:
                    self.send_said(handler, response, tag, choice,
                                   choice.parser.feed(event.text) + choice.parser.finish())
                    text = ""
                handler.send_event(response.chunk(tag, text, choice.finish_reason(), choice.tokens))
            self.account(choices)
            if include_usage:
                handler.send_event(response.usage_chunk(choices, prompt_tokens))
            handler.send_event("[DONE]")
        except OSError:  # the client went away: stop generating for it
            for handle in handles:
                handle.cancel()
        except EngineUnavailable as error:  # the stream has begun: the error goes in it, and it ends
            handler.send_event({"error": {"message": str(error), "type": "server_error", "param": None,
                                          "code": "engine_unavailable"}})

    def next_event(self, sink: queue.SimpleQueue) -> tuple[int, Any]:
        """The next (tag, event) of a request's sink, or (-1, None) after POLL_S without one. Never waits
        forever: EngineUnavailable when the engine failed meanwhile."""
        try:
            return sink.get(timeout=POLL_S)
        except queue.Empty:
            self.check_engine()
            return -1, None

    def check_engine(self) -> None:
        """EngineUnavailable once the engine has failed: a waiting handler answers instead of hanging."""
        if self.engine is not None and self.engine.status.dead:
            raise EngineUnavailable(f"the engine failed: {self.engine.status.dead}")

    @staticmethod
    def send_said(handler: Handler, response: Response, tag: int, choice: Choice,
                  said: list[tuple[str, Any]]) -> None:
        """Stream what a tool-call parser let through: content chunks, and each finished call."""
        for kind, item in said:
            if kind == "content":
                handler.send_event(response.chunk(tag, item, tokens=choice.tokens))
                choice.tokens = []
            else:
                handler.send_event(response.tool_call_chunk(tag, choice.calls.index(item), item))

    def account(self, choices: list[Choice]) -> None:
        for choice in choices:
            if choice.finish is None:
                continue
            usage = choice.finish.usage
            self.metrics.add("reame_generations_total")
            self.metrics.add("reame_prompt_tokens_total", usage.prompt_tokens)
            self.metrics.add("reame_prompt_tokens_cached_total", usage.cached_tokens)
            self.metrics.add("reame_generated_tokens_total", usage.completion_tokens)
            self.metrics.add("reame_prompt_seconds_total", usage.prompt_seconds)
            self.metrics.add("reame_generation_seconds_total", usage.decode_seconds)


PUBLIC_ROUTES = {"/health": App.health, "/": App.web_page, "/index.html": App.web_page}
ROUTES = {
    "/metrics": App.metrics_text,
    "/stats": App.stats,
    "/v1/sessions": App.create_session,
    "/v1/models": App.models,
    "/v1/completions": App.completions,
    "/v1/chat/completions": App.chat_completions,
    "/v1/embeddings": App.embeddings,
    "/v1/warm": App.warm,
    "/tokenize": App.tokenize,
    "/detokenize": App.detokenize,
}


def encode_vector(vector: list[float], encoding: str) -> list[float] | str:
    """A vector as floats, or as OpenAI's base64 of little-endian float32s."""
    if encoding == "float":
        return vector
    packed = array.array("f", vector)
    if sys.byteorder == "big":
        packed.byteswap()
    return base64.b64encode(packed.tobytes()).decode("ascii")


def canonical_path(path: str) -> str:
    """OpenAI's routes answer without their /v1 too, as llama-server's do: a client whose base_url
    lacks it keeps working."""
    if path.startswith("/v1/") or path in ROUTES:
        return path
    prefixed = "/v1" + path
    return prefixed if prefixed in ROUTES or prefixed.startswith(("/v1/models/", "/v1/sessions/")) else path


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


def refusal(error: RequestError | OverloadedError, prompt_param: str = "prompt") -> HttpError:
    """The HTTP answer to an engine that refused a request: bad input 400, a full queue 429.
    `prompt_param`: what the request called its prompt (a chat's is its "messages")."""
    if isinstance(error, OverloadedError):
        return HttpError(429, str(error), "server_error", "queue_full", headers={"Retry-After": "2"})
    param = prompt_param if error.param in (None, "prompt") else error.param
    return HttpError(400, str(error), param=param, code=error.code)
