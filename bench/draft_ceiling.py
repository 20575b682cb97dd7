#!/usr/bin/env python3
"""The most copying drafts can speed up greedy answers on this machine, beside Reame's and ngram-simple's.

    python bench/draft_ceiling.py                     # Qwen2.5-Coder-1.5B, held_out's 10 rewrites, 128 tokens
    python bench/draft_ceiling.py --kind "code: rewrite" --texts 12 --tokens 128 --at 64
    python bench/draft_ceiling.py --model smollm2-135m --kind "prose: summarise"
    python bench/draft_ceiling.py --save /tmp/rewrites.json; python bench/draft_ceiling.py --load /tmp/rewrites.json

On a compute-bound CPU each row a verification adds costs a good part of a one-row step, so what drafting
can buy has a ceiling set by the machine's step costs and by how far the model copies. This measures the
first and records the second, then costs every policy's steps from the measured curve:

1. the greedy answers (token ids) of a Reame server with speculation off to held_out.py's requests (its
   chat prompts rendered and tokenized by the server, answered by /completion): exact speculation leaves a
   greedy answer byte for byte as it is, so they are every exact policy's answer;
2. the step costs, measured in-process as bench/rowwise.py measures them (after as many KV cells as the
   answers' median context), with the batched kernels (llama-server's steps) and row by row (Reame's exact
   steps), at a ladder of sizes, linear between them;
3. each policy's decode time after the first token, every step costed from the curve:
   - no drafts: one row per token;
   - ngram-simple: llama.cpp's (common/ngram-map.cpp at the pin: the last 12 tokens found earlier in the
     prompt and answer, the up to 48 after them drafted), on the batched curve;
   - Reame: its Speculation (prompt lookup, and a Palimpsest holding the answers before, as a server
     that answered them has), on the row-by-row curve, which it is given whole (a server that remembers
     its curve; learning it live costs more);
   - the ceiling: prompt lookup's guess cut to exactly the run the model then accepts, and drafted only
     when that step costs less than as many one-row steps. No drafter copying from the context can do
     better with these steps; only a source that knows the answer (a repeat's archive) can.

Printed per answer length (`--at` and `--tokens`): the modelled tok/s without drafts, each policy's ratio
to it, and Reame's and the ceiling's ratio to ngram-simple. A model over measured costs, not a live run:
held_out.py measures the live ratios, with the step-time noise and the learning this leaves out.
"""

from __future__ import annotations

import bisect
import json
import os
import statistics
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

from common import bench_parser, machine, model_path, print_table, server_command
from held_out import requests
from prefix_cache import post
from rowwise import step_curves
from server import ServerGroup

from reame.model.backend import ModelSettings
from reame.model.llama import LlamaBackend
from reame.native import LLAMA_COMMIT
from reame.speculative import Drafting, PromptLookup, Speculation
from reame.speculative.controller import MODELLED_TOKENS
from reame.speculative.palimpsest import Palimpsest

LADDER = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 33, 40, 49)  # step sizes measured (49: ngram-simple's 48 drafts)
NGRAM_N, NGRAM_M = 12, 48  # llama.cpp's ngram-simple defaults (common.h: size_n, size_m)
MAX_DRAFT = 32  # Reame's speculative.max_draft_tokens default
Answer = tuple[list[int], list[int]]  # prompt and greedy answer, token ids


class Curve:
    """Seconds of a step of n rows from measured sizes: linear between two, and past the largest along
    the last two."""

    def __init__(self, seconds: dict[int, float]) -> None:
        self.sizes, self.seconds = sorted(seconds), seconds

    def __call__(self, rows: int) -> float:
        if rows in self.seconds:
            return self.seconds[rows]
        at = min(max(bisect.bisect_left(self.sizes, rows), 1), len(self.sizes) - 1)
        low, high = self.sizes[at - 1], self.sizes[at]
        return self.seconds[low] + (self.seconds[high] - self.seconds[low]) * (rows - low) / (high - low)


