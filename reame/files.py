"""Small pieces the on-disk stores share: an exclusive lock between processes, token arrays as bytes."""

from __future__ import annotations

import array
import fcntl
import os
import sys
from collections.abc import Sequence
from pathlib import Path


class FileLock:
    """An exclusive flock on a file, for the duration of a with-block."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd = -1

    def __enter__(self) -> FileLock:
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
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
