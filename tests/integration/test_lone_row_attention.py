"""Patch 0004: a row computed row by row (`rowwise`) gets the logits a one-row step of ggml's own kernels gives
it, past 256 cells too, where a lone row's attention takes the split-KV path (its cells cut into one chunk a
thread). Before it, Reame's exact steps summed those cells in one chunk and parted from llama-server's one-row
steps there (a median 0.5 logit apart), so a greedy answer parted from llama-server's."""

from reame.model.backend import Backend

# Past 256 cells: the KV view a lone step sees is 512 cells, where the split-KV path starts.
PROMPT = " ".join(f"Line {n}: the quick brown fox jumps over the lazy dog." for n in range(30))
NEXT = " And then the fox rests in the shade of an old oak tree."


def one_row_steps(backend: Backend, tokens: list[int], start: int, rowwise: bool) -> list[list[float]]:
    """The logits of `tokens` decoded one step each from `start` on, then cut again."""
    logits = []
    for offset, token in enumerate(tokens):
        backend.decode([token], [start + offset], [0], [True], rowwise=rowwise)
        logits.append(list(backend.logits(0)))
    assert backend.seq_rm(0, start, -1)
    return logits


def test_a_row_computed_row_by_row_past_256_cells_is_ggmls_own_one_row_step(backend):
    prompt, following = backend.tokenize(PROMPT), backend.tokenize(NEXT, add_special=False)[:6]
    assert len(prompt) > 300
    backend.decode(prompt, list(range(len(prompt))), [0] * len(prompt), [False] * len(prompt))
    stock = one_row_steps(backend, following, len(prompt), rowwise=False)
    assert one_row_steps(backend, following, len(prompt), rowwise=True) == stock
    n = len(following)
    backend.decode(following, list(range(len(prompt), len(prompt) + n)), [0] * n, [True] * n, rowwise=True)
    assert [list(backend.logits(row)) for row in range(n)] == stock
