"""ARCA's append-only file: every write as the RESP command that replays it, fsynced once a second, rewritten
in the background; read back at start, where a torn last record is cut and damage anywhere else is refused.

One owner: the daemon's event loop thread appends; the fsync and the rewrite run in a worker thread on data
handed to them. A `kill -9` loses at most the last second. When the file grows past twice its size after the
last rewrite, a rewrite writes the current keyspace to a new file while writes go on; the commands written
meanwhile are appended to it before it replaces the old one.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from reame.arca.resp import RequestParser, command_bytes
from reame.arca.store import Keyspace, Stream, format_id
from reame.errors import ReameError
from reame.files import PRIVATE_FILE, create_private, fsync_directory, private_directory

log = logging.getLogger("reame.arca")

AOF_NAME = "appendonly.aof"
REWRITE_MIN_BYTES = 1 << 20


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


# Where a record begins (after the CRLF ending the one before): found after an unfinished record, the
# unfinished one was not the last, so it is damage, not a crash mid-append.
RECORD_START = re.compile(rb"\r\n\*[0-9]+\r\n\$[0-9]+\r\n")


@dataclass(frozen=True)
class LogScan:
    """An AOF read: its whole commands, the bytes they take from the start, and the file's size. `damaged`:
    what follows them is not a torn final record (malformed, or more records after an unfinished one)."""

    commands: list[list[bytes]]
    good: int
    size: int
    damaged: bool


class LogDamaged(ReameError):
    """The AOF is damaged before its end: loading it would drop everything after the damage."""

    def __init__(self, path: Path, scan: LogScan) -> None:
        super().__init__(f"{path} is damaged at byte {scan.good} of {scan.size}, after {len(scan.commands)} whole "
                         "commands; ARCA does not start on it, so nothing is lost. `reame arca --check-aof` says "
                         "more; `reame arca --check-aof --fix` moves it aside and keeps the commands before the "
                         "damage")


def scan_log(data: bytes) -> LogScan:
    commands, good, malformed = RequestParser().whole_commands(data)
    damaged = malformed or (good < len(data) and RECORD_START.search(data, good) is not None)
    return LogScan(commands, good, len(data), damaged)


def read_log(path: Path) -> LogScan:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return LogScan([], 0, 0, False)
    return scan_log(data)


def check_log(path: Path, fix: bool) -> tuple[bool, str]:
    """`reame arca --check-aof [--fix]`, as redis-check-aof: whether the log is sound (after the fix), and what
    was found and done. A fix never deletes: the damaged file is moved aside, and a log of the whole commands
    before the damage takes its place."""
    scan = read_log(path)
    if not path.exists():
        return True, f"{path}: no append-only file (an empty store)"
    if scan.good == scan.size:
        return True, f"{path}: {len(scan.commands)} commands, {scan.size} bytes: OK"
    where = f"{path}: {len(scan.commands)} whole commands, then at byte {scan.good} of {scan.size}"
    if not scan.damaged:
        return True, f"{where} a torn last record ({scan.size - scan.good} bytes, a crash mid-append): loading " \
                     "cuts it off"
    if not fix:
        return False, f"{where} damage: {scan.size - scan.good} bytes from there would be lost; run with --fix to " \
                      "move the file aside and keep the commands before the damage"
    aside = path.with_name(f"{path.name}.damaged-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}")
    os.replace(path, aside)
    with create_private(path) as out:
        out.write(aside.read_bytes()[:scan.good])
        out.flush()
        os.fsync(out.fileno())
    fsync_directory(path.parent)
    return True, f"{where} damage: moved the file to {aside} and wrote the {len(scan.commands)} commands before " \
                 f"the damage ({scan.good} bytes) to {path}; the {scan.size - scan.good} bytes after it are only " \
                 f"in {aside}"


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
