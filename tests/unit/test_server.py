"""The HTTP server on FakeBackend: routing, validation, OpenAI shapes, SSE, auth, limits, disconnects."""

import http.client
import json
import socket
import sys
import threading
import time

import pytest

from reame.engine import Engine, GenerationRequest, SamplingParams
from tests.fakes.backend import N_VOCAB, FakeBackend, gated_rule
from reame.server.settings import ServerSettings
from reame.server.listener import ReameHTTPServer
from reame.server.app import App
from reame.server.models import ModelFacts, ModelPool, ServedModel
from tests.waiting import wait_until

FAKE_FACTS = ModelFacts("fake.gguf", 1 << 20, 0.0, "fake", "F32", "1M", 1024, 1024)  # what a file would say


class Live:
    """A server of one model, "reame", over `engine` (None: still loading), on a free port."""

    def __init__(self, engine: Engine | None, models: ModelPool | None = None, **settings) -> None:
        """`models`: the server's models instead (its first one is loaded here)."""
        settings.setdefault("request_log", False)
        self.settings = ServerSettings(port=0, **settings)
        if models is None:
            models = ModelPool([ServedModel("reame", facts=FAKE_FACTS, engine=engine,
                                            state="loaded" if engine is not None else "unloaded")])
        else:
            models.preload(models.default)
        self.model = models.default
        self.app = App(self.settings, models)
        self.app.ready = self.model.engine is not None
        self.server = ReameHTTPServer(self.settings, self.app)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def request(self, method: str, path: str, body=None, headers=None, raw: bytes | None = None):
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        payload = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        if body is not None:  # as every client sends JSON
            headers = {"Content-Type": "application/json", **(headers or {})}
        connection.request(method, path, body=payload, headers=headers or {})
        response = connection.getresponse()
        data = response.read()
        connection.close()
        return response, data

    def json(self, method: str, path: str, body=None, headers=None):
        response, data = self.request(method, path, body, headers)
        return response.status, json.loads(data) if data else None

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def test_health_models_and_unknown_routes(live):
    assert live.json("GET", "/health") == (200, {"status": "ok", "auth": False})
    status, body = live.json("GET", "/v1/models")
    assert status == 200 and body["data"][0]["id"] == "reame" and body["object"] == "list"
    assert live.json("GET", "/v1/models/reame")[0] == 200
    assert live.json("GET", "/v1/models/other")[1]["error"]["code"] == "model_not_found"
    status, body = live.json("GET", "/nope")
    assert status == 404 and set(body["error"]) == {"message", "type", "param", "code"}
    status, body = live.json("GET", "/v1/completions")
    assert status == 405 and body["error"]["code"] == "method_not_allowed"


@pytest.mark.parametrize("path", ["/models", "/chat/completions", "/v1/models"])
def test_openai_routes_answer_without_their_v1_too(live, path):
    """(/completions is llama-server's own /completion, as in llama-server.)"""
    body = {"prompt": "hi", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    status, answer = live.json("GET" if path.endswith("models") else "POST", path,
                               None if path.endswith("models") else body)
    assert status == 200 and answer["object"] in ("list", "text_completion", "chat.completion")


def test_models_report_when_the_server_started(live):
    before = int(time.time())
    card = live.json("GET", "/v1/models")[1]["data"][0]
    assert abs(card["created"] - before) <= 5
    assert live.json("GET", f"/models/{card['id']}")[1] == card


def test_the_web_page_is_served_without_a_key_and_its_stats_need_one(engine):
    server = Live(engine, api_keys=("secret",))
    try:
        response, page = server.request("GET", "/")
        assert response.status == 200 and response.getheader("Content-Type") == "text/html; charset=utf-8"
        assert b"<title>Reame</title>" in page and server.request("GET", "/index.html")[1] == page
        assert "script-src 'unsafe-inline'" in response.getheader("Content-Security-Policy")
        assert server.json("GET", "/health") == (200, {"status": "ok", "auth": True})
        assert server.json("GET", "/stats")[0] == 401
        assert server.json("POST", "/", {})[0] == 405
        assert server.json("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2},
                           {"Authorization": "Bearer secret"})[0] == 200
        status, stats = server.json("GET", "/stats", headers={"Authorization": "Bearer secret"})
        assert status == 200 and stats["model"] == "reame" and stats["time"] > 0
        values = {(s["name"], tuple(sorted(s["labels"].items()))): s["value"] for s in stats["samples"]}
        assert values[("reame_generations_total", (("model", "reame"),))] == 1
        assert values[("reame_generated_tokens_total", (("model", "reame"),))] == 2
        assert values[("reame_busy_slots", (("model", "reame"),))] == 0
    finally:
        server.close()


def test_health_is_503_while_the_model_loads():
    server = Live(None)
    try:
        assert server.json("GET", "/health") == (503, {"status": "loading", "auth": False})
        assert server.json("POST", "/v1/completions", {"prompt": "x"})[0] == 503
    finally:
        server.close()


def test_completion_shape_and_usage(live, engine):
    status, body = live.json("POST", "/v1/completions", {"prompt": "hello", "max_tokens": 5, "temperature": 0,
                                                         "ignore_eos": True})
    assert status == 200
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-") and body["created"] > 0
    choice = body["choices"][0]
    assert set(choice) == {"text", "index", "logprobs", "finish_reason"} and choice["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 6, "completion_tokens": 5, "total_tokens": 11,
                             "prompt_tokens_details": {"cached_tokens": 0},
                             "completion_tokens_details": {"accepted_prediction_tokens": 0,
                                                           "rejected_prediction_tokens": 0}}
    again = live.json("POST", "/v1/completions", {"prompt": "hello", "max_tokens": 5, "temperature": 0,
                                                  "ignore_eos": True})[1]
    assert again["choices"][0]["text"] == choice["text"]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 5  # an idle slot kept the KV
    alone = engine.generate(GenerationRequest("hello", SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)))
    assert choice["text"] == alone.text


