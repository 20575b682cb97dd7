"""ARCA's keyspace: strings and streams with expiry, a byte budget with LRU eviction, an append-only file.

One owner: the daemon's event loop thread calls everything here (the AOF's fsync and
rewrite run in a worker thread on data handed to them). Times are milliseconds since
the epoch, as Redis keeps them, so an expiry survives a restart.

The append-only file holds every write as the RESP command that replays it, with
relative expiries turned absolute (`SET k v PXAT t`, `PEXPIREAT`). It is fsynced once
a second: a `kill -9` loses at most the last second. At start it is replayed; a
torn or damaged tail (a crash in the middle of an append) is cut off at the last
whole command, never loaded. When it grows past twice its size after the last
rewrite, a rewrite writes the current keyspace to a new file in a worker thread
while writes go on; the commands written meanwhile are appended to it before it
replaces the old one.
"""

from __future__ import annotations

import bisect
import collections
import fnmatch
import itertools
import logging
import os
import threading
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from reame.arca.resp import RequestParser, command_bytes
from reame.files import PRIVATE_FILE, create_private, fsync_directory, private_directory

log = logging.getLogger("reame.arca")

ENTRY_OVERHEAD = 64  # bytes counted per key beside its name and value (Redis's own overhead is similar)
STREAM_ENTRY_OVERHEAD = 32
AOF_NAME = "appendonly.aof"
REWRITE_MIN_BYTES = 1 << 20


def now_ms() -> int:
    return time.time_ns() // 1_000_000


class StoreError(Exception):
    """A command's arguments make no sense for the data (the reply is `-ERR` or `-WRONGTYPE`)."""


class WrongType(StoreError):
    def __init__(self) -> None:
        super().__init__("WRONGTYPE Operation against a key holding the wrong kind of value")


StreamId = tuple[int, int]


@dataclass
class Stream:
    ids: list[StreamId] = field(default_factory=list)
    fields: list[list[bytes]] = field(default_factory=list)
    last_id: StreamId = (0, 0)
    size: int = 0  # bytes counted against the budget

    def trim(self, max_length: int) -> int:
        removed = max(0, len(self.ids) - max_length)
        if removed:
            self.size -= sum(fields_size(f) for f in self.fields[:removed])
            del self.ids[:removed], self.fields[:removed]
        return removed


def fields_size(pairs: list[bytes]) -> int:
    return STREAM_ENTRY_OVERHEAD + sum(len(item) for item in pairs)


def integer(text: bytes, message: str = "ERR value is not an integer or out of range") -> int:
    try:
        value = int(text)
    except ValueError:
        raise StoreError(message) from None
    if not -2**63 <= value < 2**63:
        raise StoreError(message)
    return value


def format_id(stream_id: StreamId) -> bytes:
    return b"%d-%d" % stream_id


def parse_id(text: bytes, default_sequence: int = 0) -> StreamId:
    """`ms-seq` or `ms` (sequence `default_sequence`); StoreError otherwise."""
    ms, dash, sequence = text.partition(b"-")
    try:
        return int(ms), int(sequence) if dash else default_sequence
    except ValueError:
        raise StoreError("ERR Invalid stream ID specified as stream command argument") from None


@dataclass(slots=True)
class Entry:
    value: bytes | Stream
    expires_at: int | None = None  # ms since the epoch


