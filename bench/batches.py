#!/usr/bin/env python3
"""A nightly triage job as an OpenAI batch, against the same requests sent to llama-server.

    python bench/batches.py                                  # Qwen2.5-Coder-1.5B, 200 tickets, 4 slots
    python bench/batches.py --model smollm2-135m --lines 60

The job: support tickets (bench/data/workload/tickets.jsonl, each made distinct by an order number, so no
answer is repeated) under one long system prompt with a JSON schema, greedy. Reame gets them as one batch
(`files.create`, `batches.create`, polled until completed); llama-server from the same pin gets the same
requests one at a time and `--slots` at a time (its best is the figure), with `--cache-reuse 256` and its
unified KV. Both servers are fresh, the same threads, context and slots. Then an interactive chat's time to
first token is measured on the idle Reame server and again while the batch runs (each a new question, so
no cache answers it): what stepping aside buys a person.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from common import ROOT, bench_parser, machine, metric, model_path, print_table, read_stream, server_command
from server import ServerGroup
from workload import DATA, TRIAGE_SCHEMA, chat, send

import http.client

# Reame's counters read after the batch (reame_<name>_total): where its time went.
WHERE_TIME_WENT = ("prompt_tokens", "prompt_tokens_cached", "prompt_seconds", "generated_tokens", "generation_seconds",
                   "spec_decode_drafted", "spec_decode_accepted")
INTERACTIVE = "In two sentences, what should a support team do first when an outage ticket arrives?"


def triage_bodies(lines: int) -> list[dict]:
    system = (DATA / "triage_system.txt").read_text()
    rows = [json.loads(line) for line in (DATA / "tickets.jsonl").read_text().splitlines()]
    schema = {"type": "json_schema", "json_schema": {"name": "triage", "schema": TRIAGE_SCHEMA, "strict": True}}
    return [chat(system, f'Ticket: "{rows[n % len(rows)]["text"]}" (order #{1000 + n})', 64, response_format=schema)
            for n in range(lines)]


def call(port: int, method: str, path: str, body: bytes | None = None, content_type: str = "application/json"
         ) -> dict:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    connection.request(method, path, body=body, headers={"Content-Type": content_type} if body else {})
    response = connection.getresponse()
    data = response.read()
    connection.close()
    if response.status != 200:
        raise SystemExit(f"{method} {path} answered {response.status}: {data[:300]!r}")
    return json.loads(data)


def first_token_seconds(port: int, tag: str) -> float:
    """An interactive chat's time to its first token (a question no earlier one asked)."""
    body = json.dumps({"messages": [{"role": "user", "content": f"[{tag}] {INTERACTIVE}"}], "max_tokens": 8,
                       "temperature": 0, "stream": True, "stream_options": {"include_usage": True}})
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    started = time.perf_counter()
    connection.request("POST", "/v1/chat/completions", body=body, headers={"Content-Type": "application/json"})
    answer = read_stream(connection.getresponse())
    connection.close()
    return answer.first - started


def run_batch(port: int, bodies: list[dict], interactive: int) -> tuple[float, list[float], list[float], dict]:
    """(seconds from batch creation to completion, interactive TTFTs idle, during the batch, the batch)."""
    idle = [first_token_seconds(port, f"idle {n}") for n in range(interactive)]
    lines = "".join(json.dumps({"custom_id": f"t{n}", "method": "POST", "url": "/v1/chat/completions",
                                "body": body}) + "\n" for n, body in enumerate(bodies)).encode()
    boundary = uuid.uuid4().hex
    form = (f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n--{boundary}\r\n'
            f'Content-Disposition: form-data; name="file"; filename="tickets.jsonl"\r\n\r\n').encode() + lines + \
        f"\r\n--{boundary}--\r\n".encode()
    uploaded = call(port, "POST", "/v1/files", form, f"multipart/form-data; boundary={boundary}")
    started = time.perf_counter()
    batch = call(port, "POST", "/v1/batches", json.dumps({"input_file_id": uploaded["id"],
                                                          "endpoint": "/v1/chat/completions"}).encode())
    during = []
    while batch["status"] not in ("completed", "failed"):
        if len(during) < interactive and batch["request_counts"]["completed"] >= 2:
            during.append(first_token_seconds(port, f"busy {len(during)}"))
        else:
            time.sleep(0.2)
        batch = call(port, "GET", f"/v1/batches/{batch['id']}")
    return time.perf_counter() - started, idle, during, batch


