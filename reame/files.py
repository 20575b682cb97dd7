"""Small pieces the on-disk stores share: private directories and files, an exclusive lock between
processes, token arrays as bytes.

What the stores keep (prompts and answers as tokens, conversations' KV, cached answers) is the users'
data: directories are 0700 and files 0600 whatever the umask, a new file is created exclusively and
never through a symlink someone planted, and a rename that promises durability is followed by an fsync
of its directory.
"""

from __future__ import annotations

import array
import fcntl
import os
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import BinaryIO

PRIVATE_DIRECTORY = 0o700
PRIVATE_FILE = 0o600
NEW_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def private_directory(path: Path) -> Path:
    """`path` (and its missing parents) as a directory only this user can enter; one of ours made by an
    earlier version with a looser mode is tightened. OSError when it cannot be made."""
    path.mkdir(mode=PRIVATE_DIRECTORY, parents=True, exist_ok=True)
    try:
        status = path.stat()
        if status.st_uid == os.geteuid() and status.st_mode & 0o077:
            path.chmod(PRIVATE_DIRECTORY)
    except OSError:
        pass  # not ours to tighten (a shared directory the user chose): used as it is
    return path


def create_private(path: Path) -> BinaryIO:
    """A new file, open for writing, that only this user can read: exclusive (an existing file or a
    symlink at `path` is an error, FileExistsError or OSError), whatever the umask."""
    return os.fdopen(os.open(path, NEW_FILE_FLAGS, PRIVATE_FILE), "wb")


def read_private(path: Path, limit: int) -> bytes:
    """At most `limit` bytes of a file, never read through a symlink someone planted (OSError then, as
    for a missing file)."""
    with os.fdopen(os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC), "rb") as stream:
        return stream.read(limit)


def write_file_atomically(path: Path, data: bytes | memoryview) -> None:
    """`data` as the private file `path`, whole or not at all, durable once this returns: written to a new
    temp file beside it, fsynced, renamed over `path`, the directory fsynced."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    temporary.unlink(missing_ok=True)  # a leftover of this same process and thread (it died mid-write)
    try:
        with create_private(temporary) as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temporary, path)
        fsync_directory(path.parent)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def fsync_directory(directory: Path) -> None:
    """Make a rename in `directory` durable (the new name is on disk, not only the file's bytes)."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class FileLock:
    """An exclusive flock on a file, for the duration of a with-block."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd = -1

    def __enter__(self) -> FileLock:
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, PRIVATE_FILE)
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc: object) -> None:
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)


def pack_tokens(tokens: Sequence[int]) -> bytes:
    """Tokens as little-endian int32s."""
    packed = array.array("i", tokens)
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


def unpack_tokens(data: bytes) -> tuple[int, ...]:
    values = array.array("i")
    values.frombytes(data)
    if sys.byteorder == "big":
        values.byteswap()
    return tuple(values)
