"""The store client a Reame node uses: ARCA or a real Redis/Valkey, standard commands only.

A store is a speed-up, never a dependency: every call has a short timeout, a failure
marks the store down and answers as if it had nothing (a miss, a write not made),
and the next try waits a backoff that doubles up to BACKOFF_MAX_S. Thread-safe (one
connection, one lock: calls are a fraction of a millisecond on a local network).
A reply is read with bounds (its size, its items in all, its nesting) and within one deadline for the
whole reply, however slowly the bytes come: a store that sends more, or takes longer, is treated as down.
A Redis Cluster is reame/arca/cluster.py, over one client per node.
"""

from __future__ import annotations

import logging
import re
import socket
import threading
import time
import urllib.parse
from dataclasses import dataclass

from reame.arca.resp import command_bytes
from reame.errors import ConfigError

log = logging.getLogger("reame.arca")

TIMEOUT_S = 0.2
BACKOFF_START_S = 0.5
BACKOFF_MAX_S = 30.0


MAX_BULK_BYTES = 64 << 20  # a KV chunk is 4 MiB; nothing a node asks for is larger
MAX_REPLY_BYTES = 128 << 20  # a whole reply on the wire
MAX_REPLY_ITEMS = 1 << 16  # array items in a whole reply: each costs a Python object (36 MiB of them: +659 MiB)
MAX_DEPTH = 8  # stream replies nest 4 deep

REDIS_PORT = 6379  # a redis:// URL without a port, as Redis's own clients read it
ARCA_PORT = 6420  # `reame arca`'s port: the original's host[:port] form means an ARCA


class StoreDown(Exception):
    """The store could not be reached or answered nonsense (internal: callers never see it)."""


class ReplyError(Exception):
    """The store answered `-ERR …`."""


@dataclass(frozen=True)
class StoreAddress:
    host: str
    port: int
    password: str
    database: int

    @staticmethod
    def parse(text: str) -> StoreAddress:
        """`redis://[[user]:password@]host[:port][/db]` (port 6379 when omitted, as Redis's own URLs), or the
        original Reame's `host` / `host:port` / `[ipv6]:port`, which name an ARCA: port 6420 when omitted."""
        if "://" not in text:
            return StoreAddress._arca(text)
        try:
            parts = urllib.parse.urlsplit(text)
            if parts.scheme != "redis" or not parts.hostname:
                raise ValueError("not a redis:// URL with a host")
        except ValueError:  # urlsplit's own for a broken IPv6 host
            raise ConfigError(f"arca.remote must be host, host:port or redis://[:password@]host:port/0, "
                              f"got {text!r}") from None
        try:
            port = parts.port or REDIS_PORT
            database = int(parts.path.strip("/") or 0)
        except ValueError:
            raise ConfigError(f"arca.remote has a bad port or database number: {text!r}") from None
        return StoreAddress(parts.hostname, port, urllib.parse.unquote(parts.password or ""), database)

    @staticmethod
    def _arca(text: str) -> StoreAddress:
        """`host`, `host:port`, `[ipv6]` or `[ipv6]:port` (a bare IPv6 address has no port)."""
        host, port = text, str(ARCA_PORT)
        bracketed = re.fullmatch(r"\[([^\]]*)\](?::(\d+))?", text)
        if bracketed:
            host, port = bracketed.group(1), bracketed.group(2) or port
        elif text.count(":") == 1:
            host, port = text.split(":")
        if not host or any(c.isspace() or c in "/@?#[]" for c in host) or not (port.isascii() and port.isdigit()) \
                or not 0 < int(port) < 65536:
            raise ConfigError(f"arca.remote must be host, host:port or redis://[:password@]host:port/0, got {text!r}")
        return StoreAddress(host, int(port), "", 0)


class StoreCommands:
    """The commands nodes use, over `call` (never raising: None when the store is down or refused)."""

    timeout_s: float

    def call(self, *words: bytes, timeout_s: float | None = None) -> object:
        raise NotImplementedError

    @property
    def failures(self) -> int:
        """How often the store was found down so far: a reader with nothing to read waits longer meanwhile."""
        raise NotImplementedError

    def get(self, key: bytes) -> bytes | None:
        reply = self.call(b"GET", key)
        return reply if isinstance(reply, bytes) else None

    def set(self, key: bytes, value: bytes, ttl_ms: int = 0) -> bool:
        words = [b"SET", key, value] + ([b"PX", str(ttl_ms).encode()] if ttl_ms else [])
        return self.call(*words) == b"OK"

    def mget(self, keys: list[bytes]) -> list[bytes | None]:
        """The values of `keys` (in a cluster, keys of one hash slot), None for each missing one."""
        reply = self.call(b"MGET", *keys)
        if not isinstance(reply, list) or len(reply) != len(keys):
            return [None] * len(keys)
        return [value if isinstance(value, bytes) else None for value in reply]

    def xadd(self, stream: bytes, fields: dict[bytes, bytes], max_length: int) -> bytes | None:
        pairs = [item for pair in fields.items() for item in pair]
        reply = self.call(b"XADD", stream, b"MAXLEN", b"~", str(max_length).encode(), b"*", *pairs)
        return reply if isinstance(reply, bytes) else None

    def xread(self, stream: bytes, after: bytes, count: int,
              block_ms: int | None) -> list[tuple[bytes, dict[bytes, bytes]]]:
        """Entries of `stream` after id `after` (waiting up to `block_ms` for one; None: not waiting); [] on
        a timeout or failure."""
        block = [b"BLOCK", str(block_ms).encode()] if block_ms is not None else []
        reply = self.call(b"XREAD", b"COUNT", str(count).encode(), *block, b"STREAMS", stream, after,
                          timeout_s=self.timeout_s + (block_ms or 0) / 1000)
        try:
            entries = reply[0][1] if isinstance(reply, list) and len(reply[0]) == 2 else []
            return [(entry[0], dict(zip(entry[1][::2], entry[1][1::2]))) for entry in entries
                    if isinstance(entry[0], bytes) and isinstance(entry[1], list)]
        except (TypeError, IndexError, KeyError):  # not a stream reply: a store that is not what it claims
            return []

    def close(self) -> None:
        raise NotImplementedError


