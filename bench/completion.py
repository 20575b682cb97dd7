#!/usr/bin/env python3
"""An editing session of code completion: llama.vim's /infill requests, Reame vs llama-server (±cache reuse).

    python bench/completion.py                                  # Qwen2.5-Coder-0.5B, then 1.5B
    python bench/completion.py --model qwen2.5-coder-0.5b --lines 12

The session is recorded from llama.vim's own logic (autoload/llama.vim) over a real file of this repository
being written: before typing, the user visits the files around it and each visit's chunk enters the plugin's
ring of extra context (16 chunks of 32 lines at most), each followed by the ring's warm-up request (n_predict
0); then `--lines` lines of the edited file are deleted and typed back, and at every word the plugin asks for
a completion (its first request of a position: t_max_predict_ms 250, 128 tokens at most, n_indent, 256
lines of prefix, 64 of suffix, the ring as `input_extra`); between bursts of typing the ring takes the
chunks the plugin queued as the cursor moved (the prefix's far side, the suffix's next lines). What the
plugin does with answers (its client-side cache, the follow-up request that assumes the suggestion accepted)
depends on them, so it is left out: every server gets the same requests, in the same order.

Three servers run at once on the same build, model, threads, context (8,192) and batch (512: llama-server's
prompt is then the same tokens as Reame's), one slot each: Reame, llama-server, llama-server
--cache-reuse 256. Each request goes to the three in turn (the first rotating), and a server is only asked
once the previous one is idle (its CPU time stopped moving), so none computes while another is timed.
Sampling is greedy (top_k 1) so that the answers can be compared; t_max_predict_ms still ends an answer by
the clock, so two answers agree when one starts the other.
"""

from __future__ import annotations

import http.client
import json
import os
import random
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from common import ROOT, bench_parser, machine, model_path, print_table, rotated, server_command
from server import free_port, wait_ready

from reame.native import LLAMA_COMMIT

EDITED = "reame/engine/sequences.py"
# The files a developer writing EDITED would look at first, in the order visited.
VISITED = ("reame/engine/slots.py", "reame/engine/kv.py", "reame/engine/admission.py", "reame/engine/step.py",
           "reame/engine/scheduler.py", "reame/engine/request.py", "reame/cache/__init__.py")
# llama.vim's defaults (g:llama_config).
N_PREFIX, N_SUFFIX, N_PREDICT = 256, 64, 128
RING_N_CHUNKS, RING_CHUNK_SIZE, RING_SCOPE = 16, 64, 1024
T_MAX_PROMPT_MS, T_MAX_PREDICT_FIRST_MS = 500, 250
RESPONSE_FIELDS = ["content", "timings/prompt_n", "timings/prompt_ms", "timings/prompt_per_token_ms",
                   "timings/prompt_per_second", "timings/predicted_n", "timings/predicted_ms",
                   "timings/predicted_per_token_ms", "timings/predicted_per_second", "truncated", "tokens_cached"]
WORD_ENDS = set(" ().,:[]=")
CONTEXT, BATCH = 8192, 512
SERVERS = ("reame", "llama-server", "llama-server --cache-reuse 256")


