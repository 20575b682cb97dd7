"""The models one server serves: found by the name a request gives, loaded when a request needs one, at most
`max_loaded` at once and within a RAM budget, unloaded after their keep-alive or when another model needs the
room (the least recently used idle one first).

The pool owns every model's loaded state; a request leases the model it uses (`acquire`/`release`), so a model
is never unloaded under a request. A request for a model that must wait (it is loading, or the room it needs
is held by models still answering) waits here, up to a deadline, while its client is there; the models in
its way take no new requests meanwhile (they drain), so a stream of requests for one model cannot starve
another's.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from reame.engine import Engine
from reame.errors import EngineUnavailable, ReameError

if TYPE_CHECKING:
    from reame.answers import AnswerCache
    from reame.semantic import SemanticCache
    from reame.server.sessions import Sessions

log = logging.getLogger("reame.server")

FOREVER = -1.0  # a keep-alive that never expires
WAIT_POLL_S = 0.25  # how often a waiting request checks its client and its deadline


@dataclass(frozen=True)
class ModelFacts:
    """What /v1/models, /api/tags and /api/show say of a model, loaded or not (from its GGUF header)."""

    path: str = ""
    size_bytes: int = 0
    modified: float = 0.0  # the file's mtime
    architecture: str = "unknown"
    quantization: str = "unknown"
    parameter_size: str = "unknown"  # "135M", "0.5B": the file's size label
    context_train: int = 0
    context_length: int = 0  # what this server gives it (planned when not loaded)


@dataclass(eq=False)
class ServedModel:
    """One model as the server serves it. Its caches (sessions, exact and semantic answers) live as long as
    the server: they stay while the model is unloaded. `engine` and the lease state belong to the pool."""

    name: str
    aliases: tuple[str, ...] = ()
    facts: ModelFacts = field(default_factory=ModelFacts)
    memory_bytes: int = 0  # what it takes loaded: weights, KV, buffers (an estimate, for the RAM budget)
    sessions: Sessions | None = None
    answers: AnswerCache | None = None  # None: cache.answers is off
    semantic: SemanticCache | None = None  # None: cache.semantic is off (it keeps its answers in `answers`)
    pinned: bool = False  # the server's first model: the default keep-alive does not unload it
    engine: Engine | None = None
    state: str = "unloaded"  # unloaded | loading | loaded | unloading
    users: int = 0  # requests holding it
    last_used: float = 0.0  # monotonic
    expires: float | None = None  # monotonic; None: never (pinned, or a keep-alive of FOREVER)
    draining: bool = False  # another model waits for its room: no new requests until it is unloaded
    given_names: tuple[str, ...] = ()  # the names its configuration gave it (llama-server's `aliases`)
    tags: tuple[str, ...] = ()  # what /v1/models lists as its `tags` (llama-server's --tags)

    def answers_to(self, requested: str) -> bool:
        """Whether a request's `model` names this one: its name, an alias, or either with Ollama's `:latest`."""
        wanted = requested.strip().lower().removesuffix(":latest")
        return wanted in (name.lower() for name in (self.name, *self.aliases))

    def context_length(self) -> int:
        """Its context in tokens: the engine's while loaded (llama.cpp may round what was asked), else the
        planned one."""
        engine = self.engine
        return engine.backend.n_ctx if engine is not None else self.facts.context_length

    def expires_at(self) -> float | None:
        """When its keep-alive ends, as wall-clock time (None: never, or not loaded)."""
        if self.expires is None or self.state != "loaded":
            return None
        return time.time() + (self.expires - time.monotonic())


class UnknownModel(ReameError):
    """A request named a model this server does not serve."""


class ModelUnavailable(ReameError):
    """A model could not be loaded, or did not become free before the request's deadline."""

    def __init__(self, message: str, retry: bool) -> None:
        super().__init__(message)
        self.retry = retry  # whether trying later may succeed (a wait) or not (a file that fails to load)