def test_chat_shape_with_text_parts(live):
    status, body = live.json("POST", "/v1/chat/completions", {
        "model": "anything", "max_completion_tokens": 4, "temperature": 0,
        "messages": [{"role": "system", "content": "be brief"},
                     {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]}]})
    assert status == 200 and body["object"] == "chat.completion"
    message = body["choices"][0]["message"]
    assert message["role"] == "assistant" and isinstance(message["content"], str)
    assert body["usage"]["completion_tokens"] <= 4


def test_n_choices_and_prompt_lists(live):
    status, body = live.json("POST", "/v1/completions", {"prompt": ["a", "b"], "n": 3, "max_tokens": 3,
                                                         "temperature": 0.9, "seed": 1})
    assert status == 200 and [c["index"] for c in body["choices"]] == list(range(6))
    status, body = live.json("POST", "/v1/completions", {"prompt": [[256, 97, 98]], "max_tokens": 2})
    assert status == 200 and len(body["choices"]) == 1


def test_best_of_answers_with_the_elected_attempt_and_the_vote(live):
    request = {"prompt": "vote", "max_tokens": 6, "temperature": 0, "seed": 4, "best_of": 3}
    status, body = live.json("POST", "/v1/completions", request)
    assert status == 200 and len(body["choices"]) == 1 and body["choices"][0]["index"] == 0
    [vote] = body["reame"]["conclave"]
    assert vote["n"] == 3 and len(vote["candidates"]) == 3 and 1 <= vote["consensus"] <= 3
    assert body["usage"]["completion_tokens"] == sum(c["completion_tokens"] for c in vote["candidates"])
    assert body["usage"]["prompt_tokens"] == 5  # counted once
    # The anchor keeps the request's settings: greedy, so a plain request gives its text.
    plain = live.json("POST", "/v1/completions", {"prompt": "vote", "max_tokens": 6, "temperature": 0})[1]
    anchor_won = vote["winner"] == 0
    assert not anchor_won or body["choices"][0]["text"] == plain["choices"][0]["text"]
    status, chat = live.json("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                               "max_tokens": 4, "reame": {"best_of": 2}})
    assert status == 200 and len(chat["choices"]) == 1 and chat["reame"]["conclave"][0]["n"] == 2
    status, same = live.json("POST", "/v1/completions", {"prompt": "x", "max_tokens": 2, "n": 2, "best_of": 2})
    assert status == 200 and len(same["choices"]) == 2 and "reame" not in same  # best_of = n: n choices


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": "x", "best_of": 3, "n": 2}, "best_of"),
    ("/v1/completions", {"prompt": "x", "best_of": 17}, "best_of"),
    ("/v1/completions", {"prompt": "x", "best_of": "3"}, "best_of"),
    ("/v1/completions", {"prompt": "x", "best_of": 3, "stream": True}, "best_of"),
    ("/v1/chat/completions", {"reame": {"best_of": 0}}, "best_of"),
    ("/v1/chat/completions", {"reame": [3]}, "reame"),
    ("/v1/chat/completions", {"reame": {"bestof": 3}}, "reame"),
    ("/v1/chat/completions", {"reame": {"best_of": 2}, "n": 2}, "best_of"),
])
def test_bad_best_of_is_400_naming_the_field(live, path, body, param):
    body = dict({"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {}, **body)
    status, answer = live.json("POST", path, body)
    assert status == 400 and answer["error"]["param"] == param, answer


def test_seeded_requests_repeat(live):
    request = {"prompt": "seeded", "max_tokens": 12, "temperature": 1.0, "seed": 7, "ignore_eos": True}
    first = live.json("POST", "/v1/completions", request)[1]["choices"][0]["text"]
    assert live.json("POST", "/v1/completions", request)[1]["choices"][0]["text"] == first


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "max_tokens": "10"}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "temperature": None, "top_p": "high"}, "top_p"),
    ({"prompt": "x", "temperature": 3}, "temperature"),
    ({"prompt": "x", "stream": "yes"}, "stream"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "n": 1.5}, "n"),
    ({"prompt": "x", "stop": 5}, "stop"),
    ({"prompt": "x", "stop": ["a", 1]}, "stop"),
    ({"prompt": "x", "seed": "1"}, "seed"),
    ({"prompt": "x", "logit_bias": {"abc": 1}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"5": 500}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {str(N_VOCAB + 5): 1}}, "logit_bias"),
    ({"prompt": "x", "stream_options": []}, "stream_options"),
    ({"prompt": "x", "model": 5}, "model"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": [1, "a"]}, "prompt"),
    ({"prompt": [1, N_VOCAB]}, "prompt"),
    ({}, "prompt"),
    ({"prompt": "x", "suffix": 5}, "suffix"),
    ({"prompt": "x", "logprobs": 6}, "logprobs"),
    ({"prompt": "x", "logprobs": True}, "logprobs"),
    ({"prompt": "x", "logprobs": 1, "echo": True}, "echo"),
])
def test_bad_completion_fields_are_400_naming_the_field(live, body, param):
    status, answer = live.json("POST", "/v1/completions", body)
    assert status == 400, answer
    assert answer["error"]["param"] == param and answer["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("body, param", [
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": ["hi"]}, "messages[0]"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "xml"}}, "response_format"),
    ({"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_schema"}},
     "response_format.json_schema"),
    ({"messages": [{"role": "user", "content": "hi"}], "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "a+"}}}},
     "response_format.json_schema.schema"),
    ({"messages": [{"role": "user", "content": "hi"}], "grammar": "root ::= \"a"}, "grammar"),
    ({"messages": [{"role": "user", "content": "hi"}], "grammar": "root ::= missing"}, "grammar"),
    ({"messages": [{"role": "user", "content": "hi"}], "grammar": 5}, "grammar"),
    ({"messages": [{"role": "user", "content": "hi"}], "json_schema": {"type": "object"},
      "grammar": "root ::= \"a\""}, "json_schema"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, "tools[0]"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": {"a": 1}}, "tools"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": {"name": "a b"}}]},
     "tools[0].function.name"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
    ({"messages": [{"role": "user", "content": "hi"}], "tool_choice": "required"}, "tool_choice"),
    ({"messages": [{"role": "user", "content": "hi"}], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"messages": [{"role": "user", "content": "hi"}], "functions": [{"name": "f"}]}, "functions"),
    ({"messages": [{"role": "assistant", "content": "", "tool_calls": [{"function": "f"}]}]},
     "messages[0].tool_calls[0]"),
    ({"messages": [{"role": "tool", "content": "1", "tool_call_id": 5}]}, "messages[0].tool_call_id"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": -1}, "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "logprobs": 1}, "logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
])
def test_bad_chat_fields_are_400_naming_the_field(live, body, param):
    status, answer = live.json("POST", "/v1/chat/completions", body)
    assert status == 400 and answer["error"]["param"] == param


