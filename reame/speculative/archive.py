"""The Palimpsest's archive on disk: every generation with its prompt, as framed, checksummed records.

One file per tokenizer, `<dir>/<vocabulary hash>.palimpsest` (little-endian):

    header  magic "REAMEPAL", u32 version, 32-byte vocabulary hash, u64 generation (random, new with
            every rewrite: how the other processes tell a new file from the one they read)
    frames  u32 payload bytes, u32 crc32 of the payload, payload: the tokens as int32s

The vocabulary hash in the name and the header means another tokenizer's
tokens can never be read as this one's.

Several processes share the file. An append holds an exclusive `flock` on
`<file>.lock`: it first cuts off a frame torn by a writer that died in the
middle of its append (only the last frame can be torn: appends are
serialised), then writes its frame with one `write`. A process that is
killed loses nothing it appended (the data is the kernel's); `sync` fsyncs
what was appended, at most once a second from the Palimpsest's flusher, so a
power cut loses at most the last second. Every process reads the frames the
others appended from where it stopped reading (`read_new`); its own appends
it knows by their offsets. When the file outgrows its byte budget, the
appending process rewrites it, under the lock, with the newest frames that
fit in KEEP_SHARE of the budget (a temp file renamed over it); the others see
a new generation in its header and read it again from the start.

A frame whose checksum fails is skipped (its length still says where the next
one starts); a frame that claims more than MAX_FRAME_BYTES ends the readable
part of the file, as truncation does.
"""

from __future__ import annotations

import logging
import os
import struct
import threading
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from reame.files import FileLock, create_private, pack_tokens, private_directory, unpack_tokens

log = logging.getLogger("reame.palimpsest")

MAGIC = b"REAMEPAL"
VERSION = 1
HEADER = struct.Struct("<8sI32sQ")
FRAME = struct.Struct("<II")
SUFFIX = ".palimpsest"
MAX_FRAME_BYTES = 1 << 26
KEEP_SHARE = 0.75  # a compaction keeps the newest frames that fit in this share of the budget


@dataclass(frozen=True)
class NewFrames:
    """What `read_new` found: the frames appended since the last call, and whether the file was rewritten
    (then `frames` is the whole new file and what was read before is gone)."""

    frames: list[tuple[int, ...]]
    restarted: bool


