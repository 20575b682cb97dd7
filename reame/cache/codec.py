"""zstd for snapshot and session files, when this Python has it.

Compression is optional everywhere: the `zstandard` package (a dependency of
the pip install, and bundled in the .pyz for each supported Python minor) is
used when it imports; without it files are written raw, which costs little
(KV data measured 1.04-1.09x with zstd), and a compressed file written
elsewhere is reported as unreadable, never a crash. The package is looked up
once per process and its absence logged once, at info level.
"""

from __future__ import annotations

import functools
import logging
from types import ModuleType

from reame.errors import CacheError

log = logging.getLogger("reame.cache")


class CodecUnavailable(CacheError):
    """A file is zstd-compressed and this Python has no zstd to read it."""


@functools.cache
def _zstandard() -> ModuleType | None:
    try:
        import zstandard
    except ImportError:
        log.info("the zstandard module is not available to this Python: KV snapshots and sessions are "
                 "stored uncompressed, and compressed ones written elsewhere are skipped")
        return None
    return zstandard


def available() -> bool:
    return _zstandard() is not None


def describe() -> str:
    """One line for --version: the zstd this process uses, if any."""
    module = _zstandard()
    return f"zstandard {module.__version__}" if module else "zstandard missing (snapshots stored uncompressed)"


def compress(data: bytes | memoryview) -> bytes | None:
    """zstd level 1, or None when this Python has no zstandard."""
    module = _zstandard()
    return module.ZstdCompressor(level=1).compress(data) if module else None


def decompress(data: bytes | memoryview, raw_size: int) -> bytes:
    """The original bytes (at most `raw_size`); CodecUnavailable without zstandard, CacheError when damaged."""
    module = _zstandard()
    if module is None:
        raise CodecUnavailable("the file is zstd-compressed and this Python has no zstandard module")
    try:
        return module.ZstdDecompressor().decompress(data, max_output_size=raw_size)
    except module.ZstdError as error:
        raise CacheError(f"cannot decompress: {error}") from None
