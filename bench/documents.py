#!/usr/bin/env python3
"""The documents job: questions over six documents in a shuffled order, Reame vs llama-server; one node, a
restart, a second node.

    python bench/documents.py                                  # SmolLM2-135M, a 4,096-token context
    python bench/documents.py --model qwen2.5-coder-1.5b --ram-cap-mb 2048

Six sections of the Python Language Reference (bench/data/documents, ~2,000 tokens each: together three
times the context), four questions each, 24 streamed greedy chat requests in a shuffled order in which no
document is asked twice in a row, so every document is revisited after others took the KV. Each server
gets the same 4 slots and context; the job runs one request at a time, then four at a time (four clients
taking the next question in the order). TTFT = request sent to first token.

1. One node, the job cold: Reame (prefix cache on, 4 slots), Reame with its prefix cache off, and
   llama-server from the same pin with its prompt cache (`--cache-ram` 8192 MiB, idle slots saved to it)
   as it comes: 4 slots sharing one KV (`-np 4 --kv-unified`, what it picks without `-np`), then with one
   slot (`-np 1`, where every restore finds the KV empty), and `-np 1 --cache-reuse 256`. A "first"
   question is the first time a document is asked; a "revisit" any later one.
2. After a restart: the same Reame (its disk tier, the same directories) and a new llama-server
   (`-np 1`), the whole job again; every document has been read before.
3. A second node: a Reame with directories of its own sharing node 1's Redis (a redis-server started
   here; node 1 ran step 1 with it and published its snapshots), the whole job; llama-server has no such
   tier, so a new llama-server (step 2's) is its second node.
4. With --ram-cap-mb, the box's RAM capped as a small VPS has (a memory cgroup around the server): Reame
   restarted under the cap (snapshots from its disk), and llama-server under the cap with its default
   `--cache-ram`; each one's peak memory and whether the kernel killed it.

Every answer is compared with the cold answer to the same prompt: Reame with its prefix cache off and one
slot, one request at a time, so that each is computed from an empty KV (greedy). Printed per run: how many
first questions and how many revisits gave that answer, how many answers equal those of Reame's own first
run (one client), and requests that failed. A revisit computes its question in a batch of a few rows
after the restored document, a cold prompt in a batch of hundreds, and llama.cpp's attention rounds the
two differently (docs/engine.md): a revisit's answer can differ from the cold one, on either server.
Printed from Reame's /metrics after each run: restores by outcome and the cells idle slots gave up. Exact
answers off (bench/common.py); speculation off in every Reame so that a differing answer can only come from reuse.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import queue
import random
import re
import statistics
import subprocess
import tempfile
import threading
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

from common import ROOT, machine, model_path, print_table, read_stream, server_command
from redis_servers import redis_server
from server import free_port, wait_ready

from reame.native import LLAMA_COMMIT

DOCUMENTS = ROOT / "bench" / "data" / "documents"
QUESTIONS = (
    "What is this section about? Answer in one sentence.",
    "Which Python keyword or statement does it discuss most?",
    "Quote the first rule it states.",
    "Name two terms it defines.",
)
SLOTS = 4
READY_S = 600


@dataclass(frozen=True)
class Asked:
    """One question of the job as a client saw its answer (`error`: why it got none)."""

    document: int
    question: int
    first: bool  # the first time the job asks about this document
    ttft: float
    text: str
    error: str = ""


def documents(count: int, characters: int) -> list[str]:
    """`count` documents; with `characters`, each that long, the next file's text continuing a short one."""
    files = [path.read_text() for path in sorted(DOCUMENTS.glob("*.txt"))]
    if not characters:
        return files[:count]
    return [("\n\n".join(files[(i + k) % len(files)] for k in range(len(files))))[:characters] for i in range(count)]


def job_order(count: int, questions: int, rounds: int, seed: int) -> list[tuple[int, int]]:
    """Every (document, question) once, shuffled so that no document is asked twice in a row; with several
    rounds, that order again (the same questions asked again)."""
    rng = random.Random(seed)
    pairs = [(document, question) for document in range(count) for question in range(questions)]
    while count > 1:
        rng.shuffle(pairs)
        if all(a[0] != b[0] for a, b in zip(pairs, pairs[1:])):
            break
    return pairs * rounds


