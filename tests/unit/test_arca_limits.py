"""ARCA against hostile clients and damaged files (issue 32): what an unauthenticated client may make it buffer,
a browser's request, too many or idle clients, one damaged byte in the log, values past the budget, SCAN and
expiry over a large keyspace, expiries it could not replay. Real sockets and redis-py, a daemon on a thread."""

import socket
import tracemalloc

import pytest
import redis

from reame import cli
from reame.arca import server as arca_server
from reame.arca.resp import command_bytes
from reame.arca.server import Arca, ArcaSettings
from reame.arca.store import ENTRY_OVERHEAD, EXPIRY_OVERHEAD, Keyspace, now_ms
from reame.arca.aof import AOF_NAME, LogDamaged, check_log
from tests.arca_thread import arca_thread
from tests.cpu import cpu_clock
from tests.sockets import until_closed
from tests.waiting import wait_until

from .test_arca_commands import run


def rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096


def test_before_auth_a_client_cannot_make_arca_buffer_more_than_a_few_kib(tmp_path):
    with arca_thread(tmp_path, requirepass="secret") as port:
        before = rss_bytes()
        with socket.create_connection(("127.0.0.1", port), timeout=20) as sock:
            mebibyte = b"x" * (1 << 20)  # 150 MiB before AUTH, one MiB at a time
            reply = until_closed(sock, b"*2\r\n$3\r\nGET\r\n$157286400\r\n", *[mebibyte] * 150)
        assert reply == b"-ERR Protocol error: unauthenticated bulk length\r\n"
        assert rss_bytes() - before < 20 << 20
        with socket.create_connection(("127.0.0.1", port), timeout=20) as sock:
            assert until_closed(sock, b"*11\r\n") == b"-ERR Protocol error: unauthenticated multibulk length\r\n"
        client = redis.Redis(port=port, password="secret")
        assert client.set("big", b"y" * 100_000) and len(client.get("big")) == 100_000  # authenticated: lifted


def test_auth_lifts_the_limits_for_the_commands_pipelined_after_it(tmp_path):
    with arca_thread(tmp_path, requirepass="secret") as port, \
            socket.create_connection(("127.0.0.1", port), timeout=20) as sock:
        big = b"v" * 50_000
        sock.sendall(command_bytes(b"AUTH", b"secret") + command_bytes(b"SET", b"k", big) + b"GET k\r\n")
        expected = b"+OK\r\n+OK\r\n$50000\r\n" + big + b"\r\n"
        got = b""
        while len(got) < len(expected):
            got += sock.recv(65536)
        assert got == expected