class StoreClient(StoreCommands):
    def __init__(self, address: StoreAddress, timeout_s: float = TIMEOUT_S) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._socket: socket.socket | None = None
        self._buffer = bytearray()
        self._down_until = 0.0
        self._backoff = BACKOFF_START_S
        self._failures = 0
        self._deadline = 0.0  # of the request being read, and what its reply has cost so far
        self._received = 0
        self._items = 0

    @property
    def failures(self) -> int:
        return self._failures

    def call(self, *words: bytes, timeout_s: float | None = None) -> object:
        """The reply, or None when the store is down (or answered an error)."""
        reply = self.request(words, timeout_s)
        if isinstance(reply, ReplyError):
            log.warning("the store refused %s: %s", words[0].decode(), reply)
            return None
        return reply

    def request(self, words: tuple[bytes, ...], timeout_s: float | None = None, asking: bool = False) -> object:
        """The reply, a ReplyError the store answered (a cluster's redirections among them), or None when
        the store is down. `asking`: send Redis Cluster's ASKING first, on the same connection."""
        if time.monotonic() < self._down_until:
            return None
        with self._lock:
            try:
                if self._socket is None:
                    self._connect()
                if asking:
                    self._request([b"ASKING"], timeout_s or self.timeout_s)
                return self._request(list(words), timeout_s or self.timeout_s)
            except ReplyError as error:
                return error
            except (OSError, StoreDown) as error:
                self._fail(error)
                return None

    def close(self) -> None:
        with self._lock:
            self._disconnect()

    # --- the connection ---

    def _fail(self, error: Exception) -> None:
        self._disconnect()
        self._failures += 1
        if self._backoff == BACKOFF_START_S:
            log.warning("the store at %s:%d is unreachable (%s); serving without it, retrying in %.1f s",
                        self.address.host, self.address.port, error, self._backoff)
        self._down_until = time.monotonic() + self._backoff
        self._backoff = min(self._backoff * 2, BACKOFF_MAX_S)

    def _disconnect(self) -> None:
        if self._socket is not None:
            self._socket.close()
        self._socket, self._buffer = None, bytearray()

    def _connect(self) -> None:
        sock = socket.create_connection((self.address.host, self.address.port), timeout=self.timeout_s)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._socket, self._buffer = sock, bytearray()
        if self.address.password:
            self._request([b"AUTH", self.address.password.encode()], self.timeout_s)
        if self.address.database:
            self._request([b"SELECT", str(self.address.database).encode()], self.timeout_s)
        if self._backoff != BACKOFF_START_S:
            log.info("the store at %s:%d is back", self.address.host, self.address.port)
        self._backoff = BACKOFF_START_S

    def _request(self, words: list[bytes], timeout_s: float) -> object:
        assert self._socket is not None
        self._deadline = time.monotonic() + timeout_s
        self._received, self._items = 0, 0
        self._socket.settimeout(timeout_s)
        self._socket.sendall(command_bytes(*words))
        return self._reply()

    def _reply(self, depth: int = 0) -> object:
        line = self._line()
        kind, rest = line[:1], bytes(line[1:])
        if kind == b"+":
            return rest
        if kind == b"-":
            raise ReplyError(rest.decode("utf-8", "replace"))
        if kind == b":":
            return self._number(rest)
        if kind == b"$":
            length = self._number(rest)
            if length < 0:
                return None
            if length > MAX_BULK_BYTES:
                raise StoreDown(f"a value of {length} bytes")
            return self._exactly(length + 2)[:-2]
        if kind == b"*":
            count = self._number(rest)
            self._items += max(count, 0)
            if self._items > MAX_REPLY_ITEMS or depth >= MAX_DEPTH:
                raise StoreDown("an array too large or too deep")
            return None if count < 0 else [self._reply(depth + 1) for _ in range(count)]
        raise StoreDown(f"unexpected reply {bytes(line[:20])!r}")

    @staticmethod
    def _number(text: bytes) -> int:
        if not 0 < len(text) <= 20:
            raise StoreDown("a malformed number")
        try:
            return int(text)
        except ValueError:
            raise StoreDown("a malformed number") from None

    def _line(self) -> bytearray:
        while True:
            end = self._buffer.find(b"\r\n")
            if end >= 0:
                line = self._buffer[:end]
                del self._buffer[:end + 2]
                return line
            if len(self._buffer) > 64 << 10:
                raise StoreDown("a line without an end")
            self._more()

    def _exactly(self, size: int) -> bytes:
        while len(self._buffer) < size:
            self._more(size - len(self._buffer))
        data = bytes(self._buffer[:size])
        del self._buffer[:size]
        return data

    def _more(self, wanted: int = 0) -> None:
        """More of the reply, within the request's deadline and MAX_REPLY_BYTES."""
        assert self._socket is not None
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise StoreDown("no whole reply in time")
        self._socket.settimeout(left)
        chunk = self._socket.recv(max(65536, min(wanted, 4 << 20)))
        if not chunk:
            raise StoreDown("the store closed the connection")
        self._received += len(chunk)
        if self._received > MAX_REPLY_BYTES:
            raise StoreDown(f"a reply of more than {MAX_REPLY_BYTES} bytes")
        self._buffer += chunk
