#!/usr/bin/env python3
"""Greedy means greedy, on texts nobody wrote for speculation: speculation off vs on, a restart between.

    python bench/held_out.py                          # Qwen2.5-Coder-1.5B, 2 threads, 10 texts a kind
    python bench/held_out.py --model smollm2-135m --texts 10
    python bench/held_out.py --kind "code: rewrite" --kind "prose: summarise"   # some kinds only

The texts are others': passages of the Python Language Reference and functions of the standard library
as this Python ships them (`pydoc_data.topics`, `inspect.getsource`), and the support tickets of
bench/data/workload (written for the workload benchmark, never for speculation, never tuned against).
Five kinds of greedy chat request, `--texts` of each: summarise a passage, explain a passage, explain a
function, rewrite a function with type hints (an answer that mostly copies its input), extract a ticket's
fields under a JSON schema. The exact-answer cache is off, so every request decodes.

Five servers from the same pinned build, model and threads, one request at a time in rotating order:
Reame with speculation off (`REAME_SPECULATIVE_ENABLED=0`, its other settings as they come: exact, so its
greedy generating steps are computed row by row as the next one's are), Reame as it comes (speculation on and exact,
its Palimpsest archive in a fresh directory, the step costs of earlier runs on this machine remembered in the
cache's model facts, as any server after its first), Reame with `speculative.exact = false` (drafts verified at
any batch size), llama-server as it comes (no speculation) and llama-server `--spec-type ngram-simple`
(sent the rewrites only). Each Reame has a prefix cache of its own, so no server restores another's
prompt. Then every server is restarted (archives and prefix caches stay on disk) and the three Reames
answer every request again: the repeat after a restart. llama-server is sent each request twice in a
row: new, and with its slot holding the prompt, when it decodes the prompt's last token alone, as Reame
does every prompt of 64 tokens or more (engine/sequences.py, SOLO_LAST_TOKEN_PREFILL: so that a repeat
computes what the first request did).

Printed per kind: how many answers are byte-identical to Reame's with speculation off (before and after
the restart) and llama-server's to it; decode tok/s with speculation off; paired median ratios to it
(first answers, and repeats after the restart), and for rewrites to llama-server ngram-simple (and
whether its answers are llama-server's without speculation).
"""

from __future__ import annotations

import inspect
import json
import statistics
import tempfile
import time
from pathlib import Path

from common import ROOT, bench_parser, machine, model_path, print_table, rotated
from palimpsest import send_chat, servers

from reame.native import LLAMA_COMMIT

PASSAGES = ("while", "for", "with", "class", "raise", "lambda", "global", "del", "assert", "return", "yield", "if")
FUNCTIONS = ("textwrap.dedent", "statistics.median", "difflib.get_close_matches", "heapq.nlargest", "shutil.which",
             "string.capwords", "html.escape", "glob.escape", "calendar.monthrange", "fnmatch.filter",
             "colorsys.rgb_to_hls", "shlex.quote")
TICKETS = ROOT / "bench" / "data" / "workload" / "tickets.jsonl"
TICKET_SCHEMA = {"type": "object", "properties": {
    "category": {"type": "string", "enum": ["bug", "question", "feature", "billing", "account", "outage"]},
    "priority": {"type": "string", "enum": ["low", "medium", "high", "urgent"]},
    "team": {"type": "string"}, "summary": {"type": "string"}},
    "required": ["category", "priority", "team", "summary"]}
SERVERS: dict[str, dict[str, str] | list[str]] = {
    "reame, speculation off": {"REAME_SPECULATIVE_ENABLED": "0", "REAME_SPECULATIVE_EXACT": "1",
                               "REAME_CACHE_DIR": "{archive}/kv-off"},
    "reame": {"REAME_SPECULATIVE_EXACT": "1", "REAME_SPECULATIVE_PALIMPSEST_DIR": "{archive}/exact",
              "REAME_CACHE_DIR": "{archive}/kv-exact"},
    "reame, exact off": {"REAME_SPECULATIVE_EXACT": "0", "REAME_SPECULATIVE_PALIMPSEST_DIR": "{archive}/inexact",
                         "REAME_CACHE_DIR": "{archive}/kv-inexact"},
    "llama-server": [],
    "llama-server ngram-simple": ["--spec-type", "ngram-simple"],
}
OFF, ON, INEXACT, LLAMA, NGRAM = SERVERS
REAMES = (OFF, ON, INEXACT)


def passage(topic: str, characters: int = 1200) -> str:
    """The reference's text on `topic`, cut at the last paragraph within `characters`."""
    from pydoc_data.topics import topics
    text = topics[topic].strip()
    cut = text.rfind("\n\n", 0, characters)
    return text[:cut if cut > 0 else characters]


def source(dotted: str) -> str:
    module, _, name = dotted.rpartition(".")
    return inspect.getsource(getattr(__import__(module, fromlist=[name]), name))


