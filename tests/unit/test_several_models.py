"""Several models behind one FakeBackend server: the request's `model` picks one (every API family), one loaded
at a time under a one-model limit, lists with each model's facts, Ollama's keep_alive and ps, and caches,
sessions and metrics kept per model. (Two real models, swapped: tests/compat/test_several_models.py.)"""

import time

import pytest
from hypothesis import given, settings, strategies as st

from reame.answers import AnswerCache
from reame.cache.answers import RamAnswers
from reame.engine import Engine
from reame.server.apis.ollama import keep_alive_of
from reame.server.client import HttpError
from reame.server.models import FOREVER, ModelFacts, ModelPool, ServedModel
from reame.server.sessions import Sessions
from tests.fakes.backend import FakeBackend, reply_rule
from tests.unit.test_answer_cache import metric
from tests.unit.test_server import Live

REPLIES = {"small": "I am small.", "coder": "I am the coder."}
QUESTION = [{"role": "user", "content": "who are you?"}]


@pytest.fixture
def two(tmp_path):
    """A server of "small" (first) and "coder" (alias "qwen"), at most one loaded, each with its own sessions and
    exact answers (in one RAM tier)."""
    ram = RamAnswers(1 << 20)
    models = [ServedModel(name, aliases=aliases, facts=ModelFacts(f"/m/{name}.gguf", size, 0.0, "llama", quant, label,
                                                                  8192, 1024),
                          memory_bytes=size, sessions=Sessions(tmp_path / name, name.encode()),
                          answers=AnswerCache([ram], name.encode()), pinned=name == "small")
              for name, aliases, size, quant, label in (("small", (), 100 << 20, "Q4_1", "135M"),
                                                        ("coder", ("qwen",), 400 << 20, "Q4_K_M", "0.5B"))]

    def load(model: ServedModel) -> Engine:
        return Engine(FakeBackend(n_ctx=1024, rule=reply_rule(REPLIES[model.name]))).start()
    server = Live(None, ModelPool(models, load, max_loaded=1))
    yield server
    server.close()
    server.app.models.close()


def chat(server, model, **extra):
    return server.json("POST", "/v1/chat/completions", {"model": model, "messages": QUESTION, "temperature": 0,
                                                        "max_tokens": 20, **extra})


def test_the_requests_model_picks_one_and_one_is_loaded_at_a_time(two):
    pool = two.app.models
    assert chat(two, "coder")[1]["choices"][0]["message"]["content"] == REPLIES["coder"]
    assert [model.name for model in pool.loaded()] == ["coder"]
    status, body = chat(two, "small")
    assert status == 200 and body["model"] == "small" and body["choices"][0]["message"]["content"] == REPLIES["small"]
    assert [model.name for model in pool.loaded()] == ["small"]
    assert chat(two, "qwen:latest")[1]["model"] == "coder"  # an alias, with Ollama's tag
    assert chat(two, None)[1]["model"] == "small"  # no model: the first
    assert (pool.loads, pool.unloads) == (5, 4)  # small at start, coder, small, coder, small
    assert metric(two, "reame_model_loads_total") == 5 and metric(two, "reame_models_loaded") == 1


def test_an_unknown_model_is_a_404_in_each_familys_shape(two):
    status, body = chat(two, "gpt-4o")
    assert status == 404 and body["error"]["code"] == "model_not_found" and "small, coder" in body["error"]["message"]
    status, body = two.json("POST", "/api/chat", {"model": "llama3", "messages": QUESTION, "stream": False})
    assert status == 404 and "llama3" in body["error"]
    status, body = two.json("POST", "/v1/messages", {"model": "claude", "max_tokens": 5, "messages": QUESTION})
    assert status == 404 and body["error"]["type"] == "not_found_error"
    assert two.json("POST", "/v1/responses", {"model": "o3", "input": "hi"})[0] == 404
    assert two.json("GET", "/v1/models/o3")[0] == 404
    assert two.app.models.loaded()[0].name == "small"  # nothing was unloaded for them


def test_every_family_reaches_the_model_it_names(two):
    _, ollama = two.json("POST", "/api/chat", {"model": "coder", "messages": QUESTION, "stream": False,
                                               "options": {"temperature": 0}})
    assert ollama["message"]["content"] == REPLIES["coder"] and ollama["load_duration"] > 0
    _, anthropic = two.json("POST", "/v1/messages", {"model": "small", "max_tokens": 20, "messages": QUESTION,
                                                     "temperature": 0})
    assert anthropic["content"][0]["text"] == REPLIES["small"]
    _, responses = two.json("POST", "/v1/responses", {"model": "coder", "input": "who are you?", "temperature": 0})
    assert responses["output"][0]["content"][0]["text"] == REPLIES["coder"] and responses["model"] == "coder"
    _, completion = two.json("POST", "/v1/completions", {"model": "small", "prompt": "x", "max_tokens": 2})
    assert completion["model"] == "small"


def test_lists_show_every_model_with_its_facts_loaded_or_not(two):
    _, models = two.json("GET", "/v1/models")
    cards = {card["id"]: card for card in models["data"]}
    assert list(cards) == ["small", "coder"] and cards["coder"]["reame"]["aliases"] == ["qwen"]
    assert cards["small"]["reame"]["loaded"] and not cards["coder"]["reame"]["loaded"]
    assert cards["coder"]["reame"]["quantization"] == "Q4_K_M" and cards["coder"]["reame"]["context_length"] == 1024
    assert cards["coder"]["reame"]["size_bytes"] == 400 << 20
    assert two.json("GET", "/v1/models/qwen")[1] == cards["coder"]
    _, tags = two.json("GET", "/api/tags")
    assert [(m["name"], m["details"]["quantization_level"], m["details"]["parameter_size"]) for m in tags["models"]] \
        == [("small", "Q4_1", "135M"), ("coder", "Q4_K_M", "0.5B")]
    _, shown = two.json("POST", "/api/show", {"model": "coder"})
    assert shown["model_info"]["llama.context_length"] == 8192
    assert two.app.models.models[1].state == "unloaded"  # described from its file, not loaded for it


