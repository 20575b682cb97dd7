#!/usr/bin/env python3
"""Concurrent streaming clients: aggregate tok/s and TTFT, Reame vs llama-server -np N vs serialized.

    python bench/concurrency.py                                   # SmolLM2-135M, 1/2/4/8 clients
    python bench/concurrency.py --model qwen2.5-coder-1.5b --clients 4 --tokens 64

For each N, both servers run with N slots (same build, model, threads, total
context); N clients each stream one greedy completion of a different prompt at
once; then the same N requests go to Reame one after another ("serialized").
Only one server computes at a time. Aggregate tok/s = all generated tokens over
the wall time from the first request to the last token.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import subprocess
import threading
import time

from common import ROOT, bench_parser, machine, model_path, print_table, server_command
from server import free_port, stream_once, wait_ready

from reame.native import LLAMA_COMMIT


def start(kind: str, path: str, slots: int, threads: int, context: int) -> tuple[subprocess.Popen, int]:
    port = free_port()
    command = server_command(kind, path, port, threads, context, slots)
    process = subprocess.Popen(command, env=dict(os.environ, PYTHONPATH=str(ROOT)), stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    wait_ready(port, process)
    stream_once(port, 8, f"warm-up {kind}")
    return process, port


def concurrent(port: int, clients: int, n_tokens: int, tag: str) -> tuple[float, list[float], list[float]]:
    """(aggregate tok/s, TTFTs in ms, each stream's decode tok/s) for `clients` simultaneous streams: where
    a request's time goes, waiting for its first token or between its tokens."""
    results: list[tuple[float, float]] = [(0.0, 0.0)] * clients
    started = time.perf_counter()

    def one(i: int) -> None:
        results[i] = stream_once(port, n_tokens, f"{tag}-{i}")

    threads = [threading.Thread(target=one, args=(i,)) for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - started
    return clients * n_tokens / wall, [ttft * 1000 for ttft, _ in results], [rate for _, rate in results]


def serialized(port: int, clients: int, n_tokens: int, tag: str) -> float:
    started = time.perf_counter()
    for i in range(clients):
        stream_once(port, n_tokens, f"{tag}-{i}")
    return clients * n_tokens / (time.perf_counter() - started)


def token_times(port: int, prompt: str, n_tokens: int) -> list[float]:
    """Arrival time of every streamed piece of one greedy completion."""
    body = json.dumps({"prompt": prompt, "max_tokens": n_tokens, "temperature": 0, "ignore_eos": True,
                       "stream": True})
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    connection.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
    times = [time.perf_counter() for line in connection.getresponse()
             if line.startswith(b"data: {") and b'"text":""' not in line]
    connection.close()
    return times


def long_prompt_stall(port: int, streams: int, n_tokens: int, long_tokens: int, tag: str) -> tuple[float, float]:
    """Running streams' median and worst inter-token gap (ms) while a long prompt arrives mid-stream."""
    gaps: list[float] = []
    worst = [0.0]

    def running(i: int) -> None:
        times = token_times(port, f"[{tag}-{i}] Tell me a long story.", n_tokens)
        steps = [b - a for a, b in zip(times, times[1:])]
        gaps.extend(steps)
        worst[0] = max(worst[0], max(steps, default=0.0))

    threads = [threading.Thread(target=running, args=(i,)) for i in range(streams)]
    for thread in threads:
        thread.start()
    time.sleep(1.0)
    document = " ".join(f"Line {i}: the quick brown fox jumps over the lazy dog." for i in range(long_tokens // 14))
    token_times(port, f"[{tag}-long] {document}\nSummarise the text above.", 4)
    for thread in threads:
        thread.join()
    return statistics.median(gaps) * 1000, worst[0] * 1000


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(share * (len(ordered) - 1))))]


def main() -> None:
    parser = bench_parser(__doc__, "smollm2-135m", tokens=64, reps=2)
    parser.add_argument("--clients", type=int, action="append")
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--long-prompt", type=int, default=0, metavar="TOKENS",
                        help="instead: 2 running streams, and a prompt of about TOKENS arriving mid-stream")
    args = parser.parse_args()
    path = str(model_path(args.model))
    if args.long_prompt:
        stall_table(args, path)
        return
    rows = []
    for clients in args.clients or [1, 2, 4, 8]:
        servers = {kind: start(kind, path, clients, args.threads, args.context) for kind in ("reame", "llama-server")}
        try:
            measured: dict[str, list[float]] = {"reame": [], "llama-server": [], "serialized": []}
            ttfts: dict[str, list[float]] = {"reame": [], "llama-server": []}
            decode_rates: dict[str, list[float]] = {"reame": [], "llama-server": []}
            for rep in range(args.reps):
                order = ("reame", "llama-server") if rep % 2 == 0 else ("llama-server", "reame")
                for kind in order:
                    rate, ttft, decode = concurrent(servers[kind][1], clients, args.tokens, f"{rep}-{kind}")
                    measured[kind].append(rate)
                    ttfts[kind] += ttft
                    decode_rates[kind] += decode
                measured["serialized"].append(serialized(servers["reame"][1], clients, args.tokens, f"s{rep}"))
        finally:
            for process, _ in servers.values():
                process.terminate()
                process.wait(30)
        reame, llama, alone = (statistics.median(measured[k]) for k in ("reame", "llama-server", "serialized"))
        rows.append([str(clients), f"{alone:.1f}", f"{llama:.1f}", f"{reame:.1f}", f"{reame / alone:.2f}",
                     f"{reame / llama:.2f}",
                     f"{percentile(ttfts['reame'], 0.5):.0f} / {percentile(ttfts['reame'], 0.95):.0f}",
                     f"{percentile(ttfts['llama-server'], 0.5):.0f} / {percentile(ttfts['llama-server'], 0.95):.0f}",
                     f"{statistics.median(decode_rates['reame']):.1f}",
                     f"{statistics.median(decode_rates['llama-server']):.1f}"])
    print(f"machine: {machine()} · llama.cpp {LLAMA_COMMIT} · {args.model} · {args.tokens} tokens per client, "
          f"context {args.context}, reps {args.reps}\n")
    print_table(["clients", "serialized tok/s", "llama-server -np N tok/s", "reame tok/s", "reame / serialized",
                 "reame / llama-server", "reame TTFT p50/p95 ms", "llama-server TTFT p50/p95 ms",
                 "reame decode tok/s per stream (p50)", "llama-server decode tok/s per stream (p50)"], rows)


def stall_table(args: argparse.Namespace, path: str) -> None:
    rows = []
    for kind in ("reame", "llama-server"):
        process, port = start(kind, path, 3, args.threads, args.context)
        try:
            for rep in range(args.reps):
                median_gap, worst_gap = long_prompt_stall(port, 2, args.tokens, args.long_prompt, f"{rep}-{kind}")
                rows.append([kind, str(rep), f"{median_gap:.0f}", f"{worst_gap:.0f}"])
        finally:
            process.terminate()
            process.wait(30)
    print(f"machine: {machine()} · llama.cpp {LLAMA_COMMIT} · {args.model} · 2 streams of {args.tokens} tokens, "
          f"a ~{args.long_prompt}-token prompt arriving after 1 s\n")
    print_table(["server", "rep", "median inter-token ms", "worst inter-token ms"], rows)


if __name__ == "__main__":
    main()
