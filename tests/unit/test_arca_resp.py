"""RESP: the request parser (whole, in pieces, malformed, oversized) and the reply encoder."""

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reame.arca.resp import OK, Error, ProtocolError, RequestParser, Simple, command_bytes, encode, split_inline

PIPELINE = b"*1\r\n$4\r\nPING\r\n*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$5\r\na\r\nb\x00\r\nGET k\r\n\r\n*0\r\n"
COMMANDS = [[b"PING"], [b"SET", b"k", b"a\r\nb\x00"], [b"GET", b"k"]]


def test_a_pipeline_parses_whole_and_byte_by_byte_alike():
    assert RequestParser().feed(PIPELINE) == COMMANDS
    parser, found = RequestParser(), []
    for i in range(len(PIPELINE)):
        found += parser.feed(PIPELINE[i:i + 1])
    assert found == COMMANDS


def test_a_large_bulk_arriving_in_pieces_is_returned_once_whole():
    payload = bytes(range(256)) * 4096
    data = command_bytes(b"SET", b"big", payload)
    parser = RequestParser()
    assert [parser.feed(data[i:i + 1000]) for i in range(0, len(data) - 1000, 1000)] == \
        [[]] * len(range(0, len(data) - 1000, 1000))
    assert parser.feed(data[(len(data) - 1) // 1000 * 1000:]) == [[b"SET", b"big", payload]]


@pytest.mark.parametrize("line, words", [
    (b"SET k v", [b"SET", b"k", b"v"]),
    (b"  GET\t k  ", [b"GET", b"k"]),
    (b'SET k "a b\\n\\x41"', [b"SET", b"k", b"a b\nA"]),
    (b"SET k 'it\\'s'", [b"SET", b"k", b"it's"]),
    (b"", []),
])
def test_inline_words(line, words):
    assert split_inline(line) == words


@pytest.mark.parametrize("data, message", [
    (b"*abc\r\n", "invalid multibulk length"),
    (b"*2000000\r\n", "invalid multibulk length"),
    (b"*1\r\n+PING\r\n", "expected '\\$'"),
    (b"*1\r\n$-1\r\n", "invalid bulk length"),
    (b"*1\r\n$x\r\n", "invalid bulk length"),
    (b"*1\r\n$999999999999\r\n", "invalid bulk length"),
    (b"*1\r\n$4\r\nPINGxx", "must end with CRLF"),
    (b"GET " + b"k" * 70000, "too big inline request"),
    (b'SET k "unterminated\r\n', "unbalanced quotes"),
    (b"*1\r\n$" + b"1" * 40, "line too long"),
])
def test_malformed_input_is_a_protocol_error(data, message):
    with pytest.raises(ProtocolError, match=message):
        RequestParser().feed(data)


def test_limits_are_checked_before_anything_is_allocated():
    parser = RequestParser(max_bulk=10, max_items=3)
    with pytest.raises(ProtocolError):
        parser.feed(b"*1\r\n$11\r\n")  # no payload sent yet: refused on the length alone
    with pytest.raises(ProtocolError):
        RequestParser(max_items=3).feed(b"*4\r\n")


@pytest.mark.parametrize("reply, resp2, resp3", [
    (None, b"$-1\r\n", b"_\r\n"),
    (OK, b"+OK\r\n", b"+OK\r\n"),
    (Simple("PONG"), b"+PONG\r\n", b"+PONG\r\n"),
    (Error("ERR bad\r\nthing"), b"-ERR bad  thing\r\n", b"-ERR bad  thing\r\n"),
    (42, b":42\r\n", b":42\r\n"),
    (b"", b"$0\r\n\r\n", b"$0\r\n\r\n"),
    ("é", b"$2\r\n\xc3\xa9\r\n", b"$2\r\n\xc3\xa9\r\n"),
    ([b"a", None, [1]], b"*3\r\n$1\r\na\r\n$-1\r\n*1\r\n:1\r\n", b"*3\r\n$1\r\na\r\n_\r\n*1\r\n:1\r\n"),
    ({"k": 1}, b"*2\r\n$1\r\nk\r\n:1\r\n", b"%1\r\n$1\r\nk\r\n:1\r\n"),
])
def test_replies_encode_as_redis_does(reply, resp2, resp3):
    assert encode(reply) == resp2 and encode(reply, resp3=True) == resp3


# Words rich in what could confuse a parser that splits at CRLF: CRLF itself, headers, quotes, long items.
WORDS = st.one_of(st.sampled_from([b"GET", b"SET", b"\r\n", b"$3\r\nabc", b"*2\r\n", b"\r", b"\n", b"'", b'"', b"",
                                   b"x" * 5000]), st.binary(max_size=12))
COMMANDS_OR_LINES = st.lists(st.one_of(
    st.lists(WORDS, min_size=1, max_size=4).map(lambda words: command_bytes(*words)),
    st.lists(st.sampled_from([b"PING", b"GET", b"k", b"'a b'", b" ", b"\t"]), max_size=4).map(
        lambda words: b" ".join(words) + b"\r\n"),
    st.binary(max_size=16),  # malformed, mostly
), max_size=12).map(b"".join)


def parsed(data: bytes, piece: int) -> list[list[bytes]] | str:
    """What RequestParser makes of `data` fed in pieces of `piece` bytes: the commands, or the error."""
    parser, found = RequestParser(), []
    try:
        for i in range(0, len(data), piece):
            found += parser.feed(data[i:i + piece])
    except ProtocolError as error:
        return f"error: {error}"
    return found


@settings(max_examples=int(os.environ.get("REAME_FUZZ_EXAMPLES", "300")), deadline=None)
@given(COMMANDS_OR_LINES)
def test_the_fast_path_and_the_general_parser_agree_on_any_input(data):
    """Whole reads take the fast path (plain_commands) for what it can; byte by byte, only the general parser
    runs. Valid or not, both must make the same of the same bytes."""
    assert parsed(data, len(data) or 1) == parsed(data, 1)


def test_an_item_holding_crlf_or_a_long_item_leaves_the_fast_path_without_harm():
    data = command_bytes(b"SET", b"k", b"a\r\n$1\r\nb") + command_bytes(b"SET", b"big", b"y" * 10000) + b"PING\r\n"
    assert RequestParser().feed(data) == [[b"SET", b"k", b"a\r\n$1\r\nb"], [b"SET", b"big", b"y" * 10000],
                                          [b"PING"]]