def record(path: str, threads: int, chosen: list[tuple[str, dict]], tokens: int) -> list[Answer]:
    """Each request's rendered prompt and greedy answer from a Reame server with speculation off."""
    with tempfile.TemporaryDirectory(prefix="reame-ceiling-") as cache:
        group = ServerGroup({"reame": lambda port: (server_command("reame", path, port, threads, 4096), {
            **os.environ, "REAME_SPECULATIVE_ENABLED": "0", "REAME_CACHE_DIR": cache})})
        group.start()
        try:
            port, answers = group.port("reame"), []
            for _, body in chosen:
                prompt = post(port, "/apply-template", {"messages": body["messages"]})["prompt"]
                ids = post(port, "/tokenize", {"content": prompt, "add_special": True, "parse_special": True})["tokens"]
                answer = post(port, "/completion", {"prompt": ids, "n_predict": tokens, "temperature": 0,
                                                    "return_tokens": True, "cache_prompt": False})["tokens"]
                answers.append((ids, answer))
            return answers
        finally:
            group.stop()


def accepted(drafts: Sequence[int], answer: Sequence[int], at: int) -> int:
    """How many of `drafts` the model accepts at `at`: the run equal to the answer there."""
    run = 0
    while run < len(drafts) and at + run < len(answer) and drafts[run] == answer[at + run]:
        run += 1
    return run


def no_drafts(answer: Sequence[int], step: Curve) -> float:
    return (len(answer) - 1) * step(1)


def decode_seconds(answer: Sequence[int], step: Curve, draft: Callable[[int], list[int]],
                   emitted: Callable[[Sequence[int], int, int], None]) -> float:
    """The decode time after the first token when each step verifies `draft(at)`'s tokens: the model emits
    the run of them it accepts and its own next token, told to `emitted(tokens, drafted, accepted)`."""
    at, seconds = 1, 0.0
    while at < len(answer):
        drafts = draft(at)
        run = accepted(drafts, answer, at)
        seconds += step(1 + len(drafts))
        emitted(answer[at:at + run + 1], len(drafts), run)
        at += run + 1
    return seconds


def ngram_simple(prompt: Sequence[int], answer: Sequence[int], step: Curve) -> float:
    """common_ngram_simple_draft at every step: the pattern is the last NGRAM_N tokens (the sampled one
    last), found searching back from before itself; its following tokens drafted when at least NGRAM_N of
    them are there, cut to the tokens the answer may still have."""
    tokens = [*prompt, answer[0]]

    def draft(at: int) -> list[int]:
        history, length = tokens[:-1], len(tokens) - 1
        if length <= NGRAM_N + NGRAM_M + 1:
            return []
        pattern = history[length - NGRAM_N + 1:] + tokens[-1:]
        for start in range(length - NGRAM_N - 1, 0, -1):
            if history[start:start + NGRAM_N] == pattern:
                copy = min(NGRAM_M, length - (start + NGRAM_N))
                if copy < NGRAM_N:
                    return []
                # then cut to the answer's room, as common_speculative_draft does
                return history[start + NGRAM_N:start + NGRAM_N + min(copy, len(answer) - at - 1)]
        return []

    return decode_seconds(answer, step, draft, lambda emitted, drafted, run: tokens.extend(emitted))


def reame(answers: list[Answer], step: Curve, palimpsest_dir: Path) -> list[float]:
    """Each answer's decode time under Reame's speculation, in order, its Palimpsest filling as they end."""
    palimpsest = Palimpsest(palimpsest_dir, bytes(32), 1 << 30)
    palimpsest.loaded.wait()
    speculation = Speculation(palimpsest, PromptLookup(), max_draft=MAX_DRAFT)
    speculation.rowwise_cost.seed({rows: step(rows) for rows in range(1, MODELLED_TOKENS + 1)})
    times = []
    try:
        for prompt, answer in answers:
            draftings = speculation.start(prompt)
            speculation.observe(draftings, answer[:1])
            proposed: list[Drafting | None] = [None]  # the source of the draft being verified

            def draft(at: int) -> list[int]:
                proposed[0], drafts = speculation.propose(draftings, 1, 1, len(answer) - at - 1, rowwise=True)
                return drafts

            def emitted(tokens: Sequence[int], drafted: int, run: int) -> None:
                if proposed[0] is not None:
                    speculation.verified(proposed[0], drafted, run)
                speculation.observe(draftings, tokens)

            times.append(decode_seconds(answer, step, draft, emitted))
            speculation.release(draftings)
    finally:
        speculation.close()
    return times


