#!/usr/bin/env python3
"""Portable vs native libllama: single-stream greedy decode, alternating processes.

    python bench/portable.py                     # SmolLM2-135M and Qwen2.5-Coder-1.5B
    python bench/portable.py --model smollm2-135m --reps 6

The portable build (what dist/reame.pyz carries) picks a CPU variant at run
time; the native one is compiled for this CPU. Each measurement is a fresh
process (REAME_LIBLLAMA selects the build), in ABBA order.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys

from common import bench_parser, machine, model_path, print_table, summary

from reame import native

PROMPT = "Write a long story about a lighthouse keeper."


def worker(model: str, threads: int, n_tokens: int) -> None:
    from reame.engine import Engine, GenerationRequest, SamplingParams
    from reame.model.backend import ModelSettings
    from reame.model.llama import LlamaBackend
    params = SamplingParams(temperature=0, max_tokens=n_tokens + 1, ignore_eos=True)
    with LlamaBackend(ModelSettings(model, n_ctx=n_tokens + 64, n_threads=threads)) as backend, \
            Engine(backend) as engine:
        engine.generate(GenerationRequest(PROMPT, SamplingParams(temperature=0, max_tokens=8)))  # warm up
        print(engine.generate(GenerationRequest(PROMPT, params)).finish.usage.decode_tokens_per_second)


def measure(lib_dir: str, model: str, threads: int, n_tokens: int) -> float:
    env = dict(os.environ, REAME_LIBLLAMA=lib_dir)
    command = [sys.executable, __file__, "--worker", model, "--threads", str(threads), "--tokens", str(n_tokens)]
    return float(subprocess.run(command, env=env, capture_output=True, text=True, check=True).stdout.split()[-1])


def main() -> None:
    parser = bench_parser(__doc__, None, tokens=128, reps=6)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.threads, args.tokens)
        return
    builds = {"native": native.build_dir(portable=False) / "lib", "portable": native.build_dir(portable=True) / "lib"}
    for name, directory in builds.items():
        if not directory.exists():
            flag = " --portable" if name == "portable" else ""
            sys.exit(f"no {name} build at {directory}: python build_zipapp.py --lib{flag}")
    print(f"machine: {machine()} · reps {args.reps}, ABBA, one process per measurement\n")
    rows = []
    for name in args.model or ["smollm2-135m", "qwen2.5-coder-1.5b"]:
        path = str(model_path(name))
        runs: dict[str, list[float]] = {"native": [], "portable": []}
        for rep in range(args.reps):
            order = ("native", "portable") if rep % 2 == 0 else ("portable", "native")
            for build in order:
                runs[build].append(measure(str(builds[build]), path, args.threads, args.tokens))
        ratios = [p / n for n, p in zip(runs["native"], runs["portable"])]
        rows.append([name, f"tg{args.tokens}", summary(runs["native"]), summary(runs["portable"]),
                     f"{statistics.median(ratios):.3f} ({min(ratios):.2f}–{max(ratios):.2f})"])
    print_table(["model", "test", "native tok/s", "portable tok/s", "portable / native (paired)"], rows)


if __name__ == "__main__":
    main()
