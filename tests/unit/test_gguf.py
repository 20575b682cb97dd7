"""The GGUF metadata reader on well-formed and malformed files."""

import struct

import pytest

from reame import gguf
from reame.errors import ModelFileError


def string(text: str) -> bytes:
    data = text.encode()
    return struct.pack("<Q", len(data)) + data


def kv(key: str, kind: int, payload: bytes) -> bytes:
    return string(key) + struct.pack("<I", kind) + payload


def make_gguf(entries: list[bytes], version: int = 3, tensors: int = 0) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", version, tensors, len(entries)) + b"".join(entries)


GOOD = make_gguf([
    kv("general.architecture", 8, string("llama")),
    kv("llama.block_count", 4, struct.pack("<I", 30)),
    kv("llama.context_length", 4, struct.pack("<I", 8192)),
    kv("llama.embedding_length", 4, struct.pack("<I", 576)),
    kv("llama.attention.head_count", 4, struct.pack("<I", 9)),
    kv("llama.attention.head_count_kv", 4, struct.pack("<I", 3)),
    kv("general.tags", 9, struct.pack("<IQ", 8, 2) + string("a") + string("b")),
    kv("tokenizer.ggml.scores", 9, struct.pack("<IQ", 6, 1000) + b"\0" * 4000),
    kv("tokenizer.ggml.tokens", 9, struct.pack("<IQ", 8, 100) + b"".join(string(f"t{i}") for i in range(100))),
    kv("some.flag", 7, b"\x01"),
])


def test_reads_scalars_small_arrays_and_skips_large_ones(tmp_path):
    path = tmp_path / "m.gguf"
    path.write_bytes(GOOD)
    metadata = gguf.read_metadata(path)
    assert metadata["general.architecture"] == "llama" and metadata["some.flag"] is True
    assert metadata["general.tags"] == ["a", "b"]
    assert metadata["tokenizer.ggml.scores"].length == 1000
    assert metadata["tokenizer.ggml.tokens"].length == 100
    assert gguf.architecture_facts(metadata) == {
        "layers": 30, "kv_heads": 3, "key_size": 64, "value_size": 64, "context_train": 8192}


@pytest.mark.parametrize("data, fragment", [
    (b"", "not a GGUF"),
    (b"GGML" + GOOD[4:], "not a GGUF"),
    (b"GGUF" + struct.pack("<I", 7) + GOOD[8:], "version 7"),
    (GOOD[:11], "truncated"),
    (GOOD[:-1], "truncated"),
    (GOOD[:200], "truncated"),
    (make_gguf([], tensors=0)[:-8] + struct.pack("<Q", 10**9), "implausible metadata"),
    (make_gguf([struct.pack("<Q", 2**40) + b"key"]), "implausible string"),
    (make_gguf([kv("k", 42, b"")]), "unknown GGUF value type"),
    (make_gguf([kv("k", 9, struct.pack("<IQ", 9, 1))]), "nested arrays"),
    (make_gguf([kv("k", 9, struct.pack("<IQ", 77, 100))]), "unknown GGUF array type"),
    (make_gguf([kv("k", 9, struct.pack("<IQ", 6, 10**12))]), "truncated"),
    (make_gguf([kv("k", 9, struct.pack("<IQ", 8, 10**9))]), "implausible array"),
    (make_gguf([kv("k", 9, struct.pack("<IQ", 8, 100) + string("x") * 99)]), "truncated"),
    (make_gguf([kv("k", 9, struct.pack("<IQ", 8, 100) + string("x") * 99 + struct.pack("<Q", 2**40))]),
     "implausible string"),
])
def test_malformed_files_are_refused_with_a_reason(tmp_path, data, fragment):
    path = tmp_path / "bad.gguf"
    path.write_bytes(data)
    with pytest.raises(ModelFileError) as raised:
        gguf.read_metadata(path)
    assert fragment in str(raised.value)


def test_unreadable_path(tmp_path):
    with pytest.raises(ModelFileError, match="cannot read"):
        gguf.read_metadata(tmp_path / "missing.gguf")


@pytest.mark.parametrize("chunk_bytes", [8, 13, 64, 1 << 20])
def test_vocabulary_skipped_across_chunk_boundaries(tmp_path, monkeypatch, chunk_bytes):
    """Strings are stepped over in chunks: a length prefix or a string cut by a chunk's end is read whole."""
    monkeypatch.setattr(gguf, "SKIP_CHUNK_BYTES", chunk_bytes)
    tokens = [f"token{i}" * (i % 7) for i in range(5000)]
    path = tmp_path / "vocab.gguf"
    path.write_bytes(make_gguf([
        kv("tokenizer.ggml.tokens", 9, struct.pack("<IQ", 8, len(tokens)) + b"".join(map(string, tokens))),
        kv("after", 4, struct.pack("<I", 7)),
    ]))
    metadata = gguf.read_metadata(path)
    assert metadata["tokenizer.ggml.tokens"].length == 5000 and metadata["after"] == 7