def test_ollamas_keep_alive_loads_unloads_and_shows_in_ps(two):
    loaded = two.json("POST", "/api/generate", {"model": "coder", "keep_alive": "10m"})[1]
    assert loaded["done_reason"] == "load"
    (running,) = two.json("GET", "/api/ps")[1]["models"]
    expires = time.mktime(time.strptime(running["expires_at"][:19], "%Y-%m-%dT%H:%M:%S")) - time.timezone
    assert running["name"] == "coder" and abs(expires - (time.time() + 600)) < 60
    assert running["size"] == 400 << 20 and running["context_length"] == 1024
    unloaded = two.json("POST", "/api/generate", {"model": "coder", "keep_alive": 0})[1]
    assert unloaded["done_reason"] == "unload" and two.json("GET", "/api/ps")[1]["models"] == []
    assert two.json("POST", "/api/generate", {"model": "coder", "keep_alive": "soon"})[0] == 400
    first = two.app.models.default
    assert two.json("POST", "/api/generate", {"model": first.name})[1]["done_reason"] == "load"
    kept = two.json("POST", "/api/generate", {"model": first.name, "keep_alive": 0})[1]
    assert kept["done_reason"] == "load" and first.state == "loaded"  # the model everyone is served by stays


def test_answers_sessions_and_metrics_are_each_models_own(two):
    for model in ("small", "coder"):
        response, _ = two.request("POST", "/v1/chat/completions", {"model": model, "messages": QUESTION,
                                                                   "temperature": 0, "max_tokens": 20})
        assert response.getheader("X-Reame-Cache") == "miss"  # the other model's answer is not this one's
    response, data = two.request("POST", "/v1/chat/completions", {"model": "coder", "messages": QUESTION,
                                                                  "temperature": 0, "max_tokens": 20})
    assert response.getheader("X-Reame-Cache") == "hit" and REPLIES["coder"].encode() in data
    assert metric(two, "reame_answers_hits_total", model="coder") == 1
    assert metric(two, "reame_answers_hits_total", model="small") == 0
    assert metric(two, "reame_generations_total", model="coder") == 1
    created = two.json("POST", "/v1/sessions", {"model": "coder", "id": "mine"})[1]
    assert created["id"] == "mine" and two.json("GET", "/v1/sessions/mine")[0] == 404
    assert two.json("GET", "/v1/sessions/mine?model=coder")[0] == 200


@pytest.mark.parametrize("value, seconds", [("5m", 300), ("1h30m", 5400), ("250ms", 0.25), ("-1", FOREVER),
                                            (-5, FOREVER), (42, 42), ("0", 0), (None, None)])
def test_keep_alive_reads_ollamas_durations(value, seconds):
    assert keep_alive_of({"keep_alive": value}) == seconds


@settings(max_examples=500, deadline=None)
@given(st.one_of(st.text(max_size=200), st.floats(), st.integers(), st.booleans(), st.lists(st.integers())))
def test_keep_alive_refuses_anything_else_quickly(value):
    started = time.perf_counter()
    try:
        seconds = keep_alive_of({"keep_alive": value})
        assert seconds == FOREVER or 0 <= seconds <= 366 * 86400
    except HttpError as error:
        assert error.status == 400 and error.param == "keep_alive"
    assert time.perf_counter() - started < 0.05


def test_hostile_model_names_are_refused_quickly_and_load_nothing(two):
    huge = "m" * (1 << 20)
    for body in ({"model": huge}, {"model": ["coder"]}, {"model": {"$gt": ""}}, {"model": 10**30}):
        started = time.perf_counter()
        status, answer = two.json("POST", "/v1/chat/completions", {**body, "messages": QUESTION, "max_tokens": 2})
        assert status in (400, 404) and time.perf_counter() - started < 1
        assert len(answer["error"]["message"]) < 500  # the name is not echoed whole
        status, answer = two.json("POST", "/api/chat", {**body, "messages": QUESTION, "stream": False})
        assert status in (400, 404) and len(answer["error"]) < 500
    assert two.json("GET", "/v1/models/" + "m" * 60_000)[0] == 404
    assert [model.name for model in two.app.models.loaded()] == ["small"] and two.app.models.loads == 1


def test_a_sessions_model_query_is_bounded(two):
    assert two.json("GET", "/v1/sessions/mine?" + "&".join(f"k{i}=v" for i in range(100)))[0] == 400
    assert two.json("GET", "/v1/sessions/mine?model=" + "x" * 50_000)[0] == 404
    assert two.json("POST", "/v1/sessions", {"model": "coder", "id": "mine"})[0] == 200
    assert two.json("GET", "/v1/sessions/mine?model=coder&model=small")[0] == 200  # the first one counts


@pytest.mark.parametrize("text", ['{"architecture": "llama"}', "[]", "not json", '{"architecture": 1, '
                                  '"quantization": "Q4_0", "parameter_size": "1B", "context_train": 5}',
                                  '{"architecture": "a", "quantization": "b", "parameter_size": "c", '
                                  '"context_train": true}'])
def test_a_remembered_summary_that_is_not_one_is_refused(text):
    from reame.node import parse_summary
    with pytest.raises(ValueError):
        parse_summary(text)
