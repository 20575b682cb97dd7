"""The KV ledger (engine/kv.py) against FakeBackend, whose cells follow llama.cpp's rules: after any sequence of
decodes, copies, cuts and restores the ledger counts exactly the cells the model's memory holds."""

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from reame.engine.kv import KvCells
from reame.model.backend import DECODE_NO_KV_SLOT
from tests.fakes.backend import FakeBackend


def decode(kv: KvCells, seq_id: int, count: int) -> int:
    start = kv.length(seq_id)
    return kv.decode([ord("a")] * count, list(range(start, start + count)), [seq_id] * count, [False] * count)


def test_copies_share_cells_and_a_cell_is_free_when_no_sequence_holds_it():
    backend = FakeBackend(n_ctx=100, n_seq_max=3)
    kv = KvCells(backend)
    decode(kv, 0, 40)
    kv.copy(0, 1, 30)
    assert kv.used() == 40 and kv.length(1) == 30
    decode(kv, 1, 5)  # its own cells after the shared ones
    assert kv.used() == 45 == backend.cells_in_use()
    assert kv.exclusive(0) == 10 and kv.exclusive(1) == 5
    kv.remove(0)
    assert kv.used() == 35 == backend.cells_in_use() and kv.free(2) == 65


def test_a_restore_takes_as_many_cells_as_its_state_holds_and_a_refused_one_leaves_the_sequence_empty():
    backend = FakeBackend(n_ctx=100, n_seq_max=3)
    kv = KvCells(backend)
    decode(kv, 0, 30)
    state = kv.state(0)
    decode(kv, 1, 60)
    assert kv.restore(0, state, 30), "its own 30 cells are freed first: it fits beside the other 60"
    assert kv.used() == 90 == backend.cells_in_use()
    assert not kv.restore(2, state, 30), "30 cells do not fit in the 10 left"
    assert kv.length(2) == 0 and kv.used() == 90 == backend.cells_in_use()
    assert not kv.restore(0, b"not a state", 10) and kv.length(0) == 0 and kv.used() == 60


def test_a_state_that_does_not_hold_the_cells_it_claims_is_refused():
    backend = FakeBackend(n_ctx=100, n_seq_max=2)
    kv = KvCells(backend)
    decode(kv, 0, 20)
    assert not kv.restore(1, kv.state(0), 21)
    assert kv.length(1) == 0 and backend.kv_tokens(1) == []


def test_a_full_decode_changes_nothing():
    backend = FakeBackend(n_ctx=10, n_seq_max=2)
    kv = KvCells(backend)
    decode(kv, 0, 8)
    assert decode(kv, 1, 3) == DECODE_NO_KV_SLOT
    assert kv.length(1) == 0 and kv.used() == 8


def test_separate_streams_each_have_their_own_cells():
    backend = FakeBackend(n_ctx=100, n_seq_max=2)
    backend.n_ctx_seq = 50  # a KV that is not unified: each sequence its own 50 cells
    kv = KvCells(backend)
    assert not kv.unified and kv.capacity == 50
    decode(kv, 0, 40)
    assert kv.free(0) == 10 and kv.free(1) == 50
    assert kv.same_stream(0, 0) and not kv.same_stream(0, 1)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["decode", "copy", "cut", "remove", "restore"]),
                          st.integers(0, 3), st.integers(0, 3), st.integers(1, 40)), max_size=40))
def test_the_ledger_counts_what_the_memory_holds_after_any_edits(edits):
    backend = FakeBackend(n_ctx=256, n_seq_max=4)
    kv = KvCells(backend)
    saved: dict[int, tuple[bytes, int]] = {}
    for kind, seq_id, other, count in edits:
        if kind == "decode":
            decode(kv, seq_id, count)
        elif kind == "copy" and other != seq_id:
            kv.remove(other)
            kv.copy(seq_id, other, min(count, kv.length(seq_id)))
        elif kind == "cut":
            kv.remove(seq_id, min(count, kv.length(seq_id)))
        elif kind == "remove":
            kv.remove(seq_id)
        elif kind == "restore":
            if seq_id in saved:
                kv.restore(other, *saved[seq_id])
            saved[seq_id] = (kv.state(seq_id), kv.length(seq_id))
        assert kv.used() == backend.cells_in_use()
        for seq in range(4):
            assert kv.length(seq) == len(backend.kv_tokens(seq))
            assert kv.exclusive(seq) <= kv.length(seq)


def test_many_slots_generating_beside_shared_prompts_are_counted_exactly():
    backend = FakeBackend(n_ctx=8192, n_seq_max=16, n_batch=512)
    kv = KvCells(backend)
    rng = random.Random(3)
    for step in range(2000):  # generation steps, and now and then a clone of a sequence's prompt
        seq_id = rng.randrange(16)
        decode(kv, seq_id, 1)
        target = (seq_id + 1) % 16
        if step % 97 == 0 and not kv.length(target):
            kv.copy(seq_id, target, kv.length(seq_id))
    assert kv.used() == backend.cells_in_use()
