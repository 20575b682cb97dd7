#!/usr/bin/env python3
"""Time to first token with a shared document prefix: cold, warm from RAM, warm from disk, vs llama-server.

    python bench/prefix_cache.py                                   # Qwen2.5-Coder-1.5B, 2000 and 3900 tokens
    python bench/prefix_cache.py --model smollm2-135m --prefix 1000

For each prefix length a document of exactly that many tokens is followed by
a different short question in every request (streamed /v1/completions,
greedy, TTFT = request sent to first token). One server computes at a time:

- reame: cold (`--cold-pairs` requests; every one but the last starts with
  its own line, "Run k.", so neither server has any of it cached, and the
  last is the plain document the warm cases restore); the same process again
  (its slot still holds the document; `--reps` times); from the RAM tier
  (after an unrelated request took the slot; twice); a new process on the
  same directory (disk tier; the file is in the OS page cache, as on a server
  that wrote it recently; `--restarts` new processes, one request each); and,
  when this host lets us drop the page cache, two new processes reading the
  disk cold.
- llama-server (same pinned build, model, threads, context): cold (the same
  prompts); the same process again (cache_prompt); a new process after
  `/slots/0?action=save`, restoring with `?action=restore` first (its best
  equivalent across a restart; the restore time is counted in its TTFT).

llama-server stays up throughout, and every Reame request is paired with a
llama-server request asked just before or after it, one computing at a time
(cold with its cold one on the same prompt, warm with its warm same process):
each ratio compares requests made in the same minute, and the ratio printed is
the median of the pairs' ratios, their range after it (on a noisy host one step
costs up to a fifth more or less than the next). Each server goes first in half
of the pairs: the second request of a pair runs ~5% slower here, in the wake of
the first (its threads still spinning, caches cold).
Every warm request prefills the same number of tokens (QUESTIONS): the row count
of a step moves its cost by up to a third on Q4_K_M files here.

Each prefix length starts Reame on a fresh cache directory, so a cold run never
finds an earlier run's snapshots. Each server's first question is asked again at the
end, warm: its greedy answer must be the cold one ("same answer").

Also printed: where one warm request's time goes (a trace in this process,
after the servers: tokenize and prefix-cache lookup, each decode step with its
rows and context length, the first token event), and bytes per token of the
snapshot files for f16 and q8_0 KV.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import ROOT, machine, model_path, print_table, server_command, summary
from server import free_port, wait_ready

from reame.native import LLAMA_COMMIT

SENTENCE = ("Section {i}: the {name} service keeps {n} replicas, answers within {ms} ms at the 99th percentile, "
            "and pages the on-call engineer when its error budget of {pct}% is spent. ")
NAMES = ["billing", "search", "ingest", "auth", "export", "mailer", "scheduler", "gateway"]


def document_text(n_words: int) -> str:
    return "".join(SENTENCE.format(i=i, name=NAMES[i % len(NAMES)], n=2 + i % 5, ms=40 + 7 * i, pct=i % 9 + 1)
                   for i in range(n_words // 25 + 1))


def question(number: int, section: int) -> str:
    return f"\n\nQuestion {number}: which service has the highest latency in section {section}?\nAnswer:"


COLD_QUESTION = question(1, 10)
# The warm questions: number and section both two-digit, the number's first digit never 1 (the cold
# question's) nor the previous question's of the same server (they are drawn in pairs, one per server),
# so every warm request, whatever it restores (its slot, the RAM tier, the disk), shares exactly the
# document and "Question " with it and prefills the same number of tokens: one row more or less moves a
# step's cost by up to a third at 16 rows on Q4_K_M files here. 80 numbers × 8 sections, all distinct.
QUESTIONS = [question(10 * (2 + i % 8) + (i // 8) % 10, 20 + 10 * (i // 80)) for i in range(640)]
RAM_TIER_PAIRS = 2  # warm pairs from the RAM tier, each after an unrelated request took the slot
COLD_READ_PAIRS = 2  # new processes reading the disk after the page cache is dropped


def post(port: int, path: str, body: dict, timeout_s: float = 600) -> dict:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    connection.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
    response = connection.getresponse()
    data = response.read()
    connection.close()
    if response.status != 200:
        sys.exit(f"POST {path} answered {response.status}: {data[:300]!r}")
    return json.loads(data) if data else {}


ANSWER_TOKENS = 8


def first_token(port: int, prompt: str) -> tuple[float, str]:
    """Seconds from sending a streamed greedy completion to its first token, and its whole text."""
    body = json.dumps({"prompt": prompt, "max_tokens": ANSWER_TOKENS, "temperature": 0, "ignore_eos": True,
                       "stream": True})
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    started = time.perf_counter()
    connection.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
    first, pieces = 0.0, []
    for raw in connection.getresponse():
        line = raw.strip()
        if not line.startswith(b"data: {"):
            continue
        text = json.loads(line[6:])["choices"][0].get("text") or ""
        if text and not first:
            first = time.perf_counter() - started
        pieces.append(text)
    connection.close()
    return first, "".join(pieces)


def first_token_s(port: int, prompt: str) -> float:
    return first_token(port, prompt)[0]


class Server:
    """One server process at a time, stopped on exit."""

    def __init__(self, command: list[str], port: int, env: dict[str, str]) -> None:
        self.port = port
        self.process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_ready(port, self.process, timeout_s=300)

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.process.terminate()
        self.process.wait(60)


def reame_server(path: str, args: argparse.Namespace, cache_dir: Path, kv_type: str = "f16") -> Server:
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(ROOT), REAME_CACHE_DIR=str(cache_dir))
    return Server(server_command("reame", path, port, args.threads, args.ctx) + ["--kv-type", kv_type], port, env)


def llama_server(path: str, args: argparse.Namespace, slot_dir: Path) -> Server:
    port = free_port()
    return Server(server_command("llama-server", path, port, args.threads, args.ctx) +
                  ["--slot-save-path", str(slot_dir)], port, dict(os.environ))


def even(count: int) -> int:
    """`count` rounded up to even: each server goes first in as many pairs as the other."""
    return count + count % 2


def drop_page_cache() -> bool:
    """Empty the OS page cache (root on a host that allows it); False when not permitted."""
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def exact_document(port: int, n_tokens: int) -> str:
    """A document of exactly `n_tokens` tokens (without BOS) for this model's tokenizer."""
    tokens = post(port, "/tokenize", {"content": document_text(n_tokens)})["tokens"]
    if len(tokens) < n_tokens:
        sys.exit("the generated document is too short")
    return post(port, "/detokenize", {"tokens": tokens[:n_tokens]})["content"]


