"""The fleet's KV tier: prefix-cache snapshots shared through the store `arca.remote` names, so a document
one node prefilled is restored by every other node instead of prefilled again.

Keys (every node of one model, library and KV layout computes the same ones):

    reame:kv:{<fp>}:b:<block key>   -> snapshot name   one per full block of a published snapshot, the
                                                       chained block key of prefix.py; all of one model's
                                                       in one hash slot (its `{fp}` tag), so one MGET
                                                       finds a prompt's deepest block
    reame:kv:{<name>}:m             -> meta            format, chunk count, size, the snapshot's tokens
    reame:kv:{<name>}:c:<i>         -> chunk i         the snapshot file (store.py's format: fingerprint,
                                                       tokens, zstd when it pays, crc32), CHUNK_BYTES each

A snapshot's keys share its `{name}` tag: in a Redis Cluster its chunks live on one node, and different
snapshots spread over the nodes. Chunks go first, then the meta, then the block keys, so whoever finds
a block key finds the rest (unless the store evicted it since: then the fetch fails its checks).

Publishing runs on a thread of its own from a queue bounded in bytes (what does not fit is skipped and
counted), niced and waiting for the engine's idle moments between chunks, as the disk writer does.
A fetch runs in the requesting thread with a deadline; anything missing, late, damaged, foreign or
malformed is a miss (counted) and the prompt is prefilled as without a store. Lookups and fetches take
one of up to READERS connections each, so a large fetch never holds up another request's lookup, and a
snapshot is fetched once however many requests want it at the same time: the others wait for that fetch
(within their own deadline). The store's own memory policy evicts (maxmemory + allkeys-lru):
docs/deploy.md says how to set it.
"""

from __future__ import annotations

import collections
import logging
import os
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence

from reame.arca.client import StoreCommands
from reame.cache.store import MAX_TOKENS, Snapshot, common_prefix, decode, encode
from reame.errors import CacheError
from reame.files import pack_tokens, unpack_tokens

log = logging.getLogger("reame.cache")

CHUNK_BYTES = 4 << 20  # no single value blocks the store for long
MAX_SNAPSHOT_BYTES = 4 << 30
MAX_LOOKUP_BLOCKS = 1024  # a prompt's deepest blocks asked in one MGET (32k tokens of 32-token blocks)
META = struct.Struct("<8sIIQ")  # magic, version, chunks, file size; then the tokens
META_MAGIC = b"REAMEKVM"
META_VERSION = 1
PUBLISHER_NICENESS = 19
MAX_IDLE_WAIT_S = 30.0
READERS = 4  # connections for lookups and fetches at once: more requests than that wait for one

STATS = {
    "hits": "prompts whose KV was restored from the shared store instead of prefilled",
    "misses": "prompts looked up in the shared store and not found (or found unusable)",
    "bytes_read": "bytes of snapshots fetched from the shared store",
    "bytes_written": "bytes of snapshots published to the shared store",
    "published": "snapshots published to the shared store",
    "publish_skipped": "snapshots not published: the queue's byte budget was full",
    "publish_failed": "snapshots the store did not take whole (down, full, or refused)",
    "damaged": "snapshots fetched whole that failed their checks (evicted or corrupt chunks)",
    "timeouts": "fetches abandoned at their deadline",
    "fetches_shared": "prompts that waited for a fetch of the same snapshot already under way, not fetching it again",
}


def index_key(fingerprint: bytes, block: bytes) -> bytes:
    return b"reame:kv:{" + fingerprint.hex()[:32].encode() + b"}:b:" + block.hex().encode()


def meta_key(name: str) -> bytes:
    return f"reame:kv:{{{name}}}:m".encode()


def chunk_key(name: str, index: int) -> bytes:
    return f"reame:kv:{{{name}}}:c:{index}".encode()


def encode_meta(chunks: int, size: int, tokens: Sequence[int]) -> bytes:
    return META.pack(META_MAGIC, META_VERSION, chunks, size) + pack_tokens(tokens)


