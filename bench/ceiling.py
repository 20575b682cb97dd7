#!/usr/bin/env python3
"""The machine's ceiling: what a decode step costs with 1, 2, 4, 8, 16 rows (llama-batched-bench, same pin).

    python bench/ceiling.py                                   # Qwen2.5-Coder-1.5B, 2 threads
    python bench/ceiling.py --model smollm2-135m --model qwen2.5-coder-0.5b

Batching and speculation both buy tokens with rows: N sequences decode N rows a step,
a draft of k tokens is verified in a step of k+1 rows. On a memory-bound machine a
step of 8 rows costs about what a step of 1 does; on a compute-bound one it costs up
to 8 times as much, and neither batching nor speculation can gain more than the
step costs allow. Every batching and speculation figure in docs/BENCHMARKS.md is to
be read beside this table: aggregate tok/s at B sequences is what B rows a step give
at most; `step / 1 row` is what a draft of B-1 tokens costs against a plain step.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from common import bench_parser, llama_tool, machine, model_path, print_table

from reame.native import LLAMA_COMMIT

ROWS = (1, 2, 4, 8, 16)


def batched_bench(path: Path, threads: int, prompt: int, steps: int, rows: tuple[int, ...] = ROWS
                  ) -> dict[int, float]:
    """Seconds per decode step at each row count (the text-generation phase: `steps` steps of B rows)."""
    command = [str(llama_tool("llama-batched-bench")), "-m", str(path), "-t", str(threads), "-c", "8192",
               "-b", "2048", "-ub", "512", "-npp", str(prompt), "-ntg", str(steps),
               "-npl", ",".join(map(str, rows))]
    result = subprocess.run(command, capture_output=True, text=True, timeout=3600)
    if result.returncode != 0:
        raise SystemExit(f"llama-batched-bench failed: {result.stderr[-500:]}")
    costs = {}
    for line in result.stdout.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) >= 8 and re.fullmatch(r"\d+", cells[0] or "x") and re.fullmatch(r"\d+", cells[2] or "x"):
            tg, count, t_tg = int(cells[1]), int(cells[2]), float(cells[6])
            costs[count] = t_tg / tg
    missing = [count for count in rows if count not in costs]
    if missing:
        raise SystemExit(f"llama-batched-bench printed no row for {missing}:\n{result.stdout[-1500:]}")
    return costs


def main() -> None:
    parser = bench_parser(__doc__, None, tokens=32, reps=1, tokens_help="decode steps per row count",
                          reps_help="(unused)")
    parser.add_argument("--prompt", type=int, default=128, help="prompt tokens per sequence before decoding")
    parser.add_argument("--rows", type=lambda text: tuple(int(n) for n in text.split(",")), default=ROWS,
                        help="row counts, comma-separated (default 1,2,4,8,16; 1 is always measured)")
    args = parser.parse_args()
    models = args.model or ["qwen2.5-coder-1.5b"]
    rows_asked = tuple(sorted({1, *args.rows}))  # one row is what every other count is measured against
    print(f"# The machine's ceiling: {machine()}, {args.threads} threads, llama.cpp {LLAMA_COMMIT}\n")
    for name in models:
        path = model_path(name)
        costs = batched_bench(path, args.threads, args.prompt, args.tokens, rows_asked)
        print(f"## {path.name} (prompt {args.prompt} tokens per sequence, {args.tokens} steps)\n")
        print_table(["rows a step (B)", "ms a step", "step / 1 row", "ms a row", "aggregate tok/s"],
                    [[str(rows), f"{1000 * costs[rows]:.1f}", f"{costs[rows] / costs[1]:.2f}",
                      f"{1000 * costs[rows] / rows:.1f}", f"{rows / costs[rows]:.1f}"] for rows in rows_asked])
        print()


if __name__ == "__main__":
    main()
