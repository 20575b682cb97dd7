"""Failure answers, never hangs: a dying engine, a bug in a route, a trickling client, refusals that are
HTTP answers and never connection resets."""

import http.client
import json
import socket
import threading

import pytest

from reame.engine import Engine, GenerationRequest, SamplingParams
from tests.fakes.backend import FakeBackend, gated_rule
from reame.errors import EngineUnavailable

from tests.waiting import wait_until

from .test_server import Live, RawConnection, read_sse


class Boom(RuntimeError):
    pass


def kill_on_next_admission(engine: Engine) -> None:
    """A bug in the engine loop, outside any step: the kind that used to end the thread silently."""
    def broken_admit() -> None:
        raise Boom("injected")
    engine._admit = broken_admit


def test_a_dying_engine_answers_every_client_and_refuses_new_work():
    gate = threading.Event()
    engine = Engine(FakeBackend(n_seq_max=2, rule=gated_rule(gate))).start()
    server = Live(engine)
    try:
        running = engine.submit(GenerationRequest("a", SamplingParams(max_tokens=50, ignore_eos=True)))
        assert next(iter(running)).token >= 0  # it is decoding
        kill_on_next_admission(engine)
        waiting = engine.submit(GenerationRequest("b", SamplingParams(max_tokens=5)))
        gate.set()
        assert running.result(10).finish.reason == "error"
        assert waiting.result(10).finish.reason == "error" and "Boom" in waiting.finish.message
        assert engine.status.dead and engine.idle.is_set()
        with pytest.raises(EngineUnavailable):
            engine.submit(GenerationRequest("c", SamplingParams(max_tokens=5)))
        status, health = server.json("GET", "/health")
        assert status == 503 and health["status"] == "error" and "Boom" in health["message"]
        status, body = server.json("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2})
        assert status == 503 and body["error"]["code"] == "engine_unavailable"
    finally:
        gate.set()
        server.close()
        engine.close()


@pytest.mark.parametrize("stream", [False, True])
def test_a_handler_waiting_on_a_dead_engine_answers_instead_of_hanging(stream):
    """The engine dies without a word to a request already queued (as if its event were lost)."""
    gate = threading.Event()
    engine = Engine(FakeBackend(rule=gated_rule(gate, wait_s=60))).start()
    server = Live(engine)
    try:
        busy = engine.submit(GenerationRequest("busy", SamplingParams(max_tokens=3)))
        while engine.load()[1] < 1 and busy.finish is None:  # admitted: the engine waits inside its decode
            gate.wait(0.01)
        original_end = engine._end
        engine._end = lambda why, reason="cancelled": None  # it fails to answer anyone
        kill_on_next_admission(engine)
        answer = {}
        body = {"prompt": "hi", "max_tokens": 2, "stream": stream}
        client = threading.Thread(target=lambda: answer.update(
            events=read_sse(server, "/v1/completions", body, done=False)) if stream else answer.update(
            reply=server.json("POST", "/v1/completions", body)))
        client.start()
        while engine.load()[0] < 1 and client.is_alive():  # the request is queued behind the busy one
            client.join(0.01)
        gate.set()
        client.join(20)
        assert not client.is_alive(), "the handler hung on a dead engine"
        if stream:
            assert answer["events"][-1]["error"]["code"] == "engine_unavailable"
        else:
            assert answer["reply"][0] == 503
        engine._end = original_end
    finally:
        gate.set()
        server.close()
        engine.close()


def last_sse_event(data: bytes) -> tuple[str, dict]:
    """The last event of an SSE stream: its name ("" when unnamed) and its JSON."""
    frames = [frame for frame in data.decode().split("\n\n") if "data: " in frame]
    name, payload = "", ""
    for line in frames[-1].split("\n"):
        if line.startswith("event: "):
            name = line[7:]
        elif line.startswith("data: "):
            payload = line[6:]
    return name, json.loads(payload)


ASK = [{"role": "user", "content": "hi"}]
# Each family's streamed request and how its stream must end when the engine dies mid-answer.
FAMILY_STREAMS = {
    "openai completions": ("/v1/completions", {"prompt": "hi", "max_tokens": 2},
                           lambda data: last_sse_event(data)[1]["error"]["code"] == "engine_unavailable"),
    "openai chat": ("/v1/chat/completions", {"messages": ASK, "max_tokens": 2},
                    lambda data: last_sse_event(data)[1]["error"]["code"] == "engine_unavailable"),
    "ollama": ("/api/chat", {"model": "reame", "messages": ASK, "options": {"num_predict": 2}},
               lambda data: "engine" in json.loads(data.decode().strip().split("\n")[-1])["error"]),
    "anthropic": ("/v1/messages", {"model": "reame", "messages": ASK, "max_tokens": 2},
                  lambda data: last_sse_event(data) == ("error", {"type": "error", "error": {
                      "type": "overloaded_error", "message": last_sse_event(data)[1]["error"]["message"]}})),
    "responses": ("/v1/responses", {"model": "reame", "input": "hi", "max_output_tokens": 16},
                  lambda data: last_sse_event(data)[0] == "error"
                  and last_sse_event(data)[1]["code"] == "engine_unavailable"),
}


@pytest.mark.parametrize("family", FAMILY_STREAMS)
def test_an_engine_dying_mid_stream_ends_each_familys_stream_with_its_error_event(family):
    """The stream has begun (its headers are out): the error must be the family's own last event, never a
    JSON error body written into the stream."""
    path, body, ends_in_its_error = FAMILY_STREAMS[family]
    gate = threading.Event()
    engine = Engine(FakeBackend(rule=gated_rule(gate, wait_s=60))).start()
    server = Live(engine)
    try:
        busy = engine.submit(GenerationRequest("busy", SamplingParams(max_tokens=3)))
        while engine.load()[1] < 1 and busy.finish is None:
            gate.wait(0.01)
        original_end = engine._end
        engine._end = lambda why, reason="cancelled": None  # it fails to answer anyone
        kill_on_next_admission(engine)
        answer = {}
        client = threading.Thread(target=lambda: answer.update(
            reply=server.request("POST", path, dict(body, stream=True))))
        client.start()
        while engine.load()[0] < 1 and client.is_alive():  # queued behind the busy one, its stream begun
            client.join(0.01)
        gate.set()
        client.join(20)
        assert not client.is_alive(), "the handler hung on a dead engine"
        response, data = answer["reply"]
        assert response.status == 200 and ends_in_its_error(data), data.decode()[-400:]
        engine._end = original_end
    finally:
        gate.set()
        server.close()
        engine.close()


def test_a_bug_in_a_route_is_a_500_in_openais_shape_and_the_server_goes_on(engine, monkeypatch, caplog):
    import dataclasses

    from reame.server.app import ROUTER
    server = Live(engine)
    try:
        route = ROUTER._exact["/v1/models"]
        monkeypatch.setitem(ROUTER._exact, "/v1/models",
                            dataclasses.replace(route, handler=lambda app, handler, path: 1 / 0))
        status, body = server.json("GET", "/v1/models")
        assert status == 500 and body["error"]["type"] == "server_error" and body["error"]["code"] == "internal_error"
        assert "ZeroDivisionError" in caplog.text
        assert server.json("GET", "/health")[0] == 200
    finally:
        server.close()


@pytest.fixture
def engine():
    with Engine(FakeBackend(n_ctx=1024, n_seq_max=2)) as engine:
        yield engine


def test_a_client_trickling_its_request_is_cut_off_with_408(engine):
    server = Live(engine, idle_timeout_s=5, request_timeout_s=0.5)
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
            request = b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Length: 2\r\n\r\n{}"
            sent = 0
            reply = b""
            while sent < len(request):
                sock.sendall(request[sent:sent + 1])  # one byte a tenth of a second: never idle 5 s
                sent += 1
                try:
                    sock.settimeout(0.1)
                    reply = sock.recv(65536)
                    break
                except TimeoutError:
                    continue
            assert reply.startswith(b"HTTP/1.1 408") and sent < len(request)
            sock.settimeout(5)
            assert b"Connection: close" in reply + sock.recv(65536)
    finally:
        server.close()


def test_too_many_connections_get_a_503_answer_never_a_reset(engine):
    server = Live(engine, max_connections=1)
    holder = RawConnection(server.port)
    try:
        holder.sock.sendall(b"GET /health HTTP/1.1\r\n")  # mid-request, so not an idle connection to close
        wait_until(lambda: server.server.connections() == {"busy": 1, "idle": 0}, what="the holder to be busy")
        for _ in range(5):
            with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
                sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Length: 20000\r\n\r\n" +
                             b"x" * 20000)
                response = http.client.HTTPResponse(sock)
                response.begin()
                assert response.status == 503 and response.getheader("Retry-After") == "1"
                assert json.loads(response.read())["error"]["code"] == "overloaded"
                assert sock.recv(1) == b""  # an orderly close, not ConnectionResetError
    finally:
        holder.close()
        server.close()


