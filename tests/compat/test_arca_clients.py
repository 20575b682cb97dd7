"""`reame arca` with the clients users point at Redis: redis-cli, redis-py (RESP2 and RESP3) and
redis-benchmark; kill -9 recovery; limits that disconnect."""

import os
import re
import signal
import socket
import subprocess
import sys
import threading
from contextlib import contextmanager
from pathlib import Path

import pytest
import redis

from tests.waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]


def pythons() -> list[str]:
    """The CPython 3.11+ interpreters of this machine (pyenv's, and the one running the tests): asyncio's server
    shutdown changed in 3.12.1, and users run the .pyz on whichever they have."""
    found = {sys.executable} | {str(path) for path in Path.home().glob(".pyenv/versions/3.1[1-9]*/bin/python3")}
    return sorted(found)


@contextmanager
def arca(directory: Path, *flags: str, python: str = sys.executable):
    """A `reame arca` process on a free port; yields (port, process); stopped with SIGTERM (exit 0)."""
    process = subprocess.Popen([python, "-m", "reame", "arca", "--port", "0", "--dir", str(directory),
                                *flags], stderr=subprocess.PIPE, text=True,
                               env=dict(os.environ, PYTHONPATH=str(ROOT)))
    port = None
    assert process.stderr is not None
    said = []
    for line in process.stderr:
        said.append(line)
        found = re.search(r"ARCA listening on 127\.0\.0\.1:(\d+)", line)
        if found:
            port = int(found.group(1))
            break
    if not port:
        process.kill()
        raise AssertionError(f"ARCA did not say where it listens (exit {process.wait(timeout=30)}): {''.join(said)}")
    drain = threading.Thread(target=process.stderr.read, daemon=True)
    drain.start()
    try:
        yield port, process
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            assert process.wait(timeout=30) == 0


def cli(port: int, *words: str, password: str | None = None) -> str:
    auth = ["-a", password, "--no-auth-warning"] if password else []
    result = subprocess.run(["redis-cli", "-p", str(port), *auth, *words], capture_output=True, text=True,
                            timeout=30)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def test_redis_cli_works_unmodified(tmp_path):
    with arca(tmp_path) as (port, _):
        assert cli(port, "PING") == "PONG"
        assert cli(port, "SET", "greeting", "hello world", "EX", "100") == "OK"
        assert cli(port, "GET", "greeting") == "hello world"
        assert cli(port, "TTL", "greeting") in ("99", "100")
        assert cli(port, "MSET", "a", "1", "b", "2") == "OK"
        assert cli(port, "MGET", "a", "c", "b").splitlines() == ["1", "", "2"]
        assert cli(port, "DEL", "a", "b", "c") == "2"
        assert cli(port, "XADD", "corpus", "1-1", "tokens", "abc") == "1-1"
        assert cli(port, "XRANGE", "corpus", "-", "+").splitlines() == ["1-1", "tokens", "abc"]
        assert cli(port, "--scan", "--pattern", "g*") == "greeting"
        assert "redis_version:" in cli(port, "INFO", "server")
        assert cli(port, "DBSIZE") == "2"
        assert "ERR unknown command" in cli(port, "NOSUCH")
        # Typed lines, as in an interactive session (inline commands under the hood for telnet users).
        typed = subprocess.run(["redis-cli", "-p", str(port)], input="SET x 'a b'\nGET x\n", capture_output=True,
                               text=True, timeout=30)
        assert typed.stdout.splitlines() == ["OK", "a b"]


@pytest.mark.parametrize("protocol", [2, 3])
def test_redis_py_works_unmodified(tmp_path, protocol):
    with arca(tmp_path) as (port, _):
        client = redis.Redis(port=port, protocol=protocol, client_name="reame-test")
        assert client.ping() is True
        assert client.set("k", "v", ex=60) is True and client.get("k") == b"v" and 0 < client.ttl("k") <= 60
        assert client.set("k", "w", nx=True) is None and client.set("k", "w", xx=True, get=True) == b"v"
        assert client.mset({"a": "1", "b": "2"}) is True and client.mget("a", "b", "z") == [b"1", b"2", None]
        assert client.exists("a", "b", "z") == 2 and client.delete("a", "z") == 1
        assert client.expire("b", 30) is True and client.persist("b") is True and client.ttl("b") == -1
        assert client.client_getname() in ("reame-test", b"reame-test") and client.client_id() > 0
        assert sorted(client.scan_iter(match="*")) == [b"b", b"k"]
        first = client.xadd("s", {"f": "v"})
        assert client.xlen("s") == 1 and client.xrange("s") == [(first, {b"f": b"v"})]
        read = client.xread({"s": "0"})
        assert (read == [[b"s", [(first, {b"f": b"v"})]]]) if protocol == 2 else (read == {b"s": [[(first, {
            b"f": b"v"})]]})
        pipe = client.pipeline(transaction=False)
        for i in range(100):
            pipe.set(f"p{i}", i)
        pipe.get("p99")
        assert pipe.execute()[-1] == b"99"
        assert client.dbsize() == 103 and client.info()["redis_version"]
        assert client.flushdb() is True and client.dbsize() == 0