def measure(path: str, args: argparse.Namespace, document: str, work: Path
            ) -> tuple[dict[str, float], dict[str, float], dict[str, list[float]], dict[str, bool]]:
    """TTFTs of every case for Reame and llama-server (medians), each case's pair ratios, and whether each
    one's warm greedy answer was its cold one. llama-server stays up throughout: every cold Reame request is
    paired with a cold llama-server request, every warm one with llama-server's warm same process, asked in the
    same minute (in turn, one computing at a time), so each ratio compares requests made under the same machine
    mood; the median of the pairs' ratios is the figure, since a step's cost drifts by a fifth from one minute
    to the next on a noisy host. Every warm request prefills the same number of tokens (QUESTIONS)."""
    cache_dir, slot_dir = work / "kv", work / "slots"
    shutil.rmtree(cache_dir, ignore_errors=True)
    slot_dir.mkdir(exist_ok=True)
    reame: dict[str, float] = {}
    llama: dict[str, float] = {}
    pairs: dict[str, list[tuple[float, float]]] = {}  # case -> (reame, llama-server warm) asked in turn
    ratios: dict[str, list[float]] = {}  # case -> each pair's reame / llama-server
    same: dict[str, bool] = {}
    questions = iter(QUESTIONS)
    cold_prompt = document + COLD_QUESTION
    with llama_server(path, args, slot_dir) as theirs:
        def paired(case: str, ours: Server, rep: int, prompts: dict[str, str] | None = None) -> dict[str, str]:
            """One Reame and one llama-server request in turn (by default each a new warm question); each goes
            first on alternate reps (the second of a pair runs ~5% slower here, in the first one's wake), so every
            case has an even count. Returns each server's answer."""
            if prompts is None:
                prompts = {name: document + next(questions) for name in ("reame", "llama-server")}
            asked = [("reame", ours), ("llama-server", theirs)][::1 if rep % 2 else -1]
            answered = {name: first_token(server.port, prompts[name]) for name, server in asked}
            pairs.setdefault(case, []).append((answered["reame"][0], answered["llama-server"][0]))
            return {name: text for name, (_, text) in answered.items()}

        with reame_server(path, args, cache_dir) as ours:
            for rep in reversed(range(even(args.cold_pairs))):
                # Each earlier pair's document starts with its own line, so neither server has any of it yet;
                # the last pair's is the plain document, the one every warm case then restores.
                prompt = (f"Run {rep}.\n" if rep else "") + cold_prompt
                answers = paired("cold", ours, rep, {"reame": prompt, "llama-server": prompt})
            for rep in range(even(args.reps)):
                paired("same process (slot)", ours, rep)
            same["llama-server"] = first_token(theirs.port, cold_prompt)[1] == answers["llama-server"]
            for rep in range(RAM_TIER_PAIRS):
                first_token_s(ours.port, "An unrelated request that takes the only slot.")
                paired("RAM tier", ours, rep)
        for restart in range(even(args.restarts)):  # one request per new process, each paired
            with reame_server(path, args, cache_dir) as ours:
                paired("new process, disk (page cache)", ours, restart)
                if restart == 0:
                    same["reame"] = first_token(ours.port, cold_prompt)[1] == answers["reame"]
        for rep in range(COLD_READ_PAIRS if drop_page_cache() else 0):
            with reame_server(path, args, cache_dir) as ours:
                drop_page_cache()
                paired("new process, disk (cold read)", ours, rep)
        post(theirs.port, "/slots/0?action=save", {"filename": "document.bin"})
    for case, measured in pairs.items():
        reame[case] = statistics.median(mine for mine, _ in measured)
        peer_case = case if case in ("cold", "same process (slot)") else f"warm beside: {case}"
        llama[peer_case] = statistics.median(peer for _, peer in measured)
        ratios[case] = [mine / peer for mine, peer in measured]
    with llama_server(path, args, slot_dir) as server:
        started = time.perf_counter()
        post(server.port, "/slots/0?action=restore", {"filename": "document.bin"})
        restore_s = time.perf_counter() - started
        llama["new process, slot restore"] = restore_s + first_token_s(server.port, document + next(questions))
    return reame, llama, ratios, same