def decode_meta(value: bytes) -> tuple[int, int, tuple[int, ...]] | None:
    """(chunks, size, tokens) of a meta value, or None for one that is not ours or not plausible."""
    if len(value) < META.size or (len(value) - META.size) % 4:
        return None
    magic, version, chunks, size = META.unpack_from(value)
    tokens = unpack_tokens(value[META.size:])
    if magic != META_MAGIC or version != META_VERSION or not 0 < size <= MAX_SNAPSHOT_BYTES or \
            chunks != -(-size // CHUNK_BYTES) or not 0 < len(tokens) <= MAX_TOKENS:
        return None
    return chunks, size, tokens


class _Fetch:
    """One snapshot's fetch under way, and its result for the requests that wait for it."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.snapshot: Snapshot | None = None


class RemoteKV:
    """One model's snapshots in the shared store. `connect` makes a client: the publisher and each lookup or
    fetch under way get a connection of their own, so neither a large publish nor a large fetch holds up
    a lookup."""

    def __init__(self, connect: Callable[[], StoreCommands], fingerprint: bytes, timeout_s: float,
                 publish_budget_bytes: int, ttl_ms: int = 0, compress: bool = True) -> None:
        self.fingerprint = fingerprint
        self.timeout_s = timeout_s
        self.publish_budget_bytes = publish_budget_bytes
        self.ttl_ms = ttl_ms
        self.compress = compress
        self._connect = connect
        self._readers = threading.Condition()  # guards the idle readers, their count and the fetches under way
        self._idle_readers: list[StoreCommands] = []
        self._all_readers: list[StoreCommands] = []
        self._fetches: dict[str, _Fetch] = {}
        self._writer = connect()
        self._stats: Counter[str] = Counter()
        self._lock = threading.Condition()
        self._queue: collections.deque[tuple[str, Snapshot, list[bytes]] | None] = collections.deque()
        self._queued_bytes = 0
        self._busy = False
        self.engine_idle: threading.Event | None = None
        self._thread = threading.Thread(target=self._publish_loop, name="reame-kv-publisher", daemon=True)
        self._thread.start()

    # --- lookups (requesting threads) ---

    def deepest(self, blocks: Sequence[bytes]) -> tuple[int, str] | None:
        """(full blocks covered, snapshot name) of the deepest of `blocks` the store knows a snapshot of."""
        first = max(0, len(blocks) - MAX_LOOKUP_BLOCKS)
        reader = self._borrow(time.monotonic() + self.timeout_s)
        if reader is None:
            return None
        try:
            names = reader.mget([index_key(self.fingerprint, block) for block in blocks[first:]])
        finally:
            self._give_back(reader)
        for depth in range(len(names) - 1, -1, -1):
            value = names[depth]
            if value is not None and len(value) == 40 and all(c in b"0123456789abcdef" for c in value):
                return first + depth + 1, value.decode()
        return None

    def fetch(self, name: str, tokens: Sequence[int], better_than: int) -> Snapshot | None:
        """The snapshot `name`, if it shares more than `better_than` tokens with `tokens` and arrives whole
        within the deadline; None (counted) otherwise. While another request fetches the same snapshot, this
        one waits for that fetch instead of making its own."""
        deadline = time.monotonic() + self.timeout_s
        with self._readers:
            under_way = self._fetches.get(name)
            if under_way is None:
                fetch = self._fetches[name] = _Fetch()
        if under_way is not None:
            return self._share(under_way, tokens, better_than, deadline)
        try:
            fetch.snapshot = self._fetch_whole(name, tokens, better_than, deadline)
        finally:
            with self._readers:
                del self._fetches[name]
            fetch.done.set()
        return fetch.snapshot

    def _share(self, fetch: _Fetch, tokens: Sequence[int], better_than: int, deadline: float) -> Snapshot | None:
        """The result of another request's fetch of the same snapshot (its misses were counted there)."""
        if not fetch.done.wait(max(0.0, deadline - time.monotonic())):
            return self._missed("timeouts")
        snapshot = fetch.snapshot
        if snapshot is None or common_prefix(snapshot.tokens, tokens) <= better_than:
            return self._missed("misses")
        self._count("hits")
        self._count("fetches_shared")
        return snapshot

    def _fetch_whole(self, name: str, tokens: Sequence[int], better_than: int, deadline: float) -> Snapshot | None:
        reader = self._borrow(deadline)
        if reader is None:
            return self._missed("timeouts")
        try:
            return self._read(reader, name, tokens, better_than, deadline)
        finally:
            self._give_back(reader)

    def _read(self, reader: StoreCommands, name: str, tokens: Sequence[int], better_than: int,
              deadline: float) -> Snapshot | None:
        value = reader.call(b"GET", meta_key(name), timeout_s=max(0.001, deadline - time.monotonic()))
        meta = decode_meta(value) if isinstance(value, bytes) else None
        if meta is None:
            return self._missed("misses")
        chunks, size, kept_tokens = meta
        if common_prefix(tokens, kept_tokens) <= better_than:
            return self._missed("misses")
        data = bytearray()  # grown as chunks arrive: a meta's claimed size allocates nothing by itself
        for index in range(chunks):
            left = deadline - time.monotonic()
            if left <= 0:
                return self._missed("timeouts")
            chunk = reader.call(b"GET", chunk_key(name, index), timeout_s=left)
            expected = min(CHUNK_BYTES, size - len(data))
            if not isinstance(chunk, bytes) or len(chunk) != expected:
                return self._missed("damaged" if chunk is not None else "misses")
            data += chunk
        try:
            snapshot = decode(data, self.fingerprint)
        except CacheError:
            return self._missed("damaged")
        if snapshot.tokens != kept_tokens:
            return self._missed("damaged")
        self._count("hits")
        self._count("bytes_read", size)
        return snapshot

    def _borrow(self, deadline: float) -> StoreCommands | None:
        """An idle reader connection, a new one while there are fewer than READERS, else the first given back
        before `deadline` (None after it)."""
        with self._readers:
            while not self._idle_readers and len(self._all_readers) >= READERS:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._readers.wait(left)
            if self._idle_readers:
                return self._idle_readers.pop()
            reader = self._connect()  # a client connects at its first call, not here
            self._all_readers.append(reader)
            return reader

    def _give_back(self, reader: StoreCommands) -> None:
        with self._readers:
            self._idle_readers.append(reader)
            self._readers.notify()

    def missed(self) -> None:
        self._count("misses")

    def _missed(self, why: str) -> Snapshot | None:
        """Count a lookup that found nothing by its cause; None, what such a lookup returns."""
        self._count(why)
        if why != "misses":
            self._count("misses")
        return None

    # --- publishing (the engine thread queues; the publisher thread sends) ---

    def publish(self, name: str, snapshot: Snapshot, blocks: list[bytes]) -> bool:
        """Queue a snapshot to publish under its `blocks`; False (counted) when the byte budget is full."""
        size = len(snapshot.blob)
        with self._lock:
            if self._queued_bytes + size > self.publish_budget_bytes:
                self._count("publish_skipped")
                return False
            self._queue.append((name, snapshot, blocks))
            self._queued_bytes += size
            self._lock.notify()
        return True

    def flush(self, timeout_s: float) -> bool:
        """Wait until everything queued is sent (or failed); False after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while self._queue or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._lock.wait(left)
        return True

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {name: self._stats[name] for name in STATS}

    def close(self, timeout_s: float = 60.0) -> None:
        """Send what is queued (a `reame warm` publishes before it exits), then stop."""
        if not self.flush(timeout_s):
            log.warning("KV snapshots still queued for the store after %g s are not published", timeout_s)
        with self._lock:
            self._queue.clear()
            self._queue.append(None)
            self._lock.notify()
        self._thread.join(timeout_s)
        with self._readers:
            readers, self._all_readers, self._idle_readers = self._all_readers, [], []
        for reader in readers:
            reader.close()
        self._writer.close()

    def _count(self, name: str, value: int = 1) -> None:
        with self._lock:
            self._stats[name] += value

    def _publish_loop(self) -> None:
        try:  # Linux nices threads one by one: the publisher yields the cores to decoding
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), PUBLISHER_NICENESS)
        except (AttributeError, OSError):
            pass
        while True:
            with self._lock:
                while not self._queue:
                    self._lock.wait()
                item = self._queue.popleft()
                if item is None:
                    return
                self._busy = True
            name, snapshot, blocks = item
            try:
                sent = self._send(name, snapshot, blocks)
            except Exception:  # a failing store loses a snapshot, never the publisher
                log.exception("publishing a KV snapshot failed")
                sent = 0
            with self._lock:
                self._queued_bytes -= len(snapshot.blob)
                self._busy = False
                if sent:
                    self._stats["published"] += 1
                    self._stats["bytes_written"] += sent
                else:
                    self._stats["publish_failed"] += 1
                self._lock.notify_all()

    def _send(self, name: str, snapshot: Snapshot, blocks: list[bytes]) -> int:
        """Chunks, meta, then block keys; the bytes sent, or 0 when the store did not take it all."""
        data = encode(self.fingerprint, snapshot, self.compress)
        ttl = [b"PX", str(self.ttl_ms).encode()] if self.ttl_ms else []
        chunks = -(-len(data) // CHUNK_BYTES)
        view = memoryview(data)
        for index in range(chunks):
            self._pause()
            piece = bytes(view[index * CHUNK_BYTES:(index + 1) * CHUNK_BYTES])
            if self._writer.call(b"SET", chunk_key(name, index), piece, *ttl, timeout_s=max(self.timeout_s, 5.0)) \
                    != b"OK":
                return 0
        if self._writer.call(b"SET", meta_key(name), encode_meta(chunks, len(data), snapshot.tokens), *ttl,
                             timeout_s=self.timeout_s) != b"OK":
            return 0
        for block in blocks:
            if self._writer.call(b"SET", index_key(self.fingerprint, block), name.encode(), *ttl,
                                 timeout_s=self.timeout_s) != b"OK":
                return 0
        return len(data)

    def _pause(self) -> None:
        if self.engine_idle is not None:
            self.engine_idle.wait(MAX_IDLE_WAIT_S)

