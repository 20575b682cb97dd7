"""Each API family's route run on a recording client, no server and no socket: a streamed answer's frames
carry, in the family's own shape, the same text as the whole answer, and end with the family's own end."""

import json

import pytest

from reame.engine import Engine
from reame.server.app import App
from reame.server.settings import ServerSettings
from reame.server.models import ModelPool, ServedModel
from tests.fakes.backend import FakeBackend
from tests.fakes.client import RecordingClient, run_route
from tests.unit.test_server import FAKE_FACTS

ASK = [{"role": "user", "content": "hello there"}]


@pytest.fixture
def app():
    with Engine(FakeBackend(n_ctx=1024, n_seq_max=2)) as engine:
        service = App(ServerSettings(port=0, request_log=False),
                      ModelPool([ServedModel("reame", facts=FAKE_FACTS, engine=engine, state="loaded")]))
        service.ready = True
        yield service


def run(app: App, path: str, body: dict) -> RecordingClient:
    return run_route(app, path, body)


def whole_and_streamed(app, path, body):
    whole = run(app, path, dict(body, stream=False))
    streamed = run(app, path, dict(body, stream=True))
    assert whole.status == streamed.status == 200
    return whole.frames[0][1], streamed.frames


def test_openai_chat(app):
    whole, frames = whole_and_streamed(app, "/v1/chat/completions", {"messages": ASK, "max_tokens": 12,
                                                                     "temperature": 0})
    # A text chunk comes serialised already (the stream's hot path), the others as objects.
    chunks = [json.loads(payload) if isinstance(payload, str) else payload for kind, payload in frames
              if kind == "data" and payload != "[DONE]"]
    text = "".join(chunk["choices"][0]["delta"].get("content") or "" for chunk in chunks)
    assert text == whole["choices"][0]["message"]["content"] and frames[-1] == ("data", "[DONE]")


def test_ollama_chat(app):
    whole, frames = whole_and_streamed(app, "/api/chat", {"model": "reame", "messages": ASK,
                                                         "options": {"temperature": 0, "num_predict": 12}})
    lines = [payload for kind, payload in frames if kind == "line"]
    assert "".join(line["message"]["content"] for line in lines) == whole["message"]["content"]
    assert lines[-1]["done"] and not any(line["done"] for line in lines[:-1])


def test_anthropic_messages(app):
    whole, frames = whole_and_streamed(app, "/v1/messages", {"model": "reame", "messages": ASK, "max_tokens": 12,
                                                            "temperature": 0})
    text = "".join(payload["delta"]["text"] for kind, payload in frames if kind == "content_block_delta")
    assert text == whole["content"][0]["text"]
    assert frames[0][0] == "message_start" and frames[-1][0] == "message_stop"


def test_responses(app):
    whole, frames = whole_and_streamed(app, "/v1/responses", {"model": "reame", "input": "hello there",
                                                             "max_output_tokens": 16, "temperature": 0})
    names = [kind for kind, _ in frames]
    text = "".join(payload["delta"] for kind, payload in frames if kind == "response.output_text.delta")
    assert text == whole["output"][0]["content"][0]["text"]
    assert names[0] == "response.created" and names[-1] in ("response.completed", "response.incomplete")


@pytest.mark.parametrize("path,asked", [
    ("/api/chat", {"messages": ASK}),
    ("/api/generate", {"prompt": "hello there"}),
])
def test_ollama_logprobs_ride_with_the_text_they_scored(app, path, asked):
    """Ollama's logprobs (an option of the exchange, as OpenAI's are): one entry per generated token, its
    alternatives the most likely first (greedy without a repeat penalty picks the first), streamed with the text
    they scored."""
    body = {"model": "reame", **asked, "logprobs": True, "top_logprobs": 2,
            "options": {"temperature": 0, "num_predict": 8, "repeat_penalty": 1.0}}
    whole, frames = whole_and_streamed(app, path, body)
    entries = whole["logprobs"]
    text = whole["message"]["content"] if path == "/api/chat" else whole["response"]
    assert len(entries) == whole["eval_count"] and "".join(entry["token"] for entry in entries) == text
    for entry in entries:
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"} and len(entry["top_logprobs"]) == 2
        assert entry["top_logprobs"][0]["token"] == entry["token"]
        assert entry["top_logprobs"][0]["logprob"] == entry["logprob"] >= entry["top_logprobs"][1]["logprob"]
        assert bytes(entry["bytes"]).decode() == entry["token"]
    lines = [payload for kind, payload in frames if kind == "line"]
    assert [entry for line in lines for entry in line.get("logprobs", [])] == entries


def test_ollama_answers_carry_no_logprobs_unless_asked(app):
    whole = run(app, "/api/chat", {"model": "reame", "messages": ASK, "stream": False, "top_logprobs": 3,
                                   "options": {"temperature": 0, "num_predict": 4}}).frames[0][1]
    assert "logprobs" not in whole and whole["message"]["content"]


@pytest.mark.parametrize("top", [21, -1, "3", True])
def test_ollama_top_logprobs_out_of_range_is_a_400(app, top):
    from reame.server.client import HttpError
    with pytest.raises(HttpError) as raised:
        run(app, "/api/chat", {"model": "reame", "messages": ASK, "logprobs": True, "top_logprobs": top})
    assert raised.value.status == 400 and raised.value.param == "top_logprobs"
