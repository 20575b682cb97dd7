#!/usr/bin/env python3
"""Soak: many streaming clients misbehaving against a few slots, and hostile ones; nothing may break or leak.

    python bench/soak.py                          # 64 clients (16 hostile), parallel 4, 45 s, SmolLM2-135M
    python bench/soak.py --seconds 600            # the long version
    python bench/soak.py --clients 16 --hostile 4 --seconds 10 --max-queue 8   # what CI runs

Each well-behaved client loops: it sends a completion or a chat (streamed or
not, random length) and behaves one way at random: reads it all, disconnects
after a few chunks, reads slowly, or closes before the first token. A refusal
must be an HTTP 429 or 503 with Retry-After (the client then backs off 1 s); a
connection reset without an answer is counted as a failure. Every completed
answer must be valid (JSON, or SSE frames ending with [DONE] and a finish_reason).

Each hostile client (--hostile of them) loops over issue 32's cheap attacks at
random: a max_tokens of 2^31, a 22-byte grammar asking 200,000 repetitions, a
schema nested 600 deep, 256 generations in one request, lenient framing, a
socket left idle, headers trickled a byte at a time. Each must get what the
server promises (the answer clamped, a 400, a 408 or a closed connection);
anything else is a failure.

After the clients stop, the server must come back to its baseline: no request
running, the KV cells the model holds equal to what its slots record, its
threads and open files back to what they were before, and resident memory
grown by at most --max-growth-mb beyond what the prefix cache's RAM tier reports
holding (its snapshots are kept on purpose, up to cache.ram_mb, 256 MiB by
default). The server's KV cache directory is a fresh one, so that files of
earlier runs (mapped by the RAM tier at start) are not counted as this run's.
Descriptors opened since the baseline and still open are listed by what they
point at. Exit status 0 only when every check holds.
"""

from __future__ import annotations

import http.client
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

from common import ROOT, bench_parser, machine, metric, model_path, print_table
from server import free_port, wait_ready

BEHAVIOURS = ("whole", "disconnect", "slow", "cancel")


def proc_status(pid: int) -> tuple[int, int, float]:
    """(threads, open file descriptors, resident MiB) of a process."""
    status = Path(f"/proc/{pid}/status").read_text()
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    return int(fields["Threads"]), fds, int(fields["VmRSS"].split()[0]) / 1024


def open_files(pid: int) -> Counter[str]:
    """What a process's descriptors point at (a path, socket:[inode] or the like), counted."""
    targets: Counter[str] = Counter()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            targets[os.readlink(f"/proc/{pid}/fd/{fd}")] += 1
        except OSError:  # closed meanwhile
            pass
    return targets


class Tally:
    """What the clients saw, shared by their threads."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.counts: Counter[str] = Counter()
        self.latencies: list[float] = []
        self.failures: list[str] = []

    def add(self, what: str, latency: float | None = None, failure: str = "") -> None:
        with self.lock:
            self.counts[what] += 1
            if latency is not None:
                self.latencies.append(latency)
            if failure:
                self.failures.append(failure)


def one_request(port: int, rng: random.Random, tally: Tally) -> float:
    """Send one request and behave; return how long to back off before the next."""
    chat = rng.random() < 0.5
    stream = rng.random() < 0.7
    behaviour = rng.choice(BEHAVIOURS) if stream else rng.choice(("whole", "cancel"))
    tokens = rng.randint(4, 48)
    topic = f"client request {rng.random():.6f}: "
    body = {"max_tokens": tokens, "stream": stream, "temperature": 0.8, "seed": rng.randint(0, 1000)}
    if chat:
        path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": topic + "tell a story"}]
    else:
        path, body["prompt"] = "/v1/completions", topic + "Once upon a time"
    started = time.perf_counter()
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        connection.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
        if behaviour == "cancel":
            connection.close()  # gone before the answer: the server must cancel and free the slot
            tally.add("cancelled")
            return 0.0
        response = connection.getresponse()
        if response.status in (429, 503):
            response.read()
            if not response.getheader("Retry-After"):
                tally.add("bad refusal", failure=f"{response.status} without Retry-After")
            else:
                tally.add(f"refused {response.status}")
            return 1.0
        if response.status != 200:
            tally.add("error", failure=f"HTTP {response.status}: {response.read()[:200]!r}")
            return 0.0
        if not stream:
            answer = json.loads(response.read())
            if not answer["choices"] or answer["choices"][0]["finish_reason"] not in ("stop", "length"):
                tally.add("invalid", failure=f"bad answer {answer}")
            else:
                tally.add("completed", time.perf_counter() - started)
            return 0.0
        frames, finish = 0, None
        for line in response:
            if not line.startswith(b"data: "):
                continue
            payload = line[6:].strip()
            if payload == b"[DONE]":
                break
            event = json.loads(payload)
            finish = (event["choices"][0].get("finish_reason") if event["choices"] else None) or finish
            frames += 1
            if behaviour == "slow":
                time.sleep(0.05)
            if behaviour == "disconnect" and frames >= 3:
                connection.close()
                tally.add("disconnected")
                return 0.0
        if payload != b"[DONE]" or finish not in ("stop", "length"):
            tally.add("invalid", failure=f"stream ended without [DONE] or finish ({finish})")
        else:
            tally.add("completed", time.perf_counter() - started)
    except (ConnectionResetError, BrokenPipeError, http.client.RemoteDisconnected) as error:
        tally.add("reset", failure=f"{type(error).__name__} with no HTTP answer")
    except (OSError, http.client.HTTPException, ValueError, KeyError) as error:
        tally.add("error", failure=f"{type(error).__name__}: {error}")
    finally:
        connection.close()
    return 0.0


DEEP_SCHEMA: dict = {"type": "string"}
for _ in range(600):
    DEEP_SCHEMA = {"type": "array", "items": DEEP_SCHEMA}
REFUSED_BODIES = {  # attack -> (path, body) that must get a 400
    "grammar {0,200000}": ("/v1/completions", {"prompt": "hi", "grammar": 'root ::= "a"{0,200000}'}),
    "schema 600 deep": ("/v1/completions", {"prompt": "hi", "json_schema": DEEP_SCHEMA}),
    "16 prompts x n 16": ("/v1/completions", {"prompt": ["a"] * 16, "n": 16, "max_tokens": 1}),
}
ANSWER_CAP = 96  # the soak server's server.max_answer_tokens: what a max_tokens of 2^31 is clamped to


def raw_exchange(port: int, data: bytes, pause_s: float = 0.0) -> bytes:
    """Send `data` (a byte at a time, `pause_s` apart, when given), read until the server closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        try:
            for piece in ([bytes([byte]) for byte in data] if pause_s else [data]):
                sock.sendall(piece)
                time.sleep(pause_s)
        except (ConnectionResetError, BrokenPipeError):
            pass  # cut off while sending: what it was told comes next
        reply = b""
        try:
            while chunk := sock.recv(65536):
                reply += chunk
        except (ConnectionResetError, BrokenPipeError):
            pass
        return reply


