#!/usr/bin/env python3
"""Sampling inside the decode graph vs on the CPU afterwards, per sampler chain.

    python bench/sampling.py                              # SmolLM2-135M
    python bench/sampling.py --model qwen2.5-coder-1.5b --reps 4

llama.cpp can attach a sampler chain to a sequence so the draw happens inside
the decode graph ("backend sampling"); otherwise the chain runs over the
step's logits afterwards. Two contexts over the same model decode the same
greedy or sampled 128 tokens one step at a time on this thread, alternating
(ABBA), so both see the same machine; the table gives milliseconds per token,
decode and sampling together, and the paired ratio in-graph / CPU.
"""

from __future__ import annotations

import statistics
import time

from common import bench_parser, machine, model_path, print_table, summary

from reame.model.backend import ModelSettings
from reame.model.llama import LlamaBackend
from reame.engine.request import SamplingParams
from reame.model.sampling import chain_steps
from reame.native import LLAMA_COMMIT

PROMPT = "Write a long story about a lighthouse keeper who finds a message in a bottle."
CHAINS = {
    "greedy": SamplingParams(temperature=0),
    "greedy, ignore_eos": SamplingParams(temperature=0, ignore_eos=True),
    "temperature 0.7": SamplingParams(temperature=0.7, seed=1),
    "temperature 0.7, top_p 0.9": SamplingParams(temperature=0.7, top_p=0.9, seed=1),
}


def ms_per_token(backend: LlamaBackend, params: SamplingParams, in_graph: bool, n_tokens: int) -> float:
    """Prefill the prompt, then decode `n_tokens` one step at a time with the chain for `params`."""
    prompt = backend.tokenize(PROMPT)
    backend.seq_rm(0)
    sampler = backend.new_sampler(chain_steps(params, backend.eog_tokens()), 0 if in_graph else None)
    try:
        backend.decode(prompt, list(range(len(prompt))), [0] * len(prompt), [False] * (len(prompt) - 1) + [True])
        token, position = backend.sample(sampler, len(prompt) - 1), len(prompt)
        started = time.perf_counter()
        for _ in range(n_tokens):
            backend.decode([token], [position], [0], [True])
            token, position = backend.sample(sampler, 0), position + 1
        return (time.perf_counter() - started) / n_tokens * 1000
    finally:
        backend.free_sampler(sampler)


def main() -> None:
    parser = bench_parser(__doc__, "smollm2-135m", tokens=128, reps=6)
    args = parser.parse_args()
    settings = ModelSettings(str(model_path(args.model)), n_ctx=2048, n_threads=args.threads)
    rows = []
    with LlamaBackend(settings) as graph, LlamaBackend(settings) as cpu:
        sides = {"graph": (graph, True), "cpu": (cpu, False)}
        for name, params in CHAINS.items():
            times: dict[str, list[float]] = {side: [] for side in sides}
            for side, (backend, in_graph) in sides.items():
                ms_per_token(backend, params, in_graph, 8)  # warm up
            for rep in range(args.reps):
                for side in (("graph", "cpu") if rep % 2 == 0 else ("cpu", "graph")):
                    backend, in_graph = sides[side]
                    times[side].append(ms_per_token(backend, params, in_graph, args.tokens))
            ratios = [g / c for g, c in zip(times["graph"], times["cpu"])]
            rows.append([name, summary(times["graph"]), summary(times["cpu"]),
                         f"{statistics.median(ratios):.3f} ({min(ratios):.2f}–{max(ratios):.2f})"])
    print(f"machine: {machine()} · llama.cpp {LLAMA_COMMIT} · {args.model} · reps {args.reps}, ABBA\n")
    print_table(["chain", "in-graph ms/token", "CPU ms/token", "in-graph / CPU time (paired)"], rows)


if __name__ == "__main__":
    main()
