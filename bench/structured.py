#!/usr/bin/env python3
"""Structured output and Il Suggeritore: JSON extraction with a schema, list and table writing.

    python bench/structured.py                          # Qwen2.5-Coder-1.5B, 2 threads, 3 reps
    python bench/structured.py --model smollm2-135m --reps 1

Three servers from the same pinned build, model and threads run side by side,
one request at a time, in rotating order: Reame with Il Suggeritore off
(`REAME_SPECULATIVE_SUGGERITORE=0`; prompt lookup stays on, as by default),
Reame as configured by default (Il Suggeritore on), and llama-server.

- extraction: each short text is sent as a greedy chat request with
  `response_format: {"type": "json_schema", …}` (llama-server converts the
  same schema with its own json-schema-to-grammar); every answer is checked
  against the schema. Wall time is from sending the request to the last
  token; decode tok/s between the first and the last streamed token.
- writing: a numbered list and a Markdown table, plain text (no grammar),
  greedy, at most `--tokens` tokens.

Ratios are per request and rep against Reame with Il Suggeritore off, and
their median is printed; the acceptance of Il Suggeritore's drafts comes from
the default Reame server's /metrics, counted per task. "ceiling" is the
speed-up over plain decoding that the default server's drafts (every
source's) allow at the step costs measured below, with no other overhead:
what this machine lets drafting reach on that work.

First, alone on the machine, it measures what bounds any drafting here: the
time of one decode step carrying k tokens of one sequence, each with logits,
against one token (a draft of k-1 tokens all accepted yields k tokens for
that price).
"""

from __future__ import annotations

import http.client
import json
import os
import statistics
import subprocess
import time
from pathlib import Path

from common import ROOT, bench_parser, machine, model_path, print_table, read_stream, server_command, \
    speculation_counts
from server import free_port, wait_ready

from reame.native import LLAMA_COMMIT

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "email": {"type": "string"},
        "company": {"type": "string"},
        "city": {"type": "string"},
        "order_number": {"type": "string"},
        "amount_eur": {"type": "number"},
        "urgency": {"enum": ["low", "normal", "high"]},
        "topic": {"enum": ["billing", "delivery", "technical", "account", "other"]},
        "wants_callback": {"type": "boolean"},
    },
    "required": ["name", "email", "company", "city", "order_number", "amount_eur", "urgency", "topic",
                 "wants_callback"],
    "additionalProperties": False,
}
TEXTS = [
    "Hi, this is Maria Rossi from Ferramenta Rossi in Bologna. Order 58213 (EUR 1,240.50) still has not arrived "
    "after three weeks and our shop opens on Monday. Please call me back today: maria@ferramentarossi.it",
    "Hello support, Jonas Berg here (Nordlicht GmbH, Hamburg). Invoice for order A-7781 charged us 89.90 EUR "
    "twice. Not urgent, an email reply to j.berg@nordlicht.de is fine.",
    "Dear team, I cannot log in to the dashboard since yesterday's update. Order 99-1002, 15 euros a month. "
    "Priya Nair, Café Lumen, Lisbon. priya.nair@cafelumen.pt - a phone call would help.",
    "Good morning. Tomasz Kowalski, Kowalski & Syn, Kraków. We would like to know whether order PL-3320 "
    "(4,500 EUR) can ship in two parts. Write to tomasz@kowalski-syn.pl when you can.",
]
EXTRACTION = ("Extract the customer's details from this message as JSON with the keys name, email, company, city, "
              "order_number, amount_eur, urgency, topic, wants_callback.\n\nMessage: {text}")
WRITING = {
    "numbered list": "Write a numbered list of 20 practical tips for keeping a small vegetable garden healthy, "
                     "one short sentence each.",
    "table": "Write a Markdown table of 12 European countries with the columns Country, Capital, Population "
             "(millions) and Currency.",
}
SERVERS = {  # the Palimpsest off: it would draft the later reps from the first (bench/palimpsest.py)
    "reame, Suggeritore off": {"REAME_SPECULATIVE_SUGGERITORE": "0", "REAME_SPECULATIVE_PALIMPSEST": "0"},
    "reame": {"REAME_SPECULATIVE_PALIMPSEST": "0"},
    "llama-server": None,
}
BASE = "reame, Suggeritore off"


def chat(port: int, prompt: str, max_tokens: int, schema: dict | None) -> tuple[str, int, float, float]:
    """(text, completion tokens, wall seconds, decode tok/s) of one streamed greedy chat answer."""
    body: dict = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0,
                  "stream": True, "stream_options": {"include_usage": True}}
    if schema is not None:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "customer", "schema": schema}}
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    sent = time.perf_counter()
    connection.request("POST", "/v1/chat/completions", body=json.dumps(body),
                       headers={"Content-Type": "application/json"})
    response = connection.getresponse()
    if response.status != 200:
        raise SystemExit(f"port {port} answered {response.status}: {response.read()[:300]!r}")
    answer = read_stream(response)
    connection.close()
    return answer.text, answer.tokens, answer.last - sent, answer.decode_speed


def ceiling(tokens: float, counts: dict[str, float], costs: dict[int, float]) -> float:
    """The speed-up over plain decoding these drafts allow at the measured step costs, with no other
    overhead: plain steps yield one token each; the verifying steps yield their accepted drafts and one
    more, each costing a step of 1 + (mean draft length) tokens."""
    steps = counts["steps"]
    if not steps:
        return 1.0
    size = 1 + counts["all drafted"] / steps
    sizes = sorted(costs)
    below = max((k for k in sizes if k <= size), default=sizes[0])
    above = min((k for k in sizes if k >= size), default=sizes[-1])
    share = 0.0 if above == below else (size - below) / (above - below)
    relative = (costs[below] + share * (costs[above] - costs[below])) / costs[1]
    plain_steps = tokens - counts["all accepted"] - steps
    return tokens / (plain_steps + steps * relative)


