"""The HTTP server against cheap hostile requests (issue 32): absurd max_tokens, more generations than the queue
holds, idle and trickling sockets, sockets numbered past 1024, another key's sessions, sessions without end,
files other local users could read. Each gets a clear 4xx (or a closed idle connection), and everyone else goes
on being answered."""

import dataclasses
import json
import os
import resource
import socket
import stat
import threading

import pytest

from reame.engine import Engine, GenerationRequest, SamplingParams
from tests.fakes.backend import FakeBackend, gated_rule
from reame.server import sessions as sessions_module
from reame.server.sessions import Sessions
from reame.settings import SessionLimits
from tests.waiting import wait_until

from .test_server import Live, chat_turns


@pytest.mark.parametrize("max_tokens", [2**31 - 1, 2**31, 2**63, 2**64, 99999999999999999999])
@pytest.mark.parametrize("path, body", [("/v1/completions", {"prompt": "hi"}),
                                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})])
def test_a_huge_max_tokens_is_clamped_to_the_context_and_answered(live, path, body, max_tokens):
    status, answer = live.json("POST", path, dict(body, max_tokens=max_tokens, ignore_eos=True))
    assert status == 200 and answer["choices"][0]["finish_reason"] == "length"
    assert answer["usage"]["prompt_tokens"] + answer["usage"]["completion_tokens"] == 1024  # the context, full


def test_a_request_asking_the_whole_context_does_not_hold_the_others_out_of_their_slots():
    """Reserving its whole max_tokens, one such request kept everyone behind it waiting for its minutes of
    generation (two stopped a 2-core server); it now reserves a slot's share and runs beside the others."""
    with Engine(FakeBackend(n_ctx=2048, n_seq_max=4)) as engine:
        greedy = SamplingParams(temperature=0, ignore_eos=True)
        huge = [engine.submit(GenerationRequest(f"big {i}", dataclasses.replace(greedy, max_tokens=2**63)))
                for i in range(2)]
        small = engine.submit(GenerationRequest("small", dataclasses.replace(greedy, max_tokens=4)))
        assert small.result(10).finish.reason == "length"
        for handle in huge:
            handle.cancel()
        # Still generating when the small one ended: it went beside them, not after.
        assert [handle.result(10).finish.reason for handle in huge] == ["cancelled", "cancelled"]


def test_the_servers_answer_cap_clamps_any_max_tokens():
    with Engine(FakeBackend(n_ctx=2048), max_answer_tokens=7) as engine:
        for asked in (None, 2**31, 2**64, 6):
            result = engine.generate(GenerationRequest("x", SamplingParams(temperature=0, ignore_eos=True,
                                                                           max_tokens=asked)))
            assert result.finish.reason == "length" and len(result.tokens) == min(asked or 7, 7)


@pytest.mark.parametrize("body, message", [
    ({"prompt": ["a"] * 16, "n": 16}, "at most 16 generations in all (prompts × n × best_of); this one asks 256"),
    ({"prompt": ["a", "b"], "best_of": 16}, "this one asks 32"),
    ({"prompt": ["a"] * 9, "n": 2}, "this one asks 18"),
])
def test_one_request_asks_at_most_sixteen_generations(live, body, message):
    status, answer = live.json("POST", "/v1/completions", dict(body, max_tokens=1))
    assert status == 400 and message in answer["error"]["message"] and answer["error"]["param"] == "n"


def test_every_generation_counts_against_the_queue():
    gate = threading.Event()
    with Engine(FakeBackend(n_ctx=1024, n_seq_max=1, rule=gated_rule(gate)), max_queue=4) as engine:
        server = Live(engine)
        try:
            status, answer = server.json("POST", "/v1/completions", {"prompt": "x", "n": 5, "max_tokens": 1})
            assert status == 400 and answer["error"]["code"] == "too_many_generations"
            # Greedy: a sampled end of text (the gated rule leaves it a small chance) would end one with "stop".
            running = engine.submit(GenerationRequest("x", SamplingParams(temperature=0, max_tokens=2)))
            wait_until(lambda: engine.load() == (0, 1), what="the first request to run")  # it holds the one slot
            waiting = engine.submit_together([GenerationRequest("y", SamplingParams(temperature=0, max_tokens=1))] * 3)
            status, answer = server.json("POST", "/v1/completions", {"prompt": "x", "n": 2, "max_tokens": 1})
            assert status == 429 and answer["error"]["code"] == "queue_full"  # 3 waiting + 2 > 4
            assert engine.load() == (3, 1)
            gate.set()
            for handle in [running, *waiting]:
                assert handle.result(10).finish.reason == "length"
            assert engine.load() == (0, 0)
            assert server.json("POST", "/v1/completions", {"prompt": "x", "n": 4, "max_tokens": 1})[0] == 200
        finally:
            gate.set()
            server.close()


