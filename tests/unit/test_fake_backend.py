from reame.model.backend import DECODE_NO_KV_SLOT, DECODE_OK
from tests.fakes.backend import BOS, IM_START, FakeBackend


def test_tokenize_parses_specials_and_round_trips():
    backend = FakeBackend()
    tokens = backend.tokenize("<|im_start|>café")
    assert tokens[:2] == [BOS, IM_START]
    assert backend.detokenize(tokens[1:]) == "<|im_start|>café"


def test_state_get_set_restores_a_sequence_elsewhere():
    backend = FakeBackend(n_seq_max=2)
    assert backend.decode([1, 2, 3], [0, 1, 2], [0, 0, 0], [False, False, True]) == DECODE_OK
    blob = backend.seq_state_get(0)
    assert backend.seq_state_set(1, blob)
    assert backend.kv_tokens(1) == [1, 2, 3]


def test_malformed_state_blob_is_refused():
    backend = FakeBackend()
    for blob in (b"", b"garbage", b'{"magic": "other"}', b"\xff\xfe"):
        assert not backend.seq_state_set(0, blob)


def test_full_context_reports_no_kv_slot():
    backend = FakeBackend(n_ctx=4)
    assert backend.decode([1, 2, 3, 4, 5], list(range(5)), [0] * 5, [False] * 5) == DECODE_NO_KV_SLOT
    assert backend.kv_tokens(0) == []


def test_seq_cp_and_rm():
    backend = FakeBackend(n_seq_max=2)
    backend.decode([1, 2, 3], [0, 1, 2], [0, 0, 0], [False, False, True])
    backend.seq_cp(0, 1, 0, 2)
    assert backend.kv_tokens(1) == [1, 2]
    assert backend.seq_rm(0, 1, -1)
    assert backend.kv_tokens(0) == [1]
    assert not backend.seq_rm(1, 0, 1)  # no holes