class Keyspace:
    """Keys to entries, in least-recently-used order, within `budget_bytes` (0: no limit)."""

    def __init__(self, budget_bytes: int = 0) -> None:
        self.budget_bytes = budget_bytes
        self._entries: collections.OrderedDict[bytes, Entry] = collections.OrderedDict()
        self.used_bytes = 0
        self.evicted = 0
        self.expired = 0
        self._scan_order: list[tuple[int, bytes]] | None = None  # (cursor hash, key), sorted; None: stale
        # The keys with a deadline, for active expiry to visit in turn (never the whole keyspace).
        self._deadlines: dict[bytes, int] = {}

    # --- reading ---

    def get_entry(self, key: bytes) -> Entry | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        if entry.expires_at is not None and entry.expires_at <= now_ms():
            self._remove(key)
            self.expired += 1
            return None
        self._entries.move_to_end(key)
        return entry

    def get(self, key: bytes) -> bytes | None:
        entry = self._entries.get(key)
        if entry is None or entry.expires_at is not None:  # (get_entry, inlined for the commonest read)
            entry = self.get_entry(key)
            if entry is None:
                return None
        else:
            self._entries.move_to_end(key)
        if type(entry.value) is not bytes:
            raise WrongType()
        return entry.value

    def __len__(self) -> int:
        return len(self._entries)

    def items(self) -> list[tuple[bytes, Entry]]:
        return list(self._entries.items())

    def expiring(self) -> int:
        return len(self._deadlines)

    # --- writing ---

    def set(self, key: bytes, value: bytes, expires_at: int | None) -> None:
        old = self._entries.pop(key, None)
        if old is None:
            self._scan_order = None  # a new key (the order of those there stays right)
        else:
            self.used_bytes -= self._size(key, old.value)
            if old.expires_at is not None:
                self._deadlines.pop(key, None)
        self._entries[key] = Entry(value, expires_at)
        if expires_at is not None:
            self._deadlines[key] = expires_at
        self.used_bytes += ENTRY_OVERHEAD + len(key) + len(value)
        if self.budget_bytes and self.used_bytes > self.budget_bytes:
            self.evict(keep=key)

    def set_expiry(self, key: bytes, expires_at: int | None) -> bool:
        entry = self.get_entry(key)
        if entry is None:
            return False
        entry.expires_at = expires_at
        if expires_at is None:
            self._deadlines.pop(key, None)
        else:
            self._deadlines[key] = expires_at
        return True

    def delete(self, key: bytes) -> bool:
        if self.get_entry(key) is None:
            return False
        self._remove(key)
        return True

    def clear(self) -> None:
        self._entries.clear()
        self._deadlines.clear()
        self.used_bytes = 0
        self._scan_order = None

    def stream(self, key: bytes, create: bool) -> Stream | None:
        entry = self.get_entry(key)
        if entry is None:
            if not create:
                return None
            stream = Stream()
            self._entries[key] = Entry(stream)
            self._scan_order = None
            self.used_bytes += self._size(key, stream)
            return stream
        if not isinstance(entry.value, Stream):
            raise WrongType()
        return entry.value

    def stream_grew(self, key: bytes, added: int) -> None:
        """A stream's size changed by `added` bytes (XADD, XTRIM): keep the budget."""
        self.used_bytes += added
        self.evict(keep=key)

    def evict(self, keep: bytes | None = None) -> None:
        """Drop least recently used keys until the budget holds (never `keep`, the key just written)."""
        while self.budget_bytes and self.used_bytes > self.budget_bytes and len(self._entries) > 1:
            oldest = next(iter(self._entries))
            if oldest == keep:
                self._entries.move_to_end(oldest)
                oldest = next(iter(self._entries))
            self._remove(oldest)
            self.evicted += 1

    def expire_some(self, now: int, sample: int = 20) -> int:
        """Active expiry: look at the next `sample` keys with a deadline (live ones go to the back, so the
        following calls look at others), drop the dead ones."""
        dead = []
        for key in list(itertools.islice(self._deadlines, sample)):
            if self._deadlines[key] <= now:
                dead.append(key)
            else:
                self._deadlines[key] = self._deadlines.pop(key)
        for key in dead:
            self._remove(key)
        self.expired += len(dead)
        return len(dead)

    def _remove(self, key: bytes) -> None:
        entry = self._entries.pop(key, None)
        self._deadlines.pop(key, None)
        if entry is not None:
            self.used_bytes -= self._size(key, entry.value)
            self._scan_order = None

    @staticmethod
    def _size(key: bytes, value: bytes | Stream) -> int:
        return ENTRY_OVERHEAD + len(key) + (value.size if isinstance(value, Stream) else len(value))

    # --- SCAN ---

    def scan(self, cursor: int, count: int, pattern: bytes | None, kind: bytes | None) -> tuple[int, list[bytes]]:
        """Keys in the order of a hash of their names from `cursor` on: a key present from the first
        call to the last is returned at least once, whatever is added or removed meanwhile."""
        if self._scan_order is None:
            self._scan_order = sorted((scan_hash(key), key) for key in self._entries)
        order = self._scan_order
        index = bisect.bisect_left(order, (cursor, b""))
        found: list[bytes] = []
        now = now_ms()
        while index < len(order) and (len(found) < count or order[index][0] == order[index - 1][0]):
            key = order[index][1]
            index += 1
            entry = self._entries.get(key)
            if entry is None or (entry.expires_at is not None and entry.expires_at <= now):
                continue
            if pattern is not None and not fnmatch.fnmatchcase(key.decode("latin-1"), pattern.decode("latin-1")):
                continue
            if kind is not None and kind.lower() != (b"stream" if isinstance(entry.value, Stream) else b"string"):
                continue
            found.append(key)
        return (order[index][0] if index < len(order) else 0), found


def scan_hash(key: bytes) -> int:
    return zlib.crc32(key) + 1  # 0 is the cursor that starts a scan