def one_attack(port: int, rng: random.Random, tally: Tally) -> float:
    """One of issue 32's cheap attacks, and whether the server answered it as it promises."""
    attack = rng.choice([*REFUSED_BODIES, "max_tokens 2^31", "lenient framing", "idle socket", "trickled headers"])
    try:
        if attack in REFUSED_BODIES:
            path, body = REFUSED_BODIES[attack]
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
            connection.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
            response = connection.getresponse()
            response.read()
            connection.close()
            held = response.status == 400 or (response.status in (429, 503) and response.getheader("Retry-After"))
        elif attack == "max_tokens 2^31":
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
            connection.request("POST", "/v1/completions", headers={"Content-Type": "application/json"},
                               body=json.dumps({"prompt": "count:", "max_tokens": 2**31, "ignore_eos": True}))
            response = connection.getresponse()
            answer = json.loads(response.read())
            connection.close()
            held = response.status in (429, 503) or answer["usage"]["completion_tokens"] <= ANSWER_CAP
        elif attack == "lenient framing":
            reply = raw_exchange(port, b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n"
                                       b"Content-Length: +16\r\n\r\n" b'{"prompt":"hi"}x')
            held = reply.startswith(b"HTTP/1.1 400") or reply.startswith(b"HTTP/1.1 503")
        elif attack == "idle socket":
            with socket.create_connection(("127.0.0.1", port), timeout=60):
                time.sleep(rng.uniform(0.5, 3.0))
            held = True
        else:
            reply = raw_exchange(port, b"GET /health HTTP/1.1\r\nHost: localhost\r\nX-Slow: " + b"z" * 60 + b"\r\n\r\n",
                                 pause_s=0.05)
            held = reply == b"" or reply.startswith((b"HTTP/1.1 408", b"HTTP/1.1 503"))
        tally.add("attack answered as promised" if held else "attack mishandled",
                  failure="" if held else f"{attack}: not answered as promised")
    except (OSError, http.client.HTTPException, ValueError, KeyError) as error:
        tally.add("attack mishandled", failure=f"{attack}: {type(error).__name__}: {error}")
    return 0.0


def client(port: int, seed: int, stop: threading.Event, tally: Tally, hostile: bool) -> None:
    rng = random.Random(seed)
    while not stop.is_set():
        backoff = one_attack(port, rng, tally) if hostile else one_request(port, rng, tally)
        if backoff:
            stop.wait(backoff)


