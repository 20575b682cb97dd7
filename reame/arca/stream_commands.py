"""ARCA's stream commands (the corpus nodes share): XADD, XRANGE, XREAD [BLOCK], XLEN, XTRIM, XSETID."""

from __future__ import annotations

import bisect

from reame.arca.resp import OK, Error, Reply
from reame.arca.state import CORPUS_PREFIX, ArcaState
from reame.arca.store import StoreError, Stream, StreamId, fields_size, format_id, integer, now_ms, parse_id
from reame.arca.types import Blocked, Client



def cmd_xadd(state: ArcaState, client: Client, args: list[bytes]) -> Reply:
    key, rest = args[0], args[1:]
    create, max_length, min_id = True, None, None
    while rest and rest[0].upper() in (b"NOMKSTREAM", b"MAXLEN", b"MINID"):
        option = rest[0].upper()
        if option == b"NOMKSTREAM":
            create, rest = False, rest[1:]
            continue
        rest = rest[1:]
        if rest and rest[0] in (b"=", b"~"):
            rest = rest[1:]
        if not rest:
            return Error("ERR syntax error")
        if option == b"MAXLEN":
            max_length = integer(rest[0])
            if max_length < 0:
                return Error("ERR The MAXLEN argument must be >= 0.")
        else:
            min_id = parse_id(rest[0])
        rest = rest[1:]
        if rest and rest[0].upper() == b"LIMIT" and len(rest) >= 2:
            rest = rest[2:]
    if len(rest) < 3 or len(rest) % 2 == 0:
        return Error("ERR wrong number of arguments for 'xadd' command")
    pairs = list(rest[1:])
    added = fields_size(pairs)
    stream = state.keyspace.stream(key, create=False)
    state.keyspace.stream_fits(key, stream or Stream(), added)  # before anything is made or changed
    stream = stream or state.keyspace.stream(key, create)
    if stream is None:
        return None
    stream_id = _new_id(stream, rest[0])
    stream.ids.append(stream_id)
    stream.fields.append(pairs)
    stream.last_id = stream_id
    stream.size += added
    removed_size = stream.size
    if max_length is not None:
        stream.trim(max_length)
    if min_id is not None:
        _trim_min_id(stream, min_id)
    state.keyspace.stream_grew(key, added - (removed_size - stream.size))
    trim = (b"MAXLEN", max_length) if max_length is not None else (b"MINID", format_id(min_id)) \
        if min_id is not None else ()
    state.log(b"XADD", key, *trim, format_id(stream_id), *pairs)
    state.stream_added()
    if key.startswith(CORPUS_PREFIX):
        state.corpus_keys.add(key)
    return format_id(stream_id)


def _new_id(stream: Stream, text: bytes) -> StreamId:
    last = stream.last_id
    if text == b"*":
        ms = max(now_ms(), last[0])
        return (ms, last[1] + 1) if ms == last[0] else (ms, 0)
    if text.endswith(b"-*"):
        ms = parse_id(text[:-2])[0]
        candidate = (ms, last[1] + 1) if ms == last[0] else (ms, 0 if ms else 1)
    else:
        candidate = parse_id(text)
    if candidate == (0, 0):
        raise StoreError("ERR The ID specified in XADD must be greater than 0-0")
    if candidate <= last:
        raise StoreError("ERR The ID specified in XADD is equal or smaller than the target stream top item")
    return candidate


def _trim_min_id(stream: Stream, min_id: StreamId) -> int:
    cut = bisect.bisect_left(stream.ids, min_id)
    return stream.trim(len(stream.ids) - cut) if cut else 0


def cmd_xsetid(state: ArcaState, client: Client, args: list[bytes]) -> Reply:
    stream = state.keyspace.stream(args[0], create=False)
    if stream is None:
        return Error("ERR no such key")
    last = parse_id(args[1])
    if stream.ids and last < stream.ids[-1]:
        return Error("ERR The ID specified in XSETID is smaller than the target stream top item")
    stream.last_id = last
    state.log(b"XSETID", args[0], args[1])
    return OK


