#!/usr/bin/env python3
"""The Palimpsest: drafting from earlier generations, against llama-server's n-gram modes.

    python bench/palimpsest.py                          # Qwen2.5-Coder-1.5B, 2 threads, 12 + 12 products
    python bench/palimpsest.py --model smollm2-135m --products 4 --reps 1

Five servers from the same pinned build, model and threads, one request at a
time in rotating order: Reame with the Palimpsest off
(`REAME_SPECULATIVE_PALIMPSEST=0`), Reame as configured by default (its
archive in a fresh directory), llama-server plain, `--spec-type ngram-simple`
and `--spec-type ngram-mod` (which keeps its n-grams across the requests of
one process).

- template: one support-reply template over `--products` customers and
  products, then over as many new ones; greedy answers. The first pass is what the servers have seen;
  the second is measured: wall time per request and decode tok/s.
- repeated after a restart: one request, then every server is restarted (the
  Reame archive stays on disk), then the same request `--reps` times, as users
  send it: the answer ends where the model ends it (at most `--tokens`); decode
  tok/s. Reame's exact answer cache is off (as in every benchmark of
  computing), so the repeat is computed.

Ratios are per request against Reame with the Palimpsest off, paired medians;
acceptance of the Palimpsest's drafts from the default server's /metrics.
"""

from __future__ import annotations

import http.client
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from common import ROOT, bench_parser, rotated, machine, model_path, print_table, read_stream, server_command, \
    speculation_counts
from server import ServerGroup

from reame.native import LLAMA_COMMIT

PRODUCTS = [
    ("a cast-iron skillet", "kitchen", 39), ("a trail running shoe", "sport", 129),
    ("a mechanical keyboard", "office", 89),
    ("a down sleeping bag", "outdoor", 249), ("a pour-over coffee kettle", "kitchen", 45),
    ("a standing desk", "office", 399), ("a bicycle helmet", "sport", 69), ("a camping stove", "outdoor", 59),
    ("a chef's knife", "kitchen", 99), ("a yoga mat", "sport", 35), ("a desk lamp", "office", 49),
    ("a water filter bottle", "outdoor", 29), ("a rice cooker", "kitchen", 79), ("a pair of dumbbells", "sport", 55),
    ("an ergonomic chair", "office", 299), ("a headlamp", "outdoor", 25), ("a stand mixer", "kitchen", 349),
    ("a jump rope", "sport", 15), ("a noise-cancelling headset", "office", 179), ("a trekking pole", "outdoor", 65),
    ("a Dutch oven", "kitchen", 119), ("a foam roller", "sport", 25), ("a monitor arm", "office", 75),
    ("a two-person tent", "outdoor", 189),
]
CUSTOMERS = ["Anna", "Bruno", "Chiara", "Dario", "Elena", "Fabio", "Giulia", "Hugo", "Irene", "Jonas", "Katia", "Luca",
             "Marta", "Nico", "Olga", "Paolo", "Rita", "Sven", "Teresa", "Ugo", "Vera", "Walter", "Xenia", "Zeno"]
# Narrow, repetitive work: the same kind of reply every time, to another customer about another product.
TEMPLATE = ("Customer {customer} wants to return {name} ({category}, {price} EUR), bought {days} days ago. Write "
            "Reame Shop's reply: greet them by name, confirm the return is accepted under the 30-day policy, list "
            "the three steps to send the item back, and say when the refund arrives. Sign as Reame Shop Support.")
REPEATED = "Explain step by step how a hash table stores and finds a key, with an example in Python."
SERVERS = {
    "reame, Palimpsest off": {"REAME_SPECULATIVE_PALIMPSEST": "0"},
    "reame": {"REAME_SPECULATIVE_PALIMPSEST_DIR": "{archive}"},
    "llama-server": [],
    "llama-server ngram-simple": ["--spec-type", "ngram-simple"],
    "llama-server ngram-mod": ["--spec-type", "ngram-mod"],
}
BASE = "reame, Palimpsest off"


def chat(port: int, prompt: str, max_tokens: int) -> tuple[float, float, int, str]:
    """(wall seconds, decode tok/s, tokens, text) of one streamed greedy chat answer."""
    return send_chat(port, {"messages": [{"role": "user", "content": prompt}]}, max_tokens)


def send_chat(port: int, body: dict, max_tokens: int) -> tuple[float, float, int, str]:
    """`body` (messages and any other fields) sent as a streamed greedy chat request of at most `max_tokens`:
    (wall seconds, decode tok/s, tokens, text)."""
    body = dict(body, max_tokens=max_tokens, temperature=0, stream=True, stream_options={"include_usage": True})
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    sent = time.perf_counter()
    connection.request("POST", "/v1/chat/completions", body=json.dumps(body),
                       headers={"Content-Type": "application/json"})
    answer = read_stream(connection.getresponse())
    connection.close()
    return answer.last - sent, answer.decode_speed, answer.tokens, answer.text