def trace_warm_request(path: str, args: argparse.Namespace, document: str) -> list[str]:
    """Where one warm request's time goes: the document is prefilled once, then a new question is timed
    phase by phase through the engine (the server adds its HTTP parsing and the event's write)."""
    from reame.engine import Engine, GenerationRequest, SamplingParams
    from reame.model.backend import ModelSettings
    from reame.model.llama import LlamaBackend

    backend = LlamaBackend(ModelSettings(path, n_ctx=args.ctx, n_threads=args.threads, n_seq_max=4))
    steps: list[str] = []
    decode = backend.decode

    def traced(tokens, positions, seq_ids, outputs):
        started = time.perf_counter()
        status = decode(tokens, positions, seq_ids, outputs)
        steps.append(f"decode step: {len(tokens)} rows at context {positions[-1] + 1}: "
                     f"{1000 * (time.perf_counter() - started):.1f} ms")
        return status

    backend.decode = traced
    params = SamplingParams(temperature=0, max_tokens=1)
    try:
        with Engine(backend) as engine:
            engine.generate(GenerationRequest(document + COLD_QUESTION, params))
            steps.clear()
            started = time.perf_counter()
            handle = engine.submit(GenerationRequest(document + QUESTIONS[0], params))
            submitted = time.perf_counter()
            next(handle.events())
            first = time.perf_counter()
            for _ in handle.events():
                pass
    finally:
        backend.close()
    return [f"tokenize, validate and look up the prefix cache (caller's thread): "
            f"{1000 * (submitted - started):.1f} ms", *steps,
            f"submission to the first token event: {1000 * (first - submitted):.1f} ms"]