class AppendOnlyFile:
    """The write log: appended by the loop thread, fsynced once a second, rewritten in the background."""

    def __init__(self, directory: Path) -> None:
        private_directory(directory)
        self.path = directory / AOF_NAME
        self._file = open_private_log(self.path)
        fsync_directory(directory)  # the log's own name is durable from the start
        self.base_size = self.size()
        self.synced_size = self.base_size  # bytes of the file known to be on disk
        self._lock = threading.Lock()  # the file object's swap (rewrite, loop) against fsync (worker)
        self._rewrite_tail: list[bytes] | None = None  # writes made while a rewrite runs
        self.rewrites = 0

    def size(self) -> int:
        try:
            return self.path.stat().st_size
        except FileNotFoundError:
            return 0

    def append(self, record: bytes) -> None:
        """Buffered in the file object (its own lock makes it safe beside a flush from the fsync thread);
        `flush()` hands it to the OS before the replies go out."""
        self._file.write(record)
        if self._rewrite_tail is not None:
            self._rewrite_tail.append(record)

    def flush(self) -> None:
        self._file.flush()

    def sync(self) -> None:
        """Flush and fsync what was appended (the once-a-second task, and at shutdown)."""
        with self._lock:
            self._file.flush()
            flushed = self._file.tell()
            if flushed == self.synced_size:
                return
            fd = os.dup(self._file.fileno())
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        self.synced_size = flushed

    def wants_rewrite(self) -> bool:
        return self._rewrite_tail is None and self.size() > max(REWRITE_MIN_BYTES, 2 * self.base_size)

    def start_rewrite(self) -> None:
        self._rewrite_tail = []

    def write_rewrite(self, records: list[bytes]) -> Path:
        """The keyspace's records into a temp file beside the log (worker thread)."""
        temporary = self.path.with_name(self.path.name + ".rewrite")
        temporary.unlink(missing_ok=True)  # a rewrite that died: the daemon's own
        with create_private(temporary) as out:
            for record in records:
                out.write(record)
            out.flush()
            os.fsync(out.fileno())
        return temporary

    def finish_rewrite(self, temporary: Path) -> None:
        """Append what was written meanwhile, then swap the files (loop thread)."""
        tail, self._rewrite_tail = self._rewrite_tail or [], None
        with open(temporary, "ab") as out:
            for record in tail:
                out.write(record)
            out.flush()
            os.fsync(out.fileno())
        with self._lock:
            self._file.close()
            os.replace(temporary, self.path)
            fsync_directory(self.path.parent)
            self._file = open_private_log(self.path)
        self.base_size = self.synced_size = self.size()
        self.rewrites += 1

    def abandon_rewrite(self, temporary: Path | None) -> None:
        self._rewrite_tail = None
        if temporary is not None:
            temporary.unlink(missing_ok=True)

    def close(self) -> None:
        self.sync()
        with self._lock:
            self._file.close()


def open_private_log(path: Path) -> BinaryIO:
    """The log, opened to append, only this user's to read (an existing one is tightened); never a symlink."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, PRIVATE_FILE)
    os.fchmod(fd, PRIVATE_FILE)
    return os.fdopen(fd, "ab")


def read_log(path: Path) -> tuple[list[list[bytes]], int]:
    """The whole commands of an AOF, and the byte length they cover (a torn or damaged tail is after it)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return [], 0
    return RequestParser().whole_commands(data)


def snapshot_records(keyspace: Keyspace) -> list[bytes]:
    """Commands that rebuild the keyspace (what a rewrite writes)."""
    records = []
    for key, entry in keyspace.items():
        if isinstance(entry.value, Stream):
            stream = entry.value
            for stream_id, pairs in zip(stream.ids, stream.fields):
                records.append(command_bytes(b"XADD", key, format_id(stream_id), *pairs))
            if not stream.ids:
                records.append(command_bytes(b"XADD", key, b"MAXLEN", b"0", format_id(stream.last_id), b"x", b""))
            records.append(command_bytes(b"XSETID", key, format_id(stream.last_id)))
            if entry.expires_at is not None:
                records.append(command_bytes(b"PEXPIREAT", key, entry.expires_at))
        elif entry.expires_at is not None:
            records.append(command_bytes(b"SET", key, entry.value, b"PXAT", entry.expires_at))
        else:
            records.append(command_bytes(b"SET", key, entry.value))
    return records


def truncate_log(path: Path, good: int) -> None:
    """Cut a torn or damaged tail off the log, so appends continue after the last whole command."""
    size = path.stat().st_size
    if good < size:
        log.warning("%s: dropping %d bytes after the last whole command (a crash mid-append)", path, size - good)
        with open(path, "r+b") as stream:
            stream.truncate(good)
            stream.flush()
            os.fsync(stream.fileno())