class Archive:
    """One tokenizer's archive file. Thread-safe."""

    def __init__(self, directory: Path, vocabulary: bytes, budget_bytes: int) -> None:
        if len(vocabulary) != 32:
            raise ValueError("the vocabulary hash is 32 bytes")
        private_directory(directory)
        self.path = directory / (vocabulary.hex()[:32] + SUFFIX)
        self.vocabulary = vocabulary
        self.budget_bytes = max(budget_bytes, HEADER.size + FRAME.size + 64)
        self._lock = threading.Lock()
        self._file_lock = FileLock(self.path.with_name(self.path.name + ".lock"))
        self._generation: int | None = None  # the header's generation of the file read so far
        self._read_to = 0  # where the next unread frame starts
        self._own: set[int] = set()  # offsets of frames this process appended and has not read past
        self._dirty = False
        self._failed = False  # an append failed: said once
        with self._file_lock:
            self._ensure_file()

    def append(self, tokens: Sequence[int]) -> None:
        """Add one record. A full disk or an unwritable file loses the record, says so once, and never
        fails the caller: the archive only ever makes generation faster."""
        payload = pack_tokens(tokens)
        if not payload or len(payload) > MAX_FRAME_BYTES:
            return
        frame = FRAME.pack(len(payload), zlib.crc32(payload)) + payload
        try:
            with self._lock, self._file_lock:
                self._ensure_file()
                with open(self.path, "r+b") as file:
                    end = self._cut_torn_tail(file)
                    full = end + len(frame) > self.budget_bytes
                    if full:
                        self._compact(file, len(frame))
                if full:  # the compacted file is a new one, made of whole frames
                    end = self.path.stat().st_size
                with open(self.path, "r+b") as file:
                    file.seek(end)
                    file.write(frame)
                self._own.add(end)
                self._dirty = True
        except OSError as error:
            if not self._failed:
                self._failed = True
                log.warning("the Palimpsest cannot write %s (%s): generations are not archived until it can",
                            self.path, error.strerror or error)

    def read_new(self) -> NewFrames:
        """The frames others appended since the last call (own appends are skipped: the caller has them)."""
        with self._lock:
            try:
                with open(self.path, "rb") as file:
                    generation = self._generation_of(file)
                    if generation is None:
                        self._generation = None
                        return NewFrames([], True)
                    restarted = generation != self._generation
                    if restarted:
                        self._generation, self._read_to, self._own = generation, HEADER.size, set()
                    frames, self._read_to = self._frames_from(file, self._read_to, os.fstat(file.fileno()).st_size,
                                                              skip=() if restarted else self._own)
                    self._own = {offset for offset in self._own if offset >= self._read_to}
                    return NewFrames(frames, restarted)
            except FileNotFoundError:
                self._generation = None
                return NewFrames([], True)

    def position(self) -> tuple[int, int] | None:
        """(generation, offset) of what was read, when every frame before the offset was read (this process's
        own appends too); None before the first read or while an own append is still unread."""
        with self._lock:
            return None if self._generation is None or self._own else (self._generation, self._read_to)

    def resume(self, generation: int, offset: int) -> bool:
        """Read on from `offset` (a checkpoint's position) if the file is still of `generation` and a whole
        frame starts there (or the file ends there); False and nothing changed otherwise."""
        with self._lock:
            try:
                with open(self.path, "rb") as file:
                    size = os.fstat(file.fileno()).st_size
                    if self._generation_of(file) != generation or not HEADER.size <= offset <= size:
                        return False
                    if offset < size and not _whole_frame_at(file, offset, size):
                        return False
            except OSError:
                return False
            self._generation, self._read_to, self._own = generation, offset, set()
            return True

    def sync(self) -> None:
        """fsync what was appended since the last call."""
        with self._lock:
            if not self._dirty:
                return
            self._dirty = False
            try:
                fd = os.open(self.path, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            except OSError:
                pass

    def size_bytes(self) -> int:
        try:
            return self.path.stat().st_size
        except OSError:
            return 0

    # --- under the locks -------------------------------------------------------------------------

    def _ensure_file(self) -> None:
        """Create the file, or replace one that is not an archive of this vocabulary."""
        try:
            with open(self.path, "rb") as file:
                if self._generation_of(file) is not None:
                    return
            log.warning("%s is not a Palimpsest archive of this vocabulary: starting it again", self.path)
        except FileNotFoundError:
            pass
        self._write_atomically([])

    def _generation_of(self, file) -> int | None:
        """The file's generation, or None when it is not an archive of this vocabulary."""
        file.seek(0)
        data = file.read(HEADER.size)
        if len(data) != HEADER.size:
            return None
        magic, version, vocabulary, generation = HEADER.unpack(data)
        return generation if magic == MAGIC and version == VERSION and vocabulary == self.vocabulary else None

    def _cut_torn_tail(self, file) -> int:
        """Where a new frame goes: the end of the last whole frame (a torn one after it is cut off)."""
        size = os.fstat(file.fileno()).st_size
        known = self._generation is not None and self._generation_of(file) == self._generation \
            and self._read_to <= size
        at = self._read_to if known else HEADER.size  # frames before what was read are whole
        while at + FRAME.size <= size:
            file.seek(at)
            length, _ = FRAME.unpack(file.read(FRAME.size))
            if length > MAX_FRAME_BYTES or at + FRAME.size + length > size:
                break
            at += FRAME.size + length
        if at < size:
            file.truncate(at)
        return at

    def _frames_from(self, file, start: int, end: int,
                     skip: set[int] | tuple = ()) -> tuple[list[tuple[int, ...]], int]:
        """The whole frames between `start` and `end` but those at offsets in `skip`, and where they end."""
        frames = []
        at = start
        file.seek(at)
        while at + FRAME.size <= end:
            length, checksum = FRAME.unpack(file.read(FRAME.size))
            if length > MAX_FRAME_BYTES or at + FRAME.size + length > end:
                break
            payload = file.read(length)
            if at not in skip and zlib.crc32(payload) == checksum and length % 4 == 0:
                frames.append(unpack_tokens(payload))
            at += FRAME.size + length
        return frames, at

    def _compact(self, file, incoming: int) -> None:
        """Rewrite the file with the newest frames that fit in KEEP_SHARE of the budget."""
        size = os.fstat(file.fileno()).st_size
        frames, _ = self._frames_from(file, HEADER.size, size)
        room = int(self.budget_bytes * KEEP_SHARE) - HEADER.size - incoming
        kept: list[tuple[int, ...]] = []
        for frame in reversed(frames):
            room -= FRAME.size + 4 * len(frame)
            if room < 0:
                break
            kept.append(frame)
        self._write_atomically(kept[::-1])

    def _write_atomically(self, frames: list[tuple[int, ...]]) -> None:
        temp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        temp.unlink(missing_ok=True)  # this process's own leftover (its file lock is held)
        with create_private(temp) as out:
            out.write(HEADER.pack(MAGIC, VERSION, self.vocabulary, int.from_bytes(os.urandom(8), "little")))
            for frame in frames:
                payload = pack_tokens(frame)
                out.write(FRAME.pack(len(payload), zlib.crc32(payload)) + payload)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temp, self.path)


def _whole_frame_at(file, at: int, size: int) -> bool:
    """Whether a whole frame, its checksum right, starts at `at` of a file of `size` bytes."""
    file.seek(at)
    header = file.read(FRAME.size)
    if len(header) != FRAME.size:
        return False
    length, checksum = FRAME.unpack(header)
    return length <= MAX_FRAME_BYTES and at + FRAME.size + length <= size and \
        zlib.crc32(file.read(length)) == checksum
