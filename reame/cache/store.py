"""Snapshot files: one sequence's KV state and the tokens it covers, on disk.

File layout (little-endian):

    header   magic "REAMEKV\\0", u32 version, 32-byte fingerprint, u32 token count,
             u32 codec (0 raw, 1 zstd), u64 payload size, u64 raw size
    tokens   token count x i32
    payload  the state blob, raw or zstd-compressed
    trailer  u32 crc32 of everything before it

Writes go to a temp file, fsync, rename, so a reader never sees half a file.
Several processes share one directory: writes and evictions hold an exclusive
`flock` on `.lock`, the least recently used files (by mtime; a hit touches its
file) go first when the byte budget is exceeded, and each process rescans the
directory when it changed, so it sees the others' new files without a restart.
A truncated, corrupt or foreign file is removed and counted, never fatal; a
file of another model (another fingerprint) is left alone for its owner, and so
is a compressed file this Python cannot read (no zstandard): skipped and
counted, for the processes that can.
"""

from __future__ import annotations

import logging
import mmap
import os
import struct
import threading
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from reame.cache import codec
from reame.cache.codec import CodecUnavailable
from reame.errors import CacheError
from reame.files import FileLock, create_private, fsync_directory, pack_tokens, private_directory, unpack_tokens

log = logging.getLogger("reame.cache")

MAGIC = b"REAMEKV\0"
VERSION = 1
HEADER = struct.Struct("<8sI32sIIQQ")
TRAILER = struct.Struct("<I")
CODEC_RAW, CODEC_ZSTD = 0, 1
SUFFIX = ".kvs"
LOCK_NAME = ".lock"
MAX_TOKENS = 1 << 24
# Compress only when a sample shrinks by this much: KV data is mostly incompressible
# (zstd gave 1.04-1.09x on real KV), and every compressed byte costs CPU on restore.
COMPRESS_SAMPLE_BYTES = 1 << 20
COMPRESS_WORTH_RATIO = 0.85
WRITE_SLICE = 4 << 20
# A directory changed this recently may change again within its mtime granularity: rescan.
RESCAN_WINDOW_NS = 2_000_000_000


@dataclass(frozen=True)
class FileIdentity:
    """Which file a path named when it was opened: a rename over it makes another one."""

    device: int
    inode: int
    size: int

    @classmethod
    def of(cls, stat: os.stat_result) -> FileIdentity:
        return cls(stat.st_dev, stat.st_ino, stat.st_size)


@dataclass(frozen=True)
class Snapshot:
    """A sequence's KV state blob and the tokens it holds, in order.

    A blob read from disk is a writable view of the file mapped copy-on-write, so a restore hands
    it to llama.cpp without copying it first."""

    tokens: tuple[int, ...]
    blob: bytes | memoryview


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def encode_parts(fingerprint: bytes, snapshot: Snapshot, compress: bool) -> list[bytes | memoryview]:
    """A snapshot's file but its trailer, as consecutive parts (the state is not copied);
    compressed only when a sample shows that it pays. `write_atomically` adds the trailer."""
    blob = snapshot.blob
    codec_id, payload = CODEC_RAW, blob
    if compress and _compression_pays(blob):
        packed = codec.compress(blob)
        if packed is not None and len(packed) < len(blob) * COMPRESS_WORTH_RATIO:
            codec_id, payload = CODEC_ZSTD, packed
    return [HEADER.pack(MAGIC, VERSION, fingerprint, len(snapshot.tokens), codec_id, len(payload), len(blob)),
            pack_tokens(snapshot.tokens), payload]


def encode(fingerprint: bytes, snapshot: Snapshot, compress: bool) -> bytes:
    """The whole file for a snapshot, in one piece."""
    body = b"".join(encode_parts(fingerprint, snapshot, compress))
    return body + TRAILER.pack(zlib.crc32(body))


def decode(data: bytes | bytearray | mmap.mmap, fingerprint: bytes, checksum: bool = True) -> Snapshot:
    """Parse and verify a whole file; CacheError says what is wrong with it (CodecUnavailable: nothing,
    but this Python cannot decompress it). The blob is a view into `data`. `checksum=False` skips the
    crc32 of a file this process has verified already (`DiskStore` knows which)."""
    n_tokens, codec_id, payload_size, raw_size = check(data, fingerprint, checksum)
    tokens_end = HEADER.size + 4 * n_tokens
    view = memoryview(data)
    payload: bytes | memoryview = view[tokens_end:tokens_end + payload_size]
    if codec_id == CODEC_ZSTD:
        payload = codec.decompress(payload, raw_size)
    if len(payload) != raw_size:
        raise CacheError("the state has the wrong size")
    return Snapshot(unpack_tokens(bytes(view[HEADER.size:tokens_end])), payload)


