"""Ollama's API on a FakeBackend server: the same answers as the OpenAI routes in Ollama's shapes (JSON lines,
the final record, tool calls with object arguments, `{"error": …}`), its option names and defaults, and its
embeddings. (The real `ollama` client: tests/compat/test_ollama_client.py.)"""

import json

import pytest

from reame.answers import AnswerCache
from reame.cache.answers import RamAnswers
from tests.unit.test_server import Live

CHAT = {"model": "fake", "messages": [{"role": "user", "content": "hello there"}], "stream": False,
        "options": {"temperature": 0, "num_predict": 12}}
OLLAMA_SAMPLING = {"top_k": 40, "top_p": 0.9, "repeat_penalty": 1.1}  # Ollama's defaults, as OpenAI fields


def lines(live, path: str, body: dict) -> list[dict]:
    response, data = live.request("POST", path, body)
    assert response.status == 200 and response.getheader("Content-Type") == "application/x-ndjson"
    return [json.loads(line) for line in data.decode().splitlines()]


def test_chat_answers_what_the_openai_route_answers_in_ollamas_shape(live):
    status, body = live.json("POST", "/api/chat", CHAT)
    _, openai = live.json("POST", "/v1/chat/completions", {"messages": CHAT["messages"], "temperature": 0,
                                                           "max_tokens": 12, **OLLAMA_SAMPLING})
    assert status == 200 and body["message"] == {"role": "assistant",
                                                 "content": openai["choices"][0]["message"]["content"]}
    assert body["done"] is True and body["done_reason"] == openai["choices"][0]["finish_reason"]
    assert body["model"] == "fake" and body["eval_count"] == openai["usage"]["completion_tokens"]
    assert body["prompt_eval_count"] == openai["usage"]["prompt_tokens"]
    assert all(isinstance(body[name], int) for name in ("total_duration", "prompt_eval_duration", "eval_duration"))
    assert body["created_at"].endswith("Z")


def test_a_streamed_chat_is_json_lines_ending_in_the_final_record(live):
    parts = lines(live, "/api/chat", dict(CHAT, stream=True))
    _, whole = live.json("POST", "/api/chat", CHAT)
    assert all(part["done"] is False for part in parts[:-1]) and parts[-1]["done"] is True
    assert "".join(part["message"]["content"] for part in parts) == whole["message"]["content"]
    assert parts[-1]["eval_count"] == whole["eval_count"] and parts[-1]["done_reason"] == whole["done_reason"]


def test_generate_templates_the_prompt_unless_raw_and_streams_by_default(live):
    parts = lines(live, "/api/generate", {"model": "fake", "prompt": "hello there",
                                          "options": {"temperature": 0, "num_predict": 8}})
    _, chat = live.json("POST", "/api/chat", dict(CHAT, options={"temperature": 0, "num_predict": 8}))
    assert "".join(part["response"] for part in parts) == chat["message"]["content"]
    _, raw = live.json("POST", "/api/generate", {"model": "fake", "prompt": "hello there", "raw": True,
                                                 "stream": False, "options": {"temperature": 0, "num_predict": 8}})
    _, completion = live.json("POST", "/v1/completions", {"prompt": "hello there", "temperature": 0,
                                                          "max_tokens": 8, **OLLAMA_SAMPLING})
    assert raw["response"] == completion["choices"][0]["text"]


def test_an_empty_prompt_loads_the_model_as_ollama_answers_it(live):
    status, body = live.json("POST", "/api/generate", {"model": "fake"})
    assert status == 200 and body["done"] is True and body["done_reason"] == "load" and body["response"] == ""


def test_options_are_ollamas_names_over_its_defaults(live, monkeypatch):
    from reame.server.apis import ollama
    params, seed = ollama.options_of({"options": {"num_predict": 5, "top_k": 7, "seed": 3, "num_ctx": 4096,
                                                  "stop": ["x"], "mirostat": 1, "unknown": True}})
    assert (params.max_tokens, params.top_k, seed, tuple(params.stop)) == (5, 7, 3, ("x",))
    assert (params.temperature, params.top_p, params.repeat_penalty) == (0.8, 0.9, 1.1)
    params, seed = ollama.options_of({"options": {"num_predict": -1, "seed": -1}})
    assert params.max_tokens is None and seed is None