@pytest.mark.parametrize("raw", [b"{bad json", b"[1, 2]", b"\xff\xfe", b"null", b"1" * 10 + b"[" * 100000])
def test_malformed_bodies_are_400_never_500(live, raw):
    response, data = live.request("POST", "/v1/completions", raw=raw, headers={"Content-Type": "application/json"})
    assert response.status == 400 and json.loads(data)["error"]["type"] == "invalid_request_error"


def read_sse(live, path, body, done=True):
    """The JSON events of a stream; `done`: it must end with [DONE] (not left in the list)."""
    connection = http.client.HTTPConnection("127.0.0.1", live.port, timeout=10)
    connection.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
    response = connection.getresponse()
    assert response.status == 200 and response.getheader("Content-Type") == "text/event-stream"
    assert response.getheader("X-Accel-Buffering") == "no"  # a proxy in front must not hold events back
    frames = [line[6:] for line in response.read().decode().split("\n\n") if line.startswith("data: ")]
    connection.close()
    if done:
        assert frames[-1] == "[DONE]"
        frames = frames[:-1]
    return [json.loads(frame) for frame in frames]


def test_chat_stream_has_role_first_finish_last_and_usage(live):
    chunks = read_sse(live, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "temperature": 0, "stream": True,
        "stream_options": {"include_usage": True}})
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": None}
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    finals = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(finals) == 1
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] <= 6
    streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    status, whole = live.json("POST", "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "temperature": 0})
    assert streamed == whole["choices"][0]["message"]["content"]


def test_stop_strings_end_the_answer_without_leaking(live):
    free = live.json("POST", "/v1/completions", {"prompt": "abc", "max_tokens": 30, "temperature": 0,
                                                 "ignore_eos": True})[1]["choices"][0]["text"]
    stop = free[5:7]
    body = live.json("POST", "/v1/completions", {"prompt": "abc", "max_tokens": 30, "temperature": 0,
                                                 "ignore_eos": True, "stop": [stop]})[1]
    assert body["choices"][0]["text"] == free[:free.index(stop)]
    assert body["choices"][0]["finish_reason"] == "stop"


def test_tokenize_round_trip_and_metrics(live):
    status, body = live.json("POST", "/tokenize", {"content": "héllo"})
    assert status == 200
    assert live.json("POST", "/detokenize", {"tokens": body["tokens"]}) == (200, {"content": "héllo"})
    assert live.json("POST", "/detokenize", {"tokens": [N_VOCAB]})[0] == 400
    live.json("POST", "/v1/completions", {"prompt": "x", "max_tokens": 2})
    response, data = live.request("GET", "/metrics")
    text = data.decode()
    assert response.status == 200 and "text/plain" in response.getheader("Content-Type")
    assert 'reame_requests_total{status="200"}' in text and 'reame_queue_depth{model="reame"} 0' in text


def test_bearer_auth_with_several_keys(engine):
    server = Live(engine, api_keys=("k1", "k2"))
    try:
        assert server.json("GET", "/health")[0] == 200  # exempt
        status, body = server.json("GET", "/v1/models")
        assert status == 401 and body["error"]["code"] == "invalid_api_key"
        assert server.json("GET", "/v1/models", headers={"Authorization": "Bearer nope"})[0] == 401
        assert server.json("GET", "/metrics", headers={"Authorization": "k2"})[0] == 401
        assert server.json("GET", "/v1/models", headers={"Authorization": "Bearer k2"})[0] == 200
    finally:
        server.close()


def test_cors_is_off_by_default_and_configurable(live, engine):
    response, _ = live.request("OPTIONS", "/v1/models")
    assert response.getheader("Access-Control-Allow-Origin") is None
    server = Live(engine, cors_origin="*")
    try:
        response, _ = server.request("OPTIONS", "/v1/chat/completions")
        assert response.status == 204 and response.getheader("Access-Control-Allow-Origin") == "*"
        response, _ = server.request("GET", "/health")
        assert response.getheader("Access-Control-Allow-Origin") == "*"
    finally:
        server.close()


def test_keep_alive_serves_several_requests_on_one_connection(live):
    connection = http.client.HTTPConnection("127.0.0.1", live.port, timeout=10)
    for _ in range(3):
        connection.request("GET", "/health")
        response = connection.getresponse()
        assert response.status == 200 and response.read() == b'{"status":"ok","auth":false}'
    connection.close()


def raw_exchange(port: int, data: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(data)
        chunks = []
        while True:
            try:
                chunk = sock.recv(65536)
            except socket.timeout:
                break
            if not chunk:
                break
            chunks.append(chunk)
        return b"".join(chunks)


def test_oversized_body_is_413_without_reading_it(engine):
    server = Live(engine, max_body_bytes=1000)
    try:
        reply = raw_exchange(server.port, b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n"
                                          b"Content-Length: 5000\r\n\r\n")
        assert reply.startswith(b"HTTP/1.1 413")
    finally:
        server.close()


class RawConnection:
    """One keep-alive connection, requests written byte for byte, responses read one at a time."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)

    def exchange(self, data: bytes) -> tuple[int, bytes, http.client.HTTPResponse]:
        self.sock.sendall(data)
        response = http.client.HTTPResponse(self.sock)
        response.begin()
        return response.status, response.read(), response

    def closed_by_server(self) -> bool:
        return self.sock.recv(1) == b""

    def close(self) -> None:
        self.sock.close()


def post_bytes(path: str, body: bytes, method: str = "POST", headers: str = "") -> bytes:
    return (f"{method} {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n{headers}"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


MODELS = b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\n\r\n"
BODY = json.dumps({"model": "m", "input": "hello", "prompt": "hi", "max_tokens": 2}).encode()


@pytest.mark.parametrize("first, status", [
    (post_bytes("/v1/unknown", BODY), 404),
    (post_bytes("/v1/assistants", BODY), 404),
    (post_bytes("/v1/chat/completions", BODY, method="PUT"), 405),
    (post_bytes("/v1/completions", b'{"prompt": "hi", "max_tokens": "two"}'), 400),
    (post_bytes("/v1/completions", b"{not json"), 400),
    (post_bytes("/v1/completions", BODY, headers="Authorization: Bearer wrong\r\n"), 401),
    (post_bytes("/v1/models", BODY, method="GET"), 200),
])
def test_an_answer_that_did_not_need_the_body_leaves_the_connection_usable(engine, first, status):
    server = Live(engine, api_keys=("right",))
    connection = RawConnection(server.port)
    try:
        auth = b"Authorization: Bearer right\r\n"
        host = b"Host: localhost\r\n"
        with_key = first if b"Authorization" in first else first.replace(host, host + auth, 1)
        assert connection.exchange(with_key)[0] == status
        code, body, _ = connection.exchange(MODELS.replace(b"\r\n\r\n", b"\r\n" + auth + b"\r\n"))
        assert code == 200 and json.loads(body)["object"] == "list"
        completion = post_bytes("/v1/completions", BODY, headers=auth.decode())
        code, body, _ = connection.exchange(completion)
        assert code == 200 and json.loads(body)["object"] == "text_completion"
    finally:
        connection.close()
        server.close()


def chunked(body: bytes, sizes: tuple[int, ...] = (5, 1, 1000), extra: bytes = b"") -> bytes:
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n")
    parts, rest = [], body
    for size in sizes:
        piece, rest = rest[:size], rest[size:]
        if piece:
            parts.append(b"%x;ext=1\r\n%s\r\n" % (len(piece), piece))
    if rest:
        parts.append(b"%x\r\n%s\r\n" % (len(rest), rest))
    return head + b"".join(parts) + b"0\r\n" + extra + b"\r\n"


def test_chunked_request_bodies_are_read_like_content_length_ones(live):
    connection = RawConnection(live.port)
    try:
        for extra in (b"", b"X-Trailer: 1\r\n"):
            status, body, _ = connection.exchange(chunked(BODY, extra=extra))
            assert status == 200 and json.loads(body)["object"] == "text_completion"
    finally:
        connection.close()


@pytest.mark.parametrize("request_bytes, status", [
    (chunked(BODY).replace(b"5;ext=1", b"zz"), 400),
    (chunked(BODY).replace(b"5;ext=1", b"-5"), 400),
    (chunked(BODY).replace(b"5;ext=1", b"9"), 400),
    (chunked(BODY).replace(b"5;ext=1", b"5_0"), 400),
    (chunked(BODY).replace(b"5;ext=1", b"+5"), 400),
    (chunked(BODY).replace(b"5;ext=1", b"0x5"), 400),
    (chunked(BODY).replace(b"5;ext=1", b" 5"), 400),
    (b"POST /v1/completions HTTP/1.1\r\nTransfer-Encoding: gzip\r\n\r\n", 501),
    (b"POST /v1/completions HTTP/1.1\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: gzip\r\n\r\n", 501),
    (b"POST /v1/completions HTTP/1.1\r\nTransfer-Encoding: chunked\r\nContent-Length: 3\r\n\r\n", 400),
])
def test_malformed_chunked_bodies_are_refused_and_the_connection_closed(live, request_bytes, status):
    connection = RawConnection(live.port)
    try:
        code, _, response = connection.exchange(request_bytes)
        assert code == status and response.getheader("Connection") == "close"
        assert connection.closed_by_server()
    finally:
        connection.close()


FRAMED = b'{"prompt": "hi", "max_tokens": 1}'  # 33 bytes


@pytest.mark.parametrize("header", [
    b"Content-Length: +33", b"Content-Length: 3_3", b"Content-Length: \x0b33", b"Content-Length: 33\r\n 0",
    b"Content-Length: 33\r\nContent-Length: 34", b"Content-Length: 33, 34", b"Content-Length : 33",
    b"Content-Length: 0x21", b"Content-Length: \xd9\xa3\xd9\xa3", b"Content-Length: 33\r\nX-Folded: a\r\n b",
])
def test_a_request_whose_framing_another_parser_could_read_otherwise_is_400_and_closed(live, header):
    """RFC 9112 framing, to the letter: behind a proxy that reads these differently, any leniency is smuggling."""
    connection = RawConnection(live.port)
    try:
        code, body, response = connection.exchange(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n" + header +
                                                   b"\r\n\r\n" + FRAMED)
        assert code == 400 and response.getheader("Connection") == "close", body
        assert json.loads(body)["error"]["code"] == "bad_request"
        assert connection.closed_by_server()
    finally:
        connection.close()


@pytest.mark.parametrize("header", [b"Content-Length: 33", b"Content-Length:33", b"Content-Length:  33 ",
                                    b"Content-Length: 33\r\nContent-Length: 33", b"Content-Length: 33, 33"])
def test_well_framed_requests_are_read(live, header):
    connection = RawConnection(live.port)
    try:
        code, body, _ = connection.exchange(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n"
                                            b"Content-Type: application/json\r\n" + header + b"\r\n\r\n" + FRAMED)
        assert code == 200, body
    finally:
        connection.close()


@pytest.mark.parametrize("content_type", [b"multipart/form-data; boundary=----x", b"multipart/form-data",
                                          b"multipart/mixed; boundary=b"])
def test_a_multipart_requests_headers_are_well_formed(live, content_type):
    """The stdlib's header parser flags a multipart content type without its body (`curl -F`, the openai SDK's
    files.create): the request is answered for what it is (/v1/completions takes JSON only: 415), not refused
    as a malformed header and closed."""
    body = b"------x\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n------x--\r\n"
    connection = RawConnection(live.port)
    try:
        head = b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: " + content_type + \
            b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n"
        code, answer, response = connection.exchange(head + body)
        assert code == 415 and json.loads(answer)["error"]["code"] == "unsupported_media_type", answer
        assert response.getheader("Connection") != "close"
    finally:
        connection.close()


def test_a_chunked_body_over_the_limit_is_413(engine):
    server = Live(engine, max_body_bytes=1000)
    connection = RawConnection(server.port)
    try:
        assert connection.exchange(chunked(b"x" * 2000, sizes=(600, 600)))[0] == 413
    finally:
        connection.close()
        server.close()


@pytest.mark.parametrize("request_bytes", [
    b"GARBAGE\r\n\r\n",
    b"GET\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nContent-Length: abc\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nContent-Length: -5\r\n\r\n",
    b"GET / HTTP/1.1\r\n" + b"X-A: b\r\n" * 200 + b"\r\n",
    b"GET /" + b"a" * 70000 + b" HTTP/1.1\r\n\r\n",
])
def test_malformed_requests_get_an_error_and_the_server_survives(live, request_bytes):
    reply = raw_exchange(live.port, request_bytes)
    assert reply.startswith(b"HTTP/1.")
    assert int(reply.split(b" ")[1]) in (400, 411, 414, 431, 501)
    assert live.json("GET", "/health")[0] == 200


def test_a_slow_client_is_dropped_after_the_idle_timeout(engine):
    server = Live(engine, idle_timeout_s=0.5)
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nContent-Length: 100\r\n\r\n{")
            started = time.monotonic()
            reply = sock.recv(65536)
            assert time.monotonic() - started < 4
            assert reply == b"" or reply.startswith(b"HTTP/1.1 408")
    finally:
        server.close()


def test_a_client_that_disconnects_cancels_its_generation(engine):
    gate = threading.Event()
    backend = engine.backend
    original = backend.rule

    def slow_rule(history):
        gate.wait(0.02)
        return original(history)

    backend.rule = slow_rule
    server = Live(engine)
    try:
        for stream in (False, True):
            sock = socket.create_connection(("127.0.0.1", server.port), timeout=5)
            body = json.dumps({"prompt": "x", "max_tokens": 500, "ignore_eos": True, "stream": stream}).encode()
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
                         b"\r\n%s" % (len(body), body))
            wait_until(lambda: engine.load()[1] == 1, what="the generation to start")
            sock.close()
            wait_until(lambda: engine.load() == (0, 0), what="the generation to stop after the client left")
            assert all(backend.kv_tokens(seq) == [] for seq in range(4))
    finally:
        backend.rule = original
        server.close()


def test_too_many_connections_get_503(engine):
    server = Live(engine, max_connections=1)
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as first:
            first.sendall(b"GET /health HTTP/1.1\r\n\r\n")
            first.recv(1024)  # the first connection is open and idle (keep-alive)
            reply = raw_exchange(server.port, b"GET /health HTTP/1.1\r\n\r\n")
            assert reply.startswith(b"HTTP/1.1 503") and b"overloaded" in reply
    finally:
        server.close()


def test_graceful_drain_lets_a_running_request_finish():
    gate = threading.Event()
    engine = Engine(FakeBackend(rule=gated_rule(gate))).start()
    server = Live(engine)
    results = []
    thread = threading.Thread(target=lambda: results.append(server.json(
        "POST", "/v1/completions", {"prompt": "x", "max_tokens": 40, "temperature": 0, "ignore_eos": True})))
    try:
        thread.start()
        wait_until(lambda: engine.load()[1] == 1, what="the request to be running")
        server.server.shutdown()
        drained = []
        drain = threading.Thread(target=lambda: drained.append(server.server.drain(10)))
        drain.start()
        gate.set()
        drain.join(10)
        thread.join(10)
        server.server.server_close()
    finally:
        gate.set()
        engine.close()
    assert drained == [True]
    assert results and results[0][0] == 200 and results[0][1]["usage"]["completion_tokens"] == 40


def test_completion_logprobs_shape(live):
    status, body = live.json("POST", "/v1/completions", {"prompt": "hello", "max_tokens": 4, "temperature": 0,
                                                         "logprobs": 2, "ignore_eos": True})
    logprobs = body["choices"][0]["logprobs"]
    assert status == 200 and len(logprobs["tokens"]) == 4 == len(logprobs["token_logprobs"])
    assert "".join(logprobs["tokens"]) == body["choices"][0]["text"]
    assert all(lp <= 0 for lp in logprobs["token_logprobs"]) and all(len(t) == 2 for t in logprobs["top_logprobs"])
    assert logprobs["text_offset"][0] == 0


def test_chat_logprobs_whole_and_streamed_agree(live):
    request = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "temperature": 0,
               "logprobs": True, "top_logprobs": 3, "ignore_eos": True}
    status, body = live.json("POST", "/v1/chat/completions", request)
    content = body["choices"][0]["logprobs"]["content"]
    assert status == 200 and len(content) == 5
    assert set(content[0]) == {"token", "logprob", "bytes", "top_logprobs"} and len(content[0]["top_logprobs"]) == 3
    chunks = read_sse(live, "/v1/chat/completions", dict(request, stream=True))
    streamed = [entry for c in chunks if c["choices"] and c["choices"][0]["logprobs"]
                for entry in c["choices"][0]["logprobs"]["content"]]
    assert [e["logprob"] for e in streamed] == [e["logprob"] for e in content]


def test_suffix_builds_a_fill_in_the_middle_prompt(live, engine):
    from tests.fakes.backend import FIM_MID, FIM_PRE, FIM_SUF
    status, body = live.json("POST", "/v1/completions", {"prompt": "def f(", "suffix": "<|im_end|>)",
                                                         "max_tokens": 3, "temperature": 0})
    assert status == 200
    backend = engine.backend
    expected = [256, FIM_PRE, *b"def f(", FIM_SUF, *b"<|im_end|>)", FIM_MID]  # specials in user text stay text
    alone = engine.generate(GenerationRequest(expected, SamplingParams(temperature=0, max_tokens=3)))
    assert body["choices"][0]["text"] == alone.text
    assert body["usage"]["prompt_tokens"] == len(expected)
    backend.has_fim = False
    try:
        status, body = live.json("POST", "/v1/completions", {"prompt": "a", "suffix": "b"})
        assert status == 400 and body["error"]["param"] == "suffix"
    finally:
        backend.has_fim = True


@pytest.fixture
def with_sessions(engine, tmp_path):
    from reame.server.sessions import Sessions
    server = Live(engine)
    server.model.sessions = Sessions(tmp_path / "sessions", b"model-a")
    yield server
    server.close()


def chat_turns(server, session=None):
    """Two chat turns; the second carries the first answer. Returns the two answers and the second usage."""
    messages = [{"role": "user", "content": "first question"}]
    extra = {"session": session} if session else {}
    request = {"max_tokens": 8, "temperature": 0, "ignore_eos": True, **extra}
    first = server.json("POST", "/v1/chat/completions", dict(request, messages=messages))[1]
    messages += [first["choices"][0]["message"], {"role": "user", "content": "and then?"}]
    second = server.json("POST", "/v1/chat/completions", dict(request, messages=messages))[1]
    return first["choices"][0]["message"]["content"], second["choices"][0]["message"]["content"], second["usage"]


def test_a_session_reuses_the_conversation_kv_with_identical_answers(with_sessions):
    status, created = with_sessions.json("POST", "/v1/sessions")
    assert status == 200 and created["id"].startswith("sess-")
    plain = chat_turns(with_sessions)
    kept = chat_turns(with_sessions, created["id"])
    assert kept[:2] == plain[:2]
    assert kept[2]["prompt_tokens_details"]["cached_tokens"] > 20
    assert with_sessions.json("GET", f"/v1/sessions/{created['id']}")[1]["tokens"] > 20


def test_a_saved_session_survives_a_restart(with_sessions, engine, tmp_path):
    from reame.server.sessions import Sessions
    session_id = with_sessions.json("POST", "/v1/sessions", {"id": "my-chat"})[1]["id"]
    chat_turns(with_sessions, session_id)
    assert with_sessions.json("POST", f"/v1/sessions/{session_id}/save")[1]["saved"] is True
    with_sessions.model.sessions = Sessions(tmp_path / "sessions", b"model-a")  # a new process
    assert with_sessions.json("GET", f"/v1/sessions/{session_id}")[0] == 404
    assert with_sessions.json("POST", f"/v1/sessions/{session_id}/load")[0] == 200
    assert with_sessions.json("GET", f"/v1/sessions/{session_id}")[1]["tokens"] > 20
    with_sessions.model.sessions = Sessions(tmp_path / "sessions", b"model-b")  # another model
    status, body = with_sessions.json("POST", f"/v1/sessions/{session_id}/load")
    assert status == 409 and "another model" in body["error"]["message"]


@pytest.mark.parametrize("damage", [lambda b: b[:-40], lambda b: b[:10] + b"X" + b[11:], lambda b: b""])
def test_a_damaged_session_file_is_refused(with_sessions, tmp_path, damage):
    session_id = with_sessions.json("POST", "/v1/sessions")[1]["id"]
    with_sessions.json("POST", "/v1/sessions/" + session_id + "/save")
    path = tmp_path / "sessions" / f"{session_id}.session"
    path.write_bytes(damage(path.read_bytes()))
    status, body = with_sessions.json("POST", f"/v1/sessions/{session_id}/load")
    assert status == 409 and body["error"]["code"] == "session_unusable"


@pytest.mark.parametrize("path, status", [
    ("/v1/sessions/..%2Fetc", 400), ("/v1/sessions/a.b", 400), ("/v1/sessions/" + "a" * 65, 400),
    ("/v1/sessions/unknown", 404), ("/v1/sessions/unknown/load", 404),
])
def test_session_ids_are_validated_and_unknown_ones_are_404(with_sessions, path, status):
    method = "POST" if path.endswith("/load") else "GET"
    assert with_sessions.json(method, path)[0] == status


def test_session_deletion_and_wrong_uses(with_sessions):
    session_id = with_sessions.json("POST", "/v1/sessions")[1]["id"]
    assert with_sessions.json("POST", "/v1/sessions", {"id": session_id})[0] == 409
    status, body = with_sessions.json("POST", "/v1/completions", {"prompt": "x", "n": 2, "session": session_id})
    assert status == 400 and body["error"]["param"] == "session"
    assert with_sessions.json("PUT", f"/v1/sessions/{session_id}")[0] == 405
    assert with_sessions.json("DELETE", f"/v1/sessions/{session_id}")[1] == {"id": session_id, "deleted": True}
    assert with_sessions.json("POST", "/v1/completions", {"prompt": "x", "session": session_id})[0] == 404


def test_a_full_queue_is_429_and_a_queue_timeout_is_503():
    gate = threading.Event()
    engine = Engine(FakeBackend(rule=gated_rule(gate)), max_queue=1, queue_timeout_s=0.3).start()
    server = Live(engine)
    results = {}
    try:
        first = threading.Thread(target=lambda: results.setdefault("running", server.json(
            "POST", "/v1/completions", {"prompt": "a", "max_tokens": 2})))
        first.start()
        wait_until(lambda: engine.load() == (0, 1), what="the first request to be admitted (blocked in decode)")
        second = threading.Thread(target=lambda: results.setdefault("waiting", server.json(
            "POST", "/v1/completions", {"prompt": "b", "max_tokens": 2})))
        second.start()
        wait_until(lambda: engine.load()[0] == 1, what="the second request to wait for a slot")
        status, body = server.json("POST", "/v1/completions", {"prompt": "c", "max_tokens": 2})
        assert status == 429 and body["error"]["code"] == "queue_full"
        second.join(5)
        gate.set()
        first.join(5)
        assert results["waiting"][0] == 503 and results["waiting"][1]["error"]["code"] == "queue_timeout"
        assert results["running"][0] == 200
    finally:
        gate.set()
        server.close()
        engine.close()


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("text", ["plain", 'quote " and \\ backslash', "é🙂\n\t", ""])
def test_the_fast_text_chunk_is_exactly_the_general_chunk(chat, text):
    from reame.server.shapes import Response
    response = Response(chat, "model-id")
    assert json.loads(response.text_chunk(3, text)) == response.chunk(3, text)


class CachedServer:
    """A server whose model keeps a prefix cache on disk, and the same server restarted: its slots then hold
    nothing, so what a request finds, it finds in the cache."""

    def __init__(self, directory) -> None:
        self.directory = directory
        self.live, self.engine = self._start()

    def _start(self) -> tuple[Live, Engine]:
        from reame.cache import PrefixCache
        prefix_cache = PrefixCache(b"c" * 32, self.directory, block_tokens=4, min_new_tokens=16)
        engine = Engine(FakeBackend(n_ctx=1024, n_seq_max=2), cache=prefix_cache).start()
        return Live(engine), engine

    def restart(self) -> Live:
        self.close()  # the engine's close finishes the cache's disk writes
        self.live, self.engine = self._start()
        return self.live

    def close(self) -> None:
        self.live.close()
        self.engine.close()


@pytest.fixture
def cached_server(tmp_path):
    server = CachedServer(tmp_path / "kv")
    yield server
    server.close()


@pytest.fixture
def cached(cached_server):
    return cached_server.live


DOC = "a document that many requests start with, long enough to be worth a snapshot. " * 3


def test_warm_prefills_a_prompt_and_later_requests_report_it_cached(cached_server):
    status, body = cached_server.live.json("POST", "/v1/warm", {"prompt": DOC})
    assert status == 200 and body["warmed"] is True and body["tokens"] > 100 and body["cached_tokens"] == 0
    stored = cached_server.live.request("GET", "/metrics")[1].decode()
    assert 'reame_prefix_cache_snapshots_stored_total{model="reame"} 1' in stored
    cached = cached_server.restart()  # the slots forget: only the cache holds it now
    status, body = cached.json("POST", "/v1/completions", {"prompt": DOC + "question?", "max_tokens": 3})
    assert status == 200 and body["usage"]["prompt_tokens_details"]["cached_tokens"] == body["usage"][
        "prompt_tokens"] - len("question?")
    metrics = cached.request("GET", "/metrics")[1].decode()
    assert 'reame_prefix_cache_hits_total{model="reame"} 1' in metrics
    assert "# TYPE reame_prefix_cache_snapshots gauge" in metrics


def test_warm_takes_chat_messages_as_the_prefix_of_a_later_chat(cached_server):
    system = {"role": "system", "content": DOC}
    status, warmed = cached_server.live.json("POST", "/v1/warm", {"messages": [system]})
    assert status == 200 and warmed["warmed"] is True
    cached = cached_server.restart()
    status, body = cached.json("POST", "/v1/chat/completions",
                               {"messages": [system, {"role": "user", "content": "hi"}], "max_tokens": 2})
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == warmed["tokens"]


@pytest.mark.parametrize("body,param", [({}, "prompt"), ({"prompt": 5}, "prompt"), ({"prompt": ["a", "b"]}, "prompt"),
                                        ({"messages": "x"}, "messages"), ({"prompt": ""}, "prompt")])
def test_bad_warm_requests_are_400(cached, body, param):
    status, answer = cached.json("POST", "/v1/warm", body)
    assert status == 400 and answer["error"]["param"] == param


def test_warm_without_a_cache_says_nothing_was_kept(live):
    status, body = live.json("POST", "/v1/warm", {"prompt": "some text"})
    assert status == 200 and body["warmed"] is False and body["tokens"] == len("some text") + 1


def test_speculation_shows_in_usage_and_metrics():
    from reame.speculative import PromptLookup, Speculation
    from tests.unit.test_speculative import COPY_TEXT, FrozenCost, copying_rule
    speculation = Speculation(PromptLookup(), max_draft=4, cost=FrozenCost())
    with Engine(FakeBackend(n_ctx=2048, rule=copying_rule), speculation=speculation) as engine:
        server = Live(engine)
        try:
            status, body = server.json("POST", "/v1/completions", {"prompt": COPY_TEXT * 2, "max_tokens": 40,
                                                                   "temperature": 0, "ignore_eos": True})
            details = body["usage"]["completion_tokens_details"]
            assert status == 200 and details["accepted_prediction_tokens"] > 20
            metrics = server.request("GET", "/metrics")[1].decode()
        finally:
            server.close()
    assert f'reame_spec_decode_accepted_total{{model="reame",source="lookup"}} ' \
        f'{details["accepted_prediction_tokens"]}' in metrics
    assert 'reame_spec_decode_steps_total{kind="speculative",model="reame"}' in metrics
    assert 'reame_spec_decode_acceptance{model="reame",position="1"}' in metrics
    assert 'reame_spec_decode_draft_seconds_per_token{model="reame",source="lookup"}' in metrics
    assert 'reame_spec_decode_source_acceptance{model="reame",source="lookup"}' in metrics


@pytest.mark.parametrize("stream", [False, True])
def test_a_session_is_free_again_before_its_answer_is_sent(with_sessions, monkeypatch, stream):
    """A client's next turn may arrive before the handler thread returns: it must not get 409 busy."""
    from reame.server.client import Event, Whole
    from reame.server.http import Handler
    busy_when_sent = []
    sessions = with_sessions.model.sessions
    original = Handler.send

    def send(self, frame):
        if isinstance(frame, Whole) and "choices" in frame.payload or frame == Event("[DONE]"):
            busy_when_sent.append({key for key, entry in sessions._entries.items() if entry.busy})
        return original(self, frame)
    monkeypatch.setattr(Handler, "send", send)
    session_id = with_sessions.json("POST", "/v1/sessions")[1]["id"]
    with_sessions.request("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                           "max_tokens": 4, "session": session_id,
                                                           "stream": stream})
    assert busy_when_sent == [set()]