def check(data: bytes | bytearray | mmap.mmap, fingerprint: bytes, checksum: bool = True) -> tuple[int, int, int, int]:
    """The header of a whole file (tokens, codec, payload size, raw size) once its layout and, with
    `checksum`, its crc32 are right; CacheError otherwise."""
    header = _parse_header(bytes(data[:HEADER.size]), fingerprint)
    n_tokens, _, payload_size, _ = header
    if len(data) != HEADER.size + 4 * n_tokens + payload_size + TRAILER.size:
        raise CacheError("the file is truncated or has trailing bytes")
    if checksum and zlib.crc32(memoryview(data)[:-TRAILER.size]) != \
            TRAILER.unpack_from(data, len(data) - TRAILER.size)[0]:
        raise CacheError("checksum mismatch")
    return header


class ForeignFingerprint(CacheError):
    """A valid file written for another model, library or KV layout."""


def _parse_header(head: bytes, fingerprint: bytes) -> tuple[int, int, int, int]:
    if len(head) < HEADER.size:
        raise CacheError("the file is truncated")
    magic, version, file_fingerprint, n_tokens, codec_id, payload_size, raw_size = HEADER.unpack(head)
    if magic != MAGIC:
        raise CacheError("not a Reame KV snapshot")
    if version != VERSION:
        raise CacheError(f"snapshot format version {version}, this Reame reads {VERSION}")
    if codec_id not in (CODEC_RAW, CODEC_ZSTD) or n_tokens > MAX_TOKENS:
        raise CacheError("the header is damaged")
    if file_fingerprint != fingerprint:
        raise ForeignFingerprint("written for another model, library or KV layout")
    return n_tokens, codec_id, payload_size, raw_size


def _compression_pays(blob: bytes | memoryview) -> bool:
    sample = blob[:COMPRESS_SAMPLE_BYTES]
    packed = codec.compress(sample) if len(sample) else None
    return packed is not None and len(packed) < len(sample) * COMPRESS_WORTH_RATIO


