#!/usr/bin/env python3
"""Time to first token with a shared document prefix: cold, warm from RAM, warm from disk, vs llama-server.

    python bench/prefix_cache.py                                   # Qwen2.5-Coder-1.5B, 1000 and 2000 tokens
    python bench/prefix_cache.py --model smollm2-135m --prefix 1000

For each prefix length a document of exactly that many tokens is followed by
a different short question in every request (streamed /v1/completions,
greedy, TTFT = request sent to first token). One server runs at a time:

- reame: cold (empty cache directory); the same process again (its slot
  still holds the document); from the RAM tier (after an unrelated request
  took the slot); a new process on the same directory (disk tier; the file
  is in the OS page cache, as on a server that wrote it recently); and, when
  this host lets us drop the page cache, a new process reading the disk cold.
- llama-server (same pinned build, model, threads, context): cold; the same
  process again (cache_prompt); a new process after `/slots/0?action=save`,
  restoring with `?action=restore` first (its best equivalent across a
  restart; the restore time is counted in its TTFT).

Also printed: bytes per token of the snapshot files for f16 and q8_0 KV.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import ROOT, machine, model_path, print_table, server_command
from server import free_port, wait_ready

from reame.native import LLAMA_COMMIT

SENTENCE = ("Section {i}: the {name} service keeps {n} replicas, answers within {ms} ms at the 99th percentile, "
            "and pages the on-call engineer when its error budget of {pct}% is spent. ")
NAMES = ["billing", "search", "ingest", "auth", "export", "mailer", "scheduler", "gateway"]


def document_text(n_words: int) -> str:
    return "".join(SENTENCE.format(i=i, name=NAMES[i % len(NAMES)], n=2 + i % 5, ms=40 + 7 * i, pct=i % 9 + 1)
                   for i in range(n_words // 25 + 1))


def question(k: int) -> str:
    return f"\n\nQuestion {k}: which service has the highest latency in section {k}?\nAnswer:"


def post(port: int, path: str, body: dict, timeout_s: float = 600) -> dict:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    connection.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
    response = connection.getresponse()
    data = response.read()
    connection.close()
    if response.status != 200:
        sys.exit(f"POST {path} answered {response.status}: {data[:300]!r}")
    return json.loads(data) if data else {}


def first_token_s(port: int, prompt: str) -> float:
    """Seconds from sending a streamed greedy completion to its first token."""
    body = json.dumps({"prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True, "stream": True})
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    started = time.perf_counter()
    connection.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
    first = 0.0
    for raw in connection.getresponse():
        line = raw.strip()
        if not first and line.startswith(b"data: {") and json.loads(line[6:])["choices"][0].get("text"):
            first = time.perf_counter() - started
    connection.close()
    return first


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


def measure_reame(path: str, args: argparse.Namespace, document: str, work: Path) -> dict[str, float]:
    cache_dir = work / "kv"
    shutil.rmtree(cache_dir, ignore_errors=True)
    times: dict[str, float] = {}
    with reame_server(path, args, cache_dir) as server:
        times["cold"] = first_token_s(server.port, document + question(1))
        times["same process (slot)"] = first_token_s(server.port, document + question(2))
        first_token_s(server.port, "An unrelated request that takes the only slot.")
        times["RAM tier"] = first_token_s(server.port, document + question(3))
    with reame_server(path, args, cache_dir) as server:
        times["new process, disk (page cache)"] = first_token_s(server.port, document + question(4))
    if drop_page_cache():
        with reame_server(path, args, cache_dir) as server:
            drop_page_cache()
            times["new process, disk (cold read)"] = first_token_s(server.port, document + question(5))
    return times


def measure_llama_server(path: str, args: argparse.Namespace, document: str, work: Path) -> dict[str, float]:
    slot_dir = work / "slots"
    slot_dir.mkdir(exist_ok=True)
    times: dict[str, float] = {}
    with llama_server(path, args, slot_dir) as server:
        times["cold"] = first_token_s(server.port, document + question(1))
        times["same process (slot)"] = first_token_s(server.port, document + question(2))
        post(server.port, "/slots/0?action=save", {"filename": "document.bin"})
    with llama_server(path, args, slot_dir) as server:
        started = time.perf_counter()
        post(server.port, "/slots/0?action=restore", {"filename": "document.bin"})
        restore_s = time.perf_counter() - started
        times["new process, slot restore"] = restore_s + first_token_s(server.port, document + question(4))
    return times


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
    parser.add_argument("--prefix", type=int, nargs="+", default=[1000, 2000])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--ctx", type=int, default=4096)
    args = parser.parse_args()
    path = str(model_path(args.model))
    with tempfile.TemporaryDirectory(prefix="reame-bench-") as scratch:
        work = Path(scratch)
        with reame_server(path, args, work / "tokenizer-only") as server:
            documents = {n: exact_document(server.port, n) for n in args.prefix}
        rows = []
        for n, document in documents.items():
            reame_times = measure_reame(path, args, document, work)
            llama_times = measure_llama_server(path, args, document, work)
            cold = reame_times["cold"]
            for name, seconds in reame_times.items():
                rows.append([str(n), "reame", name, f"{seconds:.3f}", f"{cold / seconds:.0f}x"])
            for name, seconds in llama_times.items():
                rows.append([str(n), "llama-server", name, f"{seconds:.3f}",
                             f"{llama_times['cold'] / seconds:.0f}x"])
        sizes = {kv: bytes_per_token(path, args, documents[args.prefix[0]], args.prefix[0], work, kv)
                 for kv in ("f16", "q8_0")}
    print(f"machine: {machine()} · llama.cpp {LLAMA_COMMIT} · {Path(path).name} · {args.threads} threads\n")
    print_table(["prefix tokens", "server", "case", "TTFT s", "vs its cold"], rows)
    print()
    print_table(["KV type", "bytes/token on disk", "state bytes/token", "file/state"],
                [[kv, f"{disk:,.0f}", f"{raw:,.0f}", f"{disk / raw:.3f}"] for kv, (disk, raw) in sizes.items()])


if __name__ == "__main__":
    main()