def servers(path: str, threads: int, archive: str,
            kinds: dict[str, dict[str, str] | list[str]] | None = None) -> ServerGroup:
    """The servers of `kinds` (name: a Reame's environment, or llama-server's extra flags; the five above by
    default); Reame's archive outlives their restarts."""
    kinds = SERVERS if kinds is None else kinds

    def launch(name: str) -> Callable[[int], tuple[list[str], dict[str, str]]]:
        settings = kinds[name]

        def how(port: int) -> tuple[list[str], dict[str, str]]:
            command = server_command("llama-server" if isinstance(settings, list) else "reame", path, port,
                                     threads, 4096)
            env = dict(os.environ, PYTHONPATH=str(ROOT))
            if isinstance(settings, dict):
                env.update({key: value.format(archive=archive) for key, value in settings.items()})
            else:
                command += settings
            return command, env
        return how
    return ServerGroup({name: launch(name) for name in kinds})


def main() -> None:
    parser = bench_parser(__doc__, "qwen2.5-coder-1.5b", tokens=160, reps=3,
                          tokens_help="tokens of the repeated answer")
    parser.add_argument("--products", type=int, default=12, help="products per pass of the template workload")
    args = parser.parse_args()
    path = str(model_path(args.model))
    names = tuple(SERVERS)
    prompts = [TEMPLATE.format(customer=customer, name=product, category=category, price=price, days=3 + 7 * i % 25)
               for i, (customer, (product, category, price)) in enumerate(zip(CUSTOMERS, PRODUCTS))]
    first_pass, second_pass = prompts[:args.products], prompts[args.products:2 * args.products]
    template: dict[str, list[tuple[float, float, int, str]]] = {name: [] for name in names}
    repeated: dict[str, list[tuple[float, float, int, str]]] = {name: [] for name in names}
    archived = ""  # Reame's answer before the restart
    counted: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="reame-palimpsest-bench-") as archive:
        group = servers(path, args.threads, archive)
        try:
            group.start()
            for turn, prompt in enumerate(first_pass):
                for name in rotated(names, turn):
                    chat(group.port(name), prompt, 300)
            before = speculation_counts(group.port("reame"), "palimpsest")
            for turn, prompt in enumerate(second_pass):
                for name in rotated(names, turn):
                    template[name].append(chat(group.port(name), prompt, 300))
            after = speculation_counts(group.port("reame"), "palimpsest")
            counted["template"] = {key: after[key] - before[key] for key in after}
            for name in names:
                answer = chat(group.port(name), REPEATED, args.tokens)
                archived = answer[3] if name == "reame" else archived
            group.stop()
            group.start()
            before = speculation_counts(group.port("reame"), "palimpsest")
            for rep in range(args.reps):
                for name in rotated(names, rep):
                    repeated[name].append(chat(group.port(name), REPEATED, args.tokens))
            after = speculation_counts(group.port("reame"), "palimpsest")
            counted["repeated"] = {key: after[key] - before[key] for key in after}
        finally:
            group.stop()
    print(f"machine: {machine()} · llama.cpp {LLAMA_COMMIT} · {Path(path).name} · {args.threads} threads · "
          f"greedy · {len(second_pass)} template requests after {len(first_pass)} · repeated ×{args.reps}\n")
    rows = []
    for name in names:
        mine, base = template[name], template[BASE]
        counts = counted["template"] if name == "reame" else None
        rows.append(["template, second pass", name, f"{statistics.mean(m[2] for m in mine):.0f}",
                     f"{sum(m[0] for m in mine):.1f}", f"{statistics.median(m[1] for m in mine):.1f}",
                     f"{sum(b[0] for b in base) / sum(m[0] for m in mine):.2f}",
                     f"{statistics.median(m[1] / b[1] for m, b in zip(mine, base)):.2f}",
                     f"{counts['accepted']:.0f}/{counts['drafted']:.0f}" if counts else ""])
    for name in names:
        mine, base = repeated[name], repeated[BASE]
        counts = counted["repeated"] if name == "reame" else None
        rows.append(["repeated after a restart", name, f"{statistics.mean(m[2] for m in mine):.0f}", "",
                     f"{statistics.median(m[1] for m in mine):.1f}", "",
                     f"{statistics.median(m[1] / b[1] for m, b in zip(mine, base)):.2f}",
                     f"{counts['accepted']:.0f}/{counts['drafted']:.0f}" if counts else ""])
    print_table(["workload", "server", "tokens", "wall s (sum)", "decode tok/s", "speed-up (wall)",
                 "speed-up (tok/s, paired)", "Palimpsest accepted/drafted"], rows)
    texts = [archived] + [answer[3] for answer in repeated["reame"]]
    print("\nReame's repeats in order, speed-up (paired) and whether the text is the one before it: " + ", ".join(
        f"{mine[1] / base[1]:.2f}× {'same' if text == before else 'differs'}"
        for mine, base, text, before in zip(repeated["reame"], repeated[BASE], texts[1:], texts)))


if __name__ == "__main__":
    main()