def ask(port: int, document: str, question: str, tokens: int) -> tuple[float, str, str]:
    """A streamed greedy chat request: seconds to its first token, its whole text, and an error (a status
    or an error event, or no text at all) instead of them."""
    body = json.dumps({"messages": [{"role": "user", "content": f"{document}\n\nQuestion: {question}"}],
                       "max_tokens": tokens, "temperature": 0, "stream": True})
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=READY_S)
    started = time.perf_counter()
    connection.request("POST", "/v1/chat/completions", body=body, headers={"Content-Type": "application/json"})
    response = connection.getresponse()
    if response.status != 200:
        return 0.0, "", f"HTTP {response.status}: {response.read()[:200].decode(errors='replace')}"
    answer = read_stream(response)
    connection.close()
    first = answer.first - started if answer.first else 0.0
    return first, answer.text, answer.error or ("" if first else "no text")


def run_job(port: int, texts: list[str], order: list[tuple[int, int]], clients: int, tokens: int) -> tuple[
        list[Asked], float]:
    """The job through `clients` clients, each taking the next question in the order: its answers (in the
    order's order) and its wall time."""
    todo: queue.Queue[tuple[int, tuple[int, int]]] = queue.Queue()
    for index, pair in enumerate(order):
        todo.put((index, pair))
    asked: list[Asked | None] = [None] * len(order)
    seen: set[int] = set()
    lock = threading.Lock()

    def client() -> None:
        while True:
            try:
                index, (document, question) = todo.get_nowait()
            except queue.Empty:
                return
            with lock:
                first = document not in seen
                seen.add(document)
            asked[index] = Asked(document, question, first, *ask(port, texts[document], QUESTIONS[question], tokens))
    started = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return [a for a in asked if a is not None], time.perf_counter() - started


def kv_counters(port: int) -> dict[str, float]:
    """Reame's restores by outcome and the cells its idle slots gave up, from /metrics."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    connection.request("GET", "/metrics")
    text = connection.getresponse().read().decode()
    connection.close()
    counts: dict[str, float] = {}
    for outcome, value in re.findall(r'^reame_kv_restores_total\{[^}]*outcome="(\w+)"[^}]*\} (\S+)$', text, re.M):
        counts[outcome] = counts.get(outcome, 0.0) + float(value)
    for name, value in re.findall(r'^reame_kv_(idle_cells_given_up|remote_hits|remote_fetches_shared)_total'
                                  r'\{[^}]*\} (\S+)$', text, re.M):
        counts[name] = counts.get(name, 0.0) + float(value)
    return counts


def describe_kv(counts: dict[str, float]) -> str:
    if not counts:
        return ""
    restored, no_room, rejected = (int(counts.get(k, 0)) for k in ("restored", "no_room", "rejected"))
    text = f"restores {restored + no_room + rejected}: {restored} restored, {no_room} no room, {rejected} rejected; " \
           f"{int(counts.get('idle_cells_given_up', 0))} cells given up"
    if counts.get("remote_hits"):
        text += f"; {int(counts['remote_hits'])} from the store"
    return text


class Memory:
    """A memory cgroup capping what a server may use (v2, else v1), or nothing when this host forbids it."""

    def __init__(self, limit_mb: int) -> None:
        self.limit = limit_mb << 20
        self.path: Path | None = None
        for root, limit_file in ((Path("/sys/fs/cgroup"), "memory.max"),
                                 (Path("/sys/fs/cgroup/memory"), "memory.limit_in_bytes")):
            if not (root / limit_file).exists() and not (root / "cgroup.subtree_control").exists():
                continue
            path = root / f"reame-bench-{os.getpid()}"
            try:
                path.mkdir()
                (path / limit_file).write_text(str(self.limit))
                if limit_file == "memory.max":
                    (path / "memory.swap.max").write_text("0")
            except OSError:
                continue
            self.path, self.v2 = path, limit_file == "memory.max"
            return

    def enter(self, pid: int) -> None:
        assert self.path is not None
        (self.path / "cgroup.procs").write_text(str(pid))

    def peak_mb(self) -> float:
        assert self.path is not None
        name = "memory.peak" if self.v2 else "memory.max_usage_in_bytes"
        try:
            return int((self.path / name).read_text()) / (1 << 20)
        except OSError:
            return float("nan")

    def close(self) -> None:
        if self.path is not None:
            try:
                self.path.rmdir()
            except OSError:
                pass


class Server:
    """A server process (Reame or llama-server), optionally inside a memory cgroup; stopped on exit."""

    def __init__(self, command: list[str], port: int, env: dict[str, str], memory: Memory | None = None) -> None:
        self.port = port
        self.memory = memory
        preexec = (lambda: memory.enter(os.getpid())) if memory is not None else None
        self.process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                        preexec_fn=preexec)
        wait_ready(port, self.process, timeout_s=READY_S)

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.process.terminate()
        self.process.wait(60)

    @property
    def killed(self) -> bool:
        return self.process.poll() is not None and self.process.returncode < 0


def reame_server(path: str, args: argparse.Namespace, node: Path, cache: bool = True, remote: str = "",
                 memory: Memory | None = None, slots: int = SLOTS) -> Server:
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(ROOT), REAME_CACHE_DIR=str(node / "kv"),
               REAME_CACHE_ANSWERS_DIR=str(node / "answers"), REAME_SPECULATIVE_ENABLED="false",
               REAME_SPECULATIVE_PALIMPSEST_DIR=str(node / "palimpsest"), REAME_CACHE_ENABLED=str(cache).lower(),
               REAME_ARCA_REMOTE=remote)
    return Server(server_command("reame", path, port, args.threads, args.ctx, slots), port, env, memory)


LLAMA_SERVERS = {  # label -> slots and options
    "llama-server": (SLOTS, ("--kv-unified",)),
    "llama-server -np 1": (1, ()),
    "llama-server -np 1 --cache-reuse 256": (1, ("--cache-reuse", "256")),
}


def llama_server(path: str, args: argparse.Namespace, label: str, memory: Memory | None = None) -> Server:
    port = free_port()
    slots, options = LLAMA_SERVERS[label]
    return Server(server_command("llama-server", path, port, args.threads, args.ctx, slots) + list(options),
                  port, dict(os.environ), memory)


@dataclass
class Run:
    """One run of the job on one server."""

    label: str
    clients: int
    asked: list[Asked]
    wall: float
    kv: str = ""
    note: str = ""

    def ttfts(self, first: bool) -> list[float]:
        """Times to first token of the answered first questions (or revisits)."""
        return [a.ttft for a in self.asked if a.first == first and not a.error]

    @property
    def failed(self) -> int:
        return sum(bool(a.error) for a in self.asked)


def median(values: list[float]) -> str:
    return f"{statistics.median(values):.2f}" if values else "–"


def same_answers(run: Run, cold: dict[tuple[int, int], str], first: bool) -> str:
    """How many of the run's first questions (or revisits) got the cold answer."""
    asked = [a for a in run.asked if a.first == first]
    return f"{sum(cold.get((a.document, a.question)) == a.text for a in asked if not a.error)}/{len(asked)}"


