#!/usr/bin/env python3
"""Two models behind one server, asked in turn: Reame's model pool vs llama-server's router (same build).

    python bench/models.py                                  # SmolLM2-135M and Qwen2.5-Coder-0.5B
    python bench/models.py --first smollm2-135m --second gemma3-270m --reps 6

Each server serves both models and is asked, --reps times each, alternately: the first model, then the
second (a chat of one short question, a different one every time so that no KV is reused, greedy,
--tokens tokens). Two limits:

- one model at a time (Reame `server.max_loaded_models = 1`, llama-server `--models-max 1`): every
  request unloads the other model and loads its own;
- both loaded (2 and `--models-max 2`): the first two requests load them (not counted), then nothing is
  swapped: the time of the answer alone.

One server runs at a time; each round runs the four (two servers × two limits) in a rotated order.
Printed per server and limit: the median request time per model (min–max), its swap cost (one at a time
minus both loaded), and the most memory the server held (the resident size of its process and children:
llama-server's router runs each model in a child process).
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from common import ROOT, bench_parser, llama_tool, machine, model_path, print_table, rotated, summary
from prefix_cache import Server, post
from server import free_port

from reame.native import LLAMA_COMMIT

QUESTIONS = ("Name a colour of the rainbow.", "Name a planet.", "Name a fruit.", "Name a month.",
             "Name an animal.", "Name a river.", "Name a metal.", "Name a tree.")


def tree_rss(pid: int) -> int:
    """Resident bytes of `pid` and every process below it."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry.name))
    total, pending = 0, [pid]
    while pending:
        current = pending.pop()
        try:
            status = Path(f"/proc/{current}/status").read_text()
        except OSError:
            continue
        total += next((int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmRSS:")), 0)
        pending += children.get(current, [])
    return total


def start(kind: str, limit: int, first: Path, second: Path, threads: int, work: Path) -> tuple[Server, list[str]]:
    """A server of both models with at most `limit` loaded, and the names its requests use for them."""
    port = free_port()
    if kind == "reame":
        env = dict(os.environ, PYTHONPATH=str(ROOT), REAME_SERVER_MODELS=f"second={second}",
                   REAME_SERVER_MAX_LOADED_MODELS=str(limit), REAME_CACHE_DIR=str(work / f"kv-{limit}"))
        command = [sys.executable, "-m", "reame", "run", str(first), "--serve", "--port", str(port), "--threads",
                   str(threads), "--ctx", "2048", "--parallel", "1", "-q"]
        return Server(command, port, env), [first.stem, "second"]
    directory = work / "models"
    directory.mkdir(exist_ok=True)
    for path in (first, second):
        if not (directory / path.name).exists():
            (directory / path.name).symlink_to(path)
    command = [str(llama_tool("llama-server")), "--models-dir", str(directory), "--models-max", str(limit),
               "-t", str(threads), "-c", "2048", "-np", "1", "--port", str(port), "--host", "127.0.0.1"]
    return Server(command, port, dict(os.environ)), [first.stem, second.stem]


def ask(port: int, model: str, question: str, tokens: int) -> float:
    started = time.perf_counter()
    post(port, "/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": question}],
                                        "max_tokens": tokens, "temperature": 0})
    return time.perf_counter() - started


def run(kind: str, limit: int, args, first: Path, second: Path, work: Path,
        turn: int) -> tuple[list[list[float]], int]:
    """Request times per model (the first two, which load both, left out when both stay loaded) and the
    most memory the server held."""
    server, names = start(kind, limit, first, second, args.threads, work)
    times: list[list[float]] = [[], []]
    peak = 0
    with server:
        for index in range(2 * args.reps + (2 if limit == 2 else 0)):
            which = index % 2
            seconds = ask(server.port, names[which], f"{QUESTIONS[(index + turn) % len(QUESTIONS)]} ({kind} "
                          f"{turn}.{index})", args.tokens)
            peak = max(peak, tree_rss(server.process.pid))
            if limit == 1 or index >= 2:
                times[which].append(seconds)
    return times, peak


def main() -> None:
    parser = bench_parser(__doc__, None, 16, 4, reps_help="requests per model per server and limit")
    parser.add_argument("--first", default="smollm2-135m")
    parser.add_argument("--second", default="qwen2.5-coder-0.5b")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    first, second = model_path(args.first), model_path(args.second)
    print(f"machine: {machine()}; llama.cpp {LLAMA_COMMIT}; {first.name} and {second.name}, {args.threads} threads, "
          f"{args.tokens} tokens per answer, {args.reps} requests per model × {args.rounds} rounds")
    results: dict[tuple[str, int], tuple[list[list[float]], int]] = {}
    with tempfile.TemporaryDirectory(prefix="reame-models-") as temporary:
        work = Path(temporary)
        configs = (("reame", 1), ("llama-server", 1), ("reame", 2), ("llama-server", 2))
        for turn in range(args.rounds):
            for kind, limit in rotated(configs, turn):
                times, peak = run(kind, limit, args, first, second, work, turn)
                kept = results.setdefault((kind, limit), ([[], []], 0))
                for which in (0, 1):
                    kept[0][which].extend(times[which])
                results[(kind, limit)] = (kept[0], max(kept[1], peak))
    rows = []
    for kind in ("reame", "llama-server"):
        for limit in (1, 2):
            times, peak = results[(kind, limit)]
            swap = [] if limit == 2 else [
                statistics.median(times[which]) - statistics.median(results[(kind, 2)][0][which]) for which in (0, 1)]
            rows.append([kind, "one at a time" if limit == 1 else "both loaded", summary(times[0], 2),
                         summary(times[1], 2), " / ".join(f"{value:.2f}" for value in swap) or "–",
                         f"{peak / 2**20:.0f}"])
    print_table(["server", "models loaded", f"{first.stem} s", f"{second.stem} s", "swap cost s", "peak MiB"], rows)
    one = [statistics.median(results[(kind, 1)][0][0] + results[(kind, 1)][0][1]) for kind in ("reame", "llama-server")]
    print(f"one at a time, a request's median: Reame {one[0]:.2f} s, llama-server {one[1]:.2f} s "
          f"(Reame / llama-server {one[0] / one[1]:.2f})")


if __name__ == "__main__":
    main()
