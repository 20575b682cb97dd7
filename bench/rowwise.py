#!/usr/bin/env python3
"""What a step computed row by row costs, beside the same step with ggml's batched kernels.

    python bench/rowwise.py                          # Qwen2.5-Coder-1.5B, 2 threads, 700 cells in the KV
    python bench/rowwise.py --model smollm2-135m --depth 300 --reps 9
    python bench/rowwise.py --rows 1 8 16 32 48      # other step sizes

Under `speculative.exact` (the default) a step of generating sequences beside a greedy or seeded one is
computed row by row (Backend.decode's `rowwise`, Reame's patch to the pinned ggml): each row exactly as a
step of that one row computes it, so drafts cannot change such an answer (docs/speculative.md). The
batched kernels are cheaper per row from 4 rows on; this prints by how much, on this machine. The KV holds
`--depth` cells of a real text first (past 256, where flash attention's one-row path splits the cells), then
each size is decoded after it with every row's logits (a verification's shape), the two ways alternated in
every round, and each shape's first decode (llama.cpp builds its graph then) left out. Prints the median
milliseconds per step, their ratio, and the draft acceptance at which a row-by-row step of that size yields
as many tokens per second as one-row steps.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

from common import bench_parser, machine, model_path, print_table
from palimpsest import REPEATED

from reame.model.backend import ModelSettings
from reame.model.llama import LlamaBackend
from reame.native import LLAMA_COMMIT

ROWS = (1, 2, 3, 4, 6, 8, 9, 16)


def step_seconds(backend: LlamaBackend, tokens: list[int], depth: int, rowwise: bool) -> float:
    """One decode of `tokens` after the `depth` cells the KV holds, every row with logits; then undone."""
    n = len(tokens)
    started = time.perf_counter()
    backend.decode(tokens, list(range(depth, depth + n)), [0] * n, [True] * n, rowwise)
    seconds = time.perf_counter() - started
    backend.seq_rm(0, depth, -1)
    return seconds


def break_even_acceptance(rows: int, step: float, one_row: float) -> str:
    """The per-draft acceptance p at which a step of `rows` rows (rows - 1 drafts) yields as many tokens per
    second as one-row steps: (1 - p^rows) / (1 - p) tokens for `step` seconds against 1 for `one_row`."""
    if rows == 1:
        return ""
    needed = step / one_row
    low, high = 0.0, 1.0
    for _ in range(40):
        p = (low + high) / 2
        if (1 - p ** rows) / (1 - p) < needed:
            low = p
        else:
            high = p
    return "never" if needed > rows else f"{high:.2f}"


def step_curves(backend: LlamaBackend, sizes: list[int], depth: int, reps: int) -> dict[tuple[int, bool], float]:
    """The median seconds of a step of each of `sizes` rows, with the batched kernels (False) and row by row
    (True), after `depth` cells of a real text; the two ways alternated in every round, each shape's first
    decode (its graph built) left out."""
    text = backend.tokenize(REPEATED * 40, add_special=False, parse_special=False)
    history, tokens = text[:depth], text[depth:depth + max(sizes)]
    for start in range(0, depth, backend.n_batch):
        chunk = history[start:start + backend.n_batch]
        backend.decode(chunk, list(range(start, start + len(chunk))), [0] * len(chunk), [False] * len(chunk))
    seconds: dict[tuple[int, bool], list[float]] = {}
    for rows in sizes:  # each shape's graph is built once, uncounted
        for rowwise in (False, True):
            step_seconds(backend, tokens[:rows], depth, rowwise)
    for round_ in range(reps):
        for rows in sizes:
            order = (False, True) if round_ % 2 == 0 else (True, False)
            for rowwise in order:
                seconds.setdefault((rows, rowwise), []).append(step_seconds(backend, tokens[:rows], depth, rowwise))
    return {key: statistics.median(values) for key, values in seconds.items()}


def main() -> None:
    parser = bench_parser(__doc__, "qwen2.5-coder-1.5b", tokens=0, reps=7, reps_help="rounds (both ways each)")
    parser.add_argument("--depth", type=int, default=700, help="KV cells held before each step")
    parser.add_argument("--rows", type=int, nargs="+", default=list(ROWS), help="the step sizes to measure")
    args = parser.parse_args()
    sizes = sorted(set(args.rows) | {1})  # the one-row step is what every ratio is against
    path = str(model_path(args.model))
    with LlamaBackend(ModelSettings(path, n_ctx=args.depth + 512, n_threads=args.threads)) as backend:
        if not backend.supports_rowwise:
            raise SystemExit("this llama.cpp build has no row-by-row switch (rebuild: python build_zipapp.py --lib)")
        median = step_curves(backend, sizes, args.depth, args.reps)
    table = []
    for rows in sizes:
        batched, alone = median[(rows, False)], median[(rows, True)]
        table.append([str(rows), f"{batched * 1000:.1f}", f"{alone * 1000:.1f}", f"{alone / batched:.2f}",
                      break_even_acceptance(rows, batched, median[(1, False)]),
                      break_even_acceptance(rows, alone, median[(1, True)])])
    print(f"machine: {machine()} · llama.cpp {LLAMA_COMMIT} · {Path(path).name} · {args.threads} threads · "
          f"{args.depth} cells in the KV · median of {args.reps} rounds\n")
    print_table(["rows", "batched kernels ms", "row by row ms", "row by row / batched",
                 "acceptance to pay (batched)", "(row by row)"], table)


if __name__ == "__main__":
    main()