@pytest.mark.parametrize("body,field", [
    (dict(CHAT, options={"temperature": "hot"}), "temperature"), (dict(CHAT, options=[1]), "options"),
    (dict(CHAT, messages=[]), "messages"), (dict(CHAT, format="yaml"), "format"),
    (dict(CHAT, format={"type": "object", "properties": {"a": {"type": "wrong"}}}), "format"),
    (dict(CHAT, messages=[{"role": "user", "content": "hi", "images": ["aGk="]}]), "images"),
    ({"messages": CHAT["messages"]}, "model"),
])
def test_a_bad_request_is_a_400_in_ollamas_error_shape(live, body, field):
    status, answer = live.json("POST", "/api/chat", body)
    assert status == 400 and set(answer) == {"error"} and isinstance(answer["error"], str)


def test_format_json_and_a_schema_constrain_the_answer(structured_server):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    for format_ in ("json", schema):
        _, body = structured_server.json("POST", "/api/chat", dict(CHAT, format=format_, options={
            "temperature": 1.0, "seed": 4, "num_predict": 300}))
        parsed = json.loads(body["message"]["content"])
        assert isinstance(parsed, dict) and (format_ == "json" or isinstance(parsed["n"], int))


def test_tags_show_ps_and_version_describe_the_served_model(live):
    _, tags = live.json("GET", "/api/tags")
    (model,) = tags["models"]
    assert model["name"] == model["model"] == live.model.name and model["details"]["format"] == "gguf"
    assert model["details"]["family"] == "fake" and model["details"]["quantization_level"] == "F32"
    assert model["details"]["parameter_size"] == "1M" and len(model["digest"]) == 64
    _, shown = live.json("POST", "/api/show", {"model": "anything"})
    assert shown["model_info"]["general.architecture"] == "fake" and "completion" in shown["capabilities"]
    assert "insert" in shown["capabilities"]  # the model has fill-in-the-middle tokens
    live.model.engine.backend.has_fim = False
    assert "insert" not in live.json("POST", "/api/show", {"model": "anything"})[1]["capabilities"]
    _, running = live.json("GET", "/api/ps")
    assert running["models"][0]["context_length"] == 1024
    assert live.json("GET", "/api/version")[1]["version"]


def test_embed_and_the_older_embeddings_route(live):
    _, body = live.json("POST", "/api/embed", {"model": "fake", "input": ["one", "two"]})
    assert len(body["embeddings"]) == 2 and body["prompt_eval_count"] > 0
    _, one = live.json("POST", "/api/embed", {"model": "fake", "input": "one"})
    _, older = live.json("POST", "/api/embeddings", {"model": "fake", "prompt": "one"})
    assert older["embedding"] == one["embeddings"][0] == body["embeddings"][0]
    assert live.json("POST", "/api/embed", {"model": "fake", "input": [1, 2]})[0] == 400


def test_a_greedy_chat_is_kept_and_answered_again_from_the_exact_cache(live):
    live.model.answers = AnswerCache([RamAnswers(1 << 20)], b"fake")
    first, _ = live.request("POST", "/api/chat", CHAT)
    again, data = live.request("POST", "/api/chat", CHAT)
    assert first.getheader("X-Reame-Cache") == "miss" and again.getheader("X-Reame-Cache") == "hit"
    assert json.loads(data)["prompt_eval_count"] == 0  # nothing was evaluated for it


def test_pull_is_off_unless_the_server_allows_it(live):
    status, body = live.json("POST", "/api/pull", {"model": live.model.name, "stream": False})
    assert status == 403 and "server.allow_pull" in body["error"]


def test_pull_of_the_served_model_succeeds_and_an_unknown_one_is_404(engine):
    live = Live(engine, allow_pull=True)
    try:
        parts = lines(live, "/api/pull", {"model": live.model.name})
        assert parts[0] == {"status": "pulling manifest"} and parts[-1] == {"status": "success"}
        status, body = live.json("POST", "/api/pull", {"model": "no-such-model", "stream": False})
        assert status == 404 and "not in Reame's catalog" in body["error"]
    finally:
        live.close()
