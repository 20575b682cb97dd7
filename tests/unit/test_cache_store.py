"""Snapshot files: format, verification, damage, budget, several processes."""

import os
import random
import subprocess
import sys
import time

import pytest

from reame.cache import store
from reame.cache.store import DiskStore, Snapshot, decode, encode
from reame.errors import CacheError

FINGERPRINT = b"f" * 32
OTHER = b"o" * 32


def snapshot(n: int = 100, fill: int = 7, size: int = 4000) -> Snapshot:
    """Incompressible, like real KV, and the same for the same arguments."""
    return Snapshot(tuple(range(fill, fill + n)), random.Random(fill).randbytes(size))


def test_a_snapshot_round_trips_raw_and_compressed():
    raw = snapshot()
    assert decode(encode(FINGERPRINT, raw, compress=False), FINGERPRINT) == raw
    compressible = Snapshot((1, 2, 3), b"\0" * 100_000)
    data = encode(FINGERPRINT, compressible, compress=True)
    assert len(data) < 10_000
    assert decode(data, FINGERPRINT) == compressible


def test_incompressible_state_is_stored_raw():
    noise = Snapshot((1, 2), os.urandom(200_000))
    assert len(encode(FINGERPRINT, noise, compress=True)) > 200_000


@pytest.mark.parametrize("damage", ["truncate", "flip", "extend", "magic", "version", "empty"])
def test_damaged_files_are_refused_with_a_reason(damage):
    data = bytearray(encode(FINGERPRINT, snapshot(), compress=False))
    if damage == "truncate":
        data = data[:-10]
    elif damage == "flip":
        data[len(data) // 2] ^= 0x10
    elif damage == "extend":
        data += b"x"
    elif damage == "magic":
        data[0:8] = b"NOTKVSNP"
    elif damage == "version":
        data[8] = 99
    else:
        data = bytearray()
    with pytest.raises(CacheError):
        decode(bytes(data), FINGERPRINT)


def test_a_file_of_another_fingerprint_is_refused():
    with pytest.raises(store.ForeignFingerprint):
        decode(encode(OTHER, snapshot(), compress=False), FINGERPRINT)


def test_store_writes_reads_and_a_new_instance_sees_the_files(tmp_path):
    counts = {}
    disk = DiskStore(tmp_path, FINGERPRINT, 10 << 20, count=lambda k, n: counts.__setitem__(k, counts.get(k, 0) + n))
    first = snapshot()
    assert disk.write("a", first)
    assert disk.read("a") == first
    assert counts["bytes_written"] == counts["bytes_read"] > 4000
    again = DiskStore(tmp_path, FINGERPRINT, 10 << 20)
    assert again.entries == {"a": first.tokens}
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_a_running_store_sees_files_another_writer_added(tmp_path):
    reader = DiskStore(tmp_path, FINGERPRINT, 10 << 20)
    writer = DiskStore(tmp_path, FINGERPRINT, 10 << 20)
    writer.write("late", snapshot(fill=3))
    added, gone = reader.refresh()
    assert added == ["late"] and reader.read("late") == snapshot(fill=3)
    writer.remove("late")
    added, gone = reader.refresh()
    assert gone == ["late"] and "late" not in reader.entries


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_a_damaged_file_is_dropped_and_counted_never_fatal(tmp_path, damage):
    counts = {}
    disk = DiskStore(tmp_path, FINGERPRINT, 10 << 20, count=lambda k, n: counts.__setitem__(k, counts.get(k, 0) + n))
    disk.write("a", snapshot())
    path = disk.path("a")
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        data = data[:len(data) // 2]
    else:
        data[-100] ^= 1
    path.write_bytes(bytes(data))
    fresh = DiskStore(tmp_path, FINGERPRINT, 10 << 20,
                      count=lambda k, n: counts.__setitem__(k, counts.get(k, 0) + n))
    assert fresh.read("a") is None
    assert not path.exists()
    assert counts["corrupt_dropped"] == 1


@pytest.fixture
def checksums(monkeypatch):
    """How many crc32s the store computes over a snapshot file's body, counted."""
    calls = []
    real = store.zlib.crc32

    def crc32(data, value=0):
        calls.append(len(data))
        return real(data, value)
    monkeypatch.setattr(store.zlib, "crc32", crc32)
    return calls


def test_a_file_is_checksummed_once_per_process_and_not_after_writing_it(tmp_path, checksums):
    writer = DiskStore(tmp_path, FINGERPRINT, 10 << 20)
    writer.write("a", snapshot())
    checksums.clear()
    assert writer.read("a") == snapshot() and checksums == [], "its writer computed the crc32 itself"
    reader = DiskStore(tmp_path, FINGERPRINT, 10 << 20)
    assert reader.verify("a") and len(checksums) == 1
    assert reader.read("a") == snapshot() and reader.read("a") == snapshot()
    assert reader.verify("a") and len(checksums) == 1


def test_a_file_replaced_after_its_check_is_checked_again(tmp_path):
    counts = {}
    disk = DiskStore(tmp_path, FINGERPRINT, 10 << 20, count=lambda k, n: counts.__setitem__(k, counts.get(k, 0) + n))
    disk.write("a", snapshot())
    assert disk.verify("a")
    damaged = bytearray(disk.path("a").read_bytes())
    damaged[-100] ^= 1
    replacement = tmp_path / "replacement"
    replacement.write_bytes(bytes(damaged))
    replacement.rename(disk.path("a"))  # another inode, as every writer's rename makes
    assert disk.read("a") is None and counts["corrupt_dropped"] == 1
    assert not disk.path("a").exists()


def test_verify_drops_a_damaged_file_and_lists_the_newest_within_a_budget(tmp_path):
    disk = DiskStore(tmp_path, FINGERPRINT, 10 << 20)
    for index, name in enumerate(["old", "middle", "young"]):
        disk.write(name, snapshot(fill=index))
        os.utime(disk.path(name), ns=(time.time_ns() - (10 - index) * 10**9,) * 2)
    one = disk.path("old").stat().st_size
    assert disk.newest(one * 2) == ["young", "middle"]
    assert disk.newest(one - 1) == []
    data = bytearray(disk.path("middle").read_bytes())
    data[-100] ^= 1
    disk.path("middle").write_bytes(bytes(data))
    fresh = DiskStore(tmp_path, FINGERPRINT, 10 << 20)
    assert fresh.verify("young") and not fresh.verify("middle")
    assert "middle" not in fresh.entries and not fresh.path("middle").exists()
    assert not fresh.verify("gone")


def test_garbage_and_other_models_files_in_the_directory(tmp_path):
    (tmp_path / "junk.kvs").write_bytes(b"hello")
    other = DiskStore(tmp_path, OTHER, 10 << 20)
    other.write("theirs", snapshot())
    mine = DiskStore(tmp_path, FINGERPRINT, 10 << 20)
    assert mine.entries == {}
    assert not (tmp_path / "junk.kvs").exists(), "a foreign file is removed"
    assert other.path("theirs").exists(), "another model's snapshot is left for its owner"


def test_the_budget_evicts_least_recently_used_files(tmp_path):
    one = len(encode(FINGERPRINT, snapshot(), compress=False))
    disk = DiskStore(tmp_path, FINGERPRINT, int(one * 3.5), compress=False)
    for index, name in enumerate(["old", "middle", "young"]):
        disk.write(name, snapshot(fill=index))
        os.utime(disk.path(name), ns=(time.time_ns() - (10 - index) * 10**9,) * 2)
    assert disk.read("old")  # a hit makes "old" the most recently used
    disk.write("newest", snapshot(fill=9))
    assert sorted(p.stem for p in tmp_path.glob("*.kvs")) == ["newest", "old", "young"]
    assert sum(p.stat().st_size for p in tmp_path.glob("*.kvs")) <= int(one * 3.5)


def test_the_budget_is_enforced_at_startup_and_oversize_entries_are_refused(tmp_path):
    big = DiskStore(tmp_path, FINGERPRINT, 10 << 20)
    for index in range(4):
        big.write(f"e{index}", snapshot(fill=index))
    one = big.path("e0").stat().st_size
    small = DiskStore(tmp_path, FINGERPRINT, one * 2)
    assert len(list(tmp_path.glob("*.kvs"))) == 2
    assert not small.write("huge", snapshot(size=one * 3))


WRITER = """
import sys
from pathlib import Path
from reame.cache.store import DiskStore, Snapshot
disk = DiskStore(Path(sys.argv[1]), b"f" * 32, 1 << 30)
tag = int(sys.argv[2])
for index in range(30):
    disk.write(f"p{tag}-{index}", Snapshot((tag, index), bytes([tag]) * 50_000))
"""


def test_two_processes_writing_at_once_leave_only_whole_files(tmp_path):
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path), str(tag)]) for tag in (1, 2)]
    assert [proc.wait(timeout=60) for proc in procs] == [0, 0]
    disk = DiskStore(tmp_path, FINGERPRINT, 1 << 30)
    assert len(disk.entries) == 60
    for name in disk.entries:
        tag = int(name[1])
        assert disk.read(name) == Snapshot((tag, int(name.split("-")[1])), bytes([tag]) * 50_000)


