"""RESP, the Redis protocol: an incremental, bounded request parser and the reply encoders.

Requests are arrays of bulk strings (`*2\\r\\n$3\\r\\nGET\\r\\n$1\\r\\nk\\r\\n`) or inline
lines (`GET k\\r\\n`, as typed into telnet). The parser keeps where it stopped, so a
large bulk arriving in pieces is scanned once, not again at every piece; every
length is bounded before anything is allocated, and anything malformed raises
ProtocolError (the server answers `-ERR Protocol error: …` and closes, as Redis does).

Replies are RESP2 unless the connection said `HELLO 3`: then nulls are `_` and maps
`%`, as RESP3 clients expect.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Union

MAX_BULK_BYTES = 512 * 1024 * 1024  # Redis's proto-max-bulk-len default
MAX_ARRAY_ITEMS = 1024 * 1024
MAX_INLINE_BYTES = 64 * 1024
# Before a client has authenticated (where a password is required), as Redis bounds it.
UNAUTHENTICATED_BULK_BYTES = 16384
UNAUTHENTICATED_ARRAY_ITEMS = 10
ITEM_OVERHEAD = 64  # bytes a parsed item costs beyond its own (the bytes object, its list slot)
# Array and bulk length headers the fast path (plain_commands) reads by table lookup, not int().
SMALL_COUNTS = {b"*%d" % count: count for count in range(1, 65)}
SMALL_HEADERS = tuple(b"$%d" % length for length in range(4096))

Reply = Union[None, int, bytes, str, list, dict, "Error", "Simple"]


class ProtocolError(Exception):
    """Malformed or oversized input: answer it and close the connection (after running `before`, the
    whole commands that came ahead of it, as Redis does)."""

    before: list[list[bytes]] = []


class Error(str):
    """An error reply (`-ERR …`)."""


class Simple(str):
    """A status reply (`+OK`)."""


OK = Simple("OK")


class RequestParser:
    """Bytes in, commands (lists of bytes) out; feed() whatever the socket gave."""

    def __init__(self, max_bulk: int = MAX_BULK_BYTES, max_items: int = MAX_ARRAY_ITEMS,
                 max_inline: int = MAX_INLINE_BYTES) -> None:
        self.max_bulk, self.max_items, self.max_inline = max_bulk, max_items, max_inline
        self.unauthenticated = False  # Redis's tighter limits, with their own error texts
        self._buffer = bytearray()
        self._position = 0  # where the command being read started
        # An array being read: the items read so far, how many are expected, where to read next.
        self._items: list[bytes] | None = None
        self._items_bytes = 0  # what those items cost (ITEM_OVERHEAD each)
        self._expected = 0
        self._cursor = 0
        self._needed = 0  # bytes the buffer must hold before a retry can progress

    @property
    def pending_bytes(self) -> int:
        """What input not yet made into whole commands holds: Redis's query buffer."""
        return len(self._buffer) - self._position + self._items_bytes

    def feed(self, data: bytes, limit: int | None = None) -> list[list[bytes]]:
        """The complete commands `data` finished (empty ones dropped), at most `limit` (the rest stays for
        the next call: an unauthenticated client's commands are read one at a time, each under the limits
        its turn has); ProtocolError on bad input."""
        commands: list[list[bytes]] = []
        if limit is None and not self.unauthenticated and not self._buffer and self._items is None and \
                len(data) <= self.max_bulk:
            # Nothing pending: the whole, plain commands at the start go the fast way (a pipeline mostly is).
            commands, used = plain_commands(data, self.max_items, self.max_inline)
            if used == len(data):
                return commands
            data = data[used:]
        self._buffer += data
        while limit is None or len(commands) < limit:
            if len(self._buffer) < self._needed:
                break
            try:
                command = self._next()
            except ProtocolError as error:
                error.before = commands
                raise
            if command is None:
                break
            if command:
                commands.append(command)
        if self._position and self._items is None:
            del self._buffer[:self._position]  # keep only what is not parsed yet
            self._cursor -= self._position
            self._needed = max(0, self._needed - self._position)
            self._position = 0
        return commands

    def whole_commands(self, data: bytes) -> tuple[list[list[bytes]], int, bool]:
        """The whole commands at the start of `data`, which holds RESP arrays only (an append-only file), how
        many bytes they take, and whether parsing stopped at a malformed command (else at the end of `data`,
        or in an unfinished one)."""
        self._buffer += data
        commands: list[list[bytes]] = []
        while self._position < len(self._buffer):
            if self._buffer[self._position] != ord("*"):
                return commands, self._position, True
            try:
                command = self._next()
            except ProtocolError:
                return commands, self._position, True
            if command is None:
                break
            if command:
                commands.append(command)
        return commands, self._position, False

    def _next(self) -> list[bytes] | None:
        buffer = self._buffer
        if self._items is None:
            if self._position >= len(buffer):
                return None
            if buffer[self._position] != ord("*"):
                return self._inline()
            end = self._line_end(self._position, self.max_inline)
            if end < 0:
                return None
            count = self._number(buffer[self._position + 1:end], "multibulk length")
            if self.unauthenticated and count > UNAUTHENTICATED_ARRAY_ITEMS:
                raise ProtocolError("unauthenticated multibulk length")
            if count > self.max_items:
                raise ProtocolError("invalid multibulk length")
            self._cursor = end + 2
            if count <= 0:
                self._position = self._cursor
                return []
            self._items, self._expected = [], count
        items = self._items
        # The hot loop (every bulk of every command): locals, and no copies but the item itself.
        expected, cursor, size, find = self._expected, self._cursor, len(buffer), buffer.find
        while len(items) < expected:
            if cursor >= size:
                self._cursor, self._needed = cursor, cursor + 1
                return None
            if buffer[cursor] != 36:  # "$"
                raise ProtocolError(f"expected '$', got '{chr(buffer[cursor])}'")
            end = find(b"\r\n", cursor, cursor + 34)
            if end < 0:
                if size - cursor > 32:
                    raise ProtocolError("line too long")
                self._cursor, self._needed = cursor, size + 1
                return None
            digits = buffer[cursor + 1:end]
            if not digits.isdigit():
                raise ProtocolError("invalid bulk length")
            length = int(digits)
            if self.unauthenticated and length > UNAUTHENTICATED_BULK_BYTES:
                raise ProtocolError("unauthenticated bulk length")
            if length > self.max_bulk:
                raise ProtocolError("invalid bulk length")
            start = end + 2
            stop = start + length
            if size < stop + 2:
                self._cursor, self._needed = cursor, stop + 2  # wait for the whole bulk, without rescanning
                return None
            if buffer[stop] != 13 or buffer[stop + 1] != 10:
                raise ProtocolError("a bulk string must end with CRLF")
            items.append(bytes(buffer[start:stop]))
            self._items_bytes += length + ITEM_OVERHEAD
            cursor = stop + 2
        self._items, self._needed, self._items_bytes = None, 0, 0
        self._cursor = self._position = cursor
        return items

    def _inline(self) -> list[bytes] | None:
        end = self._buffer.find(b"\n", self._position)
        if end < 0:
            if len(self._buffer) - self._position > self.max_inline:
                raise ProtocolError("too big inline request")
            self._needed = len(self._buffer) + 1
            return None
        if end - self._position > self.max_inline:
            raise ProtocolError("too big inline request")
        line = bytes(self._buffer[self._position:end]).rstrip(b"\r")
        self._position = end + 1
        self._needed = 0
        return split_inline(line)

    def _line_end(self, start: int, limit: int) -> int:
        """Where the CRLF ending the line at `start` is (-1: not arrived; ProtocolError past `limit`)."""
        end = self._buffer.find(b"\r\n", start, start + limit + 2)
        if end < 0 and len(self._buffer) - start > limit:
            raise ProtocolError("line too long")
        return end

    @staticmethod
    def _number(digits: bytes | bytearray, what: str) -> int:
        text = bytes(digits)
        if not text or not (text.isdigit() or (text[:1] == b"-" and text[1:].isdigit())):
            raise ProtocolError(f"invalid {what}")
        return int(text)