@dataclass
class Ring:
    """llama.vim's ring of extra context: queued chunks enter it one per update, the oldest leaving."""

    rng: random.Random
    chunks: list[dict] = field(default_factory=list)
    queued: list[dict] = field(default_factory=list)

    def pick(self, lines: list[str], filename: str, evict: bool) -> None:
        """s:pick_chunk: a random half-size chunk of `lines` (all of them if short), unless one like it is there."""
        if len(lines) < 3:
            return
        if len(lines) + 1 < RING_CHUNK_SIZE:
            chunk = lines
        else:
            l0 = self.rng.randint(0, max(0, len(lines) - RING_CHUNK_SIZE // 2))
            chunk = lines[l0:min(l0 + RING_CHUNK_SIZE // 2, len(lines)) + 1]
        if any(entry["data"] == chunk for entry in self.chunks + self.queued):
            return
        for entries in (self.queued, self.chunks):
            for entry in list(entries):
                if similarity(entry["data"], chunk) > 0.9:
                    if not evict:
                        return
                    entries.remove(entry)
        if len(self.queued) == 16:
            self.queued.pop(0)
        self.queued.append({"data": chunk, "text": "\n".join(chunk) + "\n", "filename": filename})

    def update(self) -> bool:
        """s:ring_update: the first queued chunk enters the ring; whether there was one."""
        if not self.queued:
            return False
        if len(self.chunks) == RING_N_CHUNKS:
            self.chunks.pop(0)
        self.chunks.append(self.queued.pop(0))
        return True

    def evict_like(self, chunk: list[str]) -> None:
        """llama#fim drops ring chunks much like the text around the cursor."""
        self.chunks = [entry for entry in self.chunks if similarity(entry["data"], chunk) <= 0.5]

    def extra(self) -> list[dict]:
        return [{"text": entry["text"], "time": 0, "filename": entry["filename"]} for entry in self.chunks]


def similarity(c0: list[str], c1: list[str]) -> float:
    """s:chunk_sim: twice the lines of c0 found in c1 over both lengths."""
    common = sum(1 for line in c0 if line in c1)
    return 2.0 * common / (len(c0) + len(c1)) if c0 or c1 else 0.0


def near(lines: list[str], y: int) -> list[str]:
    """The lines within half a chunk of line index `y`, as the plugin's BufEnter and llama#fim take them."""
    return lines[max(0, y - RING_CHUNK_SIZE // 2):min(len(lines), y + RING_CHUNK_SIZE // 2 + 1)]


def warm_request(ring: Ring) -> dict:
    return {"id_slot": 0, "input_prefix": "", "input_suffix": "", "input_extra": ring.extra(), "prompt": "",
            "n_predict": 0, "temperature": 0.0, "samplers": [], "stream": False, "cache_prompt": True,
            "t_max_prompt_ms": 1, "t_max_predict_ms": 1, "response_fields": [""]}


def fim_request(buffer: list[str], y: int, x: int, ring: Ring, rng: random.Random) -> dict:
    """llama#fim at line index `y`, column `x` (s:fim_ctx_local without a previous completion)."""
    line = buffer[y]
    if not line.strip():
        indent, middle, line_suffix = 0, "", ""
    else:
        indent, middle, line_suffix = len(line) - len(line.lstrip()), line[:x], line[x:]
    prefix = "\n".join(buffer[max(0, y - N_PREFIX):y]) + "\n"
    suffix = line_suffix + "\n" + "\n".join(buffer[y + 1:y + 1 + N_SUFFIX]) + "\n"
    text = near(buffer, y)
    l0 = rng.randint(0, max(0, len(text) - RING_CHUNK_SIZE // 2))
    ring.evict_like(text[l0:min(l0 + RING_CHUNK_SIZE // 2, len(text)) + 1])
    return {"id_slot": 0, "input_prefix": prefix, "input_suffix": suffix, "input_extra": ring.extra(),
            "prompt": middle, "n_predict": N_PREDICT, "stop": [], "n_indent": indent, "top_k": 1, "top_p": 0.90,
            "samplers": ["top_k", "top_p", "infill"], "stream": True, "cache_prompt": True,
            "t_max_prompt_ms": T_MAX_PROMPT_MS, "t_max_predict_ms": T_MAX_PREDICT_FIRST_MS,
            "response_fields": RESPONSE_FIELDS}


def session(lines_typed: int, start_line: int, seed: int = 1) -> list[dict]:
    """The recorded requests: the visits' ring warm-ups, then the typing, bursts of four lines with the
    ring updated between them (the user pauses: llama.vim updates it after 3 s without a move)."""
    rng = random.Random(seed)
    ring = Ring(rng)
    requests: list[dict] = []
    for name in VISITED:
        lines = (ROOT / name).read_text().splitlines()
        ring.pick(near(lines, rng.randrange(len(lines))), name, evict=True)  # BufEnter
        if ring.update():
            requests.append(warm_request(ring))
    target = (ROOT / EDITED).read_text().splitlines()
    typed = target[start_line:start_line + lines_typed]
    buffer = target[:start_line] + [""] + target[start_line + lines_typed:]
    y = start_line
    # The cursor arrived from afar: the plugin queues the prefix's far side and the suffix's next lines.
    ring.pick(buffer[max(0, y - RING_SCOPE):max(1, y - N_PREFIX)], EDITED, evict=False)
    ring.pick(buffer[y + N_SUFFIX:y + N_SUFFIX + RING_CHUNK_SIZE], EDITED, evict=False)
    for index, line in enumerate(typed):
        if index and index % 4 == 0:
            while ring.update():
                requests.append(warm_request(ring))
        indent = len(line) - len(line.lstrip())
        buffer[y] = line[:indent]  # autoindent put the indentation there
        requests.append(fim_request(buffer, y, indent, ring, rng))
        for x in range(indent, len(line)):
            buffer[y] = line[:x + 1]
            if line[x] in WORD_ENDS and (x + 1 == len(line) or line[x + 1] not in WORD_ENDS):
                requests.append(fim_request(buffer, y, x + 1, ring, rng))
        buffer.insert(y + 1, "")  # Enter
        y += 1
    return requests


@dataclass
class Answer:
    text: str
    first_s: float  # time to the first content
    whole_s: float
    cached: int
    prompt_n: int


def ask(port: int, request: dict) -> Answer:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    started = time.perf_counter()
    connection.request("POST", "/infill", body=json.dumps(request), headers={"Content-Type": "application/json"})
    response = connection.getresponse()
    if response.status != 200:
        raise SystemExit(f"/infill answered {response.status}: {response.read()[:300]!r}")
    pieces, first, final = [], 0.0, {}
    if request["stream"]:
        for raw in response:
            if not raw.startswith(b"data: {"):
                continue
            record = json.loads(raw[6:])
            if record.get("content"):
                pieces.append(record["content"])
                first = first or time.perf_counter()
            if record.get("stop"):
                final = record
    else:
        final = json.loads(response.read())
    whole = time.perf_counter() - started
    connection.close()
    # llama-server applies response_fields to its final streamed record too ("timings/prompt_n"); Reame does not.
    prompt_n = final.get("timings", {}).get("prompt_n", final.get("timings/prompt_n", 0))
    return Answer("".join(pieces), (first - started) if first else whole, whole, final.get("tokens_cached", 0),
                  prompt_n)


def cpu_ticks(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


def wait_idle(pid: int, settle_s: float = 0.03) -> None:
    """Until the process's CPU time stops moving (a background writer, a spinning thread pool)."""
    before = cpu_ticks(pid)
    while True:
        time.sleep(settle_s)
        now = cpu_ticks(pid)
        if now == before:
            return
        before = now


def start(kind: str, path: str, threads: int) -> tuple[subprocess.Popen, int]:
    port = free_port()
    command = server_command("reame" if kind == "reame" else "llama-server", path, port, threads, CONTEXT)
    if kind == "reame":
        # A prefix cache of its own: nothing from an earlier run is found on disk.
        env = dict(os.environ, PYTHONPATH=str(ROOT), REAME_MODEL_BATCH=str(BATCH), REAME_MODEL_UBATCH=str(BATCH),
                   REAME_CACHE_DIR=tempfile.mkdtemp(prefix="reame-completion-"))
    else:
        env = dict(os.environ)
        command += ["-b", str(BATCH), "-ub", str(BATCH), *kind.split()[1:]]
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_ready(port, process, timeout_s=600)
    return process, port


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(share * (len(ordered) - 1))))]


def run(model: str, args) -> list[list[str]]:
    requests = session(args.lines, args.start)
    path = str(model_path(model))
    servers = {kind: start(kind, path, args.threads) for kind in SERVERS}
    answers: dict[str, list[Answer]] = {kind: [] for kind in SERVERS}
    try:
        for turn, request in enumerate(requests):
            for kind in rotated(SERVERS, turn):
                process, port = servers[kind]
                for other, _ in servers.values():
                    wait_idle(other.pid)
                answer = ask(port, request)
                if request["n_predict"]:
                    answers[kind].append(answer)
            if args.verbose and request["n_predict"]:
                print(turn, " ".join(f"{answers[k][-1].whole_s:.2f}/{answers[k][-1].prompt_n}" for k in SERVERS),
                      flush=True)
    finally:
        for process, _ in servers.values():
            process.terminate()
            process.wait(30)
    rows = []
    best = min(SERVERS[1:], key=lambda kind: statistics.median(a.whole_s for a in answers[kind]))
    for kind in SERVERS:
        mine = answers[kind]
        firsts, wholes = [a.first_s * 1000 for a in mine], [a.whole_s * 1000 for a in mine]
        theirs = answers[best]
        agree = sum(a.text.startswith(b.text) or b.text.startswith(a.text) for a, b in zip(mine, theirs))
        rows.append([model, kind, str(len(mine)), f"{statistics.median(firsts):.0f}", f"{percentile(firsts, 0.9):.0f}",
                     f"{statistics.median(wholes):.0f}", f"{percentile(wholes, 0.9):.0f}",
                     f"{statistics.median(wholes) / statistics.median(a.whole_s * 1000 for a in theirs):.2f} / "
                     f"{percentile(wholes, 0.9) / percentile([a.whole_s * 1000 for a in theirs], 0.9):.2f}",
                     f"{statistics.mean(a.prompt_n for a in mine):.0f}", f"{agree}/{len(mine)}"])
    return rows


def main() -> None:
    parser = bench_parser(__doc__, None, tokens=N_PREDICT, reps=1)
    parser.add_argument("--lines", type=int, default=24, help="lines of the edited file typed back")
    parser.add_argument("--start", type=int, default=300, help="the first of them (0-based; a prefix window "
                        "of 256 lines slides from there)")
    parser.add_argument("--verbose", action="store_true", help="a line per request")
    args = parser.parse_args()
    rows = []
    for model in args.model or ["qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"]:
        rows += run(model, args)
    print(f"machine: {machine()} · llama.cpp {LLAMA_COMMIT} · {args.threads} threads · context {CONTEXT}, "
          f"batch {BATCH}, 1 slot · {args.lines} lines typed from {EDITED}:{args.start + 1}\n")
    print_table(["model", "server", "completions", "first ms p50", "first ms p90", "whole ms p50", "whole ms p90",
                 "whole vs best llama-server p50 / p90", "prompt tokens computed (mean)", "answers agree with it"],
                rows)


if __name__ == "__main__":
    main()
