#!/usr/bin/env python3
"""Speculative decoding on three kinds of work, Reame's sources vs llama-server's speculative modes.

    python bench/speculative.py                          # Qwen2.5-Coder-1.5B, draft 0.5B, 120 tokens, 3 reps
    python bench/speculative.py --model smollm2-135m --draft ''

Servers from the same pinned build, model and threads run side by side, one
request at a time, in rotating order: Reame with speculation off
(`REAME_SPECULATIVE_ENABLED=0`), as configured by default (Il Suggeritore and
prompt lookup under their controllers; the Palimpsest off, since every rep
repeats the prompts), with the draft model only, and with both; llama-server
plain, with `--spec-type ngram-simple`, `--spec-type ngram-mod`, and with the
draft model (`-md … --spec-type draft-simple`). Without `--draft` the draft
rows are left out. Each streams a greedy chat answer of a fixed
length (end of text ignored); decode tok/s is measured by the client between
the first and the last streamed token. Tasks: (a) a copy-heavy JSON edit,
(b) a code edit, (c) free prose. Ratios are against the same server family's
plain mode, per rep, and their median is printed.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shutil
import statistics
import subprocess
import tempfile
from pathlib import Path

from common import ROOT, bench_parser, machine, model_path, print_table, read_stream, server_command
from server import free_port, wait_ready

from reame.native import LLAMA_COMMIT

RECORDS = [{"id": i, "name": name, "team": team, "status": "open", "priority": 1 + i % 3}
           for i, (name, team) in enumerate([("login page", "web"), ("export csv", "data"), ("dark mode", "web"),
                                             ("rate limits", "api"), ("audit log", "security"),
                                             ("search index", "data"), ("retry queue", "api")])]
TASKS = {
    "a: JSON edit (copy-heavy)": "Here is a JSON list:\n" + json.dumps(RECORDS, indent=2) +
    "\n\nReturn the same JSON list with every \"status\" changed to \"done\". Output only the JSON.",
    "b: code edit": "Add a docstring to each function below and return the whole file, otherwise unchanged.\n\n"
    "def parse_line(line):\n    key, _, value = line.partition('=')\n    return key.strip(), value.strip()\n\n\n"
    "def parse_file(path):\n    entries = {}\n    with open(path) as stream:\n        for line in stream:\n"
    "            if line.strip() and not line.startswith('#'):\n                key, value = parse_line(line)\n"
    "                entries[key] = value\n    return entries\n\n\n"
    "def write_file(path, entries):\n    with open(path, 'w') as stream:\n        for key, value in entries.items():\n"
    "            stream.write(f'{key} = {value}\\n')\n",
    "c: free prose": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
}
# name -> REAME_* settings, or llama-server options ("{draft}" is the draft model's path)
SERVERS = {
    "reame off": {"REAME_SPECULATIVE_ENABLED": "0"},
    "reame lookup": {},
    "reame + Palimpsest": {"REAME_SPECULATIVE_PALIMPSEST": "1", "REAME_SPECULATIVE_PALIMPSEST_DIR": "{archive}"},
    "reame draft": {"REAME_SPECULATIVE_LOOKUP": "0", "REAME_SPECULATIVE_DRAFT_MODEL": "{draft}"},
    "reame lookup+draft": {"REAME_SPECULATIVE_DRAFT_MODEL": "{draft}"},
    "llama-server": [],
    "llama-server ngram-simple": ["--spec-type", "ngram-simple"],
    "llama-server ngram-mod": ["--spec-type", "ngram-mod"],
    "llama-server draft-simple": ["-md", "{draft}", "--spec-type", "draft-simple"],
}
# Every rep repeats the same prompts: Reame's Palimpsest drafts them from the earlier reps' answers, as
# ngram-mod does from the n-grams it keeps; it is off but in "reame + Palimpsest" (a fresh archive), so the
# other rows measure drafting within one request. The first rep's ratio shows the rows before any repeat.
REAME_SETTINGS = {"REAME_SPECULATIVE_PALIMPSEST": "0"}


def stream_chat(port: int, prompt: str, n_tokens: int) -> float:
    """Decode tok/s of one streamed greedy chat answer, measured between its first and last token."""
    body = json.dumps({"messages": [{"role": "user", "content": prompt}], "max_tokens": n_tokens,
                       "temperature": 0, "ignore_eos": True, "stream": True,
                       "stream_options": {"include_usage": True}})
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    connection.request("POST", "/v1/chat/completions", body=body, headers={"Content-Type": "application/json"})
    speed = read_stream(connection.getresponse()).decode_speed
    connection.close()
    return speed


def start(name: str, path: str, draft: str, archive: str,
          args: argparse.Namespace) -> tuple[subprocess.Popen, int]:
    port = free_port()
    kind = "reame" if name.startswith("reame") else "llama-server"
    command = server_command(kind, path, port, args.threads, 4096)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    settings = SERVERS[name]
    if isinstance(settings, dict):
        env.update(REAME_SETTINGS)
        env.update({key: value.format(draft=draft, archive=archive) for key, value in settings.items()})
    else:
        command += [option.format(draft=draft) for option in settings]
    return subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL), port


def main() -> None:
    parser = bench_parser(__doc__, "qwen2.5-coder-1.5b", tokens=120, reps=3)
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b", help="draft model ('' = no draft rows)")
    parser.add_argument("--only", help="comma-separated server names to run (default: all); each family's "
                        "plain server is added for the ratios")
    args = parser.parse_args()
    path = str(model_path(args.model))
    draft = str(model_path(args.draft)) if args.draft else ""
    wanted = set(args.only.split(",")) | {"reame off", "llama-server"} if args.only else set(SERVERS)
    names = tuple(name for name in SERVERS if name in wanted and (draft or "draft" not in name))
    archive = tempfile.mkdtemp(prefix="reame-bench-palimpsest-")
    servers = {name: start(name, path, draft, archive, args) for name in names}
    speeds: dict[tuple[str, str], list[float]] = {}
    try:
        for name, (process, port) in servers.items():
            wait_ready(port, process, timeout_s=300)
            stream_chat(port, "Say hello.", 8)
        for rep in range(args.reps):
            for task, prompt in TASKS.items():
                order = names[rep % len(names):] + names[:rep % len(names)]
                for name in order:
                    speeds.setdefault((task, name), []).append(stream_chat(servers[name][1], prompt, args.tokens))
    finally:
        for process, _ in servers.values():
            process.terminate()
            process.wait(60)
        shutil.rmtree(archive, ignore_errors=True)
    rows = []
    for task in TASKS:
        for name in names:
            plain = "reame off" if name.startswith("reame") else "llama-server"
            ratios = [fast / base for fast, base in zip(speeds[(task, name)], speeds[(task, plain)])]
            values = speeds[(task, name)]
            rows.append([task, name, f"{statistics.median(values):.1f} ({min(values):.1f}–{max(values):.1f})",
                         f"{statistics.median(ratios):.2f}", f"{ratios[0]:.2f}"])
    drafting = f" · draft {Path(draft).name}" if draft else ""
    print(f"machine: {machine()} · llama.cpp {LLAMA_COMMIT} · {Path(path).name}{drafting} · {args.threads} threads · "
          f"{args.tokens} tokens, greedy · reps {args.reps}\n")
    print_table(["task", "server", "decode tok/s", "vs its plain (paired median)", "first rep"], rows)


if __name__ == "__main__":
    main()
