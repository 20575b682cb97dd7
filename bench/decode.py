#!/usr/bin/env python3
"""Single-stream greedy decode: Reame's engine vs llama-bench tg, same build, model, threads.

    python bench/decode.py                      # SmolLM2-135M and Qwen2.5-Coder-1.5B, 2 threads
    python bench/decode.py --model smollm2-135m --reps 5

Runs A (llama-bench -p 0 -n N) and B (Reame: N tokens, greedy, end-of-text ignored)
alternately in ABBA order, so both see the same machine state; prints the median and spread
of each, and the median of the per-pair ratios B/A (robust to the machine's
speed drifting during the run). Needs `python build_zipapp.py --lib --bench-tools` first.
"""

from __future__ import annotations

import json
import statistics
import subprocess

from common import bench_parser, llama_tool, machine, model_path, print_table, summary

from reame.engine import Engine, GenerationRequest, SamplingParams
from reame.model.backend import ModelSettings
from reame.model.llama import LlamaBackend
from reame.native import LLAMA_COMMIT

PROMPT = "Write a long story about a lighthouse keeper."


def llama_bench_tg(path: str, threads: int, n_tokens: int) -> float:
    command = [str(llama_tool("llama-bench")), "-m", path, "-p", "0", "-n", str(n_tokens), "-t", str(threads),
               "-r", "1", "-o", "json"]
    result = subprocess.run(command, capture_output=True, text=True, check=True)
    return float(json.loads(result.stdout)[0]["avg_ts"])


def reame_decode(engine: Engine, n_tokens: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=n_tokens + 1, ignore_eos=True)
    result = engine.generate(GenerationRequest(PROMPT, params))
    return result.finish.usage.decode_tokens_per_second  # n_tokens decode steps after the first token


def bench_model(name: str, threads: int, n_tokens: int, reps: int) -> list[str]:
    path = model_path(name)
    # The context llama-bench gives tg: room for the generated tokens (our prompt is a dozen tokens).
    settings = ModelSettings(str(path), n_ctx=n_tokens + 64, n_threads=threads)
    llama_runs, reame_runs = [], []
    with LlamaBackend(settings) as backend, Engine(backend) as engine:
        reame_decode(engine, 16)  # warm up (llama-bench warms up too)
        for rep in range(reps):
            # ABBA order: neither side always runs right after the other.
            if rep % 2 == 0:
                llama_runs.append(llama_bench_tg(str(path), threads, n_tokens))
                reame_runs.append(reame_decode(engine, n_tokens))
            else:
                reame_runs.append(reame_decode(engine, n_tokens))
                llama_runs.append(llama_bench_tg(str(path), threads, n_tokens))
    ratios = [b / a for a, b in zip(llama_runs, reame_runs)]
    return [name, str(threads), f"tg{n_tokens}", summary(llama_runs), summary(reame_runs),
            f"{statistics.median(ratios):.3f} ({min(ratios):.2f}–{max(ratios):.2f})"]


def main() -> None:
    parser = bench_parser(__doc__, None, tokens=128, reps=5)
    args = parser.parse_args()
    models = args.model or ["smollm2-135m", "qwen2.5-coder-1.5b"]
    print(f"machine: {machine()} · llama.cpp {LLAMA_COMMIT} · reps {args.reps}, alternating\n")
    rows = [bench_model(name, args.threads, args.tokens, args.reps) for name in models]
    print_table(["model", "threads", "test", "llama-bench tok/s", "reame tok/s", "reame / llama-bench (paired)"], rows)


if __name__ == "__main__":
    main()