@pytest.mark.parametrize("stream", [False, True])
def test_a_finished_request_never_frees_the_session_for_the_next_turn(with_sessions, monkeypatch, stream):
    """The next turn reserves the session while this answer is being sent; that reservation must hold."""
    from reame.server.client import Event, Whole
    from reame.server.http import Handler
    sessions = with_sessions.model.sessions
    session_id = with_sessions.json("POST", "/v1/sessions")[1]["id"]
    original = Handler.send

    def send(self, frame):
        if isinstance(frame, Whole) and "choices" in frame.payload or frame == Event("[DONE]"):
            sessions.acquire("", session_id)  # the client's next turn arrives
        return original(self, frame)
    monkeypatch.setattr(Handler, "send", send)
    with_sessions.request("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                           "max_tokens": 4, "session": session_id,
                                                           "stream": stream})
    assert {key for key, entry in sessions._entries.items() if entry.busy} == {("", session_id)}


def test_without_zstandard_sessions_save_and_load_raw(no_zstandard, with_sessions, tmp_path):
    from reame.server.sessions import Sessions
    session_id = with_sessions.json("POST", "/v1/sessions", {"id": "raw-chat"})[1]["id"]
    chat_turns(with_sessions, session_id)
    assert with_sessions.json("POST", f"/v1/sessions/{session_id}/save")[1]["saved"] is True
    with_sessions.model.sessions = Sessions(tmp_path / "sessions", b"model-a")
    assert with_sessions.json("POST", f"/v1/sessions/{session_id}/load")[0] == 200
    assert with_sessions.json("GET", f"/v1/sessions/{session_id}")[1]["tokens"] > 20