def test_a_query_buffer_past_its_limit_is_refused_and_closed(tmp_path):
    with arca_thread(tmp_path, max_query_bytes=1 << 20) as port:
        with socket.create_connection(("127.0.0.1", port), timeout=20) as sock:
            assert until_closed(sock, b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$104857600\r\n") == \
                b"-ERR Protocol error: invalid bulk length\r\n"  # a bulk it could never hold: at its header
        with socket.create_connection(("127.0.0.1", port), timeout=20) as sock:
            item = b"$100\r\n" + b"z" * 100 + b"\r\n"  # items arriving for a command that never ends
            reply = until_closed(sock, b"*100000\r\n" + item * 20_000)
            assert reply.startswith(b"-ERR Protocol error: query buffer of ") and b"client-query-buffer-limit" in reply
        assert redis.Redis(port=port).ping()


def test_a_web_page_cannot_write_into_arca(tmp_path):
    with arca_thread(tmp_path) as port:
        for request in (b"POST / HTTP/1.1\r\nHost: 127.0.0.1:6420\r\nContent-Length: 16\r\n\r\nSET pwned yes\r\n",
                        b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\nSET pwned yes\r\n"):
            with socket.create_connection(("127.0.0.1", port), timeout=20) as sock:
                reply = until_closed(sock, request)
            assert b"OK" not in reply  # closed at the POST or Host: line, before the body was run
        assert redis.Redis(port=port).exists("pwned") == 0


def test_clients_past_maxclients_are_refused_and_idle_ones_closed(tmp_path):
    with arca_thread(tmp_path, max_clients=2, timeout_s=0.5) as port:
        first, second = (socket.create_connection(("127.0.0.1", port), timeout=20) for _ in range(2))
        with first, second, socket.create_connection(("127.0.0.1", port), timeout=20) as third:
            assert until_closed(third) == b"-ERR max number of clients reached\r\n"
            assert until_closed(first) == b""  # idle past the timeout: closed by the chores
        assert redis.Redis(port=port).ping()


def test_a_client_that_does_not_authenticate_in_time_is_closed(tmp_path, monkeypatch):
    monkeypatch.setattr(arca_server, "AUTH_DEADLINE_S", 0.2)
    with arca_thread(tmp_path, requirepass="secret", timeout_s=0) as port, \
            socket.create_connection(("127.0.0.1", port), timeout=20) as sock:
        assert until_closed(sock, b"PING\r\n") == b"-NOAUTH Authentication required.\r\n"


def damaged_log(tmp_path, records=1000, damaged_record=10):
    """A log of `records` SETs with one byte flipped inside record `damaged_record` (counted from 0)."""
    arca = Arca(ArcaSettings(directory=tmp_path))
    for index in range(records):
        run(arca, "SET", f"key{index:04d}", f"value{index:04d}")
    arca.aof.close()
    path = tmp_path / AOF_NAME
    data = bytearray(path.read_bytes())
    record = len(command_bytes(b"SET", b"key0000", b"value0000"))
    data[record * damaged_record + 5] ^= 0xFF  # in the "$3" of SET
    path.write_bytes(bytes(data))
    return path, bytes(data), record


def test_one_damaged_byte_mid_log_stops_the_start_and_loses_nothing(tmp_path):
    path, data, record = damaged_log(tmp_path)
    with pytest.raises(LogDamaged) as raised:
        Arca(ArcaSettings(directory=tmp_path))
    assert f"damaged at byte {record * 10} of {len(data)}, after 10 whole commands" in str(raised.value)
    assert path.read_bytes() == data  # not cut, not loaded
    sound, report = check_log(path, fix=False)
    assert not sound and "then at byte" in report and "--fix" in report and path.read_bytes() == data


def test_check_aof_fix_moves_the_damaged_log_aside_and_keeps_what_came_before(tmp_path, capsys):
    path, data, record = damaged_log(tmp_path)
    assert cli.main(["arca", "--dir", str(tmp_path), "--check-aof"]) == 1
    assert cli.main(["arca", "--dir", str(tmp_path), "--check-aof", "--fix"]) == 0
    aside = [file for file in tmp_path.iterdir() if file.name.startswith(AOF_NAME + ".damaged-")]
    assert len(aside) == 1 and aside[0].read_bytes() == data  # every byte kept
    assert "moved the file to" in capsys.readouterr().out
    arca = Arca(ArcaSettings(directory=tmp_path))
    try:
        assert run(arca, "DBSIZE") == 10 and run(arca, "GET", "key0009") == b"value0009"
    finally:
        arca.aof.close()


def test_the_budget_counts_what_keys_really_cost():
    for value_bytes in (10, 1000):
        tracemalloc.start()
        keyspace = Keyspace()
        for index in range(50_000):
            keyspace.set(b"key:%08d" % index, bytes(value_bytes) + index.to_bytes(4, "little"),
                         now_ms() + 10**9 if index % 2 else None)
        real = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        assert 0.8 < keyspace.used_bytes / real < 1.25, (value_bytes, keyspace.used_bytes, real)
    assert ENTRY_OVERHEAD > 0 and EXPIRY_OVERHEAD > 0


def test_a_value_larger_than_the_whole_budget_is_refused_with_oom(tmp_path):
    with arca_thread(tmp_path, max_bytes=1 << 20) as port:
        client = redis.Redis(port=port)
        client.set("small", "kept")
        # redis-py reads "-OOM …" as Redis's own OutOfMemoryError
        with pytest.raises(redis.exceptions.OutOfMemoryError, match="command not allowed when used memory"):
            client.set("huge", b"x" * (20 << 20))
        with pytest.raises(redis.exceptions.OutOfMemoryError):
            client.xadd("stream", {"f": b"x" * (2 << 20)})
        assert client.get("small") == b"kept" and client.exists("huge", "stream") == 0
        assert client.info("memory")["used_memory"] <= 1 << 20


def cpu_seconds(work):
    with cpu_clock() as clock:
        result = work()
    return result, clock.seconds


def test_scan_over_a_large_keyspace_costs_what_it_returns_not_the_keyspace():
    keyspace = Keyspace()
    for index in range(200_000):
        keyspace.set(b"k%07d" % index, b"v", None)
    keyspace.set(b"one-more", b"v", None)  # a change: SCAN once sorted every key again after one
    (cursor, keys), seconds = cpu_seconds(lambda: keyspace.scan(0, 10, None, None))
    assert cursor and len(keys) < 200 and seconds < 0.05
    seen: set[bytes] = set()
    cursor = 0
    while True:
        cursor, keys = keyspace.scan(cursor, 1000, b"k00*", None)
        seen.update(keys)
        if cursor == 0:
            break
    assert seen == {b"k%07d" % index for index in range(100_000)}  # every match once the walk ends


def test_an_expiry_cycle_holds_the_loop_briefly_and_the_rest_expires_later(tmp_path):
    arca = Arca(ArcaSettings(directory=tmp_path))
    try:
        soon = now_ms() + 50
        for index in range(200_000):
            arca.keyspace.set(b"e%07d" % index, b"v", soon)
        wait_until(lambda: now_ms() > soon, what="the deadline")
        _, seconds = cpu_seconds(arca.expire_cycle)
        assert seconds < 0.2 and 0 < len(arca.keyspace) < 200_000  # ~25 ms of work, not all 200k at once
        while len(arca.keyspace):
            arca.expire_cycle()
    finally:
        arca.aof.close()


@pytest.mark.parametrize("command, error", [
    (("SET", "k", "v", "EX", "9223372036854775807"), "ERR invalid expire time in 'set' command"),
    (("SET", "k", "v", "EX", "9223372036854775"), "ERR invalid expire time in 'set' command"),
    (("SET", "k", "v", "PX", "9223372036854775807"), "ERR invalid expire time in 'set' command"),
    (("SET", "k", "v", "EXAT", "9223372036854776"), "ERR invalid expire time in 'set' command"),
    (("EXPIRE", "present", "9223372036854775807"), "ERR invalid expire time in 'expire' command"),
    (("PEXPIRE", "present", "9223372036854775807"), "ERR invalid expire time in 'pexpire' command"),
])
def test_an_expiry_redis_could_not_keep_is_refused_and_nothing_vanishes_at_a_restart(tmp_path, command, error):
    arca = Arca(ArcaSettings(directory=tmp_path))
    run(arca, "SET", "present", "v")
    assert run(arca, *command) == error
    arca.aof.close()
    again = Arca(ArcaSettings(directory=tmp_path))
    try:
        assert run(again, "GET", "present") == b"v" and run(again, "EXISTS", "k") == 0
        assert run(again, "PEXPIREAT", "present", "9223372036854775807") == 1  # the far future is a time
    finally:
        again.aof.close()
