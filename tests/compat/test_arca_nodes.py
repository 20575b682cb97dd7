"""Two Reame servers (SmolLM2) sharing exact answers through one store: ARCA, and a real redis-server.
An answer of one is a hit on the other; with the store killed, both keep answering."""

import json
import os
import subprocess
import sys
import urllib.request
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest
import redis

from tests.compat.test_arca_clients import arca
from tests.live_server import free_port, live_server
from tests.waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]
CHAT = {"messages": [{"role": "user", "content": "Name the largest planet."}], "max_tokens": 16, "temperature": 0}


@contextmanager
def redis_server(directory: Path):
    port = free_port()
    process = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                "--appendonly", "no", "--dir", str(directory)], stdout=subprocess.DEVNULL)
    wait_until(lambda: _answers(port))
    try:
        yield port, process
    finally:
        if process.poll() is None:
            process.terminate()
            process.wait(30)


def _answers(port: int) -> bool:
    try:
        return redis.Redis(port=port, socket_timeout=1).ping()
    except redis.ConnectionError:
        return False


def post(base: str, body: dict) -> dict:
    request = urllib.request.Request(base + "/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def hits(base: str) -> float:
    with urllib.request.urlopen(base + "/stats", timeout=30) as response:
        samples = json.loads(response.read())["samples"]
    return sum(s["value"] for s in samples
               if s["name"] == "reame_answers_hits_total")


@pytest.mark.parametrize("kind", ["arca", "redis-server"])
def test_two_nodes_share_answers_and_survive_the_store(native_libraries, smollm2_path, tmp_path, kind):
    with ExitStack() as stack:
        port, store = stack.enter_context(arca(tmp_path / "arca") if kind == "arca" else redis_server(tmp_path))
        # An ARCA named as the original Reame's configs name it (host:port), a Redis by its URL.
        remote = f"127.0.0.1:{port}" if kind == "arca" else f"redis://127.0.0.1:{port}/0"
        env = dict(os.environ, PYTHONPATH=str(ROOT), REAME_ARCA_REMOTE=remote,
                   REAME_CACHE_DIR=str(tmp_path / "kv"), REAME_SPECULATIVE_PALIMPSEST_DIR=str(tmp_path / "pal"))
        command = [sys.executable, "-m", "reame", "run", str(smollm2_path), "--serve", "--port", "0", "--ctx", "2048",
                   "--threads", "2"]
        # Two machines: each its own disk of kept answers, so the second finds the answer only in the store.
        first, second = (stack.enter_context(live_server(command, env=dict(
            env, REAME_CACHE_ANSWERS_DIR=str(tmp_path / machine)))).base for machine in ("a1", "a2"))
        answered = post(first, CHAT)
        hit = post(second, CHAT)
        assert hit["choices"][0]["message"]["content"] == answered["choices"][0]["message"]["content"]
        assert hit["usage"]["prompt_tokens_details"]["cached_tokens"] == hit["usage"]["prompt_tokens"]
        assert hits(second) == 1 and hits(first) == 0
        assert len(redis.Redis(port=port).keys("reame:answer:*")) == 1  # standard commands: any client sees it
        store.kill()
        store.wait(10)
        for base in (first, second):  # the store is gone: a miss, then a backoff; never a failed request
            for question in ("Name a small planet.", "Name the largest planet."):
                answer = post(base, dict(CHAT, messages=[{"role": "user", "content": question}]))
                assert answer["choices"][0]["message"]["content"]


def ask_marked(base: str, question: str) -> tuple[str, dict]:
    body = {"messages": [{"role": "system", "content": "The shop closes at 16:00 on Saturdays."},
                         {"role": "user", "content": question}], "max_tokens": 16, "temperature": 0}
    request = urllib.request.Request(base + "/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return response.headers["X-Reame-Cache"], json.loads(response.read())


@pytest.mark.parametrize("kind", ["arca", "redis-server"])
def test_two_nodes_share_the_semantic_caches_questions(native_libraries, smollm2_path, model_path, tmp_path, kind):
    """The semantic cache's questions are a stream per scope in the store: a question one node answered
    answers a retyped form of it on the other, which never saw it; any Redis client sees the stream."""
    minilm = model_path("all-minilm-l6-v2")
    with ExitStack() as stack:
        port, store = stack.enter_context(arca(tmp_path / "arca") if kind == "arca" else redis_server(tmp_path))
        env = dict(os.environ, PYTHONPATH=str(ROOT), REAME_ARCA_REMOTE=f"redis://127.0.0.1:{port}/0",
                   REAME_CACHE_DIR=str(tmp_path / "kv"), REAME_SPECULATIVE_PALIMPSEST_DIR=str(tmp_path / "pal"),
                   REAME_CACHE_SEMANTIC="true", REAME_CACHE_SEMANTIC_MODEL=str(minilm))
        command = [sys.executable, "-m", "reame", "run", str(smollm2_path), "--serve", "--port", "0", "--ctx", "2048",
                   "--threads", "2"]
        first, second = (stack.enter_context(live_server(command, env=dict(
            env, REAME_CACHE_ANSWERS_DIR=str(tmp_path / machine)))).base for machine in ("a1", "a2"))
        said, answered = ask_marked(first, "What time does the shop close on Saturdays?")
        assert said == "miss"
        said, hit = ask_marked(second, "what time does the shop close on saturdays")
        assert said == "semantic" and hit["choices"][0]["message"] == answered["choices"][0]["message"]
        streams = redis.Redis(port=port).keys("reame:semantic:*")
        assert len(streams) == 1 and redis.Redis(port=port).xlen(streams[0]) == 1
        assert 0 < redis.Redis(port=port).pttl(streams[0])  # it expires with the answers it points at
        store.kill()
        store.wait(10)
        said, _ = ask_marked(second, "What time does the shop close on Saturdays, please?")
        assert said == "miss"  # the store is gone: computed, never a failed request
