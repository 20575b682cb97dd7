#!/usr/bin/env python3
"""Why a greedy answer verified in batches can differ from the same answer decoded row by row.

    python bench/batch_numerics.py                      # Qwen2.5-Coder-1.5B, 160 tokens, 2 threads
    python bench/batch_numerics.py --model smollm2-135m

Speculative decoding verifies a draft of k tokens as one batch of k + 1 rows.
llama.cpp's CPU kernels compute a row differently by the size of its batch (a
one-row matrix-vector kernel, tiled matrix-matrix kernels for more rows), so
its logits, and at a near tie its most likely token, depend on how the answer
was batched. This measures it on one real answer: the model's greedy answer to
bench/palimpsest.py's repeated question is decoded one row at a time, then the
same tokens are fed again in batches of B rows (teacher-forced, as a draft
that is accepted whole), and each position's logits are compared with the
one-row pass. Printed per B: the largest logit difference (median and maximum
over positions), the positions whose most likely token differs from the
one-row pass, and the chance that a whole answer of that length comes out
unchanged if those flips were independent. A second table does the same with
every decode after the prompt computed row by row (Backend.decode's `rowwise`,
Reame's patch to the pinned ggml; the engine's steps beside a greedy answer),
against a one-row pass made the same way: no difference at any size is what
keeps greedy answers exact under speculation. Needs numpy.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from common import bench_parser, machine, model_path, print_table
from palimpsest import REPEATED

from reame.model.backend import ModelSettings
from reame.model.llama import LlamaBackend
from reame.native import LLAMA_COMMIT

BATCH_ROWS = (1, 2, 3, 4, 8, 16)


def logits_rows(backend: LlamaBackend, indices: range) -> np.ndarray:
    """The logits of the last batch's rows at `indices`."""
    return np.stack([np.frombuffer(backend.logits(i), dtype=np.float32).copy() for i in indices])


def prefill(backend: LlamaBackend, prompt: list[int]) -> np.ndarray:
    """A fresh context holding `prompt`, prefilled in one batch as every pass does; the last row's logits."""
    backend.clear()
    n = len(prompt)
    backend.decode(prompt, list(range(n)), [0] * n, [False] * (n - 1) + [True])
    return logits_rows(backend, range(n - 1, n))


def greedy_answer(backend: LlamaBackend, prompt: list[int], n_tokens: int) -> list[int]:
    """The model's greedy answer decoded one row at a time, up to its end or `n_tokens`."""
    last = prefill(backend, prompt)[0]
    answer: list[int] = []
    while len(answer) < n_tokens:
        token = int(last.argmax())
        if backend.is_eog(token):
            break
        answer.append(token)
        position = len(prompt) + len(answer) - 1
        backend.decode([token], [position], [0], [True])
        last = logits_rows(backend, range(1))[0]
    return answer


def forced(backend: LlamaBackend, prompt: list[int], answer: Sequence[int], rows: int,
           rowwise: bool = False) -> np.ndarray:
    """Logits predicting each answer token (the prompt's last row, then each answer token's row but the
    last), with the answer fed in batches of `rows` (computed row by row: `rowwise`)."""
    predicting = [prefill(backend, prompt)]
    fed = list(answer[:-1])
    for start in range(0, len(fed), rows):
        chunk = fed[start:start + rows]
        positions = list(range(len(prompt) + start, len(prompt) + start + len(chunk)))
        backend.decode(chunk, positions, [0] * len(chunk), [True] * len(chunk), rowwise)
        predicting.append(logits_rows(backend, range(len(chunk))))
    return np.concatenate(predicting)


def compared(backend: LlamaBackend, prompt: list[int], answer: list[int], rowwise: bool) -> list[list[str]]:
    """Per batch size: how far its rows' logits are from the one-row pass's, both fed `rowwise` or not."""
    one_row = forced(backend, prompt, answer, 1, rowwise)
    choices = one_row.argmax(axis=1)
    rows = []
    for batch in BATCH_ROWS:
        logits = one_row if batch == 1 else forced(backend, prompt, answer, batch, rowwise)
        difference = np.abs(logits - one_row).max(axis=1)
        flips = int((logits.argmax(axis=1) != choices).sum())
        unchanged = (1 - flips / len(answer)) ** len(answer)
        rows.append([str(batch), f"{np.median(difference):.3f}", f"{difference.max():.3f}",
                     f"{flips}/{len(answer)}", f"{unchanged:.2f}"])
    return rows


def main() -> None:
    parser = bench_parser(__doc__, "qwen2.5-coder-1.5b", tokens=160, reps=1, tokens_help="answer tokens compared")
    args = parser.parse_args()
    path = str(model_path(args.model))
    started = time.perf_counter()
    with LlamaBackend(ModelSettings(path, n_ctx=1024, n_threads=args.threads)) as backend:
        prompt = backend.tokenize(backend.apply_chat_template([{"role": "user", "content": REPEATED}]))
        answer = greedy_answer(backend, prompt, args.tokens)
        one_row = forced(backend, prompt, answer, 1)
        ranked = np.sort(one_row, axis=1)
        margins = ranked[:, -1] - ranked[:, -2]
        tables = {rowwise: compared(backend, prompt, answer, rowwise)
                  for rowwise in ((False, True) if backend.supports_rowwise else (False,))}
    print(f"machine: {machine()} · llama.cpp {LLAMA_COMMIT} · {Path(path).name} · {args.threads} threads · "
          f"greedy answer of {len(answer)} tokens · {time.perf_counter() - started:.0f} s")
    for rowwise, rows in tables.items():
        print("\nrow by row (decode's rowwise):\n" if rowwise else "\nggml's batched kernels:\n")
        print_table(["rows a batch", "largest logit difference vs 1 row (median)", "(max)",
                     "most likely token differs", "whole answer unchanged (if independent)"], rows)
    near = int((margins < 0.5).sum())
    print(f"\npositions whose top two logits are within 0.5 in the one-row pass: {near}/{len(answer)} "
          f"(smallest gap {margins.min():.3f})")


if __name__ == "__main__":
    main()
