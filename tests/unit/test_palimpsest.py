"""The Palimpsest: its archive on disk (frames, crashes, other processes, the budget, other vocabularies),
its index (longest match, most frequent continuation, records kept apart), and drafting on FakeBackend."""

import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from reame.engine import Engine, GenerationRequest, SamplingParams
from tests.fakes.backend import FakeBackend
from reame.speculative import Speculation
from reame.speculative import checkpoint
from reame.speculative.archive import FRAME, HEADER, Archive
from reame.speculative.palimpsest import FORCED_MATCH_EVIDENCE, ContinuationIndex, Palimpsest, vocabulary_hash
from reame.structured.gbnf import compiled

from .test_speculative import FrozenCost

ROOT = Path(__file__).resolve().parents[2]
VOCABULARY = bytes(range(32))
OTHER_VOCABULARY = bytes(range(1, 33))


def records(count, length=20):
    return [tuple(range(1000 * i, 1000 * i + length)) for i in range(count)]


def test_the_archive_gives_back_every_record_after_a_restart(tmp_path):
    archive = Archive(tmp_path, VOCABULARY, 1 << 20)
    for record in records(5):
        archive.append(record)
    archive.sync()
    reread = Archive(tmp_path, VOCABULARY, 1 << 20).read_new()
    assert reread.restarted and reread.frames == records(5)


def test_each_process_reads_what_the_others_appended_and_not_its_own(tmp_path):
    mine, theirs = Archive(tmp_path, VOCABULARY, 1 << 20), Archive(tmp_path, VOCABULARY, 1 << 20)
    assert mine.read_new().frames == [] and theirs.read_new().frames == []
    mine.append((1, 2, 3))
    theirs.append((4, 5, 6))
    mine.append((7, 8, 9))
    assert mine.read_new() .frames == [(4, 5, 6)]
    assert theirs.read_new().frames == [(1, 2, 3), (7, 8, 9)]
    assert mine.read_new().frames == theirs.read_new().frames == []


def test_a_frame_torn_by_a_crash_is_cut_off_and_every_whole_one_is_back(tmp_path):
    archive = Archive(tmp_path, VOCABULARY, 1 << 20)
    for record in records(3):
        archive.append(record)
    with open(archive.path, "ab") as file:  # a writer died half way through its frame
        file.write(FRAME.pack(80, 0) + b"\x01" * 30)
    assert Archive(tmp_path, VOCABULARY, 1 << 20).read_new().frames == records(3)
    survivor = Archive(tmp_path, VOCABULARY, 1 << 20)
    survivor.append((5, 6, 7))  # cuts the torn tail first
    assert Archive(tmp_path, VOCABULARY, 1 << 20).read_new().frames == [*records(3), (5, 6, 7)]


def test_a_frame_with_a_bad_checksum_is_skipped_and_the_next_ones_read(tmp_path):
    archive = Archive(tmp_path, VOCABULARY, 1 << 20)
    for record in records(3):
        archive.append(record)
    data = bytearray(archive.path.read_bytes())
    second_payload = HEADER.size + (FRAME.size + 80) + FRAME.size
    data[second_payload + 5] ^= 0xFF
    archive.path.write_bytes(bytes(data))
    assert Archive(tmp_path, VOCABULARY, 1 << 20).read_new().frames == [records(3)[0], records(3)[2]]


@pytest.mark.parametrize("content", [b"", b"REAMEPAL", b"not an archive at all" * 10, b"\x00" * 100])
def test_a_file_that_is_not_an_archive_of_this_vocabulary_is_started_again(tmp_path, content):
    path = Archive(tmp_path, VOCABULARY, 1 << 20).path
    path.write_bytes(content)
    archive = Archive(tmp_path, VOCABULARY, 1 << 20)
    assert archive.read_new().frames == []
    archive.append((1, 2))
    assert Archive(tmp_path, VOCABULARY, 1 << 20).read_new().frames == [(1, 2)]


def test_another_vocabulary_has_its_own_file_and_never_sees_these_tokens(tmp_path):
    Archive(tmp_path, VOCABULARY, 1 << 20).append((1, 2, 3))
    other = Archive(tmp_path, OTHER_VOCABULARY, 1 << 20)
    assert other.read_new().frames == []
    mine = Archive(tmp_path, VOCABULARY, 1 << 20)
    other.path.unlink()
    os.link(mine.path, other.path)  # even a file of the other vocabulary under its name is refused
    assert Archive(tmp_path, OTHER_VOCABULARY, 1 << 20).read_new().frames == []