class ModelPool:
    """The served models, their loading and unloading. Thread-safe: one lock guards every model's state;
    loading and unloading (seconds) run outside it, marked by the model's state."""

    def __init__(self, models: list[ServedModel], load: Callable[[ServedModel], Engine] | None = None,
                 max_loaded: int = 3, ram_budget_bytes: int = 0, keep_alive_s: float = 300.0,
                 wait_s: float = 300.0) -> None:
        """`load`: a started engine for a model (None: the models come loaded, as tests give them);
        `ram_budget_bytes` 0: no budget; `keep_alive_s`: how long an idle model stays loaded (FOREVER: always);
        `wait_s`: the longest a request waits for its model."""
        if not models:
            raise ValueError("a pool serves at least one model")
        self.models = models
        self._load = load
        self.max_loaded = max_loaded
        self.ram_budget_bytes = ram_budget_bytes
        self.keep_alive_s = keep_alive_s
        self.wait_s = wait_s
        self._lock = threading.Condition()
        self._room_waiters = 0
        self._closed = False
        self._reaper: threading.Thread | None = None
        self.loads = 0  # engines loaded (the first model's included) and unloaded: for metrics and tests
        self.unloads = 0

    @property
    def default(self) -> ServedModel:
        return self.models[0]

    # --- names --------------------------------------------------------------------------------------

    def find(self, requested: object) -> ServedModel:
        """The model a request's `model` names. A server of one model answers to any name (clients send
        "gpt-4o"); with several, no name means the first and an unknown one is UnknownModel."""
        if len(self.models) == 1 or requested is None or requested == "":
            return self.default
        if isinstance(requested, str):
            for model in self.models:
                if model.answers_to(requested):
                    return model
        shown = requested if isinstance(requested, str) else type(requested).__name__
        raise UnknownModel(f"model '{str(shown)[:100]}' is not served here; this server serves "
                           f"{', '.join(model.name for model in self.models)}")

    # --- leases -------------------------------------------------------------------------------------

    def acquire(self, model: ServedModel, gone: Callable[[], bool] = lambda: False) -> Engine:
        """The model's engine, loaded if need be, held for the caller until `release`. Waits while the model
        loads or waits for room; ModelUnavailable at the deadline or when it fails to load; ConnectionError
        when `gone()` says the client left."""
        deadline = time.monotonic() + self.wait_s
        waiting_for_room = False
        try:
            while True:
                victims: list[ServedModel] | None = None
                with self._lock:
                    engine = model.engine
                    failed = model.state == "loaded" and model.users == 0 and self._load is not None and \
                        engine is not None and bool(engine.status.dead)
                    if failed:
                        model.state = "unloading"  # a failed engine, idle: load the model afresh
                    elif model.state == "loaded" and not model.draining:
                        assert engine is not None
                        model.users += 1
                        model.last_used = time.monotonic()
                        return engine
                    elif self._closed:
                        raise ModelUnavailable("the server is shutting down", retry=True)
                    elif model.state == "unloaded":
                        if self._load is None:
                            raise ModelUnavailable(f"model '{model.name}' is not loaded", retry=False)
                        victims = self._make_room(model)
                        if victims is not None:
                            model.state = "loading"
                            for victim in victims:
                                victim.state = "unloading"
                        elif not waiting_for_room:
                            waiting_for_room = True
                            self._room_waiters += 1
                    if not failed and victims is None:
                        self._lock.wait(WAIT_POLL_S)  # loading, unloading, draining, or no room yet
                if failed:
                    self._unload(model, "its engine failed")
                    continue
                if victims is not None:
                    try:
                        for victim in victims:
                            self._unload(victim, "to make room for " + model.name)
                    except BaseException:  # the victim is unloaded whatever its close raised; this model is not
                        with self._lock:  # loading (it stayed "loading" for ever, every request waiting on it)
                            model.state = "unloaded"
                            self._lock.notify_all()
                        raise
                    return self._load_now(model)  # held by this caller already; ModelUnavailable if it fails
                if gone():
                    raise ConnectionResetError("the client left while its model was loading")
                if time.monotonic() > deadline:
                    raise ModelUnavailable(f"model '{model.name}' did not become available within {self.wait_s:g} s "
                                           "(other models are answering); retry later", retry=True)
        finally:
            if waiting_for_room:
                with self._lock:
                    self._room_waiters -= 1
                    if not self._room_waiters:
                        for other in self.models:  # nobody needs their room any more
                            other.draining = False
                    self._lock.notify_all()

    def release(self, model: ServedModel, keep_alive_s: float | None = None) -> None:
        """The caller is done with the model; it stays loaded for `keep_alive_s` (None: the server's; 0:
        unloaded now unless other requests hold it; FOREVER: until another model needs its room). The first
        model stays whatever a request says: any client could otherwise unload what everyone is served by."""
        with self._lock:
            model.users -= 1
            model.last_used = now = time.monotonic()
            if model.pinned:
                model.expires = None
            else:
                alive = self.keep_alive_s if keep_alive_s is None else keep_alive_s
                model.expires = None if alive < 0 else now + alive
            self._lock.notify_all()

    def preload(self, model: ServedModel) -> None:
        """Load a model before any request asks for it (the first one, at start-up, when nothing else is
        loaded); the loader's own error if it fails (the server then does not start)."""
        with self._lock:
            assert model.state == "unloaded" and not any(other.state != "unloaded" for other in self.models)
            model.state = "loading"
        self._load_now(model, reraise=True)
        self.release(model)

    def check(self, model: ServedModel) -> None:
        """EngineUnavailable once the model's engine has failed: a waiting request answers instead of
        hanging."""
        engine = model.engine
        if engine is not None and engine.status.dead:
            raise EngineUnavailable(f"the engine of model '{model.name}' failed: {engine.status.dead}")

    def loaded(self) -> list[ServedModel]:
        with self._lock:
            return [model for model in self.models if model.state == "loaded" and model.engine is not None]

    # --- keep-alive ---------------------------------------------------------------------------------

    def unload_idle(self, model: ServedModel) -> bool:
        """Unload a model now unless a request holds it or it is the first (Ollama's empty prompt with
        keep_alive 0); whether it was."""
        with self._lock:
            if model.state != "loaded" or model.users or model.pinned:
                return False
            model.state = "unloading"
        self._unload(model, "a request asked for it (keep_alive 0)")
        return True

    def start(self) -> ModelPool:
        """Start unloading models whose keep-alive has run out."""
        self._reaper = threading.Thread(target=self._reap, name="reame-models", daemon=True)
        self._reaper.start()
        return self

    def unload_expired(self) -> int:
        """Unload every idle model whose keep-alive has run out; how many were."""
        with self._lock:
            now = time.monotonic()
            expired = [model for model in self.models if model.state == "loaded" and model.users == 0
                       and model.expires is not None and model.expires <= now]
            for model in expired:
                model.state = "unloading"
        for model in expired:
            self._unload(model, "its keep-alive ran out")
        return len(expired)

    def _reap(self) -> None:
        while True:
            with self._lock:
                if self._closed:
                    return
                self._lock.wait(1.0)
            self.unload_expired()

    def close(self) -> None:
        """Unload every model (each engine closes its backend once its thread has ended)."""
        with self._lock:
            self._closed = True
            self._lock.notify_all()
            loaded = [model for model in self.models if model.engine is not None]
            for model in loaded:
                model.state = "unloading"
        for model in loaded:
            self._unload(model, "the server is shutting down")
        if self._reaper is not None:
            self._reaper.join()

    # --- room ---------------------------------------------------------------------------------------

    def _make_room(self, model: ServedModel) -> list[ServedModel] | None:
        """The idle models to unload so that `model` fits (possibly none), or None when it must wait: the
        models in the way then drain. Called with the lock held."""
        held = [other for other in self.models if other.state != "unloaded" and other is not model]
        if any(other.state == "unloading" for other in held):
            return None  # memory being freed: count it once it is
        victims: list[ServedModel] = []
        idle = sorted((other for other in held if other.state == "loaded" and other.users == 0),
                      key=lambda other: other.last_used)
        busy = sorted((other for other in held if other.state == "loaded" and other.users > 0),
                      key=lambda other: other.last_used)
        while not self._fits(model, [other for other in held if other not in victims]):
            if idle:
                victims.append(idle.pop(0))
            elif busy:
                busy.pop(0).draining = True  # unloaded once its requests end; none start meanwhile
                return None
            else:
                return None  # only models loading are in the way: wait for them
        return victims

    def _fits(self, model: ServedModel, held: list[ServedModel]) -> bool:
        if not held:
            return True  # alone, a model always loads, whatever its estimate says
        if len(held) + 1 > self.max_loaded:
            return False
        return not self.ram_budget_bytes or \
            sum(other.memory_bytes for other in held) + model.memory_bytes <= self.ram_budget_bytes

    def _load_now(self, model: ServedModel, reraise: bool = False) -> Engine:
        """Load `model` (state "loading", set by the caller under the lock) and hold it for the caller at once
        (so that no one waiting for room unloads it first); ModelUnavailable if it fails (`reraise`: the
        loader's own error)."""
        assert self._load is not None
        started = time.monotonic()
        try:
            engine = self._load(model)
        except Exception as error:  # a file that fails to load: this request fails, the next one tries again
            with self._lock:
                model.state = "unloaded"
                self._lock.notify_all()
            if reraise:
                raise
            log.error("cannot load model %s: %s", model.name, error)
            raise ModelUnavailable(f"cannot load model '{model.name}': {error}", retry=False) from None
        with self._lock:
            model.engine, model.state, model.draining = engine, "loaded", False
            model.last_used, model.expires = time.monotonic(), None
            model.users += 1
            self.loads += 1
            self._lock.notify_all()
        log.info("model %s loaded in %.1f s", model.name, time.monotonic() - started)
        return engine

    def _unload(self, model: ServedModel, why: str) -> None:
        """Close the model's engine (state "unloading", set by the caller under the lock)."""
        engine = model.engine
        log.info("unloading model %s: %s", model.name, why)
        try:
            if engine is not None:
                engine.close()
        finally:
            with self._lock:
                model.engine, model.state, model.draining, model.expires = None, "unloaded", False, None
                self.unloads += 1
                self._lock.notify_all()


def loaded(model: ServedModel) -> Engine:
    """The engine of a model the caller holds (Service.model acquired it: it stays loaded until released)."""
    assert model.engine is not None, "a held model is loaded"
    return model.engine
