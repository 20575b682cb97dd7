"""Read the metadata of a GGUF file without loading the model.

Only the header and the key/value section are parsed; tensor data is never
read. Large arrays (the tokenizer's vocabulary) are skipped and reported by
length, so reading the metadata of a multi-GB model takes milliseconds.
Malformed or truncated input raises ModelFileError; nothing is trusted.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import Any, BinaryIO

from reame.errors import ModelFileError

MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
MAX_KEYS = 100_000
MAX_STRING_BYTES = 64 << 20  # chat templates can be long; nothing legitimate is this long
KEEP_ARRAY_ITEMS = 64  # arrays up to this length are returned whole; longer ones as ArrayInfo
SKIP_CHUNK_BYTES = 1 << 20
MAX_STRING_ITEMS = 1 << 22  # vocabularies and merge lists run to ~10^5-10^6 strings

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_LENGTH = struct.Struct("<Q")
ARCHITECTURE_FACTS = ("layers", "kv_heads", "key_size", "value_size", "context_train")


class ArrayInfo:
    """A long array that was skipped: its element type and length."""

    __slots__ = ("item_type", "length")

    def __init__(self, item_type: int, length: int) -> None:
        self.item_type = item_type
        self.length = length

    def __repr__(self) -> str:
        return f"ArrayInfo(type={self.item_type}, length={self.length})"


def read_metadata(path: str | Path) -> dict[str, Any]:
    """Key/value metadata of a GGUF file, plus `GGUF.version` and `GGUF.tensor_count`."""
    try:
        with open(path, "rb") as stream:
            return _read(stream, str(path))
    except OSError as error:
        raise ModelFileError(f"cannot read {path}: {error.strerror}") from None


def _read(stream: BinaryIO, name: str) -> dict[str, Any]:
    reader = _Reader(stream, name)
    if stream.read(4) != MAGIC:
        raise ModelFileError(f"{name} is not a GGUF model file (it does not start with 'GGUF')")
    version = reader.scalar("<I")
    if version not in SUPPORTED_VERSIONS:
        raise ModelFileError(f"{name}: GGUF version {version} is not supported (only 2 and 3)")
    tensor_count = reader.scalar("<Q")
    key_count = reader.scalar("<Q")
    if key_count > MAX_KEYS:
        raise ModelFileError(f"{name}: implausible metadata ({key_count} keys); the file is corrupt")
    metadata: dict[str, Any] = {"GGUF.version": version, "GGUF.tensor_count": tensor_count}
    for _ in range(key_count):
        key = reader.string()
        metadata[key] = reader.value(reader.scalar("<I"))
    return metadata


class _Reader:
    def __init__(self, stream: BinaryIO, name: str) -> None:
        self.stream = stream
        self.name = name
        self.size = os.fstat(stream.fileno()).st_size

    def seek_ahead(self, size: int) -> None:
        target = self.stream.tell() + size
        if target > self.size:
            raise ModelFileError(f"{self.name}: GGUF metadata is truncated; the file is incomplete")
        self.stream.seek(target)

    def take(self, size: int) -> bytes:
        data = self.stream.read(size)
        if len(data) != size:
            raise ModelFileError(f"{self.name}: GGUF metadata is truncated; the file is incomplete")
        return data

    def scalar(self, fmt: str) -> Any:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        length = self.scalar("<Q")
        if length > MAX_STRING_BYTES:
            raise ModelFileError(f"{self.name}: implausible string length {length}; the file is corrupt")
        return self.take(length).decode("utf-8", "replace")

    def value(self, kind: int) -> Any:
        if kind in _SCALARS:
            return self.scalar(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item_type = self.scalar("<I")
            length = self.scalar("<Q")
            if item_type == _ARRAY:
                raise ModelFileError(f"{self.name}: nested arrays are not valid GGUF metadata")
            if length <= KEEP_ARRAY_ITEMS:
                return [self.value(item_type) for _ in range(length)]
            self.skip_array(item_type, length)
            return ArrayInfo(item_type, length)
        raise ModelFileError(f"{self.name}: unknown GGUF value type {kind}; the file is corrupt")

    def skip_array(self, item_type: int, length: int) -> None:
        if item_type in _SCALARS:
            self.seek_ahead(struct.calcsize(_SCALARS[item_type]) * length)
            return
        if item_type != _STRING:
            raise ModelFileError(f"{self.name}: unknown GGUF array type {item_type}; the file is corrupt")
        self.skip_strings(length)

    def skip_strings(self, count: int) -> None:
        """Step over `count` length-prefixed strings (a vocabulary: ~50k-250k of them) reading the file in
        large chunks: one read and seek per string cost 0.3 s of every start."""
        position = self.stream.tell()
        if count > MAX_STRING_ITEMS or count * 8 > self.size - position:
            raise ModelFileError(f"{self.name}: implausible array of {count} strings; the file is corrupt")
        chunk, chunk_start = b"", position
        for _ in range(count):
            offset = position - chunk_start
            if offset + 8 > len(chunk):
                self.stream.seek(position)
                chunk, chunk_start, offset = self.stream.read(SKIP_CHUNK_BYTES), position, 0
                if len(chunk) < 8:
                    raise ModelFileError(f"{self.name}: GGUF metadata is truncated; the file is incomplete")
            size = _LENGTH.unpack_from(chunk, offset)[0]
            if size > MAX_STRING_BYTES:
                raise ModelFileError(f"{self.name}: implausible string length {size}; the file is corrupt")
            position += 8 + size
        if position > self.size:
            raise ModelFileError(f"{self.name}: GGUF metadata is truncated; the file is incomplete")
        self.stream.seek(position)


def architecture_facts(metadata: dict[str, Any]) -> dict[str, int]:
    """Sizes autoconfig needs: layers, KV heads, head size, trained context (0 when absent)."""
    arch = metadata.get("general.architecture", "")
    get = lambda key, default=0: metadata.get(f"{arch}.{key}", default)  # noqa: E731
    heads = get("attention.head_count") or 0
    kv_heads = get("attention.head_count_kv") or heads
    embedding = get("embedding_length") or 0
    head_size = get("attention.key_length") or (embedding // heads if heads else 0)
    value_size = get("attention.value_length") or head_size
    return {
        "layers": int(get("block_count") or 0),
        "kv_heads": int(kv_heads if isinstance(kv_heads, int) else max(kv_heads)),
        "key_size": int(head_size),
        "value_size": int(value_size),
        "context_train": int(get("context_length") or 0),
    }


# llama.cpp's llama_ftype: what general.file_type says of a file's quantization.
FILE_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K", 11: "Q3_K_S",
              12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S", 17: "Q5_K_M", 18: "Q6_K",
              19: "IQ2_XXS", 20: "IQ2_XS", 21: "Q2_K_S", 22: "IQ3_XS", 23: "IQ3_XXS", 24: "IQ1_S", 25: "IQ4_NL",
              26: "IQ3_S", 27: "IQ3_M", 28: "IQ2_S", 29: "IQ2_M", 30: "IQ4_XS", 31: "IQ1_M", 32: "BF16",
              36: "TQ1_0", 37: "TQ2_0", 38: "MXFP4_MOE"}
LABEL_CHARACTERS = 32  # the most of a header's free text (a size label, an architecture) we repeat


def model_summary(metadata: dict[str, Any]) -> dict[str, str | int]:
    """What a model list says of a file without loading it: architecture, quantization ("Q4_K_M"), size
    label ("135M", "unknown" when absent) and trained context."""
    arch = metadata.get("general.architecture")
    file_type = metadata.get("general.file_type")
    label = metadata.get("general.size_label")
    trained = metadata.get(f"{arch}.context_length") if isinstance(arch, str) else None
    return {"architecture": arch[:LABEL_CHARACTERS] if isinstance(arch, str) and arch else "unknown",
            "quantization": FILE_TYPES.get(file_type, "unknown") if isinstance(file_type, int) else "unknown",
            "parameter_size": label[:LABEL_CHARACTERS] if isinstance(label, str) and label else "unknown",
            "context_train": trained if isinstance(trained, int) and trained >= 0 else 0}
