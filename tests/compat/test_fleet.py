"""A fleet: two real SmolLM2 nodes sharing one real redis-server, or a 3-node Redis Cluster made with
redis-cli --cluster create. A document node A read is restored by node B instead of prefilled, with the
same greedy answer; a document warmed on A (POST /v1/warm) is warm on B; each response names its node;
a store that is full (OOM) costs a publication, never a request."""

import json
import os
import sys
import urllib.request
from contextlib import ExitStack
from pathlib import Path

import pytest

from reame.arca.stores import connect, parse_remote
from reame.cache.remote import RemoteKV
from reame.cache.store import Snapshot
from tests.live_server import live_server, post_json
from tests.nginx import nginx
from tests.waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
from redis_servers import redis_cluster, redis_server  # noqa: E402

DOCUMENT = " ".join(f"Clause {n}: the tenant of unit {n} pays {40 + n} euros for {n % 5 + 1} parking spaces, "
                    f"due on day {n % 28 + 1} of the month." for n in range(1, 26))
WARMED = " ".join(f"Rule {n}: machine {n} is serviced every {n + 2} weeks by team {n % 4}." for n in range(1, 30))


def chat(base: str, system: str, question: str) -> tuple[dict, dict]:
    return post_json(base, "/v1/chat/completions", {
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
        "max_tokens": 16, "temperature": 0, "reame": {"cache": False}})


def counter(base: str, name: str) -> float:
    with urllib.request.urlopen(base + "/stats", timeout=30) as response:
        samples = json.loads(response.read())["samples"]
    return sum(s["value"] for s in samples if s["name"] == name)


@pytest.mark.parametrize("kind", ["redis-server", "cluster"])
def test_a_document_read_on_one_node_is_restored_on_the_other(native_libraries, smollm2_path, tmp_path, kind):
    with ExitStack() as stack:
        if kind == "cluster":
            ports = stack.enter_context(redis_cluster(tmp_path / "cluster"))
            remote = "redis+cluster://" + ",".join(f"127.0.0.1:{port}" for port in ports[:2])  # any nodes will do
        else:
            port, _ = stack.enter_context(redis_server(tmp_path / "redis"))
            remote = f"redis://127.0.0.1:{port}/0"
        command = [sys.executable, "-m", "reame", "run", str(smollm2_path), "--serve", "--port", "0", "--ctx",
                   "2048", "--threads", "2"]

        def node(name: str) -> str:  # a machine of its own: its own caches, the fleet's store
            env = dict(os.environ, PYTHONPATH=str(ROOT), REAME_ARCA_REMOTE=remote, REAME_SERVER_NODE_NAME=name,
                       REAME_CACHE_DIR=str(tmp_path / name / "kv"), REAME_CACHE_ANSWERS_DIR=str(tmp_path / name / "a"),
                       REAME_SPECULATIVE_PALIMPSEST_DIR=str(tmp_path / name / "p"))
            return stack.enter_context(live_server(command, env=env)).base
        first, second = node("node-a"), node("node-b")
        headers, answered = chat(first, DOCUMENT, "Who pays 52 euros?")
        assert headers["X-Reame-Node"] == "node-a" and answered["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        wait_until(lambda: counter(first, "reame_kv_remote_published_total") >= 1, 60, "node A's publication")
        headers, restored = chat(second, DOCUMENT, "Who pays 52 euros?")
        assert headers["X-Reame-Node"] == "node-b"
        assert restored["usage"]["prompt_tokens_details"]["cached_tokens"] >= answered["usage"]["prompt_tokens"] - 16
        assert restored["choices"][0]["message"] == answered["choices"][0]["message"]
        assert counter(second, "reame_kv_remote_hits_total") == 1
        assert counter(second, "reame_kv_remote_bytes_read_total") > 1 << 20

        warmed = post_json(first, "/v1/warm", {"messages": [{"role": "system", "content": WARMED}]})[1]
        assert warmed["warmed"] and warmed["shared"]
        wait_until(lambda: counter(first, "reame_kv_remote_published_total") >= 2, 60, "the warmed document")
        _, later = chat(second, WARMED, "How often is machine 7 serviced?")
        assert later["usage"]["prompt_tokens_details"]["cached_tokens"] >= warmed["tokens"] - 1


def test_a_full_store_costs_a_publication_never_a_request(tmp_path):
    with redis_server(tmp_path / "redis", "--maxmemory", "1mb", "--maxmemory-policy", "noeviction") as (port, _):
        address = parse_remote(f"redis://127.0.0.1:{port}")
        shared = RemoteKV(lambda: connect(address), b"f" * 32, 2.0, 64 << 20)
        tokens = tuple(range(64))
        assert shared.publish("a" * 40, Snapshot(tokens, os.urandom(3 << 20)), [b"k" * 16])
        assert shared.flush(30)
        assert shared.stats()["publish_failed"] == 1 and shared.stats()["published"] == 0
        assert shared.deepest([b"k" * 16]) is None  # nothing half-published is findable
        shared.close()


def test_nginx_with_the_fleet_config_routes_a_route_to_one_node(native_libraries, smollm2_path, tmp_path):
    """deploy/nginx-fleet.conf as shipped (its servers put on these ports): the same X-Reame-Route always
    reaches the same node, and routes spread over both; each response names its node."""
    command = [sys.executable, "-m", "reame", "run", str(smollm2_path), "--serve", "--port", "0", "--ctx", "512",
               "--threads", "1"]
    with ExitStack() as stack:
        bases = [stack.enter_context(live_server(command, env=dict(
            os.environ, PYTHONPATH=str(ROOT), REAME_SERVER_NODE_NAME=name, REAME_CACHE_DIR=str(tmp_path / name))))
            .base for name in ("node-a", "node-b")]
        fleet = (ROOT / "deploy" / "nginx-fleet.conf").read_text()
        for shipped, base in zip(("10.0.0.11:8080", "10.0.0.12:8080"), bases):
            fleet = fleet.replace(shipped, base.removeprefix("http://"))
        # The per-address rate limit left out: every request of this test comes from one address.
        proxy = "\n".join(line for line in (ROOT / "deploy" / "reame-proxy.conf").read_text().replace(
            "127.0.0.1:8080", "reame_fleet").splitlines() if not line.strip().startswith("limit_req "))
        work = tmp_path / "nginx"
        work.mkdir()
        (work / "fleet.conf").write_text(fleet)
        (work / "proxy.conf").write_text(proxy)
        port = stack.enter_context(nginx(work, f"include {work}/fleet.conf;\n"
                                               f"server {{ listen 127.0.0.1:{{port}}; include {work}/proxy.conf; }}"))

        def node_for(route: str) -> str | None:
            request = urllib.request.Request(f"http://127.0.0.1:{port}/health", headers={"X-Reame-Route": route})
            try:
                with urllib.request.urlopen(request, timeout=5) as response:
                    return response.headers["X-Reame-Node"]
            except OSError:
                return None
        wait_until(lambda: node_for("probe") is not None, 30, "nginx")
        assert {node_for("document-7") for _ in range(6)} in ({"node-a"}, {"node-b"})
        assert {node_for(f"document-{n}") for n in range(24)} == {"node-a", "node-b"}


def test_reame_warm_on_one_machine_warms_the_fleet(native_libraries, smollm2_path, tmp_path):
    """`reame warm` with arca.remote publishes before it exits: a node started later, with an empty cache of
    its own, restores the warmed file on its first request."""
    import subprocess
    with redis_server(tmp_path / "redis") as (port, _):
        env = dict(os.environ, PYTHONPATH=str(ROOT), REAME_ARCA_REMOTE=f"redis://127.0.0.1:{port}/0")
        (tmp_path / "rules.txt").write_text(WARMED)
        warmed = subprocess.run([sys.executable, "-m", "reame", "warm", str(smollm2_path), str(tmp_path / "rules.txt"),
                                 "--json", "--ctx", "2048"], capture_output=True, text=True,
                                env=dict(env, REAME_CACHE_DIR=str(tmp_path / "night" / "kv")), timeout=300)
        assert warmed.returncode == 0, warmed.stderr
        report = json.loads(warmed.stdout)
        assert report["shared"] is True
        command = [sys.executable, "-m", "reame", "run", str(smollm2_path), "--serve", "--port", "0", "--ctx", "2048",
                   "--threads", "2"]
        with live_server(command, env=dict(env, REAME_CACHE_DIR=str(tmp_path / "morning" / "kv"))) as server:
            _, answer = chat(server.base, WARMED, "How often is machine 3 serviced?")
            assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] >= report["tokens"] - 1


