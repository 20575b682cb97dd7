"""The model pool: names, loading on demand, the loaded-models and RAM limits, the least recently used idle
model unloaded for another, draining a busy one, keep-alive, deadlines, failed loads and failed engines."""

import threading
import time
from types import SimpleNamespace

import pytest
from hypothesis import given, settings, strategies as st

from reame.server.models import FOREVER, ModelPool, ModelUnavailable, ServedModel, UnknownModel
from tests.waiting import wait_until


class FakeEngine:
    """What the pool needs of an engine: its status, and closing."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.status = SimpleNamespace(dead="")
        self.closed = False

    def close(self) -> None:
        self.closed = True


class Loader:
    """Loads FakeEngines, remembering the order; can be told to fail."""

    def __init__(self) -> None:
        self.loaded: list[str] = []
        self.engines: list[FakeEngine] = []
        self.fail = ""

    def __call__(self, model: ServedModel) -> FakeEngine:
        if self.fail:
            raise RuntimeError(self.fail)
        self.loaded.append(model.name)
        self.engines.append(FakeEngine(model.name))
        return self.engines[-1]


def pool(*names: str, loader=None, **options) -> ModelPool:
    models = [ServedModel(name, aliases=(name.upper() + "-alias",), memory_bytes=options.pop(f"{name}_bytes", 100),
                          pinned=index == 0) for index, name in enumerate(names)]
    return ModelPool(models, loader or Loader(), **options)


def test_names_aliases_and_latest_find_a_model_and_an_unknown_one_is_refused():
    models = pool("small", "coder")
    assert models.find("coder") is models.models[1] and models.find("CODER-alias") is models.models[1]
    assert models.find("coder:latest") is models.models[1] and models.find(None) is models.default
    assert models.find("") is models.default
    with pytest.raises(UnknownModel, match="serves small, coder"):
        models.find("gpt-4o")
    with pytest.raises(UnknownModel):
        models.find(["coder"])
    assert pool("only").find("gpt-4o").name == "only"  # one model answers to any name, as clients expect


def test_a_model_loads_when_first_asked_and_the_idle_one_makes_room_under_a_one_model_limit():
    loader = Loader()
    models = pool("a", "b", loader=loader, max_loaded=1)
    models.preload(models.default)
    engine_b = models.acquire(models.models[1])
    assert loader.loaded == ["a", "b"] and loader.engines[0].closed and engine_b is loader.engines[1]
    assert [model.name for model in models.loaded()] == ["b"] and models.models[0].state == "unloaded"
    models.release(models.models[1])
    models.acquire(models.default)
    assert loader.loaded == ["a", "b", "a"] and loader.engines[1].closed
    assert (models.loads, models.unloads) == (3, 2)


def test_the_ram_budget_limits_what_loads_together_and_a_lone_model_always_loads():
    loader = Loader()
    models = pool("a", "b", "c", loader=loader, max_loaded=3, ram_budget_bytes=250, c_bytes=1000)
    for model in models.models[:2]:
        models.acquire(model)
        models.release(model)
    assert len(models.loaded()) == 2  # 100 + 100 fit in 250
    models.acquire(models.models[2])  # 1000: more than the budget, so it loads alone
    assert [model.name for model in models.loaded()] == ["c"]


def test_the_least_recently_used_idle_model_is_the_one_unloaded():
    loader = Loader()
    models = pool("a", "b", "c", loader=loader, max_loaded=2)
    a, b, c = models.models
    for model in (a, b, a):
        models.acquire(model)
        models.release(model)
    models.acquire(c)
    assert {model.name for model in models.loaded()} == {"a", "c"} and b.state == "unloaded"


def test_a_busy_model_drains_before_another_takes_its_room():
    loader = Loader()
    models = pool("a", "b", loader=loader, max_loaded=1)
    a, b = models.models
    models.preload(a)
    models.acquire(a)  # a request on a
    got: list[str] = []
    wants_b = threading.Thread(target=lambda: (models.acquire(b), got.append("b")))
    wants_b.start()
    wait_until(lambda: a.draining)
    wants_a = threading.Thread(target=lambda: (models.acquire(a), got.append("a")))
    wants_a.start()  # a is draining: this request waits too, rather than keeping it loaded for ever
    wants_a.join(0.5)
    assert got == [] and a.users == 1
    models.release(a)  # the request on a ends: a unloads, b loads
    wants_b.join(5)
    assert got == ["b"] and loader.loaded == ["a", "b"]
    models.release(b)  # then a comes back for the request waiting on it
    wants_a.join(5)
    assert got == ["b", "a"] and loader.loaded == ["a", "b", "a"]


def test_a_wait_past_the_deadline_is_refused_and_the_busy_model_serves_on():
    models = pool("a", "b", max_loaded=1, wait_s=0.3)
    a, b = models.models
    models.preload(a)
    models.acquire(a)
    with pytest.raises(ModelUnavailable, match="did not become available") as refused:
        models.acquire(b)
    assert refused.value.retry and not a.draining
    models.acquire(a)  # no longer draining: a second request on a is served
    assert a.users == 2


def test_a_client_that_leaves_stops_waiting():
    models = pool("a", "b", max_loaded=1)
    models.preload(models.default)
    models.acquire(models.default)
    with pytest.raises(ConnectionResetError):
        models.acquire(models.models[1], gone=lambda: True)


def test_keep_alive_unloads_idle_models_but_never_the_first():
    models = pool("a", "b", "c", keep_alive_s=0.0)
    a, b, c = models.models
    for model in (a, b):
        models.acquire(model)
        models.release(model)
    models.acquire(c)
    models.release(c, FOREVER)
    assert models.unload_expired() == 1 and b.state == "unloaded"
    assert a.state == "loaded" and c.state == "loaded"  # the first one, and one kept for ever
    models.acquire(a)
    models.release(a, 0)  # a request's own keep_alive does not apply to the first model: it is everyone's
    assert models.unload_expired() == 0 and a.state == "loaded" and a.expires is None
    assert not models.unload_idle(a) and a.state == "loaded"  # nor does Ollama's empty keep_alive 0 request


def test_the_reaper_unloads_after_keep_alive_without_being_asked():
    models = pool("a", "b", keep_alive_s=0.05).start()
    try:
        models.acquire(models.models[1])
        models.release(models.models[1])
        wait_until(lambda: models.models[1].state == "unloaded")
        assert models.default.state == "unloaded"  # never loaded: nothing asked for it
    finally:
        models.close()


def test_unload_idle_leaves_a_model_in_use_alone():
    models = pool("a", "b")
    b = models.models[1]
    models.acquire(b)
    assert not models.unload_idle(b) and b.state == "loaded"
    models.release(b)
    assert models.unload_idle(b) and b.state == "unloaded"


def test_a_model_that_fails_to_load_fails_its_request_and_is_tried_again_later():
    loader = Loader()
    models = pool("a", "b", loader=loader)
    loader.fail = "not a GGUF file"
    with pytest.raises(ModelUnavailable, match="not a GGUF file") as refused:
        models.acquire(models.models[1])
    assert not refused.value.retry and models.models[1].state == "unloaded"
    loader.fail = ""
    assert models.acquire(models.models[1]).name == "b"


def test_a_failed_idle_engine_is_loaded_afresh():
    loader = Loader()
    models = pool("a", "b", loader=loader)
    models.preload(models.default)
    loader.engines[0].status.dead = "decode failed"
    assert models.acquire(models.default) is loader.engines[1] and loader.engines[0].closed


def test_close_unloads_everything_and_refuses_new_requests():
    loader = Loader()
    models = pool("a", "b", loader=loader).start()
    models.preload(models.default)
    models.close()
    assert loader.engines[0].closed and not models.loaded()
    with pytest.raises(ModelUnavailable, match="shutting down"):
        models.acquire(models.models[1])


def test_a_models_name_becomes_one_safe_directory():
    from reame.node import directory_name
    assert directory_name("coder") == "coder" and directory_name("../../etc") == ".._.._etc"
    assert directory_name("..") == "_.." and directory_name("a/b c") == "a_b_c"
    assert len(directory_name("x" * 500)) == 100


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(["general.architecture", "general.file_type", "general.size_label",
                                        "llama.context_length"]),
                       st.one_of(st.text(max_size=5000), st.integers(), st.floats(), st.lists(st.integers()),
                                 st.booleans())))
def test_a_hostile_header_makes_a_short_summary(metadata):
    from reame.gguf import model_summary
    summary = model_summary(metadata)
    assert all(isinstance(summary[key], str) and len(summary[key]) <= 32
               for key in ("architecture", "quantization", "parameter_size"))
    assert isinstance(summary["context_train"], int) and summary["context_train"] >= 0


def test_a_victim_whose_engine_fails_to_close_leaves_the_model_loadable():
    """Issue 49 (suspected, reproduced): unloading a victim raised, and the model it made room for stayed
    "loading" for ever, every later request for it waiting until its deadline."""
    models = pool("a", "b", max_loaded=1, wait_s=2.0)
    a, b = models.models
    models.acquire(a)
    models.release(a)

    def broken_close() -> None:
        raise OSError("the engine thread did not stop")
    a.engine.close = broken_close  # type: ignore[method-assign]
    with pytest.raises(OSError):
        models.acquire(b)
    assert a.state == "unloaded" and b.state == "unloaded"
    started = time.monotonic()
    assert models.acquire(b).name == "b" and time.monotonic() - started < 1.0