def table(runs: list[Run], cold: dict[tuple[int, int], str], own: dict[tuple[int, int], str],
          cold_first: float) -> None:
    rows = []
    for run in runs:
        firsts, revisits = run.ttfts(True), run.ttfts(False)
        own_answers = sum(own.get((a.document, a.question)) == a.text for a in run.asked if not a.error)
        rows.append([run.label, str(run.clients), median(firsts), f"{statistics.median(firsts) / cold_first:.3f}"
                     if firsts and cold_first else "–", median(revisits),
                     f"{max(revisits):.2f}" if revisits else "–", f"{run.wall:.1f}", str(run.failed),
                     same_answers(run, cold, True), same_answers(run, cold, False),
                     f"{own_answers}/{len(run.asked)}", run.kv or run.note])
    print_table(["server", "clients", "first question TTFT s (median)", "÷ cold", "revisit TTFT s (median)",
                 "revisit TTFT s (max)", "whole job s", "failed", "first = cold answer", "revisit = cold answer",
                 "= Reame's first run", "KV"], rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--ctx", type=int, default=4096)
    parser.add_argument("--tokens", type=int, default=12, help="answer tokens per question")
    parser.add_argument("--clients", type=int, action="append", help="concurrent clients (repeatable; 1 and 4)")
    parser.add_argument("--questions", type=int, default=len(QUESTIONS), help="questions per document (1-4)")
    parser.add_argument("--seed", type=int, default=7, help="the shuffle's seed")
    parser.add_argument("--documents", type=int, default=6, help="documents (1-6)")
    parser.add_argument("--characters", type=int, default=0,
                        help="each document this long (0: as the file is; longer: the next file continues it)")
    parser.add_argument("--rounds", type=int, default=1, help="ask the job's questions this many times in all")
    parser.add_argument("--ram-cap-mb", type=int, default=0, help="also run under a memory cgroup of this size")
    parser.add_argument("--skip-cache-off", action="store_true",
                        help="no run with Reame's prefix cache off and 4 slots")
    args = parser.parse_args()
    path = str(model_path(args.model))
    texts = documents(args.documents, args.characters)
    order = job_order(len(texts), min(args.questions, len(QUESTIONS)), args.rounds, args.seed)
    clients = args.clients or [1, 4]
    print(f"machine: {machine()} · llama.cpp {LLAMA_COMMIT} · {Path(path).name} · {args.threads} threads · "
          f"context {args.ctx} · {SLOTS} slots · {len(texts)} documents × {len(order) // len(texts)} questions · "
          f"{args.tokens}-token answers\n", flush=True)
    runs: list[Run] = []

    def record(label: str, server: Server, count: int, kv: bool = False, note: str = "") -> Run:
        asked, wall = run_job(server.port, texts, order, count, args.tokens)
        run = Run(label, count, asked, wall, describe_kv(kv_counters(server.port)) if kv else "", note)
        runs.append(run)
        print(f"  {label}, {count} client(s): first {median(run.ttfts(True))} s, revisits "
              f"{median(run.ttfts(False))} s, job {wall:.1f} s, {run.failed} failed "
              f"{next((a.error for a in asked if a.error), '')} {run.kv}", flush=True)
        return run

    with tempfile.TemporaryDirectory(prefix="reame-documents-") as scratch, ExitStack() as stack:
        work = Path(scratch)
        redis_port, _ = stack.enter_context(redis_server(work / "redis"))
        remote = f"redis://127.0.0.1:{redis_port}/0"
        print("1. one node, the job cold", flush=True)
        with reame_server(path, args, work / "cold", cache=False, slots=1) as server:
            cold = record("cold answers: Reame, prefix cache off, 1 slot", server, 1)
        for count in clients:
            # A fresh node per run: the first questions are cold for every server.
            if not args.skip_cache_off:
                with reame_server(path, args, work / f"off-{count}", cache=False) as server:
                    record("Reame, prefix cache off", server, count, kv=True)
            with reame_server(path, args, work / f"node-a-{count}", remote=remote if count == clients[0] else "") \
                    as server:
                record("Reame", server, count, kv=True)
            for label in LLAMA_SERVERS if count == clients[0] else list(LLAMA_SERVERS)[:2]:
                with llama_server(path, args, label) as server:
                    record(label, server, count)
        print("2. after a restart", flush=True)
        with reame_server(path, args, work / f"node-a-{clients[0]}", remote=remote) as server:
            record("Reame after a restart", server, clients[0], kv=True)
        with llama_server(path, args, "llama-server -np 1") as server:
            record("llama-server -np 1, a new process", server, clients[0])
        print("3. a second node sharing Redis", flush=True)
        with reame_server(path, args, work / "node-b", remote=remote) as server:
            record("Reame, second node", server, clients[0], kv=True)
        if args.ram_cap_mb:
            print(f"4. under a {args.ram_cap_mb} MiB memory cap", flush=True)
            memory = Memory(args.ram_cap_mb)
            if memory.path is None:
                print("  this host does not let the benchmark make a memory cgroup: skipped", flush=True)
            else:
                try:
                    for label, start in (
                            ("Reame after a restart, capped", lambda: reame_server(
                                path, args, work / f"node-a-{clients[0]}", memory=memory)),
                            ("llama-server -np 1, capped", lambda: llama_server(path, args, "llama-server -np 1",
                                                                                 memory=memory))):
                        with start() as server:
                            run = record(label, server, clients[0], kv=label.startswith("Reame"))
                            run.note = f"peak {memory.peak_mb():.0f} MiB" + (", killed" if server.killed else "")
                            run.kv = "; ".join(filter(None, [run.kv, run.note]))
                finally:
                    memory.close()

    answers = {(a.document, a.question): a.text for a in cold.asked}
    reame = next(run for run in runs if run.label == "Reame" and run.clients == clients[0])
    cold_first = statistics.median(cold.ttfts(True))
    print()
    table(runs, answers, {(a.document, a.question): a.text for a in reame.asked}, cold_first)
    print()
    for label in LLAMA_SERVERS:
        llama = next(run for run in runs if run.label == label and run.clients == clients[0])
        if not (reame.ttfts(False) and llama.ttfts(False)):
            continue  # a job without revisits (one question per document, one round)
        print(f"revisit TTFT, Reame ÷ {label} ({clients[0]} client): "
              f"{statistics.median(reame.ttfts(False)) / statistics.median(llama.ttfts(False)):.3f}")
    for label in ("Reame after a restart", "Reame, second node"):
        run = next(r for r in runs if r.label == label)
        fresh = next(r for r in runs if r.label == "llama-server -np 1, a new process")
        print(f"{label}: first questions {statistics.median(run.ttfts(True)) / cold_first:.3f}× cold; whole job "
              f"{fresh.wall / run.wall:.2f}× faster than a new llama-server")


if __name__ == "__main__":
    main()