def main() -> None:
    parser = bench_parser(__doc__, "qwen2.5-coder-1.5b", tokens=64, reps=3, reps_help="interactive chats timed "
                          "idle and during the batch")
    parser.add_argument("--lines", type=int, default=200)
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=1, help="Reame's server.batch_concurrency")
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--no-peer", action="store_true", help="Reame only: no llama-server runs (no speed ratio)")
    args = parser.parse_args()
    path = str(model_path(args.model))
    bodies = triage_bodies(args.lines)
    state = tempfile.mkdtemp(prefix="reame-bench-batches-")

    def reame(port: int) -> tuple[list[str], dict[str, str]]:
        env = dict(os.environ, PYTHONPATH=str(ROOT), REAME_SERVER_BATCH_DIR=f"{state}/batches",
                   REAME_CACHE_DIR=f"{state}/kv", REAME_SPECULATIVE_PALIMPSEST_DIR=f"{state}/pal",
                   REAME_SERVER_BATCH_CONCURRENCY=str(args.concurrency))
        return server_command("reame", path, port, args.threads, args.context, args.slots), env

    def llama_server(port: int) -> tuple[list[str], dict[str, str]]:
        return server_command("llama-server", path, port, args.threads, args.context, args.slots) + \
            ["-kvu", "--cache-reuse", "256"], dict(os.environ)

    servers = ServerGroup({"reame": reame})
    servers.start()
    try:
        reame_seconds, idle, during, batch = run_batch(servers.port("reame"), bodies, args.reps)
        spent = {name: metric(servers.port("reame"), f"reame_{name}_total") for name in WHERE_TIME_WENT}
    finally:
        servers.stop()
    peer = {}
    for concurrency in sorted({1, args.slots}) if not args.no_peer else ():
        servers = ServerGroup({"llama-server": llama_server})
        servers.start()
        try:
            port = servers.port("llama-server")
            started = time.perf_counter()
            with ThreadPoolExecutor(concurrency) as pool:
                list(pool.map(lambda body: send(port, "/v1/chat/completions", body), bodies))
            peer[concurrency] = time.perf_counter() - started
        finally:
            servers.stop()
    best = min(peer, key=lambda concurrency: peer[concurrency]) if peer else 0
    print(f"machine: {machine()} · {Path(path).name} · {args.threads} threads · {args.slots} slots · "
          f"{args.lines} tickets · Reame batch_concurrency {args.concurrency}, speculative.exact "
          f"{os.environ['REAME_SPECULATIVE_EXACT']} (REAME_SPECULATIVE_EXACT; bench/common.py sets 0 unless given)\n")
    counts = batch["request_counts"]
    rows = [["Reame batch", f"{reame_seconds:.1f}", f"{counts['completed']}/{counts['total']}",
             f"{peer[best] / reame_seconds:.2f}x" if peer else "not run"]]
    rows += [[f"llama-server, {concurrency} at a time", f"{seconds:.1f}", "", ""] for concurrency, seconds in
             sorted(peer.items())]
    print_table(["job", "seconds", "answered", "speed vs llama-server's best"], rows)
    per_ticket = {name: value / args.lines for name, value in spent.items()}
    print(f"\nReame per ticket (the interactive chats included): prompt {per_ticket['prompt_tokens']:.0f} tokens, "
          f"{per_ticket['prompt_tokens_cached']:.0f} of them cached, {per_ticket['prompt_seconds']:.2f} s to the "
          f"first token; {per_ticket['generated_tokens']:.1f} tokens in {per_ticket['generation_seconds']:.2f} s "
          f"after it; drafts {per_ticket['spec_decode_accepted']:.1f} accepted of "
          f"{per_ticket['spec_decode_drafted']:.1f}")
    if during:
        print(f"\ninteractive chat's first token: idle {statistics.median(idle):.2f} s, during the batch "
              f"{statistics.median(during):.2f} s ({statistics.median(during) / statistics.median(idle):.2f}x)")


if __name__ == "__main__":
    main()
