"""The exact answer cache's tiers on one node: RAM's LRU under its byte budget, and the disk's files as
hostile input (damaged, oversized, planted symlinks, copied under another name, another program's), its
budget, a directory that cannot be written; the cache copies a hit into the tiers in front of it."""

import json
import os
import tracemalloc

from hypothesis import given
from hypothesis import strategies as st

from reame.cache.answers import MAX_VALUE_BYTES, DiskAnswers, RamAnswers
from reame.engine import FinishEvent, Usage
from reame.answers import AnswerCache, decode
from tests.cpu import cpu_clock

from .test_fuzz import FUZZ

KEY = b"reame:answer:" + b"ab" * 32
OTHER = b"reame:answer:" + b"cd" * 32


def test_ram_keeps_the_most_recently_used_answers_within_its_budget():
    ram = RamAnswers(3 * (len(KEY) + 10))
    keys = [KEY[:-1] + bytes([c]) for c in b"0123"]
    for key in keys[:3]:
        assert ram.put(key, b"x" * 10)
    ram.get(keys[0])  # used: the oldest is now keys[1]
    ram.put(keys[3], b"y" * 10)
    assert ram.get(keys[1]) is None and ram.get(keys[0]) == b"x" * 10 and len(ram) == 3
    assert not ram.put(KEY, b"z" * 1000)  # larger than the whole budget: not kept


def test_disk_round_trip_across_instances_and_private_files(tmp_path):
    DiskAnswers(tmp_path, 1 << 20).put(KEY, b"value")
    assert DiskAnswers(tmp_path, 1 << 20).get(KEY) == b"value"  # another process, or after a restart
    [file] = tmp_path.glob("*.answer")
    assert file.stat().st_mode & 0o777 == 0o600 and tmp_path.stat().st_mode & 0o777 == 0o700


def test_a_damaged_file_is_a_miss_and_is_removed(tmp_path):
    disk = DiskAnswers(tmp_path, 1 << 20)
    disk.put(KEY, b"value")
    path = disk.path(KEY)
    path.write_bytes(path.read_bytes()[:-1] + b"\x00")
    assert disk.get(KEY) is None and not path.exists()
    path.write_bytes(b"")
    assert disk.get(KEY) is None and not path.exists()


def test_a_huge_file_is_read_no_further_than_an_answer_can_be(tmp_path):
    disk = DiskAnswers(tmp_path, 1 << 30)
    with open(disk.path(KEY), "wb") as out:
        out.truncate(256 << 20)  # sparse: 256 MiB of zeros
    tracemalloc.start()
    assert disk.get(KEY) is None
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 4 * MAX_VALUE_BYTES and not disk.path(KEY).exists()


def test_a_planted_symlink_is_never_followed(tmp_path):
    secret = tmp_path / "secret"
    secret.write_bytes(b"not yours")
    disk = DiskAnswers(tmp_path / "answers", 1 << 20)
    os.symlink(secret, disk.path(KEY))
    assert disk.get(KEY) is None
    assert disk.put(KEY, b"value") and disk.get(KEY) == b"value"  # replaced by a file of its own
    assert secret.read_bytes() == b"not yours"


def test_a_key_that_cannot_name_a_file_is_never_a_path(tmp_path):
    disk = DiskAnswers(tmp_path, 1 << 20)
    for key in (b"reame:answer:../../etc/passwd", b"reame:answer:", b"reame:answer:ABCDEF0123456789"):
        assert disk.path(key) is None and disk.get(key) is None and not disk.put(key, b"v")


def test_the_least_recently_used_files_go_past_the_budget(tmp_path):
    value = b"v" * 1000
    disk = DiskAnswers(tmp_path, 4 * 1004)
    keys = [b"reame:answer:" + f"{i:064x}".encode() for i in range(12)]
    for key in keys:
        disk.put(key, value)
    sizes = sum(f.stat().st_size for f in tmp_path.glob("*.answer"))
    assert sizes <= 4 * 1004 and disk.get(keys[-1]) == value and disk.get(keys[0]) is None


def test_a_directory_that_cannot_be_written_keeps_nothing_and_fails_nothing(tmp_path):
    disk = DiskAnswers(tmp_path, 1 << 20)
    tmp_path.chmod(0o500)
    try:
        if os.geteuid() == 0:  # root writes anyway: make the write itself fail
            disk.directory = tmp_path / "gone"
        assert disk.put(KEY, b"value") is False and disk.get(KEY) is None
    finally:
        tmp_path.chmod(0o700)


def test_an_answer_copied_under_another_key_or_of_another_program_is_a_miss(tmp_path):
    cache = AnswerCache([DiskAnswers(tmp_path, 1 << 20)], b"fp")
    cache.put(KEY, "the answer", FinishEvent("stop", Usage(3, 2, 0.0, 0.0)))
    os.replace(cache.tiers[0].path(KEY), cache.tiers[0].path(OTHER))
    assert cache.get(OTHER) is None
    assert decode(KEY, b'{"text": "x"}') is None and decode(KEY, b"[" * 100000) is None
    stored = {"key": KEY.decode(), "text": "x", "finish_reason": "error", "completion_tokens": 1}
    assert decode(KEY, json.dumps(stored).encode()) is None  # never an answer that was not whole


def test_a_hit_in_a_far_tier_is_copied_into_the_near_ones(tmp_path):
    ram, disk = RamAnswers(1 << 20), DiskAnswers(tmp_path, 1 << 20)
    AnswerCache([disk], b"fp").put(KEY, "kept", FinishEvent("length", Usage(3, 2, 0.0, 0.0)))
    cache = AnswerCache([ram, disk], b"fp")
    assert ram.get(KEY) is None and cache.get(KEY).text == "kept" and ram.get(KEY) is not None


@FUZZ
@given(st.binary(max_size=4096))
def test_any_file_content_is_a_miss_or_an_answer_quickly(tmp_path_factory, content):
    directory = tmp_path_factory.mktemp("answers")
    cache = AnswerCache([DiskAnswers(directory, 1 << 20)], b"fp")
    cache.tiers[0].path(KEY).write_bytes(content)
    with cpu_clock() as clock:
        found = cache.get(KEY)
    assert clock.seconds < 0.5
    assert found is None or isinstance(found.text, str)
