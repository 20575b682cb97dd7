"""Patch 0003: a token takes a KV cell after its own sequence's cells. The CPU's attention sums the cells in
index order, so a token that went into a hole another sequence's cut left before its own cells (llama.cpp's
search head goes back to the first freed cell) would compute other logits than the same sequence alone."""

from reame.model.backend import Backend

OTHER = "The quick brown fox jumps over the lazy dog, again and again, until the dog finally wakes up and runs."
OWN = "def average(values):\n    return sum(values) / len(values)\n"


def next_logits(backend: Backend, own: list[int], token: int) -> list[float]:
    """Sequence 1's prompt and then `token`, each row computed as a one-row step computes it."""
    backend.decode(own, list(range(len(own))), [1] * len(own), [False] * len(own), rowwise=True)
    backend.decode([token], [len(own)], [1], [True], rowwise=True)
    return list(backend.logits(0))


def test_a_token_beside_a_hole_another_sequence_left_computes_what_it_does_alone(backend):
    other, own = backend.tokenize(OTHER), backend.tokenize(OWN)
    token = own[-1]
    alone = next_logits(backend, own, token)
    backend.clear()
    backend.decode(other, list(range(len(other))), [0] * len(other), [False] * len(other), rowwise=True)
    backend.decode(own, list(range(len(own))), [1] * len(own), [False] * len(own), rowwise=True)
    assert backend.seq_rm(0, len(other) // 2, -1)  # a hole before sequence 1's cells: the search head goes there
    backend.decode([token], [len(own)], [1], [True], rowwise=True)
    assert list(backend.logits(0)) == alone
