#!/usr/bin/env python3
"""The jobs our users run, on Reame and on llama-server, side by side, over two nights.

    python bench/workload.py                     # Qwen2.5-Coder-1.5B, 2 threads, every job, 1 and 4 at a time
    python bench/workload.py --model smollm2-135m --jobs triage --concurrency 1 --tickets 8

Three servers from the same pinned build, model, threads, context and slots: Reame as configured by
default (its caches in fresh directories, kept across the restart between nights), llama-server's
default, and llama-server's best setting for this work (`--cache-reuse 256 --spec-type ngram-mod`;
`-kvu` for both llama-servers so that a slot may use the whole context, as Reame's do). Every server is
restarted between the nights, as a nightly job starts its server; greedy answers throughout.

- triage: short support tickets under a long system prompt with few-shot examples (bench/data/workload/
  triage_system.txt), a JSON schema for the answer; night 1 sends the first half of the tickets, night 2
  a quarter of them again and the other half. Answers are checked against a human's labels.
- document: questions over one long handbook (handbook.md) in the system prompt; night 2 repeats half of
  night 1's questions and asks new ones. Answers are checked against accepted patterns.
- code: fill-in-the-middle completions over one file (inventory.py) with small edits between requests
  (completions.jsonl); night 2 repeats two of night 1's requests as they were. Reame takes them on
  /v1/completions with `suffix`, llama-server on /infill. An answer must be non-empty.

One at a time, the servers take turns request by request (in rotating order); 4 at a time, each server
gets the night's requests from 4 clients, servers one after the other. Per job and server: total time,
seconds per request on night 1 and on night 2 (repeated and new apart), what a repeat cost against its
first time, answers valid and right, answers the same as Reame's (JSON compared parsed: llama-server
indents it), and the ceiling: what a perfect cache
(a repeat free, every prompt token already prefilled by an earlier request free) and perfect drafts (every
answer decoded 17 tokens per step, the cost of a 17-token batch) would take on this host, from
`llama-bench -p 512,17` on the same run; shared prompt tokens are estimated from shared characters.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from common import ROOT, llama_tool, rotated, machine, model_path, print_table, server_command
from server import ServerGroup

from reame.native import LLAMA_COMMIT

DATA = Path(__file__).resolve().parent / "data" / "workload"
SERVERS = {
    "reame": None,
    "llama-server": ["-kvu"],
    "llama-server best": ["-kvu", "--cache-reuse", "256", "--spec-type", "ngram-mod"],
}
REFERENCE = "reame"
PEER = "llama-server best"
TRIAGE_SCHEMA = {
    "type": "object", "additionalProperties": False, "required": ["category", "priority", "team"],
    "properties": {
        "category": {"enum": ["bug", "billing", "account", "feature", "outage", "question"]},
        "priority": {"enum": ["urgent", "high", "medium", "low"]},
        "team": {"enum": ["web", "mobile", "api", "payments", "identity", "infra"]},
    },
}
LABELS = ("category", "priority", "team")


@dataclass(frozen=True)
class Request:
    """One request of a job, as each server family takes it."""

    key: str  # the same key on both nights: a repeat
    text: str  # what the prompt says, for the ceiling's estimate of shared tokens
    reame: tuple[str, dict]  # (path, body)
    llama: tuple[str, dict]
    check: Callable[[str], tuple[bool, int, int]]  # answer -> (valid, right, of how many)
    meaning: Callable[[str], object] = str.strip  # what two answers must share to count as the same


@dataclass
class Answer:
    text: str
    seconds: float
    prompt_tokens: int
    completion_tokens: int


@dataclass
class Night:
    requests: list[Request]
    answers: dict[str, dict[str, Answer]] = field(default_factory=dict)  # server -> key -> answer
    wall: dict[str, float] = field(default_factory=dict)  # server -> seconds for the whole night


def chat(system: str, user: str, max_tokens: int, **extra: object) -> dict:
    return {"messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
            "max_tokens": max_tokens, "temperature": 0, **extra}


def parsed(text: str) -> object:
    """A JSON answer's content, whatever its layout (llama-server's is indented, Reame's compact)."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def triage_jobs(tickets: int) -> tuple[list[Request], list[Request]]:
    system = (DATA / "triage_system.txt").read_text()
    rows = [json.loads(line) for line in (DATA / "tickets.jsonl").read_text().splitlines()][:tickets]
    schema = {"type": "json_schema", "json_schema": {"name": "triage", "schema": TRIAGE_SCHEMA, "strict": True}}

    def request(row: dict) -> Request:
        body = chat(system, f'Ticket: "{row["text"]}"', 64, response_format=schema)

        def check(text: str) -> tuple[bool, int, int]:
            try:
                answer = json.loads(text)
            except ValueError:
                return False, 0, len(LABELS)
            valid = isinstance(answer, dict) and all(
                answer.get(k) in TRIAGE_SCHEMA["properties"][k]["enum"] for k in LABELS)  # type: ignore[index]
            return valid, sum(isinstance(answer, dict) and answer.get(k) == row[k] for k in LABELS), len(LABELS)
        return Request(f"ticket {row['id']}", system + row["text"], ("/v1/chat/completions", body),
                       ("/v1/chat/completions", body), check, parsed)
    half = len(rows) // 2
    first = [request(row) for row in rows[:half]]
    return first, first[:half // 2] + [request(row) for row in rows[half:]]


def document_jobs(questions: int) -> tuple[list[Request], list[Request]]:
    system = "Answer the question from this handbook in one short sentence.\n\n" + (DATA / "handbook.md").read_text()
    rows = [json.loads(line) for line in (DATA / "questions.jsonl").read_text().splitlines()][:questions]

    def request(row: dict) -> Request:
        body = chat(system, row["q"], 48)

        def check(text: str) -> tuple[bool, int, int]:
            return bool(text.strip()), int(bool(re.search(row["accept"], text, re.I))), 1
        return Request(row["q"], system + row["q"], ("/v1/chat/completions", body), ("/v1/chat/completions", body),
                       check)
    half = len(rows) // 2
    first = [request(row) for row in rows[:half]]
    return first, first[:half // 2] + [request(row) for row in rows[half:]]


def code_jobs(steps: int) -> tuple[list[Request], list[Request]]:
    source = (DATA / "inventory.py").read_text()
    requests = []
    for number, line in enumerate((DATA / "completions.jsonl").read_text().splitlines()[:steps]):
        step = json.loads(line)
        if step["edit"]:
            source = source.replace(*step["edit"])
        cut = source.index(step["cursor_after"]) + len(step["cursor_after"])
        prefix, suffix = source[:cut] + step["insert"], source[cut:]
        reame = {"prompt": prefix, "suffix": suffix, "max_tokens": 48, "temperature": 0, "stop": ["\n\n"]}
        llama = {"input_prefix": prefix, "input_suffix": suffix, "n_predict": 48, "temperature": 0,
                 "stop": ["\n\n"], "cache_prompt": True}
        requests.append(Request(f"completion {number + 1}", prefix + suffix, ("/v1/completions", reame),
                                ("/infill", llama), lambda text: (bool(text.strip()), 0, 0)))
    half = len(requests) // 2
    return requests[:half], requests[half:] + requests[:2]


JOBS = {"triage": triage_jobs, "document": document_jobs, "code": code_jobs}


def send(port: int, path: str, body: dict) -> Answer:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=900)
    started = time.perf_counter()
    connection.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
    response = connection.getresponse()
    data = response.read()
    seconds = time.perf_counter() - started
    connection.close()
    if response.status != 200:
        raise SystemExit(f"{path} answered {response.status}: {data[:300]!r}")
    reply = json.loads(data)
    if "choices" in reply:
        choice = reply["choices"][0]
        text = choice["message"]["content"] if "message" in choice else choice["text"]
        usage = reply["usage"]
        return Answer(text or "", seconds, usage["prompt_tokens"], usage["completion_tokens"])
    return Answer(reply["content"], seconds, reply["tokens_evaluated"], reply["tokens_predicted"])  # /infill


class Servers(ServerGroup):
    """The three servers; Reame's cache directories (in `state`) outlive their restarts."""

    def __init__(self, path: str, threads: int, context: int, slots: int, state: str) -> None:
        def launch(options: list[str] | None) -> Callable[[int], tuple[list[str], dict[str, str]]]:
            def how(port: int) -> tuple[list[str], dict[str, str]]:
                command = server_command("reame" if options is None else "llama-server", path, port, threads,
                                         context, slots) + (options or [])
                env = dict(os.environ, PYTHONPATH=str(ROOT))
                if options is None:
                    env.update(REAME_CACHE_ANSWERS="1", REAME_CACHE_ANSWERS_DIR=f"{state}/answers",
                               REAME_CACHE_DIR=f"{state}/kv", REAME_SPECULATIVE_PALIMPSEST_DIR=f"{state}/pal")
                return command, env
            return how
        super().__init__({name: launch(options) for name, options in SERVERS.items()})

    def ask(self, name: str, request: Request) -> Answer:
        path, body = request.reame if name == REFERENCE else request.llama
        return send(self.port(name), path, body)


def run_night(servers: Servers, night: Night, concurrency: int, turn: int) -> None:
    names = tuple(SERVERS)
    for name in names:
        night.answers[name] = {}
    if concurrency == 1:
        for index, request in enumerate(night.requests):
            for name in rotated(names, turn + index):
                night.answers[name][request.key] = servers.ask(name, request)
        for name in names:
            night.wall[name] = sum(a.seconds for a in night.answers[name].values())
        return
    for name in rotated(names, turn):
        started = time.perf_counter()
        with ThreadPoolExecutor(concurrency) as pool:
            answers = list(pool.map(lambda request: servers.ask(name, request), night.requests))
        night.wall[name] = time.perf_counter() - started
        night.answers[name] = {request.key: answer for request, answer in zip(night.requests, answers)}


def physics(path: str, threads: int) -> tuple[float, float]:
    """(prompt tokens/s at 512, tokens/s of a 17-token batch) from llama-bench: a perfect cache's and
    perfect drafts' speeds on this host; the best of 3 repetitions, since a ceiling is the fastest this
    (shared, noisy) host went."""
    output = subprocess.run([str(llama_tool("llama-bench")), "-m", path, "-t", str(threads), "-p", "512,17",
                             "-n", "0", "-r", "3", "-o", "json"], capture_output=True, text=True, check=True).stdout
    speeds = {row["n_prompt"]: max(row["samples_ts"]) for row in json.loads(output)}
    return speeds[512], speeds[17]


def ceiling(nights: list[Night], prefill_speed: float, draft_speed: float) -> float:
    """Seconds a perfect cache and perfect drafts would take over both nights (Reame's token counts)."""
    seen: list[str] = []
    keys: set[str] = set()
    total = 0.0
    for night in nights:
        for request in night.requests:
            if request.key in keys:
                continue  # a repeat: the answer is known
            keys.add(request.key)
            answer = night.answers[REFERENCE][request.key]
            shared = max((len(os.path.commonprefix([request.text, earlier])) for earlier in seen), default=0)
            new_tokens = answer.prompt_tokens * (1 - shared / max(1, len(request.text)))
            total += new_tokens / prefill_speed + answer.completion_tokens / draft_speed
            seen.append(request.text)
    return total


def mean_seconds(night: Night, name: str, requests: list[Request]) -> float:
    return statistics.mean(night.answers[name][r.key].seconds for r in requests) if requests else 0.0


def report(job: str, concurrency: int, nights: list[Night], limit: float) -> list[list[str]]:
    first, second = nights
    repeated = [r for r in second.requests if r.key in {q.key for q in first.requests}]
    new = [r for r in second.requests if r not in repeated]
    rows = []
    totals = {name: first.wall[name] + second.wall[name] for name in SERVERS}
    for name in SERVERS:
        cost = statistics.mean(second.answers[name][r.key].seconds / first.answers[name][r.key].seconds
                               for r in repeated) if repeated else 0.0
        checks = [r.check(n.answers[name][r.key].text) for n in nights for r in n.requests]
        identical = sum(r.meaning(n.answers[name][r.key].text) == r.meaning(n.answers[REFERENCE][r.key].text)
                        for n in nights for r in n.requests)
        right = sum(c[1] for c in checks)
        of = sum(c[2] for c in checks)
        rows.append([job, str(concurrency), name, f"{totals[name]:.1f}",
                     f"{mean_seconds(first, name, first.requests):.2f}",
                     f"{mean_seconds(second, name, repeated):.2f}", f"{mean_seconds(second, name, new):.2f}",
                     f"{100 * cost:.0f}%",
                     f"{sum(c[0] for c in checks)}/{len(checks)}", f"{right}/{of}" if of else "",
                     f"{identical}/{len(checks)}", f"{totals[PEER] / totals[name]:.2f}"])
    rows.append([job, str(concurrency), "ceiling", f"{limit:.1f}", "", "", "", "0%", "", "", "",
                 f"{totals[PEER] / limit:.2f}"])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b", help="catalog name or path")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--jobs", default="triage,document,code", help="comma-separated: " + ", ".join(JOBS))
    parser.add_argument("--concurrency", default="1,4", help="comma-separated clients at a time")
    parser.add_argument("--tickets", type=int, default=32, help="tickets of the triage job (both nights)")
    parser.add_argument("--questions", type=int, default=12, help="questions of the document job")
    parser.add_argument("--steps", type=int, default=8, help="completions of the code job")
    args = parser.parse_args()
    path = str(model_path(args.model))
    sizes = {"triage": args.tickets, "document": args.questions, "code": args.steps}
    prefill_speed, draft_speed = physics(path, args.threads)
    rows: list[list[str]] = []
    started = time.monotonic()
    for concurrency in (int(c) for c in args.concurrency.split(",")):
        for job in args.jobs.split(","):
            first, second = JOBS[job](sizes[job])
            nights = [Night(first), Night(second)]
            with tempfile.TemporaryDirectory(prefix="reame-workload-") as state:
                servers = Servers(path, args.threads, 4096 * concurrency if concurrency > 1 else 4096, concurrency,
                                  state)
                for turn, night in enumerate(nights):
                    servers.start()
                    try:
                        run_night(servers, night, concurrency, turn)
                    finally:
                        servers.stop()
                    print(f"{job}, {concurrency} at a time, night {turn + 1}: " + ", ".join(
                        f"{name} {seconds:.1f} s" for name, seconds in night.wall.items()), file=sys.stderr)
            rows += report(job, concurrency, nights, ceiling(nights, prefill_speed, draft_speed))
    print(f"machine: {machine()} · llama.cpp {LLAMA_COMMIT} · {Path(path).name} · {args.threads} threads · greedy · "
          f"llama-bench: prompt {prefill_speed:.1f} tok/s at 512, {draft_speed:.1f} tok/s in 17-token batches\n")
    print_table(["job", "at a time", "server", "total s", "night 1 s/req", "night 2 repeated s/req",
                 "night 2 new s/req", "repeat / first", "valid", "right", f"same as {REFERENCE}",
                 f"speed-up vs {PEER}"], rows)
    print(f"\n({time.monotonic() - started:.0f} s)")


if __name__ == "__main__":
    main()
