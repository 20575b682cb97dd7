"""The shared corpus: one node's Palimpsest records reach another's through ARCA (an XADD stream)."""

from functools import partial

from reame.arca.client import StoreAddress, StoreClient
from reame.speculative.corpus import Corpus
from reame.speculative.palimpsest import Palimpsest
from tests.arca_thread import arca_thread
from tests.waiting import wait_until

VOCABULARY = bytes(range(32))
ANSWER = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]


def palimpsest(directory, vocabulary=VOCABULARY):
    source = Palimpsest(directory, vocabulary, 1 << 20)
    assert source.loaded.wait(10)
    return source


def test_a_generation_recorded_on_one_node_drafts_on_another(tmp_path):
    with arca_thread(tmp_path / "arca") as port:
        address = partial(StoreClient, StoreAddress("127.0.0.1", port, "", 0))
        first, second = palimpsest(tmp_path / "a"), palimpsest(tmp_path / "b")
        first.attach(Corpus(address, VOCABULARY, first))
        link = Corpus(address, VOCABULARY, second)
        second.attach(link)
        try:
            first.record([1, 2, 3, 4, *ANSWER])
            wait_until(lambda: link.absorbed == 1)
            assert second.continuation([1, 2, 3, 4], 8) == ANSWER[:8]
            # A node started later reads what was written before it; its own records it does not absorb.
            late = palimpsest(tmp_path / "c")
            late_link = Corpus(address, VOCABULARY, late)
            late.attach(late_link)
            wait_until(lambda: late_link.absorbed == 1)
            late.record([20, 21, 22, 23, 24])
            wait_until(lambda: late_link.sent == 1)
            wait_until(lambda: link.absorbed == 2)
            assert late_link.absorbed == 1
            late.close()
        finally:
            first.close()
            second.close()


def test_another_tokenizer_never_reads_these_tokens(tmp_path):
    with arca_thread(tmp_path / "arca") as port:
        address = partial(StoreClient, StoreAddress("127.0.0.1", port, "", 0))
        first, other = palimpsest(tmp_path / "a"), palimpsest(tmp_path / "b", bytes(32))
        first_link, other_link = Corpus(address, VOCABULARY, first), Corpus(address, bytes(32), other)
        first.attach(first_link)
        other.attach(other_link)
        try:
            first.record([1, 2, 3, 4, *ANSWER])
            wait_until(lambda: first_link.sent == 1)
            assert other_link.stream != first_link.stream and other_link.absorbed == 0
            assert other.continuation([1, 2, 3, 4], 8) == []
        finally:
            first.close()
            other.close()
