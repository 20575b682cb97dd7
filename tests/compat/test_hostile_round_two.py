"""Issue 49's findings, sent as the issue wrote them to a real `reame run SmolLM2 --serve` as users start it:
keyless, on 127.0.0.1. Each gets a clear 4xx within a second, the server's RSS stays within 20 MB, nothing
is downloaded, unloaded or lost, and everyone else is answered meanwhile."""

import http.client
import json
import os
import sys
import time
from pathlib import Path

import pytest

from tests.compat.test_hostile_internet import RSS_SLACK, rss
from tests.live_server import live_server

ROOT = Path(__file__).resolve().parents[2]
CHAT = {"model": "smollm2-135m", "messages": [{"role": "user", "content": "Hi"}], "stream": False,
        "options": {"num_predict": 2, "temperature": 0}}


@pytest.fixture(scope="module")
def server(native_libraries, smollm2_path, tmp_path_factory):
    cache, home = tmp_path_factory.mktemp("cache"), tmp_path_factory.mktemp("home")
    command = [sys.executable, "-m", "reame", "run", str(smollm2_path), "--serve", "--port", "0", "--ctx", "2048",
               "--threads", "2", "--parallel", "2"]
    env = dict(os.environ, PYTHONPATH=str(ROOT), REAME_CACHE=str(cache), REAME_HOME=str(home),
               REAME_LIBLLAMA=str(native_libraries.lib_dir / "libllama.so"))
    with live_server(command, env=env) as live:
        live.home = home  # type: ignore[attr-defined]
        yield live


def send(server, method: str, path: str, raw: bytes | None = None, headers: dict[str, str] | None = None):
    """(status, parsed body, seconds taken), with exactly the headers given (and http.client's Host unless
    one is given)."""
    port = int(server.base.rsplit(":", 1)[1])
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    started = time.monotonic()
    connection.request(method, path, body=raw, headers=headers or {})
    response = connection.getresponse()
    data = response.read()
    connection.close()
    return response.status, json.loads(data) if data else None, time.monotonic() - started


def json_call(server, path: str, body: dict):
    return send(server, "POST", path, json.dumps(body).encode(), {"Content-Type": "application/json"})


def test_a_web_page_can_neither_pull_nor_unload_nor_read_through_a_rebound_name(server):
    """Finding 4: a text/plain POST from any page's origin, and DNS rebinding."""
    assert json_call(server, "/api/chat", CHAT)[0] == 200
    before = rss(server.process.pid)
    port = server.base.rsplit(":", 1)[1]
    page = {"Origin": "https://evil.example", "Content-Type": "text/plain;charset=UTF-8"}
    attacks = [("POST", "/api/pull", json.dumps({"model": "qwen3.5-9b"}).encode(), page),
               ("POST", "/api/generate", json.dumps({"model": "smollm2-135m", "keep_alive": 0}).encode(), page),
               ("POST", "/api/pull", json.dumps({"model": "qwen3.5-9b"}).encode(),
                {"Content-Type": "text/plain"}),  # a browser that sends no Origin
               ("GET", "/api/tags", None, {"Host": f"evil.example:{port}"}),
               ("POST", "/api/chat", json.dumps(CHAT).encode(),
                {"Host": f"evil.example:{port}", "Origin": f"http://evil.example:{port}",
                 "Content-Type": "application/json"})]
    for _ in range(5):
        for method, path, raw, headers in attacks:
            status, answer, seconds = send(server, method, path, raw, headers)
            assert status in (403, 415) and answer["error"], (path, headers, status, answer)
            assert seconds < 1.0
    assert rss(server.process.pid) - before < RSS_SLACK
    assert not (server.home / "models").exists()  # no download began
    status, ps, _ = send(server, "GET", "/api/ps")
    assert status == 200 and [model["name"] for model in ps["models"]] == ["smollm2-135m"]  # still loaded
    own = {"Origin": server.base, "Content-Type": "application/json"}  # the server's own web page
    assert send(server, "POST", "/api/chat", json.dumps(CHAT).encode(), own)[0] == 200


def test_pull_is_off_unless_the_server_allows_it(server):
    """Finding 5: any client could fill the disk with the catalog."""
    status, answer, seconds = json_call(server, "/api/pull", {"model": "qwen3.5-9b", "stream": False})
    assert status == 403 and "server.allow_pull" in answer["error"] and seconds < 1.0
    assert not (server.home / "models").exists()


def test_no_client_can_unload_the_first_model(server):
    """Finding 6: an empty /api/generate with keep_alive 0, repeated, left the next chat to load the model."""
    for _ in range(3):
        status, answer, seconds = json_call(server, "/api/generate", {"model": "smollm2-135m", "keep_alive": 0})
        assert status == 200 and answer["done_reason"] == "load" and seconds < 1.0
        status, answer, _ = json_call(server, "/api/chat", dict(CHAT, keep_alive=0))
        assert status == 200
    status, ps, _ = send(server, "GET", "/api/ps")
    assert [model["name"] for model in ps["models"]] == ["smollm2-135m"]


def test_thousands_of_embedding_inputs_are_a_400_at_once(server):
    """Finding 1: 5,000 one-letter inputs to /api/embed (a 25 KB body) took 100 s and 67 s of CPU."""
    before = rss(server.process.pid)
    for path, body in (("/api/embed", {"model": "smollm2-135m", "input": ["a"] * 5000}),
                       ("/v1/embeddings", {"input": ["a"] * 5000})):
        for _ in range(3):
            status, answer, seconds = json_call(server, path, body)
            assert status == 400 and "2048" in json.dumps(answer) and seconds < 1.0, (path, status, seconds)
    assert rss(server.process.pid) - before < RSS_SLACK
    status, answer, _ = json_call(server, "/api/embed", {"model": "smollm2-135m", "input": ["a", "b"]})
    assert status == 200 and len(answer["embeddings"]) == 2


def test_stored_responses_count_what_they_echo_and_keep_other_keys(server):
    """Finding 2: four requests with `metadata` of 2^20 empty objects took RSS from 428 to 732 MiB for an hour."""
    ask = {"model": "smollm2-135m", "input": "Hi", "max_output_tokens": 1, "temperature": 0}
    status, kept, _ = json_call(server, "/v1/responses", ask)
    assert status == 200
    before = rss(server.process.pid)
    raw = json.dumps(dict(ask, metadata=[{}] * 2**20)).encode()
    for _ in range(4):
        status, answer, seconds = send(server, "POST", "/v1/responses", raw, {"Content-Type": "application/json"})
        assert status == 400 and "JSON objects" in answer["error"]["message"] and seconds < 1.0
    status, answer, _ = json_call(server, "/v1/responses", dict(ask, metadata={f"k{n}": "v" for n in range(17)}))
    assert status == 400 and answer["error"]["param"] == "metadata"
    assert rss(server.process.pid) - before < RSS_SLACK
    assert send(server, "GET", f"/v1/responses/{kept['id']}")[0] == 200