def test_a_compressed_session_without_zstandard_is_refused_naming_the_module(with_sessions, tmp_path, monkeypatch):
    from reame.cache import codec
    from reame.cache.store import Snapshot, encode
    path = tmp_path / "sessions" / "zipped.session"
    path.parent.mkdir()
    path.write_bytes(encode(with_sessions.model.sessions.fingerprint, Snapshot((1, 2), b"\0" * 100_000), compress=True))
    with monkeypatch.context() as patched:
        patched.setitem(sys.modules, "zstandard", None)
        codec._zstandard.cache_clear()
        status, body = with_sessions.json("POST", "/v1/sessions/zipped/load")
    codec._zstandard.cache_clear()
    assert status == 409 and body["error"]["code"] == "session_unusable"
    assert "zstandard" in body["error"]["message"]


def test_without_zstandard_the_prefix_cache_stores_and_serves(no_zstandard, cached_server):
    assert cached_server.live.json("POST", "/v1/warm", {"prompt": DOC})[1]["warmed"] is True
    cached = cached_server.restart()
    status, body = cached.json("POST", "/v1/completions", {"prompt": DOC + "question?", "max_tokens": 3})
    assert status == 200 and body["usage"]["prompt_tokens_details"]["cached_tokens"] > 100


def test_a_prompt_over_the_context_is_context_length_exceeded_as_openai_says(live):
    status, body = live.json("POST", "/v1/chat/completions",
                             {"messages": [{"role": "user", "content": "x" * 2000}], "max_tokens": 2})
    assert status == 400 and body["error"]["code"] == "context_length_exceeded"
    assert body["error"]["param"] == "messages" and "maximum context length is 1024" in body["error"]["message"]
    status, body = live.json("POST", "/v1/completions", {"prompt": "x" * 2000, "max_tokens": 10})
    assert status == 400 and (body["error"]["code"], body["error"]["param"]) == ("context_length_exceeded", "prompt")
    # llama-server's type and counts, which llama.cpp's clients read, beside OpenAI's code and message
    assert body["error"]["type"] == "exceed_context_size_error"
    assert (body["error"]["n_prompt_tokens"], body["error"]["n_ctx"]) == (2001, 1024)


