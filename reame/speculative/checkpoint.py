"""The Palimpsest's index kept on disk beside its archive, so a start reads it instead of rebuilding it.

Indexing costs ~1.5 s of Python per million archived tokens, on the start of every process: a one-shot
prompt paid it in CPU taken from its own answer (40 ms for 39k tokens on 2 cores), a server in its first
seconds. A checkpoint is the index's arrays as they were when the archive had been read up to `offset` of
its `generation` (both from the archive: a rewritten archive has a new generation, and its checkpoint is
then ignored); a start loads it and reads only the frames appended after `offset`.

`<archive>.index` (native byte order, little-endian machines only):

    header  magic "REAMEIDX", u32 version, u32 table bits, u64 generation, u64 offset, u64 tokens (n)
    arrays  int32: tokens (n), the SHORT and the LONG key's heads (2^bits each), their chains (n each)

A checkpoint is written whole (temp file, rename) and checked by its size when read; its contents are
not trusted further: a position that is out of range fails a lookup, which drafts nothing, and a draft is
only ever a guess the model verifies. The archive checks that `offset` starts a whole frame.
"""

from __future__ import annotations

import array
import os
import struct
import sys
from pathlib import Path

from reame.files import create_private

MAGIC = b"REAMEIDX"
VERSION = 1
HEADER = struct.Struct("<8sIIQQQ")
SUFFIX = ".index"
MAX_TOKENS = 1 << 28  # far past any archive's budget: a header claiming more is not ours


def path_of(archive: Path) -> Path:
    return archive.with_name(archive.name + SUFFIX)


def save(path: Path, generation: int, offset: int, arrays: list[array.array], table_bits: int) -> None:
    """Write `arrays` (tokens, heads, chains, as ContinuationIndex holds them) as the index of the archive
    read to `offset` of `generation`; an error leaves the previous checkpoint (a checkpoint is a speed-up)."""
    if sys.byteorder != "little":
        return
    temp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        temp.unlink(missing_ok=True)
        with create_private(temp) as out:
            out.write(HEADER.pack(MAGIC, VERSION, table_bits, generation, offset, len(arrays[0])))
            for values in arrays:
                values.tofile(out)
        os.replace(temp, path)
    except OSError:
        temp.unlink(missing_ok=True)


def load(path: Path, table_bits: int) -> tuple[int, int, list[array.array]] | None:
    """(generation, offset, [tokens, heads..., chains...]) of the checkpoint at `path`, or None when there is
    none or it is not one this index can use (another layout, a size its header does not explain)."""
    if sys.byteorder != "little":
        return None
    try:
        with os.fdopen(os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC), "rb") as stream:
            header = stream.read(HEADER.size)
            if len(header) != HEADER.size:
                return None
            magic, version, bits, generation, offset, n = HEADER.unpack(header)
            table = 1 << table_bits
            if magic != MAGIC or version != VERSION or bits != table_bits or n > MAX_TOKENS or \
                    os.fstat(stream.fileno()).st_size != HEADER.size + 4 * (3 * n + 2 * table):
                return None
            arrays = []
            for count in (n, table, table, n, n):
                values = array.array("i")
                values.fromfile(stream, count)
                arrays.append(values)
    except (OSError, EOFError, ValueError):
        return None
    if n and arrays[0][-1] != -1:
        return None  # an index ends with a record's separator
    return generation, offset, arrays
