"""The shared-prefix KV cache: find the snapshot sharing the longest prefix with a prompt.

Prompts are cut into blocks of `block_tokens`; block i's key is a hash of
(key of block i-1, the block's tokens) and the chain starts at the model
fingerprint, so a key names one exact token prefix of one model. Every
snapshot is indexed under the keys of its full blocks. A lookup walks the
prompt's keys to the deepest one any snapshot has, then compares tokens byte
for byte and returns the snapshot with the longest common prefix; the engine
restores it and cuts the KV back to that length. So a snapshot of
"system prompt + question 1" serves "system prompt + question 2" too, and no
separate snapshot of the system prompt is needed.

Storage stays linear in what was prompted: a snapshot whose tokens are a
prefix of a newer one is dropped (the newer one covers it), and a prefix of
an existing snapshot is never stored. Snapshots live in a RAM tier
(uncompressed, LRU under its own byte budget) in front of the disk tier
(`store.DiskStore`); disk writes happen on a writer thread. With a shared
store (`remote.RemoteKV`), every new snapshot is also published to it, and a
prompt this node holds little of is looked up there before it is prefilled.
"""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from reame.cache.store import DiskStore, Snapshot, common_prefix
from reame.files import pack_tokens

if TYPE_CHECKING:  # a node without a store never loads the store's client
    from reame.cache.remote import RemoteKV

log = logging.getLogger("reame.cache")

# Counters, then gauges, that `stats()` reports, with what each means (/metrics shows them).
STATS = {
    "hits": "prefix cache lookups that found a snapshot",
    "misses": "prefix cache lookups that found none",
    "tokens_reused": "prompt tokens restored from the prefix cache instead of prefilled",
    "snapshots_stored": "KV snapshots added to the prefix cache",
    "bytes_read": "bytes of snapshot files read",
    "bytes_written": "bytes of snapshot files written",
    "evictions": "snapshot files removed to keep the disk budget",
    "corrupt_dropped": "damaged snapshot files found and removed",
    "unreadable_skipped": "compressed snapshot files skipped: this Python has no zstandard",
    "restore_failed": "snapshots this context refused (then forgotten)",
    "writes_skipped": "snapshots not written (writer queue full or a snapshot over the disk budget)",
    "write_errors": "snapshots the disk refused (full or read-only): the server goes on without them",
}
GAUGES = {
    "snapshots": "snapshots known (RAM and disk)",
    "ram_bytes": "bytes of snapshots held in RAM",
}
WRITE_QUEUE = 8
WRITER_NICENESS = 19
# While the engine computes, the writer waits between 4 MiB slices (even a niced thread that takes a
# core for a moment stalls both of llama.cpp's threads, which meet at every graph node), at most this
# long per snapshot before it writes anyway.
MAX_WRITE_DEFERRAL_S = 30.0


def block_keys(fingerprint: bytes, tokens: Sequence[int], block_tokens: int) -> list[bytes]:
    """The chain key of every full block of `tokens`."""
    keys = []
    key = fingerprint
    for start in range(0, len(tokens) - block_tokens + 1, block_tokens):
        key = hashlib.blake2b(key + pack_tokens(tokens[start:start + block_tokens]), digest_size=16).digest()
        keys.append(key)
    return keys


def snapshot_name(fingerprint: bytes, tokens: Sequence[int]) -> str:
    """A snapshot's identity: its model and every one of its tokens."""
    return hashlib.blake2b(fingerprint + pack_tokens(tokens), digest_size=20).hexdigest()