COMPRESSIBLE = Snapshot((1, 2, 3), b"\0" * 100_000)


def test_without_zstandard_snapshots_are_stored_raw_and_read_back(tmp_path, no_zstandard):
    assert len(encode(FINGERPRINT, COMPRESSIBLE, compress=True)) > 100_000
    disk = DiskStore(tmp_path, FINGERPRINT, 10 << 20)
    assert disk.write("a", COMPRESSIBLE)
    assert DiskStore(tmp_path, FINGERPRINT, 10 << 20).read("a") == COMPRESSIBLE


def test_without_zstandard_a_compressed_file_is_skipped_counted_and_left_for_others(tmp_path, monkeypatch):
    from reame.cache import codec
    DiskStore(tmp_path, FINGERPRINT, 10 << 20).write("zipped", COMPRESSIBLE)
    path = tmp_path / "zipped.kvs"
    assert path.stat().st_size < 10_000
    with monkeypatch.context() as patched:
        patched.setitem(sys.modules, "zstandard", None)
        codec._zstandard.cache_clear()
        with pytest.raises(codec.CodecUnavailable):
            decode(path.read_bytes(), FINGERPRINT)
        counts = {}
        disk = DiskStore(tmp_path, FINGERPRINT, 10 << 20,
                         count=lambda k, n: counts.__setitem__(k, counts.get(k, 0) + n))
        disk.refresh()
        assert disk.entries == {} and counts == {"unreadable_skipped": 1}
        assert disk.read("zipped") is None and counts == {"unreadable_skipped": 2}
        assert path.exists(), "a file another process can read is not removed"
    codec._zstandard.cache_clear()
    assert DiskStore(tmp_path, FINGERPRINT, 10 << 20).read("zipped") == COMPRESSIBLE


def test_a_missing_zstandard_is_said_once_at_info_level(no_zstandard, caplog):
    from reame.cache import codec
    with caplog.at_level("INFO", logger="reame.cache"):
        assert codec.compress(b"x" * 1000) is None
        assert codec.compress(b"y" * 1000) is None
        assert not codec.available()
    said = [record for record in caplog.records if "zstandard" in record.getMessage()]
    assert len(said) == 1 and said[0].levelname == "INFO"
    assert codec.describe().startswith("zstandard missing")