def bytes_per_token(path: str, args: argparse.Namespace, document: str, n_tokens: int, work: Path,
                    kv_type: str) -> tuple[float, float]:
    """(file bytes per token, raw state bytes per token) of the snapshot a prompt leaves."""
    cache_dir = work / f"kv-{kv_type}"
    shutil.rmtree(cache_dir, ignore_errors=True)
    with reame_server(path, args, cache_dir, kv_type) as server:
        post(server.port, "/v1/warm", {"prompt": document})
    files = list(cache_dir.glob("*.kvs"))
    if len(files) != 1:
        sys.exit(f"expected one snapshot in {cache_dir}, found {len(files)}")
    data = files[0].read_bytes()
    from reame.cache.store import HEADER
    raw_size = HEADER.unpack_from(data)[6]
    tokens = HEADER.unpack_from(data)[3]
    return len(data) / tokens, raw_size / tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--prefix", type=int, nargs="+", default=[2000, 3900])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--ctx", type=int, default=4096)
    parser.add_argument("--reps", type=int, default=100, help="warm same-process requests per server, in turn "
                        "(rounded up to even)")
    parser.add_argument("--cold-pairs", type=int, default=4, help="cold requests per server, in turn "
                        "(rounded up to even)")
    parser.add_argument("--restarts", type=int, default=8, help="new Reame processes asked once each from disk "
                        "(rounded up to even)")
    args = parser.parse_args()
    # Warm questions one prefix length draws: two per pair, one for llama-server's restore.
    asked = 2 * (even(args.reps) + RAM_TIER_PAIRS + even(args.restarts) + COLD_READ_PAIRS) + 1
    if asked > len(QUESTIONS):
        parser.error(f"--reps {args.reps} and --restarts {args.restarts} need {asked} distinct warm questions; "
                     f"there are {len(QUESTIONS)} of the same length")
    path = str(model_path(args.model))
    with tempfile.TemporaryDirectory(prefix="reame-bench-") as scratch:
        work = Path(scratch)
        with reame_server(path, args, work / "tokenizer-only") as server:
            documents = {n: exact_document(server.port, n) for n in args.prefix}
        rows = []
        for n, document in documents.items():
            reame_times, llama_times, ratios, same = measure(path, args, document, work)
            # Each Reame case against llama-server's: cold against cold, every warm case against its warm
            # same process (its best in one process) asked beside it.
            for server, times in (("reame", reame_times), ("llama-server", llama_times)):
                for name, seconds in times.items():
                    rows.append([str(n), server, name, f"{seconds:.3f}", f"{times['cold'] / seconds:.0f}x",
                                 summary(ratios[name], digits=2) if server == "reame" else "",
                                 "yes" if same[server] else "NO"])
        trace = trace_warm_request(path, args, documents[args.prefix[-1]])
        sizes = {kv: bytes_per_token(path, args, documents[args.prefix[0]], args.prefix[0], work, kv)
                 for kv in ("f16", "q8_0")}
    print(f"machine: {machine()} · llama.cpp {LLAMA_COMMIT} · {Path(path).name} · {args.threads} threads\n")
    print_table(["prefix tokens", "server", "case", "TTFT s", "vs its cold", "reame / llama-server",
                 "same answer warm"], rows)
    print(f"\nOne warm request in this process ({args.prefix[-1]}-token document, a new question):")
    for line in trace:
        print(f"- {line}")
    print()
    print_table(["KV type", "bytes/token on disk", "state bytes/token", "file/state"],
                [[kv, f"{disk:,.0f}", f"{raw:,.0f}", f"{disk / raw:.3f}"] for kv, (disk, raw) in sizes.items()])


if __name__ == "__main__":
    main()