class PrefixCache:
    """RAM and disk tiers of KV snapshots for one model fingerprint. Thread-safe."""

    def __init__(self, fingerprint: bytes, directory: Path | None = None, disk_budget_bytes: int = 2 << 30,
                 ram_budget_bytes: int = 256 << 20, block_tokens: int = 32, min_new_tokens: int = 64,
                 compress: bool = True, remote: RemoteKV | None = None, verify_newest: bool = True) -> None:
        """`remote`: the fleet's shared tier, which the cache then owns (closes). `verify_newest`: check the newest
        files (as many as the RAM tier holds) on the writer thread at start, so that a server's first restores
        skip it; a process that answers one prompt and exits (a one-shot) checks only the file it restores,
        instead of reading up to cache.ram_mb of files while it decodes and waiting for that at its exit."""
        self.fingerprint = fingerprint
        self.remote = remote
        self.block_tokens = max(1, block_tokens)
        self.min_new_tokens = max(self.block_tokens, min_new_tokens)
        self.ram_budget_bytes = ram_budget_bytes
        self._lock = threading.Lock()
        self._stats: Counter[str] = Counter()
        self._stats_lock = threading.Lock()  # apart from _lock: the disk tier counts while _lock is held
        self._known: dict[str, tuple[int, ...]] = {}  # every snapshot in RAM or on disk -> its tokens
        self._by_block: dict[bytes, set[str]] = {}
        self._keys: dict[str, list[bytes]] = {}  # each known snapshot's block keys, to unindex it
        self._ram: OrderedDict[str, Snapshot] = OrderedDict()
        self._ram_bytes = 0
        self._unwritten: set[str] = set()  # kept in RAM until the writer has written them
        self._disk = DiskStore(directory, fingerprint, disk_budget_bytes, compress, self._add) \
            if directory is not None else None
        self._writes: queue.Queue[tuple[str, Snapshot | None] | None] = queue.Queue(WRITE_QUEUE)
        self._engine_idle: threading.Event | None = None  # the engine's: set while nothing decodes
        self._writer: threading.Thread | None = None
        self._verified_newest = threading.Event()
        self._verifies_newest = verify_newest
        if self._disk is not None:
            self._index(self._disk.entries)
            self._writer = threading.Thread(target=self._write_loop, name="reame-cache-writer", daemon=True)
            self._writer.start()
        else:
            self._verified_newest.set()

    # --- lookups and offers (any thread) ----------------------------------------------

    def lookup(self, tokens: Sequence[int], better_than: int = 0) -> Snapshot | None:
        """The snapshot sharing the longest prefix with `tokens`, if it shares more than `better_than`."""
        keys = block_keys(self.fingerprint, tokens, self.block_tokens)
        if not keys or len(tokens) <= better_than:
            return None
        ranked = self._ranked(tokens, keys)
        local, held, as_good = None, better_than, False
        for shared, name in ranked:
            if shared <= better_than:
                as_good = True  # what the engine already holds is as good: neither a hit nor a miss
                break
            local = self._fetch(name)
            if local is not None:
                held = shared
                break
        if self.remote is not None and len(tokens) - held >= self.min_new_tokens:
            fetched = self._from_remote(keys, tokens, held)
            if fetched is not None:
                local = fetched
        if local is not None:
            self._add("hits", 1)
        elif not as_good:
            self._add("misses", 1)
        return local

    def in_ram(self, tokens: Sequence[int], better_than: int = 0) -> Snapshot | None:
        """The RAM tier's snapshot sharing the longest prefix with `tokens`, if it shares more than `better_than`:
        no disk, no store. The engine thread asks at admission, for a snapshot stored since the request's own
        lookup (another request prefilled the same document meanwhile)."""
        keys = block_keys(self.fingerprint, tokens, self.block_tokens)
        with self._lock:
            for key in reversed(keys):
                resident = [name for name in self._by_block.get(key, ()) if name in self._ram]
                if resident:
                    shared, name = max((common_prefix(self._known[name], tokens), name) for name in resident)
                    if shared <= better_than:
                        return None
                    self._ram.move_to_end(name)
                    return self._ram[name]
        return None

    def _ranked(self, tokens: Sequence[int], keys: list[bytes]) -> list[tuple[int, str]]:
        """The snapshots under the deepest of `keys` any has, longest common prefix with `tokens` first."""
        with self._lock:
            self._refresh_disk()
            candidates = next((self._by_block[key] for key in reversed(keys) if key in self._by_block), set())
            return sorted(((common_prefix(self._known[name], tokens), name) for name in candidates), reverse=True)

    def _from_remote(self, keys: list[bytes], tokens: Sequence[int], held: int) -> Snapshot | None:
        """The shared store's snapshot of this prompt if it holds min_new_tokens more than `held`; it is kept
        here too (RAM, disk), not published again."""
        assert self.remote is not None
        found = self.remote.deepest(keys)
        if found is None or found[0] * self.block_tokens < held + self.min_new_tokens:
            self.remote.missed()
            return None
        snapshot = self.remote.fetch(found[1], tokens, held)
        if snapshot is not None:
            self._keep(snapshot, publish=False)
        return snapshot

    def restored(self, tokens_reused: int) -> None:
        """The engine put a looked-up snapshot to use and kept this many of its tokens."""
        self._add("tokens_reused", tokens_reused)

    def restore_failed(self, snapshot: Snapshot) -> None:
        """The engine's context refused a snapshot (with room for it: damaged, or another layout): never offer
        it again here."""
        self._add("restore_failed", 1)
        with self._lock:
            self._forget(snapshot_name(self.fingerprint, snapshot.tokens), from_disk=False)

    def covered(self, tokens: Sequence[int]) -> int:
        """How many leading `tokens` a known snapshot holds, from the index alone (no disk, no store: the
        engine thread asks before it snapshots what an idle slot gives up)."""
        keys = block_keys(self.fingerprint, tokens, self.block_tokens)
        with self._lock:
            names = next((self._by_block[key] for key in reversed(keys) if key in self._by_block), set())
            return max((common_prefix(self._known[name], tokens) for name in names), default=0)

    def has(self, tokens: Sequence[int]) -> bool:
        """Whether a snapshot of `tokens`, or of a longer prompt starting with them, is known."""
        keys = block_keys(self.fingerprint, tokens, self.block_tokens)
        with self._lock:
            return self._covered(tokens, keys)

    def _covered(self, tokens: Sequence[int], keys: list[bytes]) -> bool:
        if snapshot_name(self.fingerprint, tokens) in self._known:
            return True
        related = self._by_block.get(keys[-1], set()) if keys else set()
        return any(_is_prefix(tokens, self._known[other]) for other in related)

    def offer(self, snapshot: Snapshot) -> bool:
        """Keep a new snapshot unless one already covers it; drop those it covers. True if kept (and then
        published to the shared store, if any)."""
        return self._keep(snapshot, publish=True)

    def share(self, tokens: Sequence[int]) -> bool:
        """Publish the snapshot covering `tokens` to the shared store (`reame warm`, POST /v1/warm: a
        document warmed on one node is warm for every node); False without a store or such a snapshot."""
        if self.remote is None:
            return False
        ranked = self._ranked(tokens, block_keys(self.fingerprint, tokens, self.block_tokens))
        snapshot = next((found for found in (self._fetch(name) for _, name in ranked) if found is not None), None)
        if snapshot is None:
            return False
        name = snapshot_name(self.fingerprint, snapshot.tokens)
        return self.remote.publish(name, snapshot, block_keys(self.fingerprint, snapshot.tokens, self.block_tokens))

    def _keep(self, snapshot: Snapshot, publish: bool) -> bool:
        tokens = snapshot.tokens
        name = snapshot_name(self.fingerprint, tokens)
        keys = block_keys(self.fingerprint, tokens, self.block_tokens)
        if not keys:
            return False
        with self._lock:
            if self._covered(tokens, keys):
                return False
            covered = {other for key in keys for other in self._by_block.get(key, ())
                       if _is_prefix(self._known[other], tokens)}
            for other in covered:
                self._forget(other, from_disk=True)
            self._index({name: tokens}, keys)
            if self._writer is not None:
                self._unwritten.add(name)
            self._keep_in_ram(name, snapshot)
        self._add("snapshots_stored", 1)
        self._queue_write(name, snapshot)
        if publish and self.remote is not None:
            self.remote.publish(name, snapshot, keys)
        return True

    def follow(self, engine_idle: threading.Event) -> None:
        """The engine's event that is set while it decodes nothing: the disk writer waits for it between
        slices (up to MAX_WRITE_DEFERRAL_S per snapshot), so writes use the gaps between requests; so does
        the publisher of the shared store."""
        self._engine_idle = engine_idle
        if self.remote is not None:
            self.remote.engine_idle = engine_idle

    def wait_verified(self, timeout_s: float) -> bool:
        """Wait (at most `timeout_s`) until the newest snapshot files found at start, as many as the RAM
        tier holds, are verified: a server that says it is ready then restores them without checking
        them on the request's time. False if that took longer (the checks go on; a restore meanwhile
        checks its own file)."""
        return self._verified_newest.wait(timeout_s)

    def stats(self) -> dict[str, int]:
        with self._stats_lock:
            counts = {name: self._stats[name] for name in STATS}
        with self._lock:
            counts.update(snapshots=len(self._known), ram_bytes=self._ram_bytes)
        return counts

    def remote_stats(self) -> dict[str, int]:
        """The shared store's counters (remote.STATS), empty without one."""
        return self.remote.stats() if self.remote is not None else {}

    def close(self) -> None:
        """Finish pending disk writes and publications, then stop the writer and the publisher."""
        if self._writer is not None:
            self._writes.put(None)
            self._writer.join()
            self._writer = None
        if self.remote is not None:
            self.remote.close()
            self.remote = None

    # --- internals -----------------------------------------------------------------

    def _add(self, name: str, value: int) -> None:
        with self._stats_lock:
            self._stats[name] += value

    def _fetch(self, name: str) -> Snapshot | None:
        with self._lock:
            snapshot = self._ram.get(name)
            if snapshot is not None:
                self._ram.move_to_end(name)
                return snapshot
        if self._disk is None:
            return None
        snapshot = self._disk.read(name)
        with self._lock:
            if snapshot is None:
                self._forget(name, from_disk=False)
            elif name in self._known:
                self._keep_in_ram(name, snapshot)
        return snapshot

    def _refresh_disk(self) -> None:
        if self._disk is None:
            return
        added, gone = self._disk.refresh()
        for name in gone:
            if name not in self._ram:
                self._forget(name, from_disk=False)
        found = {name: self._disk.tokens_of(name) for name in added}
        self._index({name: tokens for name, tokens in found.items() if tokens is not None})

    def _index(self, snapshots: dict[str, tuple[int, ...]], keys: list[bytes] | None = None) -> None:
        """Make snapshots findable; `keys`: their block keys when already computed (one snapshot)."""
        for name, tokens in snapshots.items():
            self._known[name] = tokens
            self._keys[name] = keys if keys is not None else block_keys(self.fingerprint, tokens, self.block_tokens)
            for key in self._keys[name]:
                self._by_block.setdefault(key, set()).add(name)

    def _forget(self, name: str, from_disk: bool) -> None:
        self._known.pop(name, None)
        for key in self._keys.pop(name, ()):
            names = self._by_block.get(key)
            if names is not None:
                names.discard(name)
                if not names:
                    del self._by_block[key]
        dropped = self._ram.pop(name, None)
        if dropped is not None:
            self._ram_bytes -= len(dropped.blob)
        if from_disk and self._disk is not None:
            self._queue_write(name, None)

    def _keep_in_ram(self, name: str, snapshot: Snapshot) -> None:
        if name in self._ram or len(snapshot.blob) > self.ram_budget_bytes:
            return
        self._ram[name] = snapshot
        self._ram_bytes += len(snapshot.blob)
        self._trim_ram()

    def _trim_ram(self) -> None:
        """The least recently used snapshots leave RAM until it is within its budget, but never one still
        waiting for its disk write: that one would be lost while the writer waits for the engine's idle
        moments (a server answering one request after another has few). The RAM tier may then exceed its
        budget by what the write queue holds."""
        for old_name in [name for name in self._ram if name not in self._unwritten]:
            if self._ram_bytes <= self.ram_budget_bytes:
                return
            self._ram_bytes -= len(self._ram.pop(old_name).blob)
            if self._disk is None:
                self._forget(old_name, from_disk=False)
            # With a disk tier it stays known: it is on disk; a file gone since shows as a failed
            # fetch, which forgets it then.

    def _queue_write(self, name: str, snapshot: Snapshot | None) -> None:
        if self._writer is None:
            return
        try:
            self._writes.put_nowait((name, snapshot))
        except queue.Full:
            self._add("writes_skipped", 1)
            if snapshot is not None:  # (a removal is queued with the lock held)
                self._written(name)

    def _written(self, name: str) -> None:
        """`name`'s disk write is over (done, failed or skipped): RAM may let it go."""
        with self._lock:
            if name in self._unwritten:
                self._unwritten.discard(name)
                self._trim_ram()

    def _write_loop(self) -> None:
        assert self._disk is not None
        try:  # Linux nices threads one by one: the writer yields the cores to decoding
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICENESS)
        except (AttributeError, OSError):
            pass
        try:
            for name in self._disk.newest(self.ram_budget_bytes) if self._verifies_newest else ():
                if not self._disk.verify(name):
                    with self._lock:
                        self._forget(name, from_disk=False)
        except Exception:  # a check that fails leaves the file to be checked when it is restored
            log.exception("KV snapshot verification failed")
        finally:
            self._verified_newest.set()
        while True:
            item = self._writes.get()
            if item is None:
                return
            name, snapshot = item
            deadline = time.monotonic() + MAX_WRITE_DEFERRAL_S

            def pause() -> None:
                if self._engine_idle is not None:
                    self._engine_idle.wait(max(0.0, deadline - time.monotonic()))
            try:
                if snapshot is None:
                    self._disk.remove(name)
                else:
                    self._disk.write(name, snapshot, pause)  # counts what it could not write
            except Exception:  # a failing disk loses a snapshot, never the writer
                log.exception("KV snapshot write failed")
            finally:
                if snapshot is not None:
                    self._written(name)


def _is_prefix(short: Sequence[int], long: Sequence[int]) -> bool:
    return len(short) <= len(long) and tuple(long[:len(short)]) == tuple(short)
