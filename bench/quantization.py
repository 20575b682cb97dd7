#!/usr/bin/env python3
"""Which model files batch well here: quantization types against the original file, in speed and in quality.

    python bench/quantization.py                                  # Qwen2.5-Coder-1.5B Q4_K_M -> q4_0, q8_0
    python bench/quantization.py --model qwen2.5-coder-0.5b --types q4_0

Every type is a copy of the model requantized through Reame's binding (what
`reame pull MODEL --quantize TYPE` writes, kept beside the original). For the
original and each copy:

- the cost of a decode step with 1, 2, 4, 8, 16 rows (llama-batched-bench from
  the same pin, as bench/ceiling.py): what batching N users, or verifying a
  draft of N-1 tokens, can give at most with that file; and a step of 15 rows
  beside the one of 16, where Q4_K_M files have a cliff here;
- agreement with the original file's next-token distributions over ~1,500
  tokens of text (as bench/kv_quality.py): top-1 agreement, mean and 99th
  percentile KL(original || copy);
- the file's size.

A copy requantized from an already quantized file carries both roundings; a
copy quantized from the original weights would lose less. Needs numpy.
"""

from __future__ import annotations

from ceiling import batched_bench
from common import bench_parser, machine, model_path, print_table
from kv_quality import agreement

from reame.model.backend import ModelSettings
from reame.native import LLAMA_COMMIT
from reame.quantize import QUANT_TYPES, requantize

ROWS = (1, 2, 4, 8, 15, 16)


def main() -> None:
    parser = bench_parser(__doc__, "qwen2.5-coder-1.5b", tokens=1536, reps=1, tokens_help="positions compared",
                          reps_help="(unused)")
    parser.add_argument("--types", default="q4_0,q8_0", help=f"comma-separated, of {', '.join(QUANT_TYPES)}")
    parser.add_argument("--steps", type=int, default=32, help="decode steps per row count")
    args = parser.parse_args()
    original = model_path(args.model)
    files = {"original": original}
    for kind in args.types.split(","):
        files[kind] = requantize(original, kind, args.threads)
    costs = {name: batched_bench(path, args.threads, 128, args.steps, ROWS) for name, path in files.items()}
    quality = {name: agreement(ModelSettings(str(original), n_threads=args.threads),
                               ModelSettings(str(path), n_threads=args.threads), args.tokens)
               for name, path in files.items() if name != "original"}
    print(f"# Quantization types: {machine()}, {args.threads} threads, llama.cpp {LLAMA_COMMIT}, "
          f"{original.name}\n")
    base = costs["original"]
    print_table(["file", "MB", *[f"ms a step, {rows} rows" for rows in ROWS], "tok/s at 16 rows",
                 "vs original at 1 / 4 / 16 rows"],
                [[name, f"{path.stat().st_size / 1e6:,.0f}", *[f"{1000 * costs[name][rows]:.1f}" for rows in ROWS],
                  f"{16 / costs[name][16]:.1f}",
                  " / ".join(f"{base[rows] / costs[name][rows]:.2f}" for rows in (1, 4, 16))]
                 for name, path in files.items()])
    print()
    print_table(["file", "positions", "top-1 agreement with the original", "mean KL", "p99 KL"],
                [[name, str(positions), f"{top1:.4f}", f"{mean_kl:.5f}", f"{p99_kl:.5f}"]
                 for name, (top1, mean_kl, p99_kl, positions) in quality.items()])
    print(f"\nThe copies: {', '.join(str(path) for name, path in files.items() if name != 'original')}")


if __name__ == "__main__":
    main()