def valid(text: str) -> bool:
    try:
        import jsonschema
    except ImportError:  # the check needs the test extras; without them, parsing is what is checked
        jsonschema = None
    try:
        value = json.loads(text)
        if jsonschema is not None:
            jsonschema.validate(value, SCHEMA)
    except Exception:
        return False
    return True


def step_costs(path: str, threads: int, sizes: tuple[int, ...] = (1, 2, 4, 6, 8, 16),
               reps: int = 5) -> dict[int, float]:
    """Fastest seconds of a decode step carrying k tokens of one sequence with logits, per k."""
    from reame.model.backend import ModelSettings
    from reame.model.llama import LlamaBackend
    with LlamaBackend(ModelSettings(path, n_ctx=2048, n_threads=threads)) as backend:
        context = backend.tokenize("The quick brown fox jumps over the lazy dog. " * 30)
        backend.decode(context, range(len(context)), [0] * len(context), [False] * len(context))
        at = len(context)
        best = dict.fromkeys(sizes, float("inf"))
        for _ in range(reps):
            for k in sizes:
                started = time.perf_counter()
                backend.decode(context[:k], range(at, at + k), [0] * k, [True] * k)
                best[k] = min(best[k], time.perf_counter() - started)
                backend.seq_rm(0, at, -1)
    return best


def start(name: str, path: str, threads: int) -> tuple[subprocess.Popen, int]:
    port = free_port()
    settings = SERVERS[name]
    command = server_command("llama-server" if settings is None else "reame", path, port, threads, 4096)
    env = dict(os.environ, PYTHONPATH=str(ROOT), **(settings or {}))
    return subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL), port


def main() -> None:
    parser = bench_parser(__doc__, "qwen2.5-coder-1.5b", tokens=320, reps=3,
                          tokens_help="max_tokens of the writing tasks")
    args = parser.parse_args()
    path = str(model_path(args.model))
    names = tuple(SERVERS)
    costs = step_costs(path, args.threads)
    servers = {name: start(name, path, args.threads) for name in names}
    requests = [("extraction", EXTRACTION.format(text=text), 200, SCHEMA) for text in TEXTS]
    requests += [(task, prompt, args.tokens, None) for task, prompt in WRITING.items()]
    results: dict[tuple[str, str], list[tuple[int, float, float]]] = {}
    invalid: dict[str, int] = dict.fromkeys(names, 0)
    counted: dict[str, dict[str, float]] = {}  # per task: the default server's counters, summed
    generated: dict[str, float] = {}  # per task: tokens the default server generated
    try:
        for name, (process, port) in servers.items():
            wait_ready(port, process, timeout_s=300)
            chat(port, "Say hello.", 8, None)
        for rep in range(args.reps):
            for index, (task, prompt, max_tokens, schema) in enumerate(requests):
                turn = (rep + index) % len(names)
                for name in names[turn:] + names[:turn]:
                    port = servers[name][1]
                    before = speculation_counts(port, "suggeritore") if name == "reame" else None
                    text, tokens, wall, speed = chat(port, prompt, max_tokens, schema)
                    if before is not None:
                        after = speculation_counts(port, "suggeritore")
                        sums = counted.setdefault(task, dict.fromkeys(after, 0.0))
                        for key in after:
                            sums[key] += after[key] - before[key]
                        generated[task] = generated.get(task, 0.0) + tokens
                    if schema is not None and not valid(text):
                        invalid[name] += 1
                    results.setdefault((f"{task} {index}", name), []).append((tokens, wall, speed))
    finally:
        for process, _ in servers.values():
            process.terminate()
            process.wait(60)
    print(f"machine: {machine()} · llama.cpp {LLAMA_COMMIT} · {Path(path).name} · {args.threads} threads · "
          f"greedy · reps {args.reps}\n")
    print("one decode step of k tokens: " + ", ".join(f"k={k} {seconds * 1000:.1f} ms ({seconds / costs[1]:.2f}×)"
                                                       for k, seconds in costs.items()) + "\n")
    rows = []
    for task in ("extraction", *WRITING):
        asked = sorted({request for request, _ in results if request.rsplit(" ", 1)[0] == task})
        for name in names:  # pairs: the same request in the same rep on this server and on BASE
            mine = [m for request in asked for m in results[(request, name)]]
            base = [b for request in asked for b in results[(request, BASE)]]
            wall_ratio = statistics.median(b[1] / m[1] for m, b in zip(mine, base))
            speed_ratio = statistics.median(m[2] / b[2] for m, b in zip(mine, base))
            tokens = statistics.mean(m[0] for m in mine)
            counts = counted.get(task) if name == "reame" else None
            rows.append([task, name, f"{tokens:.0f}", f"{statistics.median(m[1] for m in mine):.2f}",
                         f"{statistics.median(m[2] for m in mine):.1f}", f"{wall_ratio:.2f}", f"{speed_ratio:.2f}",
                         f"{counts['accepted']:.0f}/{counts['drafted']:.0f}" if counts else "",
                         f"{ceiling(generated[task], counts, costs):.2f}" if counts else "",
                         str(invalid[name]) if task == "extraction" else ""])
    print_table(["task", "server", "tokens", "wall s", "decode tok/s", "speed-up (wall)", "speed-up (tok/s)",
                 "Suggeritore accepted/drafted", "ceiling", "invalid"], rows)


if __name__ == "__main__":
    main()
