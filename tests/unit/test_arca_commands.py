"""ARCA's commands in process: Redis's replies and errors, expiry, eviction, streams, the append-only file."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reame.arca.resp import OK, Error, Simple, command_bytes
from reame.arca.server import Arca, ArcaSettings, Client
from reame.arca.store import now_ms
from reame.arca.aof import AOF_NAME
from tests.waiting import wait_until


@pytest.fixture
def arca(tmp_path):
    server = Arca(ArcaSettings(directory=tmp_path))
    yield server
    server.aof.close()


def run(arca, *words, client=None):
    client = client or Client("test")
    client.authenticated = True
    return arca.execute(client, [w if isinstance(w, bytes) else str(w).encode() for w in words])


def test_strings_and_their_options(arca):
    assert run(arca, "SET", "k", "v") == OK
    assert run(arca, "GET", "k") == b"v" and run(arca, "GET", "none") is None
    assert run(arca, "SET", "k", "w", "NX") is None and run(arca, "GET", "k") == b"v"
    assert run(arca, "SET", "new", "w", "XX") is None and run(arca, "EXISTS", "new") == 0
    assert run(arca, "SET", "k", "w", "XX", "GET") == b"v" and run(arca, "GET", "k") == b"w"
    assert run(arca, "SET", "k", "x", "EX", "100") == OK and 99 <= run(arca, "TTL", "k") <= 100
    assert run(arca, "SET", "k", "y", "KEEPTTL") == OK and run(arca, "TTL", "k") > 0
    assert run(arca, "SET", "k", "z") == OK and run(arca, "TTL", "k") == -1
    assert run(arca, "MSET", "a", "1", "b", "2") == OK
    assert run(arca, "MGET", "a", "none", "b") == [b"1", None, b"2"]
    assert run(arca, "DEL", "a", "b", "none") == 2 and run(arca, "EXISTS", "k", "k", "a") == 2
    assert run(arca, "DBSIZE") == 1 and run(arca, "TYPE", "k") == Simple("string")


@pytest.mark.parametrize("words, error", [
    (("SET", "k"), "ERR wrong number of arguments for 'set' command"),
    (("SET", "k", "v", "NX", "XX"), "ERR syntax error"),
    (("SET", "k", "v", "EX", "0"), "ERR invalid expire time in 'set' command"),
    (("SET", "k", "v", "EX", "ten"), "ERR value is not an integer or out of range"),
    (("SET", "k", "v", "EX", "1", "PX", "1"), "ERR syntax error"),
    (("MSET", "a", "1", "b"), "ERR wrong number of arguments for 'mset' command"),
    (("GET",), "ERR wrong number of arguments for 'get' command"),
    (("SELECT", "1"), "ERR DB index is out of range"),
    (("EXPIRE", "k", "10", "NX", "XX"), "ERR NX and XX, GT or LT options at the same time are not compatible"),
    (("SCAN", "x"), "ERR invalid cursor"),
    (("FROB", "a"), "ERR unknown command 'FROB', with args beginning with: 'a'"),
    (("AUTH", "pw"), "ERR AUTH <password> called without any password configured for the default user. "
                     "Are you sure your configuration is correct?"),
    (("HELLO", "4"), "NOPROTO unsupported protocol version"),
    (("XADD", "s", "0-0", "f", "v"), "ERR The ID specified in XADD must be greater than 0-0"),
    (("XADD", "s", "1-1", "f"), "ERR wrong number of arguments for 'xadd' command"),
])
def test_errors_are_redis_own(arca, words, error):
    assert run(arca, *words) == Error(error)


def test_expiry_relative_absolute_and_conditional(arca):
    run(arca, "SET", "k", "v")
    assert run(arca, "EXPIRE", "k", "100", "XX") == 0 and run(arca, "TTL", "k") == -1
    assert run(arca, "PEXPIRE", "k", "50000") == 1 and 49000 < run(arca, "PTTL", "k") <= 50000
    assert run(arca, "EXPIRE", "k", "10", "GT") == 0 and run(arca, "EXPIRE", "k", "10", "LT") == 1
    assert run(arca, "PERSIST", "k") == 1 and run(arca, "TTL", "k") == -1
    assert run(arca, "TTL", "none") == -2 and run(arca, "EXPIRE", "none", "5") == 0
    run(arca, "SET", "gone", "v", "PXAT", now_ms() - 1)
    assert run(arca, "GET", "gone") is None and run(arca, "EXISTS", "gone") == 0
    assert run(arca, "EXPIRE", "k", "-1") == 1 and run(arca, "EXISTS", "k") == 0  # a past deadline deletes


def test_the_byte_budget_evicts_least_recently_used_keys(tmp_path):
    arca = Arca(ArcaSettings(directory=tmp_path, max_bytes=1000))
    try:
        for i in range(10):
            run(arca, "SET", f"k{i}", "x" * 100)
            run(arca, "GET", "k0")  # k0 stays recently used
        assert arca.keyspace.used_bytes <= 1000
        assert run(arca, "EXISTS", "k0") == 1 and run(arca, "EXISTS", "k1") == 0 and run(arca, "EXISTS", "k9") == 1
        assert arca.keyspace.evicted > 0
    finally:
        arca.aof.close()


def test_scan_returns_every_key_present_throughout_whatever_changes(arca):
    for i in range(200):
        run(arca, "SET", f"key:{i}", "v")
    seen, cursor, rounds = set(), b"0", 0
    while True:
        cursor, keys = run(arca, "SCAN", cursor, "COUNT", "7", "MATCH", "key:*")
        seen.update(keys)
        run(arca, "SET", f"added:{rounds}", "v")  # changes in between
        run(arca, "DEL", f"key:{190 + rounds % 10}")
        rounds += 1
        if cursor == b"0":
            break
    assert {f"key:{i}".encode() for i in range(190)} <= seen
    assert not any(key.startswith(b"added") for key in seen)  # MATCH filters


def test_streams(arca):
    assert run(arca, "XADD", "s", "5-1", "f", "v") == b"5-1"
    assert run(arca, "XADD", "s", "5-*", "g", "w") == b"5-2"
    assert run(arca, "XADD", "s", "5-1", "f", "v") == \
        Error("ERR The ID specified in XADD is equal or smaller than the target stream top item")
    assert run(arca, "XADD", "s", "7", "h", "x") == b"7-0"
    automatic = run(arca, "XADD", "s", "*", "i", "y")
    assert int(automatic.split(b"-")[0]) >= now_ms() - 1000
    assert run(arca, "XLEN", "s") == 4 and run(arca, "XLEN", "none") == 0
    assert run(arca, "XRANGE", "s", "-", "+", "COUNT", "2") == [[b"5-1", [b"f", b"v"]], [b"5-2", [b"g", b"w"]]]
    assert run(arca, "XRANGE", "s", "5", "5") == [[b"5-1", [b"f", b"v"]], [b"5-2", [b"g", b"w"]]]
    assert run(arca, "XRANGE", "s", "(5-1", "7") == [[b"5-2", [b"g", b"w"]], [b"7-0", [b"h", b"x"]]]
    assert run(arca, "XREAD", "COUNT", "1", "STREAMS", "s", "5-2") == [[b"s", [[b"7-0", [b"h", b"x"]]]]]
    assert run(arca, "XREAD", "STREAMS", "s", "$") is None
    assert run(arca, "XTRIM", "s", "MAXLEN", "2") == 2 and run(arca, "XLEN", "s") == 2
    assert run(arca, "XADD", "s", "MAXLEN", "=", "1", "*", "j", "z") and run(arca, "XLEN", "s") == 1
    assert run(arca, "XADD", "none", "NOMKSTREAM", "*", "f", "v") is None and run(arca, "EXISTS", "none") == 0
    run(arca, "SET", "str", "v")
    assert run(arca, "XADD", "str", "*", "f", "v") == Error("WRONGTYPE Operation against a key holding the wrong "
                                                           "kind of value")
    assert run(arca, "GET", "s") == Error("WRONGTYPE Operation against a key holding the wrong kind of value")


def test_requirepass_guards_every_command_but_auth_hello_and_quit(tmp_path):
    arca = Arca(ArcaSettings(directory=tmp_path, requirepass="s3cret"))
    try:
        client = Client("test")
        call = lambda *words: arca.execute(client, [w.encode() for w in words])  # noqa: E731
        assert call("GET", "k") == Error("NOAUTH Authentication required.")
        assert call("AUTH", "wrong") == Error("WRONGPASS invalid username-password pair or user is disabled.")
        assert call("AUTH", "other", "s3cret") == Error("WRONGPASS invalid username-password pair or user is "
                                                        "disabled.")
        assert call("HELLO", "3", "AUTH", "default", "s3cret")["proto"] == 3 and client.resp3
        assert call("GET", "k") is None
    finally:
        arca.aof.close()


def test_the_append_only_file_replays_after_a_restart_with_absolute_expiries(tmp_path):
    arca = Arca(ArcaSettings(directory=tmp_path))
    run(arca, "SET", "k", "v", "EX", "1000")
    run(arca, "MSET", "a", "1", "b", "2")
    run(arca, "DEL", "b")
    run(arca, "XADD", "s", "*", "f", "v")
    deadline = now_ms() + 5
    run(arca, "SET", "short", "v", "PXAT", deadline)
    arca.aof.close()
    wait_until(lambda: now_ms() > deadline)
    again = Arca(ArcaSettings(directory=tmp_path))
    try:
        assert run(again, "GET", "k") == b"v" and 990 < run(again, "TTL", "k") <= 1000
        assert run(again, "MGET", "a", "b") == [b"1", None]
        assert run(again, "XLEN", "s") == 1
        assert run(again, "EXISTS", "short") == 0  # its deadline passed meanwhile
    finally:
        again.aof.close()


@pytest.mark.parametrize("tail", [b"*3\r\n$3\r\nSET\r\n$1\r\nx", b"*2\r\n$3\r\nDEL\r\n$99\r\nshort\r\n", b"*"])
def test_a_torn_tail_is_cut_and_never_loaded(tmp_path, tail):
    arca = Arca(ArcaSettings(directory=tmp_path))
    run(arca, "SET", "kept", "v")
    arca.aof.close()
    path = tmp_path / AOF_NAME
    whole = path.read_bytes()
    path.write_bytes(whole + tail)
    again = Arca(ArcaSettings(directory=tmp_path))
    try:
        assert run(again, "GET", "kept") == b"v" and run(again, "DBSIZE") == 1
        assert path.read_bytes() == whole  # cut back to the last whole command
        run(again, "SET", "after", "v")
    finally:
        again.aof.close()
    assert path.read_bytes() == whole + command_bytes(b"SET", b"after", b"v")


def test_a_rewrite_keeps_the_keyspace_and_what_was_written_meanwhile(tmp_path):
    import asyncio
    arca = Arca(ArcaSettings(directory=tmp_path))
    for i in range(50):
        run(arca, "SET", "k", str(i))  # 50 records for one key
    run(arca, "XADD", "s", "3-0", "f", "v")
    run(arca, "SET", "t", "v", "EX", "500")

    async def rewrite_with_a_write_meanwhile():
        task = asyncio.create_task(arca.rewrite())
        await asyncio.sleep(0)
        run(arca, "SET", "during", "v")
        await task

    asyncio.run(rewrite_with_a_write_meanwhile())
    arca.aof.close()
    assert arca.aof.rewrites == 1 and (tmp_path / AOF_NAME).read_bytes().count(b"\r\nk\r\n") == 1
    again = Arca(ArcaSettings(directory=tmp_path))
    try:
        assert run(again, "MGET", "k", "during") == [b"49", b"v"]
        assert run(again, "XRANGE", "s", "-", "+") == [[b"3-0", [b"f", b"v"]]] and run(again, "TTL", "t") > 400
        assert run(again, "XADD", "s", "2-0", "f", "v") == Error(
            "ERR The ID specified in XADD is equal or smaller than the target stream top item")
    finally:
        again.aof.close()


def test_a_draft_over_a_large_corpus_that_matches_nothing_stays_bounded(arca):
    """ARCA.DRAFT searches at most the newest 8 MiB of the corpus (no index kept beside it): a tail found
    nowhere in 32 MiB of generations costs milliseconds, and one found only in the oldest is not found."""
    from tests.cpu import cpu_clock
    oldest = b"".join(t.to_bytes(4, "little") for t in (7, 8, 9, 10))
    assert run(arca, "ARCA.OBSERVE", oldest) == OK
    filler = bytes(range(256)) * 4096  # 1 MiB of tokens that never hold 7, 8, 9 in a row
    for _ in range(32):
        assert run(arca, "ARCA.OBSERVE", filler) == OK
    with cpu_clock() as clock:
        drafts = [run(arca, "ARCA.DRAFT", oldest[:12], "4") for _ in range(10)]
    assert drafts == [None] * 10 and clock.seconds < 1.0


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(words=st.lists(st.binary(max_size=40) | st.sampled_from([b"1", b"0", b"-5", b"99999999999999999999999",
                                                                 b"4.0", b" 4", b"\x00" * 12]), max_size=4))
def test_any_corpus_command_gets_a_reply_or_an_error_quickly(arca, words):
    from tests.cpu import cpu_clock
    with cpu_clock() as clock:
        replies = [run(arca, name, *words) for name in (b"ARCA.OBSERVE", b"ARCA.DRAFT")]
    assert all(reply is None or isinstance(reply, (bytes, Error)) or reply == OK for reply in replies)
    assert clock.seconds < 0.1