def test_a_refused_body_is_drained_so_the_client_reads_its_413(engine):
    server = Live(engine, max_body_bytes=1000)
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Length: 300000\r\n\r\n")
            sock.sendall(b"y" * 300000)  # the server answers without reading it, then drains it
            response = http.client.HTTPResponse(sock)
            response.begin()
            assert response.status == 413 and response.getheader("Connection") == "close"
            response.read()
            assert sock.recv(1) == b""
    finally:
        server.close()


def test_close_never_frees_a_backend_its_thread_is_still_using():
    """close() once cleared its thread after the join timed out, and the caller then freed the backend under a
    step still running: now the thread frees what it used when that step ends."""
    gate, inside = threading.Event(), threading.Event()
    gated = gated_rule(gate, wait_s=30)

    def rule(history):
        inside.set()
        return gated(history)

    backend = FakeBackend(n_ctx=256, rule=rule)
    closed = threading.Event()
    backend.close = closed.set
    engine = Engine(backend, owns_backend=True).start()
    handle = engine.submit(GenerationRequest("x", SamplingParams(max_tokens=2)))
    wait_until(inside.is_set, what="a step to be inside the backend")
    assert engine.close(timeout_s=0.1) is False
    assert not closed.is_set()  # the step is still in the backend
    gate.set()
    wait_until(closed.is_set, what="the thread to free the backend as it ends")
    assert handle.result(10).finish.reason in ("cancelled", "length")
