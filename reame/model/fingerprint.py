"""Model fingerprints: what a saved KV state depends on, never where the file lies.

A KV snapshot is only valid for the same weights, the same llama.cpp, the same
KV element type, the same attention kernel choice and the same stream layout.
`model_content_hash` hashes the GGUF's size, its first bytes (header and
metadata) and evenly spaced samples of its tensor data; it is cached per file
(path, inode, size, mtime and ctime: a file rewritten in place with its size and
mtime put back still changes ctime, which no one can set) so a restart does not
read the samples again.
`remembered` keeps other facts computed from a model's content (its vocabulary's
hash) the same way, so a one-shot start computes none of them twice.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from reame.files import create_private

from reame.native import LLAMA_COMMIT, cache_root

HEAD_BYTES = 16 << 20  # header, metadata and tensor table of every model we serve
SAMPLES = 32
SAMPLE_BYTES = 64 << 10
HASH_CACHE_FILE = "model-hashes.json"
FACTS_CACHE_FILE = "model-facts.json"
MAX_REMEMBERED_FACTS = 1024  # a file shared by every model ever served; oldest forgotten first
MAX_MEMORY_BYTES = 16 << 20  # either memory file at its bound is well under 1 MiB
T = TypeVar("T")


def model_content_hash(path: str | os.PathLike[str]) -> str:
    """sha256 hex of a GGUF's size, head and tensor-data samples; cached by (path, inode, size, mtime, ctime)."""
    stat = os.stat(path)
    cache_key = f"{os.path.realpath(path)}|{stat.st_ino}|{stat.st_size}|{stat.st_mtime_ns}|{stat.st_ctime_ns}"
    cache_file = cache_root() / HASH_CACHE_FILE
    known = _read_hash_cache(cache_file)
    if cache_key in known:
        return known[cache_key]
    digest = hashlib.sha256(str(stat.st_size).encode())
    with open(path, "rb") as stream:
        digest.update(stream.read(HEAD_BYTES))
        if stat.st_size > HEAD_BYTES:
            step = (stat.st_size - HEAD_BYTES) // SAMPLES
            for index in range(SAMPLES):
                stream.seek(HEAD_BYTES + index * step)
                digest.update(stream.read(SAMPLE_BYTES))
    value = digest.hexdigest()
    known[cache_key] = value
    _write_hash_cache(cache_file, known)
    return value


def remembered(path: str | os.PathLike[str], fact: str, compute: Callable[[], str], parse: Callable[[str], T]) -> T:
    """`parse(compute())`: a fact about the model file at `path` that depends only on its content and
    the pinned llama.cpp, computed once and then read back (per content hash, so a copied or moved
    file keeps it; a lost write only costs computing it again). What is read back is checked like
    any input: when `parse` refuses it (ValueError, TypeError, KeyError), the fact is computed again."""
    stored = recall(path, fact)
    if stored is not None:
        try:
            return parse(stored)
        except (ValueError, TypeError, KeyError):
            pass
    text = compute()
    value = parse(text)
    remember(path, fact, text)
    return value


def recall(path: str | os.PathLike[str], fact: str) -> str | None:
    """What was last remembered of `fact` for the model file at `path` (its content), or None. The text
    is unchecked input: its reader parses it as such."""
    stored = _read_hash_cache(cache_root() / FACTS_CACHE_FILE).get(_fact_key(path, fact))
    return stored if isinstance(stored, str) else None


def remember(path: str | os.PathLike[str], fact: str, text: str) -> None:
    """Keeps `text` as `fact` for the model file at `path` (best effort), the newest fact last: the
    oldest are forgotten past MAX_REMEMBERED_FACTS."""
    cache_file, key = cache_root() / FACTS_CACHE_FILE, _fact_key(path, fact)
    known = _read_hash_cache(cache_file)
    known.pop(key, None)
    known[key] = text
    while len(known) > MAX_REMEMBERED_FACTS:
        del known[next(iter(known))]
    _write_hash_cache(cache_file, known, sort_keys=False)


def _fact_key(path: str | os.PathLike[str], fact: str) -> str:
    return f"{model_content_hash(path)}|{LLAMA_COMMIT}|{fact}"


def kv_fingerprint(content_hash: str, kv_type: str, flash_attn: str, n_stream: int) -> bytes:
    """32 bytes naming everything a sequence state blob depends on.

    `n_stream` is the KV layout: 1 for a unified buffer (any number of
    sequences), n_seq_max for split streams. A blob records it and restores
    only into the same layout, so a unified server and a one-shot CLI run
    (one sequence, one stream) share snapshots.
    """
    facts = {"model": content_hash, "llama": LLAMA_COMMIT, "kv_type": kv_type, "flash_attn": flash_attn,
             "n_stream": n_stream}
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).digest()


def _read_hash_cache(path: Path) -> dict[str, str]:
    """A memory file read back; a damaged, deep or oversized one (a file in the cache directory is input
    like any other) counts as empty, read no further than MAX_MEMORY_BYTES."""
    try:
        with path.open("rb") as stream:
            data = stream.read(MAX_MEMORY_BYTES + 1)
        if len(data) > MAX_MEMORY_BYTES:
            return {}
        known = json.loads(data)
    except (OSError, ValueError, RecursionError):
        return {}
    return known if isinstance(known, dict) else {}


def _write_hash_cache(path: Path, known: dict[str, str], sort_keys: bool = True) -> None:
    """Best effort: a lost update only costs hashing the file again."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        temporary.unlink(missing_ok=True)
        with create_private(temporary) as out:
            out.write(json.dumps(known, indent=0, sort_keys=sort_keys).encode())
        os.replace(temporary, path)
    except OSError:
        pass