def plain_commands(data: bytes, max_items: int, max_inline: int) -> tuple[list[list[bytes]], int]:
    """The whole commands at the start of `data` whose bulk strings hold no CRLF, and inline commands
    without quotes, and how many bytes they take; it stops at anything else (an unfinished or
    malformed command, an empty line), which the general parser then reads or refuses.

    Splitting at every CRLF in one call lines a command's items up with its length headers when
    no item holds a CRLF; when one does, the token after its header is shorter than the header
    says, so the check of every header against its item's length catches it and stops here."""
    parts = data.split(b"\r\n")
    last = len(parts) - 1  # the bytes after the final CRLF: never a whole line
    commands: list[list[bytes]] = []
    done = 0  # tokens of the whole commands read so far
    small_count, header = SMALL_COUNTS.get, SMALL_HEADERS.__getitem__
    while done < last:
        head = parts[done]
        count = small_count(head)
        if count is None:
            if head[:1] == b"*":
                if not head[1:].isdigit():
                    break
                count = int(head[1:])
            elif not head or len(head) > max_inline or b"\n" in head or b'"' in head or b"'" in head:
                break
            else:  # an inline command
                words = head.split()
                if words:
                    commands.append(words)
                done += 1
                continue
        end = done + 1 + 2 * count
        if count == 0 or count > max_items or end > last:
            break
        items = parts[done + 2:end:2]
        try:
            if parts[done + 1:end:2] != list(map(header, map(len, items))):
                break
        except IndexError:  # an item too long for the table: the general parser reads it
            break
        commands.append(items)
        done = end
    return commands, sum(map(len, parts[:done])) + 2 * done


