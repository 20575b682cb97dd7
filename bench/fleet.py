"""The fleet: a document one node read, asked of another node that shares its store (arca.remote).

Two Reame nodes, each with its own cache directories as two machines would have, share a real
redis-server started here (then a 3-node Redis Cluster made with redis-cli --cluster create). For each
repetition, a new document of --tokens tokens: node A reads it (cold) and is asked again (warm: its own
slot or cache); node B is first asked, as its cold baseline, the same second question about another new
document of the same size that no node has read, then that question about A's document (its first time
on it: the KV is fetched from the store) — so B's KV already holds other work, as a node's does (with
--empty-node the order alternates, and half of B's first times find its KV holding nothing else).
Printed: times to first token, B's first time over its cold time and over A's warm time, and whether
B's greedy answer equals A's.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

from common import ROOT, machine, model_path, print_table, server_command, summary
from prefix_cache import Server, exact_document, first_token, free_port, question
from redis_servers import redis_cluster, redis_server

from reame.native import LLAMA_COMMIT

PUBLISH_WAIT_S = 120.0


def counter(port: int, name: str) -> float:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    connection.request("GET", "/stats")
    samples = json.loads(connection.getresponse().read())["samples"]
    connection.close()
    return sum(sample["value"] for sample in samples if sample["name"] == name)


def wait_published(port: int, count: int) -> None:
    """Until node `port` has published `count` snapshots (its publisher works in the background)."""
    deadline = time.monotonic() + PUBLISH_WAIT_S
    while counter(port, "reame_kv_remote_published_total") < count:
        if time.monotonic() > deadline:
            raise SystemExit("node A did not publish its snapshot in time (is the store full?)")
        time.sleep(0.05)


@contextmanager
def store(kind: str, work: Path) -> Iterator[str]:
    """arca.remote for a redis-server or a 3-node cluster started for the run."""
    if kind == "cluster":
        with redis_cluster(work / "cluster") as ports:
            yield "redis+cluster://" + ",".join(f"127.0.0.1:{port}" for port in ports)
    else:
        with redis_server(work / "redis") as (port, _):
            yield f"redis://127.0.0.1:{port}/0"


def node(path: str, args: argparse.Namespace, remote: str, name: str, work: Path) -> Server:
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(ROOT), REAME_ARCA_REMOTE=remote, REAME_SERVER_NODE_NAME=name,
               REAME_CACHE_DIR=str(work / name / "kv"), REAME_CACHE_ANSWERS_DIR=str(work / name / "answers"),
               REAME_SPECULATIVE_PALIMPSEST_DIR=str(work / name / "palimpsest"))
    return Server(server_command("reame", path, port, args.threads, args.ctx), port, env)


def run_store(kind: str, path: str, args: argparse.Namespace, work: Path) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {"A cold": [], "A warm": [], "B first": [], "B cold": [], "same": []}
    with ExitStack() as stack:
        remote = stack.enter_context(store(kind, work))
        first = stack.enter_context(node(path, args, remote, "node-a", work))
        second = stack.enter_context(node(path, args, remote, "node-b", work))
        base = exact_document(first.port, args.tokens)
        for rep in range(args.reps):
            read = f"Document {2 * rep} of the fleet.\n" + base
            unread = f"Document {2 * rep + 1} of the fleet.\n" + base
            times["A cold"].append(first_token(first.port, read + question(11, 10))[0])
            wait_published(first.port, rep + 1)
            warm, warm_text = first_token(first.port, read + question(23, 20))
            times["A warm"].append(warm)
            cases = [("B cold", unread), ("B first", read)]
            for case, document in cases[::-1] if args.empty_node and rep % 2 else cases:
                seconds, text = first_token(second.port, document + question(23, 20))
                times[case].append(seconds)
                if case == "B first":
                    times["same"].append(float(text == warm_text))
            print(f"  {kind} rep {rep + 1}: " + ", ".join(f"{case} {values[-1]:.2f} s" for case, values in
                                                          times.items() if case != "same"), flush=True)
        hits = counter(second.port, "reame_kv_remote_hits_total")
        if hits < args.reps:
            raise SystemExit(f"node B restored {hits:g} of {args.reps} documents from the store")
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--tokens", type=int, default=2000, help="tokens of each document")
    parser.add_argument("--reps", type=int, default=3, help="documents per store")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--ctx", type=int, default=4096)
    parser.add_argument("--store", action="append", choices=("redis-server", "cluster"))
    parser.add_argument("--empty-node", action="store_true",
                        help="alternate the order of B's two questions (B's first time then finds its KV empty "
                             "every other repetition), as this benchmark did before it measured a busy node")
    args = parser.parse_args()
    path = str(model_path(args.model))
    print(f"machine: {machine()} · llama.cpp {LLAMA_COMMIT} · {Path(path).name} · {args.threads} threads · "
          f"documents of {args.tokens} tokens · {args.reps} per store\n")
    rows = []
    with tempfile.TemporaryDirectory(prefix="reame-fleet-") as scratch:
        for kind in args.store or ["redis-server", "cluster"]:
            times = run_store(kind, path, args, Path(scratch) / kind)
            ratios_cold = [b / c for b, c in zip(times["B first"], times["B cold"])]
            ratios_warm = [b / a for b, a in zip(times["B first"], times["A warm"])]
            rows.append([kind, summary(times["A cold"], 2), summary(times["A warm"], 2), summary(times["B first"], 2),
                         summary(times["B cold"], 2), f"{statistics.median(ratios_cold):.3f} "
                         f"({min(ratios_cold):.3f}–{max(ratios_cold):.3f})",
                         f"{statistics.median(ratios_warm):.2f} ({min(ratios_warm):.2f}–{max(ratios_warm):.2f})",
                         f"{int(sum(times['same']))}/{len(times['same'])}"])
    print()
    print_table(["store", "A cold TTFT s", "A warm TTFT s", "B first TTFT s (from the store)", "B cold TTFT s",
                 "B first / B cold", "B first / A warm", "B's answer = A's"], rows)


if __name__ == "__main__":
    main()
