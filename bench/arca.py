#!/usr/bin/env python3
"""ARCA: redis-benchmark against ARCA and a real redis-server, and an exact-answer hit over HTTP vs inference.

    python bench/arca.py                                  # Qwen2.5-Coder-1.5B for the HTTP part
    python bench/arca.py --model smollm2-135m --requests 5000

1. `redis-benchmark -t ping,set,get -P 16 -q` against `reame arca` and against
   redis-server from Debian (append-only file, fsync every second: what ARCA
   does), in turn, `--reps` times each; requests per second, median.
2. A Reame server with `arca.remote` on a fresh ARCA: a greedy chat request
   (a real inference: the answer cache misses), then the same request
   `--hits` times (served from the store): time to the whole answer over
   HTTP, p50 and p99; beside it, inferences of the same kind (new questions,
   median).
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from common import ROOT, bench_parser, machine, model_path, print_table, server_command
from server import free_port, wait_ready

from reame.native import LLAMA_COMMIT

TESTS = ("PING_INLINE", "PING_MBULK", "SET", "GET")


def start_arca(directory: Path, port: int) -> subprocess.Popen:
    process = subprocess.Popen([sys.executable, "-m", "reame", "arca", "--port", str(port), "--dir", str(directory),
                                "--max-mb", "0", "-q"], env=dict(os.environ, PYTHONPATH=str(ROOT)),
                               stderr=subprocess.DEVNULL)
    wait_pong(port)
    return process


def start_redis(directory: Path, port: int) -> subprocess.Popen:
    process = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                "--appendonly", "yes", "--appendfsync", "everysec", "--dir", str(directory)],
                               stdout=subprocess.DEVNULL)
    wait_pong(port)
    return process


def wait_pong(port: int, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        probe = subprocess.run(["redis-cli", "-p", str(port), "PING"], capture_output=True, text=True)
        if probe.stdout.strip() == "PONG":
            return
        time.sleep(0.1)
    sys.exit(f"nothing answers PING on port {port}")


def benchmark(port: int, requests: int) -> dict[str, float]:
    result = subprocess.run(["redis-benchmark", "-p", str(port), "-t", "ping,set,get", "-P", "16", "-q",
                             "-n", str(requests)], capture_output=True, text=True, timeout=600)
    found = dict(re.findall(r"([A-Z_]+): ([\d.]+) requests per second", result.stdout.replace("\r", "\n")))
    return {test: float(found[test]) for test in TESTS}


def chat(base: str, question: str) -> float:
    body = json.dumps({"messages": [{"role": "user", "content": question}], "max_tokens": 64,
                       "temperature": 0}).encode()
    started = time.perf_counter()
    request = urllib.request.Request(base + "/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as response:
        response.read()
    return time.perf_counter() - started


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))]


def main() -> None:
    parser = bench_parser(__doc__, "qwen2.5-coder-1.5b", tokens=64, reps=3, tokens_help="(fixed: 64)",
                          reps_help="redis-benchmark runs per server")
    parser.add_argument("--requests", type=int, default=200000, help="redis-benchmark requests per test")
    parser.add_argument("--hits", type=int, default=200, help="identical requests served from the store")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="reame-bench-arca-") as scratch:
        work = Path(scratch)
        arca_port, redis_port = free_port(), free_port()
        arca, redis = start_arca(work / "arca", arca_port), start_redis(work, redis_port)
        results: dict[str, list[dict[str, float]]] = {"ARCA": [], "redis-server": []}
        try:
            for rep in range(args.reps):
                order = [("ARCA", arca_port), ("redis-server", redis_port)]
                for name, port in order if rep % 2 == 0 else reversed(order):
                    results[name].append(benchmark(port, args.requests))
        finally:
            for process in (arca, redis):
                process.terminate()
                process.wait(30)

        store_port = free_port()
        store = start_arca(work / "answers", store_port)
        path = str(model_path(args.model))
        http_port = free_port()
        env = dict(os.environ, PYTHONPATH=str(ROOT), REAME_ARCA_REMOTE=f"redis://127.0.0.1:{store_port}/0",
                   REAME_CACHE_DIR=str(work / "kv"), REAME_SPECULATIVE_PALIMPSEST="0",
                   REAME_CACHE_ANSWERS="1", REAME_CACHE_ANSWERS_DISK_MB="0", REAME_CACHE_ANSWERS_RAM_MB="0")
        node = subprocess.Popen(server_command("reame", path, http_port, args.threads, 4096), env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_ready(http_port, node, timeout_s=300)
            base = f"http://127.0.0.1:{http_port}"
            question = "Explain in three sentences what a hash table is."
            miss = chat(base, question)
            hits = [chat(base, question) for _ in range(args.hits)]
            inferences = [chat(base, f"Explain in three sentences what a {thing} is.")
                          for thing in ("binary heap", "linked list", "bloom filter")]
        finally:
            node.terminate()
            node.wait(60)
            store.terminate()
            store.wait(30)

    print(f"# ARCA: {machine()}, llama.cpp {LLAMA_COMMIT}\n")
    print(f"## redis-benchmark -t ping,set,get -P 16 -n {args.requests}, median of {args.reps} (requests/s)\n")
    rows = []
    for test in TESTS:
        ours = statistics.median(r[test] for r in results["ARCA"])
        theirs = statistics.median(r[test] for r in results["redis-server"])
        rows.append([test, f"{ours:,.0f}", f"{theirs:,.0f}", f"{ours / theirs:.2f}"])
    print_table(["test", "ARCA", "redis-server (AOF everysec)", "ARCA / redis"], rows)
    print(f"\n## An exact-answer hit over HTTP vs inference ({args.model}, {args.threads} threads, "
          f"64 tokens greedy)\n")
    print_table(["request", "p50 ms", "p99 ms"],
                [[f"hit from the store (×{len(hits)})", f"{1000 * percentile(hits, 0.5):.2f}",
                  f"{1000 * percentile(hits, 0.99):.2f}"],
                 ["the same request, first (inference, a miss)", f"{1000 * miss:.0f}", ""],
                 ["new questions (inference, ×3)", f"{1000 * statistics.median(inferences):.0f}", ""]])


if __name__ == "__main__":
    main()