def requests(per_kind: int, only: set[str] | None = None) -> list[tuple[str, dict]]:
    """(kind, chat request body without max_tokens) for every request of the benchmark (of the kinds in
    `only`, if given)."""
    tickets = [json.loads(line)["text"] for line in TICKETS.read_text().splitlines() if line.strip()]
    kinds: dict[str, list[dict]] = {
        "prose: summarise": [f"Summarise this passage of a language reference in three sentences:\n\n{passage(t)}"
                             for t in PASSAGES],
        "prose: explain": [f"Explain to a beginner, with one short example, what this passage says:\n\n{passage(t)}"
                           for t in reversed(PASSAGES)],
        "code: explain": [f"Explain what this Python function does, step by step:\n\n```python\n{source(f)}```"
                          for f in FUNCTIONS],
        "code: rewrite": ["Rewrite this Python function with type hints added to its signature, and change "
                          f"nothing else:\n\n```python\n{source(f)}```" for f in reversed(FUNCTIONS)],
        "structured": [f"Triage this support ticket:\n\n{ticket}" for ticket in tickets],
    }
    schema = {"type": "json_schema", "json_schema": {"name": "triage", "schema": TICKET_SCHEMA}}
    chosen = []
    unknown = (only or set()) - kinds.keys()
    if unknown:
        raise SystemExit(f"no such kind: {', '.join(sorted(unknown))} (kinds: {', '.join(kinds)})")
    for kind, prompts in kinds.items():
        for prompt in prompts[:per_kind] if only is None or kind in only else ():
            body: dict = {"messages": [{"role": "user", "content": prompt}]}
            if kind == "structured":
                body["response_format"] = schema
            chosen.append((kind, body))
    return chosen


Answer = tuple[float, float, int, str]  # wall seconds, decode tok/s, tokens, text


def ratio(numerators: list[float], denominators: list[float]) -> str:
    pairs = [a / b for a, b in zip(numerators, denominators) if a > 0 and b > 0]
    return f"{statistics.median(pairs):.2f}x" if pairs else "-"


def main() -> None:
    parser = bench_parser(__doc__, "qwen2.5-coder-1.5b", tokens=64, reps=1, tokens_help="most tokens an answer")
    parser.add_argument("--texts", type=int, default=10, help="requests of each kind")
    parser.add_argument("--kind", action="append", help="only this kind of request (repeatable), e.g. 'code: rewrite'")
    args = parser.parse_args()
    path = str(model_path(args.model))
    chosen = requests(args.texts, set(args.kind) if args.kind else None)
    first: dict[str, list[Answer | None]] = {name: [None] * len(chosen) for name in SERVERS}
    again: dict[str, list[Answer | None]] = {name: [None] * len(chosen) for name in (*REAMES, LLAMA)}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="reame-held-out-") as archive:
        group = servers(path, args.threads, archive, SERVERS)
        try:
            group.start()
            for turn, (kind, body) in enumerate(chosen):
                for name in rotated(tuple(SERVERS), turn):
                    if name != NGRAM or kind == "code: rewrite":
                        first[name][turn] = send_chat(group.port(name), body, args.tokens)
                    if name == LLAMA:  # its slot now holds the prompt: it decodes only the last token again
                        again[name][turn] = send_chat(group.port(name), body, args.tokens)
            group.stop()
            group.start()
            for turn, (_, body) in enumerate(chosen):
                for name in rotated(REAMES, turn):
                    again[name][turn] = send_chat(group.port(name), body, args.tokens)
        finally:
            group.stop()
    rows = []
    for kind in dict.fromkeys(kind for kind, _ in chosen):
        turns = [turn for turn, (k, _) in enumerate(chosen) if k == kind]

        def answers(table: dict[str, list[Answer | None]], name: str) -> list[Answer]:
            return [answer for turn in turns if (answer := table[name][turn]) is not None]

        def same(table: dict[str, list[Answer | None]], name: str, base: str = OFF) -> str:
            return f"{sum(a[3] == b[3] for a, b in zip(answers(table, base), answers(table, name)))}/{len(turns)}"

        def speed(table: dict[str, list[Answer | None]], name: str, base: str = OFF) -> str:
            return ratio([a[1] for a in answers(table, name)], [a[1] for a in answers(table, base)])

        rewrites = kind == "code: rewrite"
        rows.append([kind, str(len(turns)), same(first, ON), same(again, ON), same(first, INEXACT),
                     same(again, INEXACT),
                     f"{same(first, LLAMA)} / {same(again, LLAMA)}" + (" (other grammar)" if kind == "structured"
                                                                       else ""),
                     f"{statistics.median(a[1] for a in answers(first, OFF)):.1f}",
                     speed(first, ON), speed(again, ON), speed(first, INEXACT), speed(again, INEXACT),
                     speed(first, ON, NGRAM) if rewrites else "-", speed(first, INEXACT, NGRAM) if rewrites else "-",
                     same(first, NGRAM, LLAMA) if rewrites else "-"])
    print(f"machine: {machine()} · llama.cpp {LLAMA_COMMIT} · {Path(path).name} · {args.threads} threads · "
          f"{len(chosen)} greedy requests, at most {args.tokens} tokens · {time.perf_counter() - started:.0f} s\n")
    print("Texts: how many answers are byte-identical to speculation off's (after a restart: both restarted).")
    print("Speeds: paired median decode tok/s ratios.\n")
    print_table(["kind", "requests", "exact: same text", "after restart", "exact off: same text", "after restart",
                 "llama-server: same text (new / repeated prompt)", "off tok/s", "exact / off", "repeat after restart",
                 "exact off / off", "repeat after restart", "exact / ngram-simple", "exact off / ngram-simple",
                 "ngram-simple: same text as llama-server"],
                rows)


if __name__ == "__main__":
    main()