def write_atomically(path: Path, parts: Sequence[bytes | memoryview],
                     pause: Callable[[], None] = lambda: None, durable: bool = True) -> None:
    """`parts` and their crc32 trailer to a new private temp file in the same directory, fsync, rename,
    fsync the directory: readers see all of it or nothing, and once this returns it survives a crash.
    `pause()` is called between slices of WRITE_SLICE bytes: it may sleep while the cores are better spent
    elsewhere. `durable=False` skips both fsyncs, for files cheap to lose (a crash may then leave a file
    whose crc32 is wrong: readers check it)."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    temporary.unlink(missing_ok=True)  # a leftover of this same process and thread (it died mid-write)
    crc = 0
    try:
        with create_private(temporary) as out:
            for part in parts:
                view = memoryview(part).cast("B")
                for start in range(0, len(view), WRITE_SLICE):
                    pause()
                    piece = view[start:start + WRITE_SLICE]
                    crc = zlib.crc32(piece, crc)
                    out.write(piece)
            out.write(TRAILER.pack(crc))
            pause()
            out.flush()
            if durable:
                os.fsync(out.fileno())
        os.replace(temporary, path)
        if durable:
            fsync_directory(path.parent)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


class DiskStore:
    """The snapshot files of one fingerprint in a shared directory, under a byte budget.

    Threading: lookups (HTTP threads) read and rescan, the cache's writer thread writes and removes;
    the index (`entries` and what was scanned) is changed under one lock, never while a file is written.
    """

    def __init__(self, directory: Path, fingerprint: bytes, budget_bytes: int, compress: bool = True,
                 count: Callable[[str, int], None] = lambda name, n: None) -> None:
        self.directory = directory
        self.fingerprint = fingerprint
        self.budget_bytes = budget_bytes
        self.compress = compress
        self._count = count
        self.entries: dict[str, tuple[int, ...]] = {}  # file stem -> tokens, this fingerprint only
        self._seen: set[str] = set()  # every file name looked at, ours or not
        self._scanned_mtime = -1
        self._lock = threading.RLock()  # guards entries, _seen and _scanned_mtime
        self._refused = False  # the last write failed (full or read-only disk): said once
        # Files whose crc32 this process has checked (or computed, writing them), by their identity: a
        # file is only ever replaced by a rename (a new inode), never changed in place, so a restore
        # from one of them skips the checksum (16 ms for a 112 MB snapshot here).
        self._verified: dict[str, FileIdentity] = {}
        private_directory(directory)
        with self._locked():
            remove_abandoned_writes(directory)
            self._enforce_budget()
        self.refresh()

    def path(self, name: str) -> Path:
        return self.directory / f"{name}{SUFFIX}"

    def refresh(self) -> tuple[list[str], list[str]]:
        """Rescan when the directory changed: (names added, names gone) for this fingerprint."""
        with self._lock:
            return self._refresh()

    def _refresh(self) -> tuple[list[str], list[str]]:
        try:
            mtime = os.stat(self.directory).st_mtime_ns
        except OSError:
            return [], []
        if mtime == self._scanned_mtime and time.time_ns() - mtime > RESCAN_WINDOW_NS:
            return [], []
        self._scanned_mtime = mtime
        present = {entry.name for entry in os.scandir(self.directory)
                   if entry.name.endswith(SUFFIX) and not entry.name.startswith(".")}
        added = []
        for file_name in present - self._seen:
            name = file_name[:-len(SUFFIX)]
            tokens = self._read_tokens(name)
            if tokens is not None:
                self.entries[name] = tokens
                added.append(name)
        gone = [name for name in list(self.entries) if self.path(name).name not in present]
        for name in gone:
            del self.entries[name]
            self._verified.pop(name, None)
        self._seen = present
        return added, gone

    def read(self, name: str) -> Snapshot | None:
        """The verified snapshot, or None (a damaged file is removed and counted)."""
        opened = self._map(name)
        if opened is None:
            return None
        data, identity = opened
        try:
            snapshot = decode(data, self.fingerprint, checksum=not self._was_verified(name, identity))
        except CodecUnavailable:
            with self._lock:
                self.entries.pop(name, None)
            self._count("unreadable_skipped", 1)
            return None
        except CacheError as error:
            self._drop_damaged(name, str(error))
            return None
        self._mark_verified(name, identity)
        self._count("bytes_read", len(data))
        try:
            os.utime(self.path(name))  # recency for the LRU, seen by every process
        except OSError:
            pass
        return snapshot

    def verify(self, name: str) -> bool:
        """Check a file's layout and crc32 now, so that its first restore need not (a damaged file is
        removed and counted); True when it is sound."""
        opened = self._map(name)
        if opened is None:
            return False
        data, identity = opened
        if self._was_verified(name, identity):
            return True
        try:
            check(data, self.fingerprint)
        except CacheError as error:
            self._drop_damaged(name, str(error))
            return False
        self._mark_verified(name, identity)
        return True

    def newest(self, budget_bytes: int) -> list[str]:
        """This fingerprint's most recently used files, newest first, as many as fit in `budget_bytes`."""
        with self._lock:
            names = list(self.entries)
        found = []
        for name in names:
            try:
                stat = self.path(name).stat()
            except OSError:
                continue
            found.append((stat.st_mtime_ns, stat.st_size, name))
        chosen, total = [], 0
        for _, size, name in sorted(found, reverse=True):
            if total + size > budget_bytes:
                break
            chosen.append(name)
            total += size
        return chosen

    def _map(self, name: str) -> tuple[bytes | mmap.mmap, FileIdentity] | None:
        """`map_copy_on_write` of a snapshot file and its identity; None when it is gone or unreadable."""
        path = self.path(name)
        try:
            data, stat = map_copy_on_write(path)
        except FileNotFoundError:
            with self._lock:
                self.entries.pop(name, None)
                self._verified.pop(name, None)
            return None
        except OSError as error:
            log.warning("cannot read KV snapshot %s: %s", path.name, error.strerror)
            return None
        return data, FileIdentity.of(stat)

    def _was_verified(self, name: str, identity: FileIdentity) -> bool:
        with self._lock:
            return self._verified.get(name) == identity

    def _mark_verified(self, name: str, identity: FileIdentity) -> None:
        with self._lock:
            self._verified[name] = identity

    def write(self, name: str, snapshot: Snapshot, pause: Callable[[], None] = lambda: None) -> bool:
        """Store a snapshot (False when it alone exceeds the budget or the disk refuses it)."""
        parts = encode_parts(self.fingerprint, snapshot, self.compress)
        size = sum(len(part) for part in parts) + TRAILER.size
        if size > self.budget_bytes:
            self._count("writes_skipped", 1)
            return False
        try:
            with self._locked():
                write_atomically(self.path(name), parts, pause)
                identity = FileIdentity.of(os.stat(self.path(name)))
                self._enforce_budget()
        except OSError as error:
            self._count("write_errors", 1)
            if not self._refused:  # said once, not for every snapshot while the disk stays full
                log.warning("cannot write KV snapshots to %s (%s): serving on, with what is in RAM and on disk "
                            "already; reame_prefix_cache_write_errors_total counts the snapshots lost",
                            self.directory, error.strerror or error)
            self._refused = True
            return False
        if self._refused:
            log.info("writing KV snapshots to %s again", self.directory)
            self._refused = False
        with self._lock:
            self.entries[name] = snapshot.tokens
            self._verified[name] = identity  # its crc32 was computed from the snapshot itself
        self._count("bytes_written", size)
        return True

    def tokens_of(self, name: str) -> tuple[int, ...] | None:
        with self._lock:
            return self.entries.get(name)

    def remove(self, name: str) -> None:
        with self._lock:
            self.entries.pop(name, None)
            self._verified.pop(name, None)
        self.path(name).unlink(missing_ok=True)

    def _read_tokens(self, name: str) -> tuple[int, ...] | None:
        path = self.path(name)
        try:
            with path.open("rb") as stream:
                head = stream.read(HEADER.size)
                n_tokens, codec_id, payload_size, _ = _parse_header(head, self.fingerprint)
                token_bytes = stream.read(4 * n_tokens)
                size = os.fstat(stream.fileno()).st_size
        except ForeignFingerprint:
            return None
        except CacheError as error:
            self._drop_damaged(name, str(error))
            return None
        except OSError:
            return None
        if len(token_bytes) != 4 * n_tokens or size != HEADER.size + 4 * n_tokens + payload_size + TRAILER.size:
            self._drop_damaged(name, "the file is truncated or has trailing bytes")
            return None
        if codec_id == CODEC_ZSTD and not codec.available():
            self._count("unreadable_skipped", 1)  # once: `refresh` looks at each file name once
            return None
        return unpack_tokens(token_bytes)

    def _drop_damaged(self, name: str, why: str) -> None:
        log.warning("dropping KV snapshot %s: %s", self.path(name).name, why)
        with self._lock:
            self.entries.pop(name, None)
            self._verified.pop(name, None)
        self.path(name).unlink(missing_ok=True)
        self._count("corrupt_dropped", 1)

    def _enforce_budget(self) -> None:
        """Delete the least recently used files until the directory fits its budget (lock held)."""
        evicted = enforce_budget(self.directory, SUFFIX, self.budget_bytes)  # `refresh` reports them gone
        if evicted:
            self._count("evictions", evicted)

    def _locked(self) -> FileLock:
        return FileLock(self.directory / LOCK_NAME)