def test_idle_sockets_cannot_keep_anyone_out(engine):
    server = Live(engine, max_connections=4)
    idle = [socket.create_connection(("127.0.0.1", server.port), timeout=10) for _ in range(4)]
    try:
        wait_until(lambda: server.server.connections() == {"busy": 0, "idle": 4}, what="four idle connections")
        # Past the limit, the longest idle connection is closed to make room for a request.
        wait_until(lambda: server.json("GET", "/health")[0] == 200, what="/health to be answered")
        assert server.json("POST", "/v1/completions", {"prompt": "x", "max_tokens": 1})[0] == 200
        assert sum(sock.recv(1) == b"" for sock in idle) >= 1  # closed: read as the end, not a reset
    finally:
        for sock in idle:
            sock.close()
        server.close()


def test_a_connection_that_sends_nothing_is_closed_after_the_header_timeout(engine):
    server = Live(engine, header_timeout_s=0.3, idle_timeout_s=30)
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
            assert sock.recv(1) == b""  # closed by the server long before the 30 s idle timeout
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n")  # headers that never end
            assert sock.recv(65536).startswith(b"HTTP/1.1 408")
    finally:
        server.close()


def test_requests_beyond_max_requests_get_503_and_health_is_still_answered():
    gate = threading.Event()
    with Engine(FakeBackend(n_ctx=1024, n_seq_max=2, rule=gated_rule(gate))) as engine:
        server = Live(engine, max_requests=1)
        slow = threading.Thread(target=server.json, args=("POST", "/v1/completions", {"prompt": "x", "max_tokens": 2}))
        try:
            slow.start()
            wait_until(lambda: engine.load()[1] == 1, what="the first request to run")
            response, body = server.request("POST", "/v1/completions", {"prompt": "y", "max_tokens": 1})
            assert response.status == 503 and response.getheader("Retry-After") == "1"
            assert json.loads(body)["error"]["code"] == "overloaded"
            assert server.json("GET", "/health")[0] == 200
        finally:
            gate.set()
            slow.join(10)
            server.close()


def test_a_client_on_a_socket_numbered_past_1024_gets_its_answer(engine):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 2048:
        pytest.skip(f"the open files limit ({hard}) is too low to open 1100")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 2048), hard))
    filler = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    gate = threading.Event()
    try:
        with Engine(FakeBackend(n_ctx=1024, n_seq_max=2, rule=gated_rule(gate, wait_s=0.6))) as slow_engine:
            server = Live(slow_engine)  # answers take > 0.25 s: the handler checks its client meanwhile
            try:
                status, answer = server.json("POST", "/v1/completions", {"prompt": "x", "max_tokens": 2})
                assert status == 200 and answer["choices"][0]["finish_reason"] == "length"
            finally:
                gate.set()
                server.close()
    finally:
        for fd in filler:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


# --- sessions ------------------------------------------------------------------------------------------------

KEYS = ("alice-key", "bob-key")


def as_key(key):
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture
def keyed(engine, tmp_path):
    server = Live(engine, api_keys=KEYS)
    server.model.sessions = Sessions(tmp_path / "sessions", b"model", SessionLimits(per_key=2, total=3))
    yield server
    server.close()