def cmd_xlen(state: ArcaState, client: Client, args: list[bytes]) -> Reply:
    stream = state.keyspace.stream(args[0], create=False)
    return len(stream.ids) if stream is not None else 0


def cmd_xtrim(state: ArcaState, client: Client, args: list[bytes]) -> Reply:
    key, rest = args[0], args[1:]
    strategy = rest[0].upper()
    rest = rest[1:]
    if rest and rest[0] in (b"=", b"~"):
        rest = rest[1:]
    if strategy not in (b"MAXLEN", b"MINID") or not rest:
        return Error("ERR syntax error")
    stream = state.keyspace.stream(key, create=False)
    if stream is None:
        return 0
    before = stream.size
    if strategy == b"MAXLEN":
        length = integer(rest[0])
        if length < 0:
            return Error("ERR The MAXLEN argument must be >= 0.")
        removed = stream.trim(length)
    else:
        removed = _trim_min_id(stream, parse_id(rest[0]))
    if removed:
        state.keyspace.stream_grew(key, stream.size - before)
        state.log(b"XTRIM", key, strategy, rest[0])
    return removed


def cmd_xrange(state: ArcaState, client: Client, args: list[bytes]) -> Reply:
    key, start, end = args[0], args[1], args[2]
    count = None
    if len(args) == 5 and args[3].upper() == b"COUNT":
        count = integer(args[4])
    elif len(args) != 3:
        return Error("ERR syntax error")
    stream = state.keyspace.stream(key, create=False)
    if stream is None or (count is not None and count <= 0):
        return []
    low = (0, 0) if start == b"-" else bound(start, low=True)
    high = (2**64 - 1, 2**64 - 1) if end == b"+" else bound(end, low=False)
    return entries(stream, low, high, count)


def cmd_xread(state: ArcaState, client: Client, args: list[bytes]) -> Reply | Blocked:
    count, block, rest = None, None, args
    while rest and rest[0].upper() in (b"COUNT", b"BLOCK"):
        if len(rest) < 2:
            return Error("ERR syntax error")
        value = integer(rest[1], "ERR timeout is not an integer or out of range")
        if rest[0].upper() == b"COUNT":
            count = value
        else:
            if value < 0:
                return Error("ERR timeout is negative")
            block = value
        rest = rest[2:]
    if not rest or rest[0].upper() != b"STREAMS" or len(rest) < 3 or len(rest) % 2 == 0:
        return Error("ERR Unbalanced 'xread' list of streams: for each stream key an ID or '$' must be "
                     "specified.")
    keys = rest[1:1 + (len(rest) - 1) // 2]
    starts = []
    for key, text in zip(keys, rest[1 + len(keys):]):
        stream = state.keyspace.stream(key, create=False)
        if text == b"$":
            starts.append(stream.last_id if stream is not None else (0, 0))
        else:
            starts.append(parse_id(text))

    def read() -> Reply:
        found = []
        for key, after in zip(keys, starts):
            stream = state.keyspace.stream(key, create=False)
            if stream is None:
                continue
            low = (after[0], after[1] + 1)
            got = entries(stream, low, (2**64 - 1, 2**64 - 1), count)
            if got:
                found.append([key, got])
        if not found:
            return None
        return {key: got for key, got in found} if client.resp3 else found

    reply = read()
    if reply is None and block is not None:
        return Blocked(read, block)
    return reply


def bound(text: bytes, low: bool) -> StreamId:
    """An XRANGE bound: `ms-seq`, `ms` (the whole millisecond), `(id` (exclusive)."""
    exclusive = text.startswith(b"(")
    if exclusive:
        text = text[1:]
    stream_id = parse_id(text, 0 if low else 2**64 - 1)
    if exclusive:
        stream_id = (stream_id[0], stream_id[1] + 1) if low else (stream_id[0], stream_id[1] - 1)
    return stream_id


def entries(stream: Stream, low: StreamId, high: StreamId, count: int | None) -> list:
    start = bisect.bisect_left(stream.ids, low)
    found: list = []
    for index in range(start, len(stream.ids)):
        if stream.ids[index] > high or (count is not None and len(found) >= count):
            break
        found.append([format_id(stream.ids[index]), list(stream.fields[index])])
    return found