@pytest.mark.parametrize("python", pythons(), ids=lambda path: Path(path).parts[-3])
def test_sigterm_stops_it_at_once_with_clients_still_connected(tmp_path, python):
    """A serving node keeps its connection open: ARCA must not wait for it (on Python 3.12.1 and 3.13 it did
    forever), nor for a client blocked in XREAD, and what was written is kept."""
    with arca(tmp_path, python=python) as (port, process):
        idle = redis.Redis(port=port)
        assert idle.set("kept", "yes")
        blocked = socket.create_connection(("127.0.0.1", port))
        blocked.sendall(b"XREAD BLOCK 0 STREAMS nothing $\r\n")
        wait_until(lambda: "blocked_clients:1" in cli(port, "INFO", "clients"), what="the XREAD to block")
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0  # (it would hang until the clients left)
        blocked.close()
        idle.close()
    with arca(tmp_path, python=python) as (port, _):
        assert cli(port, "GET", "kept") == "yes"


def test_xread_block_wakes_when_another_client_adds(tmp_path):
    with arca(tmp_path) as (port, _):
        reader, writer = redis.Redis(port=port), redis.Redis(port=port)
        got = []
        waiting = threading.Thread(target=lambda: got.append(reader.xread({"s": "$"}, block=20000)))
        waiting.start()
        wait_until(lambda: any("cmd=xread" in line for line in writer.execute_command("CLIENT", "LIST")
                               .decode().splitlines()))
        added = writer.xadd("s", {"tokens": "1 2 3"})
        waiting.join(timeout=20)
        assert got == [[[b"s", [(added, {b"tokens": b"1 2 3"})]]]]
        assert reader.xread({"s": "$"}, block=50) == []  # a timeout is an empty answer


def test_requirepass_with_redis_cli_and_redis_py(tmp_path):
    with arca(tmp_path, "--requirepass", "s3cret") as (port, _):
        assert cli(port, "GET", "k").startswith("NOAUTH")
        assert cli(port, "SET", "k", "v", password="s3cret") == "OK"
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=port, password="wrong").ping()
        assert redis.Redis(port=port, password="s3cret").get("k") == b"v"
        assert redis.Redis(port=port, password="s3cret", protocol=3).get("k") == b"v"


def test_oversized_or_malformed_requests_get_an_error_and_the_connection_closed(tmp_path):
    with arca(tmp_path) as (port, _):
        for request in (b"*1\r\n$999999999999\r\n", b"*2\r\n+GET\r\n", b"GET " + b"k" * 70000 + b"\r\n"):
            with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
                sock.sendall(request)
                reply = b""
                while chunk := sock.recv(4096):
                    reply += chunk
            assert reply.startswith(b"-ERR Protocol error")
        assert redis.Redis(port=port).ping()  # the daemon carries on


def test_kill_9_loses_at_most_the_last_second_and_never_a_torn_record(tmp_path):
    with arca(tmp_path) as (port, process):
        client = redis.Redis(port=port)
        for i in range(200):
            client.set(f"k{i}", "x" * i)
        client.xadd("corpus", {"tokens": "1 2 3"})
        # Within a second the daemon fsyncs what was written: a kill then loses none of it.
        wait_until(lambda: (lambda info: info["aof_fsynced_size"] == info["aof_current_size"] > 200 * 40)(
            client.info("persistence")), timeout_s=5)
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=10)
    with open(tmp_path / "appendonly.aof", "ab") as torn:
        torn.write(b"*3\r\n$3\r\nSET\r\n$4\r\nlost")  # a write cut in the middle
    with arca(tmp_path) as (port, _):
        client = redis.Redis(port=port)
        assert client.dbsize() == 201 and client.get("k199") == b"x" * 199 and client.xlen("corpus") == 1
        assert client.get("lost") is None