def test_a_session_belongs_to_the_key_that_made_it(keyed):
    alice, bob = as_key("alice-key"), as_key("bob-key")
    session_id = keyed.json("POST", "/v1/sessions", {"id": "chat"}, alice)[1]["id"]
    turn = {"prompt": "hello", "max_tokens": 2, "session": session_id}
    assert keyed.json("POST", "/v1/completions", turn, alice)[0] == 200
    for method, path, body in [("GET", "/v1/sessions/chat", None), ("DELETE", "/v1/sessions/chat", None),
                               ("POST", "/v1/sessions/chat/save", None), ("POST", "/v1/sessions/chat/load", None),
                               ("POST", "/v1/completions", turn)]:
        status, answer = keyed.json(method, path, body, bob)
        assert status == 404 and answer["error"]["code"] == "session_not_found", (method, path)
    assert keyed.json("GET", "/v1/sessions/chat", None, alice)[1]["tokens"] > 0  # untouched by bob
    assert keyed.json("POST", "/v1/sessions", {"id": "chat"}, bob)[0] == 200  # bob's own "chat", apart


def test_sessions_are_bounded_per_key_and_in_all(keyed):
    alice, bob = as_key("alice-key"), as_key("bob-key")
    assert [keyed.json("POST", "/v1/sessions", None, alice)[0] for _ in range(2)] == [200, 200]
    status, answer = keyed.json("POST", "/v1/sessions", None, alice)
    assert status == 429 and "this key holds 2 sessions" in answer["error"]["message"]
    assert keyed.json("POST", "/v1/sessions", None, bob)[0] == 200
    response, body = keyed.request("POST", "/v1/sessions", None, bob)
    assert response.status == 429 and "the server holds 3 sessions" in json.loads(body)["error"]["message"]
    assert response.getheader("Retry-After") == "60"


def test_sessions_past_their_ram_budget_wait_on_disk_and_answer_the_same(engine, tmp_path):
    plain = Live(engine)
    spilling = Live(engine)
    spilling.model.sessions = Sessions(tmp_path / "sessions", b"model", SessionLimits(ram_bytes=1))
    try:
        expected = chat_turns(plain)[:2]
        session_id = spilling.json("POST", "/v1/sessions")[1]["id"]
        assert chat_turns(spilling, session_id)[:2] == expected
        sessions = spilling.model.sessions
        assert sessions.ram_bytes() == 0 and sessions.path("", session_id).exists()  # written out after the turn
        assert spilling.json("GET", f"/v1/sessions/{session_id}")[1]["tokens"] > 20  # and read back on use
    finally:
        plain.close()
        spilling.close()


def test_an_idle_session_expires_in_ram_and_on_disk(engine, tmp_path, monkeypatch):
    monkeypatch.setattr(sessions_module, "EXPIRY_EVERY_S", 0.0)
    server = Live(engine)
    server.model.sessions = Sessions(tmp_path / "sessions", b"model", SessionLimits(idle_s=3600))
    try:
        session_id = server.json("POST", "/v1/sessions", {"id": "old"})[1]["id"]
        assert server.json("POST", f"/v1/sessions/{session_id}/save")[0] == 200
        path = server.model.sessions.path("", session_id)
        assert path.exists()
        server.model.sessions.limits = SessionLimits(idle_s=1e-9)  # as if an hour went by
        server.json("POST", "/v1/sessions", {"id": "new"})  # any session call looks the others over
        assert server.json("GET", "/v1/sessions/old")[0] == 404 and not path.exists()
    finally:
        server.close()


def test_saved_sessions_are_private_files_in_a_private_directory(keyed, tmp_path):
    old_umask = os.umask(0o022)
    try:
        keyed.json("POST", "/v1/sessions", {"id": "mine"}, as_key("alice-key"))
        assert keyed.json("POST", "/v1/sessions/mine/save", None, as_key("alice-key"))[0] == 200
    finally:
        os.umask(old_umask)
    path = keyed.model.sessions.path(sessions_module.key_owner("alice-key"), "mine")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert not list(path.parent.glob(".*.tmp"))


@pytest.mark.parametrize("field, value, message", [
    ("stop", ["x" * 257], "a stop string is at most 256 characters"),
    ("logit_bias", {str(token): 1 for token in range(1025)}, "logit_bias holds at most 1024 tokens"),
])
def test_what_every_token_of_an_answer_pays_for_is_bounded(live, field, value, message):
    """A 100,000-character stop string was rescanned at every token; 100,000 biased tokens applied to each draw."""
    status, answer = live.json("POST", "/v1/completions", {"prompt": "x", "max_tokens": 1, field: value})
    assert status == 400 and message in answer["error"]["message"] and answer["error"]["param"] == field