def map_copy_on_write(path: Path) -> tuple[bytes | mmap.mmap, os.stat_result]:
    """A file mapped copy-on-write (the checksum and llama.cpp read the page cache directly, with no copy of it;
    an empty file is b"") and its status; OSError when it cannot be opened."""
    with path.open("rb") as stream:
        stat = os.fstat(stream.fileno())
        data = mmap.mmap(stream.fileno(), stat.st_size, access=mmap.ACCESS_COPY) if stat.st_size else b""
    return data, stat


def remove_abandoned_writes(directory: Path) -> None:
    """Temporary files of writers that died mid-write (kill -9, power loss) never become files of the
    directory: remove those whose process is gone (its lock held, so no live writer is mid-rename)."""
    for entry in os.scandir(directory):
        parts = entry.name.split(".")
        if entry.name.startswith(".") and entry.name.endswith(".tmp") and len(parts) >= 5 and parts[-3].isdigit():
            if not _process_alive(int(parts[-3])):
                Path(entry.path).unlink(missing_ok=True)


def enforce_budget(directory: Path, suffix: str, budget_bytes: int) -> int:
    """Delete the least recently used (by mtime) `suffix` files until the directory fits `budget_bytes`
    (its lock held); how many went."""
    files = []
    for entry in os.scandir(directory):
        if entry.name.endswith(suffix) and not entry.name.startswith("."):
            try:
                stat = entry.stat()
            except OSError:
                continue
            files.append((stat.st_mtime_ns, entry.name, stat.st_size))
    total, evicted = sum(size for _, _, size in files), 0
    for _, file_name, size in sorted(files):
        if total <= budget_bytes:
            break
        (directory / file_name).unlink(missing_ok=True)
        total -= size
        evicted += 1
    return evicted


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
