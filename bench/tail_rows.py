#!/usr/bin/env python3
"""What a prompt's tail costs after a cached prefix, by its rows, flash attention on (auto) and off.

    python bench/tail_rows.py                          # SmolLM2-135M, 700 tokens in the KV
    python bench/tail_rows.py --model qwen2.5-coder-1.5b

A request that restores a prefix (a system prompt, a document) prefills only its tail, in one batch; at the
llama.cpp pin the CPU's flash attention takes another path below 64 query rows (GGML_FA_TILE_Q). This times
one decode of `rows` tokens after `--cached` tokens of KV through Reame's backend (best of `--reps`), as the
engine's prefill of a tail does, and prints each setting's milliseconds beside the 64-row batch's.
"""

from __future__ import annotations

import time

from common import bench_parser, machine, model_path, print_table

from reame.model.llama import LlamaBackend
from reame.model.backend import ModelSettings

ROWS = (8, 16, 32, 48, 56, 63, 64, 100)


def tail_costs(path: str, threads: int, cached: int, reps: int, flash_attn: str) -> dict[int, float]:
    """Seconds of one decode of each ROWS count after `cached` tokens of KV."""
    with LlamaBackend(ModelSettings(path, n_ctx=cached + max(ROWS) + 16, n_seq_max=1, n_threads=threads,
                                    n_batch=512, flash_attn=flash_attn)) as backend:
        tokens = (backend.tokenize("Each step reads all the weights once. " * 400) * 2)[:cached + max(ROWS)]
        for start in range(0, cached, 512):
            end = min(start + 512, cached)
            backend.decode(tokens[start:end], range(start, end), [0] * (end - start), [False] * (end - start))
        costs = {}
        for rows in ROWS:
            best = float("inf")
            for _ in range(reps):
                backend.seq_rm(0, cached)
                started = time.perf_counter()
                backend.decode(tokens[cached:cached + rows], range(cached, cached + rows), [0] * rows,
                               [row == rows - 1 for row in range(rows)])
                best = min(best, time.perf_counter() - started)
            costs[rows] = best
        return costs


def main() -> None:
    parser = bench_parser(__doc__, "smollm2-135m", tokens=0, reps=3, tokens_help="unused")
    parser.add_argument("--cached", type=int, default=700, help="tokens already in the KV")
    args = parser.parse_args()
    path = str(model_path(args.model))
    on = tail_costs(path, args.threads, args.cached, args.reps, "auto")
    off = tail_costs(path, args.threads, args.cached, args.reps, "off")
    print(f"machine: {machine()} · {args.model} · {args.threads} threads · {args.cached} tokens cached\n")
    print_table(["tail rows", "flash attention auto (ms)", "off (ms)", "auto vs its 64-row batch"],
                [[str(rows), f"{on[rows] * 1000:.0f}", f"{off[rows] * 1000:.0f}", f"{on[rows] / on[64]:.2f}x"]
                 for rows in ROWS])


if __name__ == "__main__":
    main()