def settle(port: int, timeout_s: float = 60) -> tuple[float, float, float]:
    """Wait until nothing runs or waits; (running, KV cells recorded, KV cells in memory)."""
    deadline = time.monotonic() + timeout_s
    while True:
        busy, waiting = metric(port, "reame_busy_slots"), metric(port, "reame_queue_depth")
        if (busy == 0 and waiting == 0) or time.monotonic() > deadline:
            return busy, metric(port, "reame_kv_tokens_recorded"), metric(port, "reame_kv_tokens_in_memory")
        time.sleep(0.2)


def back_to_baseline(pid: int, baseline: tuple[int, int, float], timeout_s: float = 30) -> tuple[int, int, float]:
    """The server's threads and open files once connection threads have wound down (or the timeout)."""
    deadline = time.monotonic() + timeout_s
    while True:
        now = proc_status(pid)
        if (now[0] <= baseline[0] and now[1] <= baseline[1]) or time.monotonic() > deadline:
            return now
        time.sleep(0.2)


def main() -> int:
    parser = bench_parser(__doc__, "smollm2-135m", 0, 1)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--hostile", type=int, default=16, help="how many of the clients attack (issue 32)")
    parser.add_argument("--parallel", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=45.0)
    parser.add_argument("--max-queue", type=int, default=32)
    parser.add_argument("--max-growth-mb", type=float, default=64.0)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    path = str(model_path(args.model))
    port = free_port()
    command = [sys.executable, "-m", "reame", "run", path, "--serve", "--port", str(port), "--threads",
               str(args.threads), "--ctx", "2048", "--parallel", str(args.parallel), "-q"]
    kv_dir = tempfile.TemporaryDirectory(prefix="reame-soak-kv-")
    env = dict(os.environ, PYTHONPATH=str(ROOT), REAME_SERVER_MAX_QUEUE=str(args.max_queue),
               REAME_CACHE_DIR=kv_dir.name,
               REAME_SERVER_REQUEST_LOGGING="false", REAME_SERVER_MAX_ANSWER_TOKENS=str(ANSWER_CAP),
               REAME_SERVER_HEADER_TIMEOUT_SECONDS="2")
    server = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_ready(port, server)
        baseline, files_before = proc_status(server.pid), open_files(server.pid)
        tally, stop = Tally(), threading.Event()
        threads = [threading.Thread(target=client, args=(port, args.seed * 1000 + i, stop, tally, i < args.hostile),
                                    daemon=True) for i in range(args.clients)]
        for thread in threads:
            thread.start()
        stop.wait(args.seconds)
        stop.set()
        for thread in threads:
            thread.join(180)
        running, recorded, in_memory = settle(port)
        after = back_to_baseline(server.pid, baseline)
        files_added = open_files(server.pid) - files_before
        ram_tier_mb = metric(port, "reame_prefix_cache_ram_bytes") / 2**20
    finally:
        server.terminate()
        server.wait(60)
        kv_dir.cleanup()
    growth_mb = after[2] - baseline[2] - ram_tier_mb
    latencies = sorted(tally.latencies)
    p50 = statistics.median(latencies) * 1000 if latencies else 0.0
    p95 = latencies[int(0.95 * (len(latencies) - 1))] * 1000 if latencies else 0.0
    checks = {
        "every refusal an HTTP 429/503 with Retry-After, no reset": tally.counts["reset"] == 0 and
        tally.counts["bad refusal"] == 0,
        "every completed answer valid": tally.counts["invalid"] == 0 and tally.counts["error"] == 0,
        "every attack answered as promised": tally.counts["attack mishandled"] == 0,
        "nothing running afterwards": running == 0,
        "KV cells in memory = recorded by the slots": in_memory == recorded,
        "threads back to baseline": after[0] <= baseline[0],
        "open files back to baseline": after[1] <= baseline[1],
        f"memory growth beyond the KV RAM tier <= {args.max_growth_mb:g} MiB": growth_mb <= args.max_growth_mb,
    }
    print(f"soak: {args.clients} clients ({args.hostile} hostile), parallel {args.parallel}, "
          f"max queue {args.max_queue}, {args.seconds:g} s, {Path(path).name}, {machine()}")
    print_table(["outcome", "count"], [[name, str(count)] for name, count in sorted(tally.counts.items())])
    print(f"\nlatency of completed answers: p50 {p50:.0f} ms, p95 {p95:.0f} ms")
    print(f"threads {baseline[0]} -> {after[0]}, open files {baseline[1]} -> {after[1]}, "
          f"RSS {baseline[2]:.0f} -> {after[2]:.0f} MiB (KV RAM tier {ram_tier_mb:.0f} MiB), "
          f"KV cells recorded {recorded:.0f} / in memory {in_memory:.0f}\n")
    print_table(["check", "holds"], [[name, "yes" if held else "NO"] for name, held in checks.items()])
    if files_added:
        print("  open since the baseline: " + ", ".join(f"{target} x{count}" for target, count in files_added.items()))
    for failure in tally.failures[:10]:
        print(f"  failure: {failure}")
    return 0 if all(checks.values()) and tally.counts["completed"] > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