SPACES = b" \t\n\r\x0b\x0c"  # what bytes.split() splits at, as plain_commands does


def split_inline(line: bytes) -> list[bytes]:
    """Words of an inline command: white space (C's isspace(), as in Redis) separates them; "double" or
    'single' quotes keep spaces (with \\n, \\r, \\t, \\\\, \\" and \\xHH escapes in double quotes), as
    redis-cli's input does."""
    words: list[bytes] = []
    i, n = 0, len(line)
    while True:
        while i < n and line[i] in SPACES:
            i += 1
        if i >= n:
            return words
        word = bytearray()
        quote = line[i] if line[i] in b"\"'" else 0
        if quote:
            i += 1
            while True:
                if i >= n:
                    raise ProtocolError("unbalanced quotes in request")
                c = line[i]
                if c == quote:
                    i += 1
                    if i < n and line[i] not in SPACES:
                        raise ProtocolError("unbalanced quotes in request")
                    break
                if c == ord("\\") and quote == ord('"') and i + 1 < n:
                    i += 1
                    escaped = line[i]
                    if escaped == ord("x") and i + 2 < n + 0 and _is_hex(line[i + 1:i + 3]):
                        word.append(int(line[i + 1:i + 3], 16))
                        i += 3
                        continue
                    word.append({ord("n"): 10, ord("r"): 13, ord("t"): 9, ord("b"): 8, ord("a"): 7}.get(escaped,
                                                                                                       escaped))
                elif c == ord("\\") and quote == ord("'") and i + 1 < n and line[i + 1] == ord("'"):
                    i += 1
                    word.append(ord("'"))
                else:
                    word.append(c)
                i += 1
        else:
            while i < n and line[i] not in SPACES:
                word.append(line[i])
                i += 1
        words.append(bytes(word))


def _is_hex(pair: bytes) -> bool:
    return len(pair) == 2 and all(c in b"0123456789abcdefABCDEF" for c in pair)


def encode(reply: Reply, resp3: bool = False) -> bytes:
    """One reply: None is the null, int an integer, bytes/str a bulk string, Simple a status, Error an
    error, list an array (nested), dict a map (RESP3) or a flat array of pairs (RESP2)."""
    kind = type(reply)
    if kind is bytes:  # the common replies first: a value, OK, a miss
        return b"$%d\r\n%b\r\n" % (len(reply), reply)  # type: ignore[arg-type, str-format]
    if reply is OK:
        return b"+OK\r\n"
    if reply is None and not resp3:
        return b"$-1\r\n"
    if kind is Simple:
        return b"+%b\r\n" % reply.encode()  # type: ignore[union-attr]
    if kind is int:
        return b":%d\r\n" % reply  # type: ignore[str-format]
    out = bytearray()
    _encode(reply, resp3, out)
    return bytes(out)


def _encode(reply: Reply, resp3: bool, out: bytearray) -> None:
    if reply is None:
        out += b"_\r\n" if resp3 else b"$-1\r\n"
    elif isinstance(reply, Error):
        out += b"-" + reply.replace("\r", " ").replace("\n", " ").encode() + b"\r\n"
    elif isinstance(reply, Simple):
        out += b"+" + reply.encode() + b"\r\n"
    elif isinstance(reply, bool):
        out += (b"#t\r\n" if reply else b"#f\r\n") if resp3 else (b":1\r\n" if reply else b":0\r\n")
    elif isinstance(reply, int):
        out += b":%d\r\n" % reply
    elif isinstance(reply, (bytes, bytearray, memoryview)):
        out += b"$%d\r\n" % len(reply) + bytes(reply) + b"\r\n"
    elif isinstance(reply, str):
        data = reply.encode()
        out += b"$%d\r\n" % len(data) + data + b"\r\n"
    elif isinstance(reply, Mapping):
        out += (b"%%%d\r\n" % len(reply)) if resp3 else (b"*%d\r\n" % (2 * len(reply)))
        for key, value in reply.items():
            _encode(key, resp3, out)
            _encode(value, resp3, out)
    elif isinstance(reply, Iterable):
        items = list(reply)
        out += b"*%d\r\n" % len(items)
        for item in items:
            _encode(item, resp3, out)
    else:
        raise TypeError(f"cannot encode {type(reply).__name__} as RESP")


def set_command(key: bytes, value: bytes) -> bytes:
    """`command_bytes(b"SET", key, value)` in one step: the commonest append-only record."""
    return b"*3\r\n$3\r\nSET\r\n$%d\r\n%b\r\n$%d\r\n%b\r\n" % (len(key), key, len(value), value)


def command_bytes(*words: bytes | str | int) -> bytes:
    """A command as a RESP array of bulk strings (what clients send, and what the AOF holds)."""
    parts = [b"*%d\r\n" % len(words)]
    for word in words:
        data = word if type(word) is bytes else str(word).encode()
        parts.append(b"$%d\r\n%b\r\n" % (len(data), data))
    return b"".join(parts)