def ceiling(prompt: Sequence[int], answer: Sequence[int], step: Curve) -> float:
    """Prompt lookup's guess cut to the run the model accepts, drafted when cheaper than plain steps."""
    lookup = PromptLookup().drafter(prompt)
    lookup.observe(answer[:1])

    def draft(at: int) -> list[int]:
        guess = lookup.propose(min(MAX_DRAFT, len(answer) - at - 1))
        run = accepted(guess, answer, at)
        return guess[:run] if run and step(1 + run) < (1 + run) * step(1) else []

    return decode_seconds(answer, step, draft, lambda emitted, drafted, run: lookup.observe(emitted))


def main() -> None:
    parser = bench_parser(__doc__, "qwen2.5-coder-1.5b", tokens=128, reps=3, tokens_help="most tokens an answer",
                          reps_help="rounds of step measurements")
    parser.add_argument("--texts", type=int, default=10, help="requests of each kind")
    parser.add_argument("--kind", action="append", help="held_out.py's kinds (repeatable; default: code: rewrite)")
    parser.add_argument("--at", type=int, action="append", help="also model the answers cut to this many tokens")
    parser.add_argument("--save", type=Path, help="keep the recorded answers and measured steps in this file")
    parser.add_argument("--load", type=Path, help="model the answers and steps a --save kept (nothing recorded or "
                                                  "measured: a draft policy's change is weighed in seconds)")
    args = parser.parse_args()
    path = str(model_path(args.model))
    kinds = sorted(set(args.kind or ["code: rewrite"]))
    if args.load:
        kept = json.loads(args.load.read_text())
        answers = [(prompt, answer) for prompt, answer in kept["answers"]]
        depth, kinds = kept["depth"], kept["kinds"]
        measured = {(rows, rowwise): seconds for rows, rowwise, seconds in kept["steps"]}
    else:
        answers = record(path, args.threads, requests(args.texts, set(kinds)), args.tokens)
        depth = int(statistics.median(len(prompt) + len(answer) // 2 for prompt, answer in answers))
        with LlamaBackend(ModelSettings(path, n_ctx=depth + 512, n_threads=args.threads)) as backend:
            measured = step_curves(backend, list(LADDER), depth, args.reps)
        if args.save:
            args.save.write_text(json.dumps({"answers": answers, "depth": depth, "kinds": kinds, "steps": [
                [rows, rowwise, seconds] for (rows, rowwise), seconds in measured.items()]}))
    batched = Curve({rows: measured[(rows, False)] for rows in LADDER})
    rowwise = Curve({rows: measured[(rows, True)] for rows in LADDER})
    table = []
    longest = max(len(answer) for _, answer in answers)
    for length in sorted({min(length, longest) for length in (*(args.at or [64]), args.tokens)}):
        cut = [(prompt, answer[:length]) for prompt, answer in answers]
        plain = sum(no_drafts(answer, rowwise) for _, answer in cut)
        plain_llama = sum(no_drafts(answer, batched) for _, answer in cut)
        ngram = sum(ngram_simple(prompt, answer, batched) for prompt, answer in cut)
        with tempfile.TemporaryDirectory(prefix="reame-ceiling-palimpsest-") as archive:
            ours = sum(reame(cut, rowwise, Path(archive)))
        best = sum(ceiling(prompt, answer, rowwise) for prompt, answer in cut)
        generated = sum(len(answer) - 1 for _, answer in cut)
        table.append([str(length), f"{generated / plain:.1f}", f"{plain_llama / ngram:.2f}x", f"{plain / ours:.2f}x",
                     f"{plain / best:.2f}x", f"{ngram / ours:.2f}x", f"{ngram / best:.2f}x"])
    print(f"machine: {machine()} · llama.cpp {LLAMA_COMMIT} · {Path(path).name} · {args.threads} threads · "
          f"{len(answers)} greedy answers ({', '.join(kinds)}) · steps after "
          f"{depth} KV cells, median of {args.reps} rounds\n")
    print("Step costs measured (ms, batched / row by row): " + ", ".join(
        f"{rows}: {measured[(rows, False)] * 1000:.0f} / {measured[(rows, True)] * 1000:.0f}" for rows in LADDER))
    print("Each policy's decode time modelled from them over the recorded answers (not a live run).\n")
    print_table(["tokens", "no drafts tok/s", "ngram-simple / its no drafts", "Reame / no drafts",
                 "ceiling / no drafts", "Reame / ngram-simple", "ceiling / ngram-simple"], table)


if __name__ == "__main__":
    main()
