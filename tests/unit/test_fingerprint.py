"""Facts about a model file, computed once per content and then read back."""

import json
import shutil

from reame.model import fingerprint


def model_file(directory, content: bytes):
    path = directory / "m.gguf"
    path.write_bytes(content)
    return path


def test_a_fact_is_computed_once_per_model_content(tmp_path, monkeypatch):
    monkeypatch.setenv("REAME_CACHE", str(tmp_path / "cache"))
    calls = []

    def compute() -> str:
        calls.append(1)
        return f"value{len(calls)}"

    first = model_file(tmp_path, b"GGUF" + b"a" * 5000)
    assert fingerprint.remembered(first, "vocabulary", compute, str) == "value1"
    assert fingerprint.remembered(first, "vocabulary", compute, str) == "value1"
    moved = tmp_path / "elsewhere"
    moved.mkdir()
    shutil.copy(first, moved / "copy.gguf")
    assert fingerprint.remembered(moved / "copy.gguf", "vocabulary", compute, str) == "value1"
    assert fingerprint.remembered(first, "another fact", compute, str) == "value2"
    other = model_file(tmp_path / "elsewhere", b"GGUF" + b"b" * 5000)
    assert fingerprint.remembered(other, "vocabulary", compute, str) == "value3"
    assert len(calls) == 3
    assert (tmp_path / "cache" / fingerprint.FACTS_CACHE_FILE).stat().st_mode & 0o077 == 0


def test_a_damaged_or_full_memory_only_costs_computing_again(tmp_path, monkeypatch):
    monkeypatch.setenv("REAME_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(fingerprint, "MAX_REMEMBERED_FACTS", 3)
    path = model_file(tmp_path, b"GGUF" + b"c" * 100)
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / fingerprint.FACTS_CACHE_FILE).write_text("{not json")
    assert fingerprint.remembered(path, "f0", lambda: "x", str) == "x"
    for index in range(1, 6):
        fingerprint.remembered(path, f"f{index}", lambda: "y", str)
    kept = json.loads((tmp_path / "cache" / fingerprint.FACTS_CACHE_FILE).read_text())
    assert [key.rsplit("|", 1)[1] for key in kept] == ["f3", "f4", "f5"]
    assert fingerprint.remembered(path, "f5", lambda: "recomputed", str) == "y"


def test_a_remembered_value_is_checked_like_any_input(tmp_path, monkeypatch):
    """A hostile or damaged file in the cache directory: what `parse` refuses is computed again."""
    monkeypatch.setenv("REAME_CACHE", str(tmp_path / "cache"))
    path = model_file(tmp_path, b"GGUF" + b"d" * 100)
    assert fingerprint.remembered(path, "number", lambda: "7", int) == 7
    memory = tmp_path / "cache" / fingerprint.FACTS_CACHE_FILE
    memory.write_text(memory.read_text().replace('"7"', '"seven"'))
    assert fingerprint.remembered(path, "number", lambda: "8", int) == 8
    memory.write_text(memory.read_text().replace('"8"', "[1, 2]"))
    assert fingerprint.remembered(path, "number", lambda: "9", int) == 9


def test_a_deep_or_oversized_memory_file_counts_as_empty(tmp_path, monkeypatch):
    monkeypatch.setenv("REAME_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(fingerprint, "MAX_MEMORY_BYTES", 1 << 16)
    path = model_file(tmp_path, b"GGUF" + b"e" * 100)
    memory = tmp_path / "cache" / fingerprint.FACTS_CACHE_FILE
    memory.parent.mkdir()
    memory.write_text("[" * 50_000 + "]" * 50_000)
    assert fingerprint.remembered(path, "deep", lambda: "1", int) == 1
    memory.write_text('{"k": "' + "x" * (1 << 17) + '"}')
    assert fingerprint.remembered(path, "big", lambda: "2", int) == 2


def test_a_file_rewritten_in_place_with_its_size_and_mtime_put_back_gets_its_own_hash(tmp_path, monkeypatch):
    """Issue 49 (suspected): the hash was cached by path, size and mtime, which whoever writes the file can
    put back (touch -d): KV computed by one model would then be restored into another."""
    import os
    monkeypatch.setenv("REAME_CACHE", str(tmp_path / "cache"))
    path = model_file(tmp_path, b"GGUF" + b"a" * 5000)
    first = fingerprint.model_content_hash(path)
    before = path.stat()
    with open(path, "r+b") as stream:  # the same inode, the same size
        stream.write(b"GGUF" + b"b" * 5000)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    while path.stat().st_ctime_ns == before.st_ctime_ns:  # the kernel's coarse clock has not ticked yet
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))  # (each call sets ctime to now)
    assert path.stat().st_size == before.st_size and path.stat().st_mtime_ns == before.st_mtime_ns
    assert fingerprint.model_content_hash(path) != first


def test_a_fact_kept_anew_replaces_the_last_and_is_read_back_as_kept(tmp_path, monkeypatch):
    """Facts that change as a process learns (step costs) are kept with `remember`, read with `recall`."""
    monkeypatch.setenv("REAME_CACHE", str(tmp_path / "cache"))
    path = model_file(tmp_path, b"GGUF" + b"f" * 100)
    assert fingerprint.recall(path, "step costs") is None
    fingerprint.remember(path, "step costs", "first")
    fingerprint.remember(path, "step costs", "second")
    assert fingerprint.recall(path, "step costs") == "second"
    assert fingerprint.remembered(path, "step costs", lambda: "computed", str) == "second"