def test_over_its_budget_the_archive_keeps_its_newest_records(tmp_path):
    budget = HEADER.size + 10 * (FRAME.size + 80)  # ten records of 20 tokens
    archive = Archive(tmp_path, VOCABULARY, budget)
    reader = Archive(tmp_path, VOCABULARY, budget)
    reader.read_new()
    for record in records(25):
        archive.append(record)
    kept = Archive(tmp_path, VOCABULARY, budget).read_new().frames
    assert archive.size_bytes() <= budget
    assert kept == records(25)[-len(kept):] and 5 <= len(kept) <= 10
    again = reader.read_new()
    assert again.restarted and again.frames == kept  # another process sees a new file and reads it whole


def test_killing_a_writer_in_the_middle_of_appends_loses_no_complete_frame(tmp_path):
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(ROOT)!r})
        from pathlib import Path
        from reame.speculative.archive import Archive
        archive = Archive(Path({str(tmp_path)!r}), bytes(range(32)), 1 << 30)
        print("ready", flush=True)
        i = 0
        while True:
            archive.append([i] * (1 + i % 5000))
            i += 1
    """)
    writer = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE)
    assert writer.stdout.readline().strip() == b"ready"
    path = Archive(tmp_path, VOCABULARY, 1 << 30).path
    while path.stat().st_size < 4 << 20:
        pass  # the writer appends as fast as it can: a kill then lands inside an append
    os.kill(writer.pid, signal.SIGKILL)
    writer.wait()
    frames = Archive(tmp_path, VOCABULARY, 1 << 30).read_new().frames
    assert frames and all(frame == (i,) * (1 + i % 5000) for i, frame in enumerate(frames))


def test_the_index_drafts_the_continuation_of_the_longest_match():
    index = ContinuationIndex()
    index.add([1, 2, 3, 4, 5, 6, 7, 8])
    index.add([9, 9, 3, 4, 5, 6, 70, 80])  # the same last four tokens, less context before them
    assert index.continuation([0, 1, 2, 3, 4, 5, 6], 5) == [7, 8]  # longest match; stops at the record's end
    assert index.continuation([9, 3, 4, 5, 6], 5) == [70, 80]
    assert index.continuation([8, 3, 4, 5, 6], 5) == []  # two equal matches that disagree: no draft
    assert index.continuation([8, 4, 5, 6], 5) == []  # three tokens in common say too little
    assert index.continuation([5, 6], 5) == []  # shorter than a key
    assert index.continuation([7, 7, 7, 7], 5) == []


def test_the_continuation_most_earlier_answers_share_is_drafted_up_to_where_they_part():
    index = ContinuationIndex()
    for tail in ([10, 11, 12, 13], [10, 11, 12, 14], [20, 21], [10, 11, 12, 13]):
        index.add([1, 2, 3, 4, *tail])
    assert index.continuation([1, 2, 3, 4], 8) == [10, 11, 12, 13]  # 3 of 4, then 2 of 3
    index.add([1, 2, 3, 4, 30])
    index.add([1, 2, 3, 4, 40])
    assert index.continuation([1, 2, 3, 4], 8) == []  # 3 of 6 went on with 10: less than half do


def test_a_long_prompt_end_finds_its_own_record_among_many_with_the_same_last_tokens():
    index = ContinuationIndex()
    suffix = [7, 7, 8, 300, 301, 302, 303]  # what every chat prompt ends with: more than the short key
    for question in range(200):
        index.add([1, 2, 3, 100 + question, 200 + question, 300 + question, *suffix, 5000 + question,
                   6000 + question])
    asked = [1, 2, 3, 100 + 3, 200 + 3, 300 + 3, *suffix]
    assert index.continuation(asked, 4) == [5003, 6003]


PROMPT = list(range(100, 120))
ANSWER = list(range(500, 540))


def following(source, emitted):
    """A drafter of PROMPT that drafted once and then saw `emitted`: its next draft."""
    drafter = source.drafter(PROMPT)
    assert drafter.propose(8) == ANSWER[:8]
    drafter.observe(emitted)
    return drafter.propose(8)


@pytest.mark.parametrize("emitted, resumes_at", [
    (ANSWER[:10] + [9, 511], 12),  # the archived 510 replaced by 9, and the answer goes on with 511
    (ANSWER[:10] + [513, 514], 15),  # 510-512 skipped
    (ANSWER[:10] + [9, 510, 511], 12),  # 9 put in before 510
    (ANSWER[:10] + [9, 7, 512], 13),  # two replaced
])
def test_after_a_divergence_the_draft_goes_on_from_the_archived_answer_once_a_token_confirms_it(
        tmp_path, emitted, resumes_at):
    source = palimpsest(tmp_path)
    source.record(PROMPT + ANSWER)
    assert source.continuation(PROMPT + emitted, 8) == []  # the keys see only a context new to the archive
    assert following(source, emitted) == ANSWER[resumes_at:resumes_at + 8]
    assert following(source, emitted[:-1]) == []  # not before: the texts may have parted
    source.close()


def test_under_a_grammar_a_match_within_the_answer_is_a_short_match_and_one_into_its_prompt_is_not(tmp_path):
    """Two requests' structured answers share their keys and punctuation: matching them says little of the values
    after, so it counts as a short match (Drafter.matched: its class's acceptance); a repeated request's match
    reaches into its prompt and keeps its length, and so does any match of an answer without a grammar."""
    source = palimpsest(tmp_path)
    source.record(PROMPT + ANSWER)
    other_prompt = list(range(200, 220))
    for grammar, expected in ((None, 12), (compiled('root ::= [^x]*'), FORCED_MATCH_EVIDENCE)):
        drafter = source.drafter(other_prompt, grammar)
        drafter.observe(ANSWER[:12])
        assert (drafter.propose(4), drafter.matched) == (ANSWER[12:16], expected)
        repeat = source.drafter(PROMPT, grammar)
        repeat.observe(ANSWER[:12])
        assert (repeat.propose(4), repeat.matched) == (ANSWER[12:16], 32)
    source.close()


def test_texts_that_parted_for_good_drop_the_place_and_the_record_end_ends_it(tmp_path):
    source = palimpsest(tmp_path)
    source.record(PROMPT + ANSWER)
    assert following(source, ANSWER[:10] + [1, 2, 3, 513]) == ANSWER[14:22]  # three misses, then back
    assert following(source, ANSWER[:10] + [1, 2, 3, 4, 514]) == []  # four: parted
    assert following(source, ANSWER) == []  # the archived answer ended: nothing past it
    source.close()


def test_the_vocabulary_hash_tells_tokenizers_apart():
    pieces = [b"a", b"b", b"c"]
    same = vocabulary_hash(pieces.__getitem__, 3)
    assert same == vocabulary_hash(pieces.__getitem__, 3) and len(same) == 32
    assert same != vocabulary_hash([b"a", b"b", b"d"].__getitem__, 3)
    assert same != vocabulary_hash([b"ab", b"", b"c"].__getitem__, 3)


def palimpsest(directory):
    source = Palimpsest(directory, VOCABULARY, 1 << 20)
    assert source.loaded.wait(10)
    return source


def generate(prompt, source):
    backend = FakeBackend(n_ctx=2048)
    speculation = Speculation(source, max_draft=16, cost=FrozenCost()) if source is not None else None
    with Engine(backend, speculation=speculation) as engine:
        return engine.generate(GenerationRequest(prompt, SamplingParams(temperature=0, max_tokens=60,
                                                                       ignore_eos=True)))


def test_a_repeated_request_is_drafted_from_its_earlier_answer_even_after_a_restart(tmp_path):
    plain = generate("the same question, again and again: ", None)
    first = generate("the same question, again and again: ", palimpsest(tmp_path))  # closed with its engine
    assert first.tokens == plain.tokens and first.finish.usage.accepted_draft_tokens == 0
    again = generate("the same question, again and again: ", palimpsest(tmp_path))  # a new process, say
    assert again.tokens == plain.tokens
    # All but the tokens each verification adds, and the second token: nothing is drafted in the step right
    # after the first token, which goes out meanwhile.
    assert again.finish.usage.accepted_draft_tokens >= 54
    other = generate("something else entirely, never asked: ", palimpsest(tmp_path))
    assert other.tokens == generate("something else entirely, never asked: ", None).tokens


def test_a_generation_that_ends_as_the_palimpsest_closes_is_archived(tmp_path, monkeypatch):
    """The flusher may be between taking what ended and its stop check when a generation ends and the server
    stops: that generation is appended before the flusher goes (it was lost, so a repeat after the restart
    found its earlier answer missing)."""
    source = Palimpsest(tmp_path, VOCABULARY, 1 << 20)
    assert source.loaded.wait(10)
    past_its_append, release = threading.Event(), threading.Event()
    checkpoint_of = Palimpsest._checkpoint

    def held_checkpoint(self, *args):
        past_its_append.set()
        release.wait(10)
        return checkpoint_of(self, *args)

    monkeypatch.setattr(Palimpsest, "_checkpoint", held_checkpoint)
    assert past_its_append.wait(10)
    record = records(1)[0]
    source.record(record)
    closing = threading.Thread(target=source.close)
    closing.start()
    assert source._stop.wait(10)
    release.set()
    closing.join(10)
    assert Archive(tmp_path, VOCABULARY, 1 << 20).read_new().frames == [record]


def index_of(source):
    with source._lock:
        return source._index


def test_a_start_reads_the_checkpoint_and_only_what_was_appended_after_it(tmp_path, monkeypatch):
    monkeypatch.setattr("reame.speculative.palimpsest.CHECKPOINT_TOKENS", 50)
    writer = Archive(tmp_path, VOCABULARY, 1 << 20)
    for record in records(5):
        writer.append(record)
    first = palimpsest(tmp_path)
    first.close()
    kept = checkpoint.path_of(writer.path)
    assert kept.exists() and kept.stat().st_mode & 0o077 == 0
    for record in records(7)[5:]:  # appended after the checkpoint: read from the archive
        writer.append(record)
    added = []
    monkeypatch.setattr(ContinuationIndex, "add", lambda self, record, add=ContinuationIndex.add: (
        added.append(tuple(record)), add(self, record))[1])
    second = palimpsest(tmp_path)
    try:
        assert added == records(7)[5:], "the checkpoint's records are not indexed again"
        assert index_of(second).tokens.tolist() == [t for r in records(7) for t in (*r, -1)]
        assert second.continuation(records(7)[2][:6], 4) == list(records(7)[2][6:10])
        assert second.continuation(records(7)[6][:6], 4) == list(records(7)[6][6:10])
    finally:
        second.close()


def test_a_rewritten_archive_makes_its_old_checkpoint_useless(tmp_path, monkeypatch):
    monkeypatch.setattr("reame.speculative.palimpsest.CHECKPOINT_TOKENS", 50)
    writer = Archive(tmp_path, VOCABULARY, 1 << 20)
    for record in records(5):
        writer.append(record)
    palimpsest(tmp_path).close()
    writer.path.unlink()
    fresh = Archive(tmp_path, VOCABULARY, 1 << 20)  # a new generation
    fresh.append(records(9)[8])
    source = palimpsest(tmp_path)
    try:
        assert index_of(source).tokens.tolist() == [*records(9)[8], -1]
    finally:
        source.close()


@pytest.mark.parametrize("damage", ["truncated", "garbage", "header only", "bad positions", "mid-frame offset"])
def test_a_damaged_checkpoint_is_never_trusted_with_more_than_a_draft(tmp_path, monkeypatch, damage):
    """A damaged or planted checkpoint: the archive is read whole instead, or the index drafts nothing where
    a position is out of range; never an error, and the archive is never cut."""
    monkeypatch.setattr("reame.speculative.palimpsest.CHECKPOINT_TOKENS", 50)
    writer = Archive(tmp_path, VOCABULARY, 1 << 20)
    for record in records(5):
        writer.append(record)
    palimpsest(tmp_path).close()
    kept = checkpoint.path_of(writer.path)
    data = bytearray(kept.read_bytes())
    if damage == "truncated":
        data = data[:-4]
    elif damage == "garbage":
        data = bytearray(os.urandom(len(data)))
    elif damage == "header only":
        data = data[:checkpoint.HEADER.size]
    elif damage == "bad positions":
        body = checkpoint.HEADER.size
        data[body + 4 * 105:] = b"\x7f\xff\xff\x7f" * ((len(data) - body - 4 * 105) // 4)
    else:
        magic, version, bits, generation, offset, n = checkpoint.HEADER.unpack_from(data)
        data[:checkpoint.HEADER.size] = checkpoint.HEADER.pack(magic, version, bits, generation, offset - 3, n)
    kept.write_bytes(bytes(data))
    size = writer.path.stat().st_size
    source = palimpsest(tmp_path)
    try:
        for record in records(5):
            source.continuation(record[:6], 4)  # whatever it drafts, it raises nothing
        if damage != "bad positions":
            assert source.continuation(records(5)[3][:6], 4) == list(records(5)[3][6:10])
        source.record((1, 2, 3, 4, 5))
    finally:
        source.close()
    assert writer.path.stat().st_size >= size
    assert Archive(tmp_path, VOCABULARY, 1 << 20).read_new().frames[:5] == records(5)