def test_redis_benchmark_runs_against_it(tmp_path):
    with arca(tmp_path) as (port, _):
        result = subprocess.run(["redis-benchmark", "-p", str(port), "-t", "ping,set,get", "-n", "2000", "-P", "16",
                                 "-q"], capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr
        for test in ("PING_INLINE", "PING_MBULK", "SET", "GET"):
            assert re.search(rf"{test}: [\d.]+ requests per second", result.stdout), result.stdout


def exchange_until_closed_or_quiet(port: int, request: bytes) -> bytes:
    """Send `request`; what comes back until the server closes the connection or is quiet for half a second
    (a reply is complete by then)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request)
        sock.settimeout(0.5)
        reply = b""
        try:
            while chunk := sock.recv(4096):
                reply += chunk
        except (TimeoutError, ConnectionResetError):
            pass
    return reply


HOSTILE = [  # (a request, and whether it needs the password to be set), as issue 32 sent them
    (b"SET k v EX 9223372036854775807\r\n", False),
    (b"SET k v EX 9223372036854775\r\n", False),
    (b"SET k v PX 9223372036854775807\r\n", False),
    (b"SET k v EXAT 9223372036854776\r\n", False),
    (b"SET present v\r\nEXPIRE present 9223372036854775807\r\n", False),
    (b"SET present v\r\nPEXPIREAT present 9223372036854775807\r\nEXISTS present\r\n", False),
    (b"POST / HTTP/1.1\r\nHost: localhost\r\nContent-Length: 15\r\n\r\nSET pwned yes\r\n", False),
    (b"GET / HTTP/1.1\r\nHost: localhost\r\n\r\nSET pwned yes\r\n", False),
    (b"*11\r\n", True),
    (b"*2\r\n$3\r\nGET\r\n$16385\r\n", True),
    (b"*2\r\n$3\r\nGET\r\n$16384\r\n" + b"k" * 16384 + b"\r\n", True),
]


@pytest.mark.parametrize("request_bytes, with_password", HOSTILE)
def test_hostile_requests_get_what_redis_server_answers(tmp_path, request_bytes, with_password):
    from tests.compat.test_arca_nodes import redis_server
    password = ["--requirepass", "secret"] if with_password else []
    with arca(tmp_path / "arca", *password) as (arca_port, _):
        ours = exchange_until_closed_or_quiet(arca_port, request_bytes)
        assert redis.Redis(port=arca_port, password="secret" if with_password else None).exists("pwned") == 0
    (tmp_path / "redis").mkdir()
    with redis_server(tmp_path / "redis") as (redis_port, _):
        if with_password:
            redis.Redis(port=redis_port).config_set("requirepass", "secret")
        theirs = exchange_until_closed_or_quiet(redis_port, request_bytes)
    assert ours == theirs


def u32s(*tokens: int) -> bytes:
    return b"".join(token.to_bytes(4, "little") for token in tokens)


def test_the_originals_corpus_commands_with_its_own_client_code(tmp_path):
    """The original's L4 example, as its users wrote it with redis-py: OBSERVE [10..14], then DRAFT from
    [10, 11, 12] gives [13, 14]; what was observed is a corpus stream (XRANGE shows it) and survives a
    restart; the nodes' corpus streams draft too; the original's errors for bad payloads and lengths."""
    with arca(tmp_path) as (port, _):
        client = redis.Redis(port=port)
        assert client.execute_command("ARCA.OBSERVE", u32s(10, 11, 12, 13, 14)) == b"OK"
        assert client.execute_command("ARCA.DRAFT", u32s(10, 11, 12), "4") == u32s(13, 14)
        assert client.execute_command("arca.draft", u32s(99, 10, 11, 12), "1") == u32s(13)  # the last 3 count
        assert client.execute_command("ARCA.DRAFT", u32s(7, 8, 9), "4") is None  # never seen
        assert client.execute_command("ARCA.DRAFT", u32s(12, 13, 14), "4") is None  # nothing follows
        assert client.execute_command("ARCA.DRAFT", u32s(11, 12), "4") is None  # fewer than 3 tokens
        assert client.execute_command("ARCA.OBSERVE", b"") == b"OK"  # accepted, ignored
        assert client.execute_command("ARCA.OBSERVE", u32s(10, 11, 12, 50, 51)) == b"OK"
        assert client.execute_command("ARCA.DRAFT", u32s(10, 11, 12), "4") == u32s(50, 51)  # the newest
        assert [fields[b"tokens"] for _, fields in client.xrange("reame:corpus:original")] == \
            [u32s(10, 11, 12, 13, 14), u32s(10, 11, 12, 50, 51)]
        client.xadd("reame:corpus:" + "ab" * 16, {"node": "n1", "tokens": u32s(1, 2, 3, 4, 5, 6)})
        assert client.execute_command("ARCA.DRAFT", u32s(2, 3, 4), "8") == u32s(5, 6)  # a node's generation
        for words, error in [(("ARCA.OBSERVE", b"abc"), "token payload must be whole u32s"),
                             (("ARCA.DRAFT", b"abcde", "4"), "token payload must be whole u32s"),
                             (("ARCA.DRAFT", u32s(1, 2, 3), "four"), "draft length is not an integer"),
                             (("ARCA.DRAFT", u32s(1, 2, 3), "0"), "draft length must be positive"),
                             (("ARCA.DRAFT", u32s(1, 2, 3)), "wrong number of arguments for 'arca.draft'")]:
            with pytest.raises(redis.ResponseError, match=error):
                client.execute_command(*words)
        assert cli(port, "ARCA.OBSERVE", "abc") == "ERR token payload must be whole u32s"
    with arca(tmp_path) as (port, _):  # after a restart, from the append-only file
        assert redis.Redis(port=port).execute_command("ARCA.DRAFT", u32s(10, 11, 12), "4") == u32s(50, 51)
