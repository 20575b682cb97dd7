#!/usr/bin/env python3
"""Single-stream decode and time to first token through HTTP: Reame vs llama-server.

    python bench/server.py                          # SmolLM2-135M, 2 threads
    python bench/server.py --model qwen2.5-coder-1.5b --reps 6

Both servers run side by side from the same pinned build, model and threads;
the client streams one /v1/completions request at a time (greedy, 128 tokens,
end-of-text ignored, a prompt no earlier request shares) to each in ABBA order,
so only one of them computes at a time. Decode tok/s is measured by the client between the first and the last
streamed token; TTFT from sending the request to the first token.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from common import ROOT, bench_parser, machine, model_path, print_table, read_stream, server_command, summary

from reame.native import LLAMA_COMMIT

PROMPT = "Write a long story about a lighthouse keeper who finds a message in a bottle."


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_ready(port: int, process: subprocess.Popen, timeout_s: float = 120, poll_s: float = 0.3) -> None:
    """Return at the first 200 of /health, asked every `poll_s`; stop the benchmark if the server dies or
    never gets there."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            sys.exit(f"a server exited early with {process.returncode}")
        try:
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            connection.request("GET", "/health")
            if connection.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(poll_s)
    sys.exit("a server did not become ready")


class ServerGroup:
    """Servers started, restarted and stopped together (what they keep on disk outlives a restart).
    `launch[name](port)` gives the command and the environment that serve on `port`."""

    def __init__(self, launch: dict[str, Callable[[int], tuple[list[str], dict[str, str]]]]) -> None:
        self.launch = launch
        self.running: dict[str, tuple[subprocess.Popen, int]] = {}

    def start(self) -> None:
        for name, how in self.launch.items():
            port = free_port()
            command, env = how(port)
            self.running[name] = (subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL,
                                                   stderr=subprocess.DEVNULL), port)
        for process, port in self.running.values():
            wait_ready(port, process, timeout_s=300)

    def stop(self) -> None:
        """Every server asked to stop; one still running a minute later is killed (a benchmark goes on
        and prints what it measured: llama-server once outlived SIGTERM after a four-at-a-time pass)."""
        for process, _ in self.running.values():
            process.terminate()
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                print(f"a server (pid {process.pid}) did not stop within 60 s of SIGTERM: killed", file=sys.stderr)
                process.kill()
                process.wait()
        self.running = {}

    def port(self, name: str) -> int:
        return self.running[name][1]


def stream_once(port: int, n_tokens: int, tag: str) -> tuple[float, float]:
    """(time to first token in s, decode tok/s) for one streamed greedy completion.

    `tag` starts the prompt, so no request shares a prefix with an earlier one: both servers
    reuse cached prompts (slot reuse, cache_prompt), and that is measured elsewhere.
    """
    body = json.dumps({"prompt": f"[{tag}] {PROMPT}", "max_tokens": n_tokens, "temperature": 0,
                       "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}})
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    started = time.perf_counter()
    connection.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
    answer = read_stream(connection.getresponse())
    connection.close()
    return answer.first - started, answer.decode_speed


def main() -> None:
    parser = bench_parser(__doc__, "smollm2-135m", tokens=128, reps=6)
    args = parser.parse_args()
    path = str(model_path(args.model))
    ports = {"llama-server": free_port(), "reame": free_port()}
    commands = {name: server_command(name, path, ports[name], args.threads, 2048) for name in ports}
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    servers = {name: subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
               for name, command in commands.items()}
    results: dict[str, dict[str, list[float]]] = {name: {"ttft": [], "tps": []} for name in servers}
    try:
        for name in servers:
            wait_ready(ports[name], servers[name])
            stream_once(ports[name], 16, f"warm-up {name}")
        for rep in range(args.reps):
            order = ("llama-server", "reame") if rep % 2 == 0 else ("reame", "llama-server")
            for name in order:
                ttft, tps = stream_once(ports[name], args.tokens, f"{rep}")
                results[name]["ttft"].append(ttft * 1000)
                results[name]["tps"].append(tps)
    finally:
        for process in servers.values():
            process.terminate()
            process.wait(30)
    ratios = [r / l for l, r in zip(results["llama-server"]["tps"], results["reame"]["tps"])]
    print(f"machine: {machine()} · llama.cpp {LLAMA_COMMIT} · {Path(path).name} · reps {args.reps}, ABBA\n")
    print_table(["server", "decode tok/s (HTTP stream)", "TTFT ms"], [
        [name, summary(results[name]["tps"]), summary(results[name]["ttft"])] for name in results])
    print(f"\nreame / llama-server decode (paired): {statistics.median(ratios):.3f} "
          f"({min(ratios):.2f}–{max(ratios):.2f})")


if __name__ == "__main__":
    main()
