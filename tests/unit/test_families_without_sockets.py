"""Each API family's route run on a recording client, no server and no socket: a streamed answer's frames
carry, in the family's own shape, the same text as the whole answer, and end with the family's own end."""

import json

import pytest

from reame.engine import Engine
from reame.server.app import ROUTER, App
from reame.server.settings import ServerSettings
from reame.server.models import ModelPool, ServedModel
from tests.fakes.backend import FakeBackend
from tests.fakes.client import RecordingClient
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
    """The route for `path` on a recording client, as App.dispatch runs it (the models let go after)."""
    client = RecordingClient(path, body)
    route, routed = ROUTER.find(path)
    assert route is not None
    try:
        route.handler(app, client, routed)
    finally:
        app.release_models(client)
    return client


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
