"""Which batch sizes compute each row exactly as a one-row decode does, measured on this machine.

Speculative decoding verifies a sequence's next token and its drafts as one batch of rows. llama.cpp's CPU
kernels do not compute a row the same way at every batch size: at the pin (0c1e57098,
ggml-cpu/repack.cpp) a repacked Q4_K/Q4_0/IQ4_NL weight multiplies the first 4*floor(n/4) rows of a batch
with a tiled matrix-matrix kernel and only the rest with the one-row kernel, so on a Q4_K_M model a row in
a batch of 4 or more rows gets logits ~0.4 apart from the one-row decode's, and where the two best tokens
are nearly tied the greedy pick flips (bench/batch_numerics.py). Other files have no such kernel (SmolLM2's
Q4_1 rows are bit-identical at 1-16 rows). Which is the case depends on the weights' types, the CPU's
instruction set and the build, so it is measured rather than derived: `exact_batch_rows` feeds the same
tokens one row at a time and then as batches of 2, 3, ... rows, and compares every row's logits bit for bit.

Attention differs too. At the pin, CPU flash attention over an f16 (or f32) KV computes a lone query row
with a split-KV path (ggml-cpu/ops.cpp, `use_split_kv_path`: one row, a KV view of 512 cells or more, i.e.
more than 256 cells in use): each thread folds its share of the cells and the shares are merged, while
any batch of 2 or more rows folds all cells in order. So past 256 cells no batch of 2 rows or more
matches a one-row step on such a KV, whatever the weights: SmolLM2-135M's rows are bit-identical at 1-17
rows with 8 cells in use and at no size past 256. A q8_0 KV has no split path (every size up to 17 is
exact on SmolLM2 there). The probe therefore measures twice, with a prefix past 256 cells (when the
context has room for it) and with a short one, and the smaller answer holds: the engine cannot see where
llama.cpp placed the cells, and other sequences' cells count towards the view.

A step whose rows all stay within that size decodes every row exactly as the one-row steps of a
non-speculating answer would, which is what keeps a greedy (or seeded) answer byte-identical with
speculation on (engine/step.py, `plan_step`).
"""

from __future__ import annotations

from array import array

from reame.model.backend import DECODE_OK, Backend

PROBE_TEXT = ("The ship's log, written in a hurried hand: wind from the north-east, 14 knots; "
              "the crew of 23 sighted land at 06:40 and anchored off the second headland.")
SHORT_PREFIX = 8
LONG_PREFIX = 300  # past 256 cells: the KV view is 512 cells, where a lone row takes the split-KV path
FIRST_STAGE_ROWS = 4  # the tiled kernels' row group: most files that differ at all differ here
MAX_PROBED_ROWS = 33  # a bound on the probe's cost: larger draft batches are not assumed exact
# Row by row, the sizes tried (and the limit): where ggml's batched paths would take over (repacked weights'
# 4-row tiles, the tiled K-quant matmul from 8 rows, 16). Each row is computed alone by construction there, so
# this checks the construction on this build and CPU at a quarter of the cost of every size (17 s for every
# size up to 17 on Qwen2.5-Coder-1.5B here, a one-shot's first start on a machine).
ROWWISE_SIZES = (2, 3, 4, 5, 8, 9, 16)


def exact_batch_rows(backend: Backend, limit: int, seq_id: int = 0, rowwise: bool = False) -> int:
    """The largest n <= `limit` such that batches of 1..n rows give every row the logits a one-row decode
    gives it, bit for bit, after a short prefix and after one past 256 cells; `rowwise`: every decode but
    the prefix's is made with Backend.decode's `rowwise`, as the engine makes its exact steps. Uses
    `seq_id`'s KV (it must be empty, and is left empty) on the calling thread, which must be the thread that
    decodes (ggml's thread team belongs to it)."""
    limit = max(1, min(limit, MAX_PROBED_ROWS, backend.n_batch))
    # The long prefix first: where the split-KV path makes every batch inexact, the short probe is then free.
    prefixes = [prefix for prefix in (LONG_PREFIX, SHORT_PREFIX) if prefix + limit <= backend.n_ctx_seq]
    tokens = backend.tokenize(PROBE_TEXT, add_special=False, parse_special=False)
    needed = LONG_PREFIX + limit
    tokens = (tokens * (needed // max(len(tokens), 1) + 1))[:needed]
    try:
        for prefix in prefixes:
            limit = _exact_rows_after(backend, tokens[:prefix], tokens[prefix:prefix + limit], seq_id, rowwise)
        return limit
    finally:
        backend.seq_rm(seq_id)


def _exact_rows_after(backend: Backend, prefix: list[int], forced: list[int], seq_id: int, rowwise: bool) -> int:
    """The largest n <= len(forced) whose batches of 1..n rows of `forced` after `prefix` are exact."""
    backend.seq_rm(seq_id)
    start = len(prefix)
    for offset in range(0, start, backend.n_batch):
        chunk = prefix[offset:offset + backend.n_batch]
        _decode(backend, chunk, offset, seq_id, outputs=False, rowwise=False)
    tested = 1
    for stage_end in sorted({min(FIRST_STAGE_ROWS, len(forced)), len(forced)}):
        reference = _one_row_logits(backend, forced[:stage_end], start, seq_id, rowwise)
        sizes: list[int] | range = range(tested + 1, stage_end + 1)
        if rowwise:  # every row is computed alone by construction: checked where ggml's batched kernels switch
            sizes = sorted({size for size in ROWWISE_SIZES if tested < size <= stage_end} | {stage_end})
        for rows in sizes:
            backend.seq_rm(seq_id, start, -1)
            _decode(backend, forced[:rows], start, seq_id, outputs=True, rowwise=rowwise)
            if any(_row_bytes(backend, row) != reference[row] for row in range(rows)):
                return tested
            tested = rows
    return len(forced)


def _one_row_logits(backend: Backend, tokens: list[int], start: int, seq_id: int, rowwise: bool) -> list[bytes]:
    """Each token's logits, fed one decode per token from position `start`."""
    backend.seq_rm(seq_id, start, -1)
    rows = []
    for offset, token in enumerate(tokens):
        _decode(backend, [token], start + offset, seq_id, outputs=True, rowwise=rowwise)
        rows.append(_row_bytes(backend, 0))
    return rows


def _decode(backend: Backend, tokens: list[int], start: int, seq_id: int, outputs: bool, rowwise: bool) -> None:
    n = len(tokens)
    status = backend.decode(tokens, list(range(start, start + n)), [seq_id] * n,
                            [outputs] * n if outputs else [False] * (n - 1) + [True], rowwise)
    if status != DECODE_OK:
        raise RuntimeError(f"the batch-numerics probe could not decode (status {status})")


def _row_bytes(backend: Backend, row: int) -> bytes:
    return array("f", backend.logits(row)).tobytes()
