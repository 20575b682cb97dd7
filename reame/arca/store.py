"""ARCA's keyspace: strings and streams with expiry, a byte budget with LRU eviction, SCAN's order.

One owner: the daemon's event loop thread calls everything here. Times are milliseconds
since the epoch, as Redis keeps them, so an expiry survives a restart (the append-only
file, aof.py, logs relative expiries made absolute: `SET k v PXAT t`, `PEXPIREAT`).
"""

from __future__ import annotations

import bisect
import collections
import fnmatch
import itertools
import re
import sys
import time
import zlib
from dataclasses import dataclass, field

# What a key costs in this process's memory beyond its name's and value's bytes objects (sys.getsizeof):
# the keyspace's dict slot and node, the Entry, its place in the SCAN index, and with an expiry the deadline's
# slot and int. Measured with tracemalloc (tests/unit/test_arca_limits.py holds them to it).
ENTRY_OVERHEAD = 200
EXPIRY_OVERHEAD = 96
STREAM_ENTRY_OVERHEAD = 144  # per stream entry: its id tuple, its fields list and their slots
OOM = "OOM command not allowed when used memory > 'maxmemory'."
SCAN_BUCKET_SHIFT = 20  # a key's SCAN bucket: the top 12 bits of its crc32 (4096 buckets)


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
    return STREAM_ENTRY_OVERHEAD + sum(map(sys.getsizeof, pairs))


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
    """Keys to entries, in least-recently-used order, within `budget_bytes` (0: no limit) of measured memory."""

    def __init__(self, budget_bytes: int = 0) -> None:
        self.budget_bytes = budget_bytes
        self._entries: collections.OrderedDict[bytes, Entry] = collections.OrderedDict()
        self.used_bytes = 0
        self.evicted = 0
        self.expired = 0
        # SCAN's order, kept as keys change: keys by bucket (a hash of their name), and the non-empty buckets sorted.
        self._buckets: dict[int, set[bytes]] = {}
        self._bucket_ids: list[int] = []
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
        """Store `value`; StoreError (OOM) when it alone is more than the whole budget, with nothing changed."""
        size = entry_size(key, value, expires_at)
        if self.budget_bytes and size > self.budget_bytes:
            raise StoreError(OOM)
        old = self._entries.pop(key, None)
        if old is None:
            self._index(key)
        else:
            self.used_bytes -= entry_size(key, old.value, old.expires_at)
            if old.expires_at is not None:
                self._deadlines.pop(key, None)
        self._entries[key] = Entry(value, expires_at)
        if expires_at is not None:
            self._deadlines[key] = expires_at
        self.used_bytes += size
        if self.budget_bytes and self.used_bytes > self.budget_bytes:
            self.evict(keep=key)

    def set_expiry(self, key: bytes, expires_at: int | None) -> bool:
        entry = self.get_entry(key)
        if entry is None:
            return False
        self.used_bytes -= entry_size(key, entry.value, entry.expires_at)
        entry.expires_at = expires_at
        self.used_bytes += entry_size(key, entry.value, expires_at)
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
        self._buckets.clear()
        self._bucket_ids.clear()
        self.used_bytes = 0

    def stream(self, key: bytes, create: bool) -> Stream | None:
        entry = self.get_entry(key)
        if entry is None:
            if not create:
                return None
            stream = Stream()
            self._entries[key] = Entry(stream)
            self._index(key)
            self.used_bytes += entry_size(key, stream, None)
            return stream
        if not isinstance(entry.value, Stream):
            raise WrongType()
        return entry.value

    def stream_fits(self, key: bytes, stream: Stream, added: int) -> None:
        """StoreError (OOM) when the stream grown by `added` bytes would be more than the whole budget."""
        if self.budget_bytes and entry_size(key, stream, None) + added > self.budget_bytes:
            raise StoreError(OOM)

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
            self.used_bytes -= entry_size(key, entry.value, entry.expires_at)
            self._unindex(key)

    # --- SCAN ---

    def _index(self, key: bytes) -> None:
        bucket = scan_bucket(key)
        keys = self._buckets.get(bucket)
        if keys is None:
            keys = self._buckets[bucket] = set()
            bisect.insort(self._bucket_ids, bucket)
        keys.add(key)

    def _unindex(self, key: bytes) -> None:
        bucket = scan_bucket(key)
        keys = self._buckets[bucket]
        keys.discard(key)
        if not keys:
            del self._buckets[bucket]
            del self._bucket_ids[bisect.bisect_left(self._bucket_ids, bucket)]

    def scan(self, cursor: int, count: int, pattern: bytes | None, kind: bytes | None) -> tuple[int, list[bytes]]:
        """Whole buckets of keys from `cursor` on, until `count` keys were looked at (as Redis, COUNT is the work
        done, not the matches found): a key present from the first call to the last is returned at least once,
        whatever is added or removed meanwhile. The cursor is the next bucket + 1 (0: start, and done)."""
        index = bisect.bisect_left(self._bucket_ids, cursor - 1 if cursor > 0 else 0)
        found: list[bytes] = []
        looked = 0
        now = now_ms()
        matcher = re.compile(fnmatch.translate(pattern.decode("latin-1")), re.DOTALL).match \
            if pattern is not None else None
        while index < len(self._bucket_ids) and looked < count:
            keys = self._buckets[self._bucket_ids[index]]
            index += 1
            looked += len(keys)
            for key in sorted(keys):
                entry = self._entries[key]
                if entry.expires_at is not None and entry.expires_at <= now:
                    continue
                if matcher is not None and not matcher(key.decode("latin-1")):
                    continue
                if kind is not None and kind.lower() != (b"stream" if isinstance(entry.value, Stream) else b"string"):
                    continue
                found.append(key)
        return (self._bucket_ids[index] + 1 if index < len(self._bucket_ids) else 0), found


def entry_size(key: bytes, value: bytes | Stream, expires_at: int | None) -> int:
    """What a key holding `value` costs against the budget (see ENTRY_OVERHEAD)."""
    held = value.size if isinstance(value, Stream) else sys.getsizeof(value)
    return ENTRY_OVERHEAD + sys.getsizeof(key) + held + (EXPIRY_OVERHEAD if expires_at is not None else 0)


def scan_bucket(key: bytes) -> int:
    return zlib.crc32(key) >> SCAN_BUCKET_SHIFT