def test_with_the_fleets_secret_an_answer_rewritten_in_redis_is_not_served(native_libraries, smollm2_path, tmp_path):
    """Issue 49, finding 3 as written: someone with write access to the store rewrote node A's kept answer, and
    node B served it (X-Reame-Cache: hit, a phishing link). With arca.secret, B computes the answer itself."""
    import redis
    with ExitStack() as stack:
        port, _ = stack.enter_context(redis_server(tmp_path / "redis"))
        command = [sys.executable, "-m", "reame", "run", str(smollm2_path), "--serve", "--port", "0", "--ctx",
                   "2048", "--threads", "2"]

        def node(name: str) -> str:
            env = dict(os.environ, PYTHONPATH=str(ROOT), REAME_ARCA_REMOTE=f"redis://127.0.0.1:{port}/0",
                       REAME_ARCA_SECRET="the fleet's secret", REAME_CACHE_DIR=str(tmp_path / name / "kv"),
                       REAME_CACHE_ANSWERS_DIR=str(tmp_path / name / "a"),
                       REAME_SPECULATIVE_PALIMPSEST_DIR=str(tmp_path / name / "p"))
            return stack.enter_context(live_server(command, env=env)).base
        first, second = node("node-a"), node("node-b")
        ask = {"messages": [{"role": "user", "content": "Name a fruit."}], "max_tokens": 8, "temperature": 0}
        _, answered = post_json(first, "/v1/chat/completions", ask)
        text = answered["choices"][0]["message"]["content"]
        store = redis.Redis(port=port)
        (key,) = store.keys("reame:answer:*")
        kept = store.get(key)
        assert text.encode() in kept  # sealed, not hidden: the tag comes first
        store.set(key, kept.replace(text.encode(), b"Visit http://evil.example"))
        headers, again = post_json(second, "/v1/chat/completions", ask)
        assert headers["X-Reame-Cache"] == "miss" and "evil.example" not in json.dumps(again)
        assert again["choices"][0]["message"]["content"] == text  # computed by B itself
