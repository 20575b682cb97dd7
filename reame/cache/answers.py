"""Where exact answers are kept on one node: a byte-bounded LRU in RAM, and files on disk that outlive the
process and are shared by every process of the machine.

A tier maps a key (bytes, already a digest of everything that decides the answer) to a value (bytes, the
answer as the server encodes it); it never interprets the value. Both tiers are speed-ups: a read that
fails is a miss, a write that fails is not made, and neither raises.

On disk one file per answer, named by the key's digest, in a private directory: written whole (temp file,
rename, crc32 trailer, as snapshots are, but without their fsyncs: an answer is cheap to lose, and one a
crash left half written fails its crc32 and is a miss), a hit touches the file (recency for the LRU, seen by every
process), and the least recently used files go when the directory passes its byte budget. A file that is
too large, truncated, corrupt or not ours is a miss and is removed.
"""

from __future__ import annotations

import collections
import logging
import os
import re
import threading
import zlib
from pathlib import Path
from typing import Protocol

from reame.cache.store import TRAILER, enforce_budget, remove_abandoned_writes, write_atomically
from reame.files import FileLock, private_directory, read_private

log = logging.getLogger("reame.cache")

SUFFIX = ".answer"
LOCK_NAME = ".lock"
MAX_VALUE_BYTES = 1 << 20  # an answer of max_answer_tokens is tens of KB: anything far larger is not ours
NAME = re.compile(rb"[0-9a-f]{16,128}")


class AnswerTier(Protocol):
    def get(self, key: bytes) -> bytes | None: ...

    def put(self, key: bytes, value: bytes) -> bool: ...


class RamAnswers:
    """The most recently used answers, at most `budget_bytes` of keys and values. Thread-safe."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self._entries: collections.OrderedDict[bytes, bytes] = collections.OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, key: bytes) -> bytes | None:
        with self._lock:
            value = self._entries.get(key)
            if value is not None:
                self._entries.move_to_end(key)
            return value

    def put(self, key: bytes, value: bytes) -> bool:
        size = len(key) + len(value)
        if size > self.budget_bytes:
            return False
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= len(key) + len(old)
            self._entries[key] = value
            self._bytes += size
            while self._bytes > self.budget_bytes:
                evicted_key, evicted = self._entries.popitem(last=False)
                self._bytes -= len(evicted_key) + len(evicted)
        return True

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)


class DiskAnswers:
    """Answer files in `directory`, at most `budget_bytes` of them (checked before this process's first write
    and after every eighth of the budget it wrote). Thread-safe; several processes may share the directory."""

    def __init__(self, directory: Path, budget_bytes: int) -> None:
        self.directory = private_directory(directory)
        self.budget_bytes = budget_bytes
        self._written = 0  # bytes written since the budget was last enforced
        self._written_lock = threading.Lock()
        self._refused = False  # the last write failed (full or read-only disk): said once
        self._tidied = False  # abandoned writes removed and the budget enforced, before this process's first write

    def _tidy(self) -> None:
        """Left to the first write: a process that only reads (a one-shot answered from here) scans nothing."""
        self._tidied = True
        try:
            with FileLock(self.directory / LOCK_NAME):
                remove_abandoned_writes(self.directory)
                enforce_budget(self.directory, SUFFIX, self.budget_bytes)
        except OSError:
            pass

    def path(self, key: bytes) -> Path | None:
        """The file of `key` (its digest part), or None for a key that cannot name a file of ours."""
        digest = key.rsplit(b":", 1)[-1]
        return self.directory / f"{digest.decode()}{SUFFIX}" if NAME.fullmatch(digest) else None

    def get(self, key: bytes) -> bytes | None:
        path = self.path(key)
        if path is None:
            return None
        try:
            data = read_private(path, MAX_VALUE_BYTES + TRAILER.size + 1)
        except OSError:
            return None  # not there (the usual miss), or unreadable
        value = data[:-TRAILER.size]
        if len(data) <= TRAILER.size or len(value) > MAX_VALUE_BYTES or \
                zlib.crc32(value) != TRAILER.unpack_from(data, len(value))[0]:
            log.warning("removed a damaged answer file %s", path.name)
            path.unlink(missing_ok=True)
            return None
        try:
            os.utime(path)
        except OSError:
            pass
        return value

    def put(self, key: bytes, value: bytes) -> bool:
        path = self.path(key)
        if path is None or len(value) > MAX_VALUE_BYTES or len(value) + TRAILER.size > self.budget_bytes:
            return False
        if not self._tidied:
            self._tidy()
        try:
            write_atomically(path, [value], durable=False)
        except OSError as error:
            if not self._refused:
                log.warning("cannot keep answers in %s (%s): they stay in RAM", self.directory, error.strerror)
            self._refused = True
            return False
        self._refused = False
        with self._written_lock:
            self._written += len(value) + TRAILER.size
            due = self._written * 8 >= self.budget_bytes
            if due:
                self._written = 0
        if due:
            try:
                with FileLock(self.directory / LOCK_NAME):
                    enforce_budget(self.directory, SUFFIX, self.budget_bytes)
            except OSError:
                pass
        return True
