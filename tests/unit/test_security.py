"""Security: auth on every route but /health, a constant-time key check, no paths in session ids,
caps on what one request may ask for, and no key or prompt text in the logs at the default level."""

import pytest

from reame.engine import Engine
from tests.fakes.backend import FakeBackend
from reame.server import http
from reame.server.app import ROUTER

from .test_server import Live

KEYS = ("first-key", "second-key", "third-key")
PARAMETRIC = ["/v1/models/m", "/v1/sessions/s", "/v1/sessions/s/save", "/v1/sessions/s/load"]


@pytest.fixture
def guarded(tmp_path):
    from reame.server.sessions import Sessions
    with Engine(FakeBackend(n_ctx=1024, n_seq_max=2)) as engine:
        server = Live(engine, api_keys=KEYS)
        server.model.sessions = Sessions(tmp_path / "sessions", b"model")
        yield server
        server.close()


PRIVATE = sorted(route.path for route in ROUTER.routes if not route.public and not route.prefix)


@pytest.mark.parametrize("path", PRIVATE + PARAMETRIC +
                         [path.removeprefix("/v1") for path in PRIVATE if path.startswith("/v1/")])
@pytest.mark.parametrize("method", ["GET", "POST", "DELETE"])
def test_every_route_but_health_needs_a_key(guarded, path, method):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "first-key"}):
        response, _ = guarded.request(method, path, {"prompt": "x"} if method == "POST" else None, headers)
        assert response.status == 401 and response.getheader("WWW-Authenticate") == "Bearer"
    response, _ = guarded.request(method, path, {"prompt": "x"} if method == "POST" else None,
                                  {"Authorization": "Bearer second-key"})
    assert response.status != 401


def test_health_answers_without_a_key(guarded):
    assert guarded.json("GET", "/health")[0] == 200


def test_every_key_is_compared_in_constant_time_whichever_matches(guarded, monkeypatch):
    compared = []

    def compare(a, b):
        compared.append(len(b))
        return a == b
    monkeypatch.setattr(http.hmac, "compare_digest", compare)
    for token in ("first-key", "third-key", "nothing-like-it"):
        compared.clear()
        guarded.request("GET", "/v1/models", headers={"Authorization": f"Bearer {token}"})
        assert len(compared) == len(KEYS), "one comparison per key, never an early return"


@pytest.mark.parametrize("session_id", ["..", "../etc", "a/b", "a%2Fb", "..%2F..%2Fetc%2Fpasswd", "x" * 65, "a.b",
                                        "%00"])
def test_a_session_id_is_never_a_path(guarded, tmp_path, session_id):
    headers = {"Authorization": "Bearer first-key"}
    for action in ("", "/save", "/load"):
        response, _ = guarded.request("POST" if action else "GET", f"/v1/sessions/{session_id}{action}",
                                      headers=headers)
        assert response.status in (400, 404)
    assert [path for path in tmp_path.rglob("*") if path.is_file()] == []


@pytest.mark.parametrize("body, code", [
    ({"prompt": "x", "n": 17}, "invalid_value"),
    ({"prompt": ["x"] * 17}, "invalid_value"),
    ({"prompt": "x", "stop": ["s"] * 17}, "invalid_value"),
    ({"prompt": "x" * 5000}, "context_length_exceeded"),
    ({"prompt": "x", "logprobs": 6}, "invalid_value"),
    ({"prompt": "x", "max_tokens": 0}, "invalid_value"),
])
def test_what_one_request_may_ask_for_is_capped(guarded, body, code):
    status, answer = guarded.json("POST", "/v1/completions", body, {"Authorization": "Bearer first-key"})
    assert status == 400 and answer["error"]["code"] == code


def test_a_huge_max_tokens_is_clamped_to_the_context(guarded):
    status, answer = guarded.json("POST", "/v1/completions", {"prompt": "x", "max_tokens": 10**12, "ignore_eos": True},
                                  {"Authorization": "Bearer first-key"})
    assert status == 200 and answer["usage"]["total_tokens"] == 1024


def test_caps_on_embeddings_and_tools(guarded):
    headers = {"Authorization": "Bearer first-key"}
    assert guarded.json("POST", "/v1/embeddings", {"input": ["a"] * 2049}, headers)[0] == 400
    tools = [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]
    assert guarded.json("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                         "tools": tools}, headers)[0] == 400


def test_the_logs_hold_no_key_and_no_prompt_text_at_the_default_level(guarded, caplog):
    server = Live(guarded.model.engine, api_keys=KEYS, request_log=True)
    secret_prompt = "the launch code is 0451"
    try:
        with caplog.at_level("INFO", logger="reame"):
            for key in ("first-key", "wrong-key"):
                headers = {"Authorization": f"Bearer {key}"}
                server.json("POST", "/v1/completions", {"prompt": secret_prompt, "max_tokens": 2}, headers)
                server.json("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": secret_prompt}],
                                                             "max_tokens": 2, "temperature": 9}, headers)
                server.json("POST", "/v1/embeddings", {"input": secret_prompt}, headers)
    finally:
        server.close()
    assert caplog.records, "request lines are logged at info level"
    assert "first-key" not in caplog.text and "wrong-key" not in caplog.text and "0451" not in caplog.text
