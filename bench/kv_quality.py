#!/usr/bin/env python3
"""What a q8_0 KV cache costs against f16: next-token agreement, KL divergence, decode speed.

    python bench/kv_quality.py                         # Qwen2.5-Coder-1.5B
    python bench/kv_quality.py --model smollm2-135m

One text (prose and code, about 1,500 tokens) is fed to two contexts of the
same model, one with an f16 KV cache and one with q8_0, in chunks, keeping the
logits of every position. Printed: how often the two agree on the most likely
next token, the mean and 99th-percentile KL(f16 || q8_0) of the next-token
distributions, and greedy decode speed after a 1,000-token prompt with each
KV type (alternating, in one process). Needs numpy.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from pathlib import Path

import numpy as np
from common import bench_parser, machine, model_path, print_table

from reame.engine import Engine, GenerationRequest, SamplingParams
from reame.model.backend import ModelSettings
from reame.model.llama import LlamaBackend
from reame.native import LLAMA_COMMIT

CHUNK = 128
TEXT = (Path(__file__).read_text() + "\n" + (Path(__file__).parent.parent / "docs" / "cache.md").read_text())


def log_softmax_rows(backend: LlamaBackend, count: int) -> np.ndarray:
    rows = np.stack([np.frombuffer(backend.logits(i), dtype=np.float32) for i in range(count)])
    rows = rows - rows.max(axis=1, keepdims=True)
    return rows - np.log(np.exp(rows).sum(axis=1, keepdims=True))


def agreement(reference: ModelSettings, other: ModelSettings, n_tokens: int) -> tuple[float, float, float, int]:
    """(top-1 agreement, mean KL(reference || other), p99 KL, positions) of two contexts' next-token
    distributions over one text (another KV type, or another file of the same model)."""
    shape = dict(n_ctx=n_tokens + 64, n_batch=CHUNK, n_ubatch=CHUNK)
    contexts = [LlamaBackend(dataclasses.replace(settings, **shape)) for settings in (reference, other)]
    try:
        tokens = contexts[0].tokenize(TEXT)[:n_tokens]
        same, divergences = 0, []
        for start in range(0, len(tokens), CHUNK):
            chunk = tokens[start:start + CHUNK]
            rows = []
            for backend in contexts:
                backend.decode(chunk, list(range(start, start + len(chunk))), [0] * len(chunk), [True] * len(chunk))
                rows.append(log_softmax_rows(backend, len(chunk)))
            p, q = rows
            same += int((p.argmax(axis=1) == q.argmax(axis=1)).sum())
            divergences += list((np.exp(p) * (p - q)).sum(axis=1))
        return same / len(tokens), float(np.mean(divergences)), float(np.percentile(divergences, 99)), len(tokens)
    finally:
        for backend in contexts:
            backend.close()


def decode_speed(path: str, threads: int, kv: str, prompt: list[int], n_tokens: int) -> float:
    settings = ModelSettings(path, n_ctx=len(prompt) + n_tokens + 64, n_threads=threads, kv_type=kv)
    with LlamaBackend(settings) as backend, Engine(backend) as engine:
        result = engine.generate(GenerationRequest(prompt, SamplingParams(temperature=0, max_tokens=n_tokens,
                                                                          ignore_eos=True)))
    return result.finish.usage.decode_tokens_per_second


def main() -> None:
    parser = bench_parser(__doc__, "qwen2.5-coder-1.5b", tokens=1536, reps=3, tokens_help="positions compared",
                          reps_help="decode-speed runs per KV type")
    args = parser.parse_args()
    path = str(model_path(args.model))
    top1, mean_kl, p99_kl, positions = agreement(ModelSettings(path, n_threads=args.threads, kv_type="f16"),
                                                 ModelSettings(path, n_threads=args.threads, kv_type="q8_0"),
                                                 args.tokens)
    with LlamaBackend(ModelSettings(path, n_ctx=2048, n_threads=args.threads)) as backend:
        prompt = backend.tokenize(TEXT)[:1000]
    speeds: dict[str, list[float]] = {"f16": [], "q8_0": []}
    started = time.perf_counter()
    for rep in range(args.reps):
        for kv in (("f16", "q8_0") if rep % 2 == 0 else ("q8_0", "f16")):
            speeds[kv].append(decode_speed(path, args.threads, kv, prompt, 64))
    print(f"machine: {machine()} · llama.cpp {LLAMA_COMMIT} · {Path(path).name} · {args.threads} threads · "
          f"{time.perf_counter() - started:.0f} s of decoding\n")
    print_table(["positions", "top-1 agreement", "mean KL(f16||q8_0)", "p99 KL"],
                [[str(positions), f"{top1:.4f}", f"{mean_kl:.5f}", f"{p99_kl:.5f}"]])
    print()
    print_table(["KV type", "decode tok/s after 1,000 tokens (median of runs)"],
                [[kv, f"{statistics.median(values):.2f} ({min(values):.2f}–{max(values):.2f})"]
                 for kv, values in speeds.items()])


if __name__ == "__main__":
    main()