def test_a_prompt_over_a_requests_context_is_refused_with_llama_servers_type_and_counts():
    with Engine(FakeBackend(n_ctx=1024, n_seq_max=4), context_per_request=256) as engine:
        server = Live(engine)
        try:
            status, body = server.json("POST", "/v1/chat/completions",
                                       {"messages": [{"role": "user", "content": "x" * 300}]})
            assert status == 400 and body["error"]["code"] == "context_length_exceeded"
            assert body["error"]["type"] == "exceed_context_size_error" and body["error"]["param"] == "messages"
            assert body["error"]["n_ctx"] == 256 and body["error"]["n_prompt_tokens"] > 300
            status, body = server.json("POST", "/completion", {"prompt": "x" * 300})
            assert status == 400 and body["error"]["type"] == "exceed_context_size_error"
            assert (body["error"]["code"], body["error"]["n_ctx"]) == (400, 256)
            assert server.json("GET", "/slots")[1][0]["n_ctx"] == 256
        finally:
            server.close()


def test_max_tokens_beyond_the_context_is_clamped_to_what_it_leaves(live):
    status, body = live.json("POST", "/v1/completions", {"prompt": "x" * 900, "max_tokens": 500,
                                                         "ignore_eos": True, "temperature": 0})
    assert status == 200 and body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"] == 1024


def test_a_body_of_a_million_json_objects_is_refused_before_it_is_parsed(live):
    """A 3 MiB body of 2^20 empty objects cost ~100 MiB of RSS once parsed; no route's request holds so many."""
    for path in ("/v1/chat/completions", "/v1/responses", "/api/chat"):
        status, answer = live.json("POST", path, {"model": "m", "metadata": [{}] * 100_001})
        assert status == 400 and "100000 JSON objects and arrays" in json.dumps(answer), path
    status, _ = live.json("POST", "/v1/completions", {"prompt": "[{" * 200, "max_tokens": 1})
    assert status == 200  # brackets in text are counted, but a prompt's worth is far within the bound
