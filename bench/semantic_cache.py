"""The semantic answer cache's study: how often a paraphrase gets the right kept answer, and a question of
another meaning a wrong one, per similarity threshold and embedding model.

The kept questions are the fact exam's (bench/data/fact_exam, 20 per language, each asked once of its
page); the incoming ones are bench/data/semantic_cache: per kept question two of the same meaning and two
that change one detail (a number, a negation, an opposite, another fact). Each incoming question is
looked up as the cache does (reame/semantic.py's `nearest`: the most similar kept question of the page,
among those that say the same numbers and negate alike) and, beside it, by similarity alone.

recall: paraphrases answered with their own question's answer; false hits: incoming questions answered
with another question's answer (of the different-meaning ones, or a paraphrase matched to the wrong
question), as a share of all incoming questions. cache.semantic_threshold's default, 0.98, has no false
hit here with the default embedding model (the lowest without one is 0.97, a hair above the most similar
wrong answer: 0.98 keeps a margin).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from common import bench_parser, machine, model_path, print_table

from reame.engine.embeddings import unit_length
from reame.model.backend import ModelSettings
from reame.model.llama import LlamaBackend
from reame.native import LLAMA_COMMIT
from reame.semantic import Details, KeptQuestion, canonical, details, nearest, unit_float32

DATA = Path(__file__).parent / "data"
THRESHOLDS = (0.60, 0.70, 0.75, 0.80, 0.85, 0.90, 0.93, 0.95, 0.97, 0.98, 0.99)
MODELS = ("all-minilm-l6-v2", "qwen2.5-coder-1.5b", "smollm2-135m")
ANYTHING = Details((), False)  # every kept question looks alike: similarity alone decides


@dataclass(frozen=True)
class Incoming:
    text: str
    stored: int  # the kept question it is asked beside
    same: bool
    kind: str


def study_set(language: str) -> tuple[list[str], list[Incoming]]:
    data = json.loads((DATA / "semantic_cache" / f"{language}.json").read_text())
    kept = [item["stored"] for item in data["questions"]]
    incoming = [Incoming(text, index, True, "paraphrase") for index, item in enumerate(data["questions"])
                for text in item["same"]]
    incoming += [Incoming(other["q"], index, False, other["kind"]) for index, item in enumerate(data["questions"])
                 for other in item["different"]]
    incoming += [Incoming(text, index, True, "retyped") for index, question in enumerate(kept)
                 for text in retyped(question, data["greeting"])]
    return kept, incoming


def retyped(question: str, greeting: str) -> list[str]:
    """The same question as people also type it: in lower case without its question mark, after a greeting."""
    return [question.lower().rstrip("?"), f"{greeting} {question}"]


@dataclass(frozen=True)
class Lookup:
    incoming: Incoming
    guarded: tuple[int, float] | None  # (kept question, similarity) of the cache's nearest
    alone: tuple[int, float]  # the same by similarity alone
    guarded_text: str | None  # the kept question the cache's nearest is


def lookups(backend: LlamaBackend, kept: list[str], incoming: list[Incoming]) -> tuple[list[Lookup], float]:
    """Every incoming question's nearest kept question, and the milliseconds an embedding took (median)."""
    def embed(text: str) -> tuple[list[float], float]:
        started = time.perf_counter()
        tokens = backend.tokenize(canonical(text), add_special=True, parse_special=False)
        vector = unit_length(backend.embed([tokens])[0])
        return vector, time.perf_counter() - started
    vectors, times = [], []
    for text in kept:
        vector, seconds = embed(text)
        vectors.append(vector)
        times.append(seconds)
    guarded_kept = [KeptQuestion(text, unit_float32(vector), str(number).encode(), details(text))
                    for number, (text, vector) in enumerate(zip(kept, vectors))]
    alone_kept = [KeptQuestion(text, question.vector, question.answer_key, ANYTHING)
                  for text, question in zip(kept, guarded_kept)]
    found = []
    for question in incoming:
        vector, seconds = embed(question.text)
        times.append(seconds)
        guarded = nearest(guarded_kept, vector, question.text)
        alone = nearest(alone_kept, vector, "")
        assert alone is not None
        found.append(Lookup(question,
                            (int(guarded.question.answer_key), guarded.similarity) if guarded else None,
                            (int(alone.question.answer_key), alone.similarity),
                            guarded.question.text if guarded else None))
    times.sort()
    return found, 1000 * times[len(times) // 2]


def score(found: list[Lookup], threshold: float, guarded: bool) -> dict[str, tuple[int, int]]:
    """At `threshold`: (right hits, questions) for paraphrases and retyped questions, and (wrong hits,
    questions) over all incoming questions."""
    counts = {"paraphrase": [0, 0], "retyped": [0, 0], "false": [0, len(found)]}
    for lookup in found:
        question = lookup.incoming
        if question.same:
            counts[question.kind][1] += 1
        match = lookup.guarded if guarded else lookup.alone
        if match is None or match[1] < threshold:
            continue
        if question.same and match[0] == question.stored:
            counts[question.kind][0] += 1
        else:
            counts["false"][0] += 1
    return {kind: (hits, total) for kind, (hits, total) in counts.items()}


def share(hits: int, total: int) -> str:
    return f"{hits}/{total} ({100 * hits / total:.1f}%)"


def main() -> None:
    parser = bench_parser(__doc__, None, tokens=0, reps=1)
    parser.add_argument("--language", action="append", choices=("en", "it"))
    args = parser.parse_args()
    languages = args.language or ["en", "it"]
    print(f"machine: {machine()} · llama.cpp {LLAMA_COMMIT} · {args.threads} threads\n")
    for name in args.model or MODELS:
        path = model_path(name)
        found: list[Lookup] = []
        milliseconds = []
        with LlamaBackend(ModelSettings(str(path), n_ctx=512, n_threads=args.threads)) as backend:
            for language in languages:
                kept, incoming = study_set(language)
                more, ms = lookups(backend, kept, incoming)
                found += more
                milliseconds.append(ms)
        print(f"## {name} ({path.name}), {', '.join(languages)}: {len(found)} incoming questions, "
              f"an embedding takes {max(milliseconds):.0f} ms (median)\n")
        rows = []
        safe = None
        for threshold in THRESHOLDS:
            guarded, alone = score(found, threshold, True), score(found, threshold, False)
            rows.append([f"{threshold:.2f}", share(*guarded["paraphrase"]), share(*guarded["retyped"]),
                         share(*guarded["false"]), share(*alone["paraphrase"]), share(*alone["false"])])
            if guarded["false"][0] == 0 and safe is None:
                safe = threshold
        print_table(["threshold", "paraphrases answered", "retyped answered", "false hits",
                     "paraphrases, similarity alone", "false hits, similarity alone"], rows)
        print("\nfalse hits at 0.90 by kind (numbers and negation checked):",
              kinds(found, 0.90), "\n")
        wrong = [(lookup.guarded[1], lookup) for lookup in found if lookup.guarded is not None and
                 not (lookup.incoming.same and lookup.guarded[0] == lookup.incoming.stored)]
        if wrong:
            closest, lookup = max(wrong, key=lambda pair: pair[0])
            print(f"the most similar wrong answer: {closest:.3f}, {lookup.incoming.text!r} ({lookup.incoming.kind}) "
                  f"-> the answer to {lookup.guarded_text!r}")
        print(f"lowest threshold without a false hit: {safe if safe is not None else 'none'}\n")


def kinds(found: list[Lookup], threshold: float) -> str:
    counts: dict[str, int] = {}
    for lookup in found:
        match = lookup.guarded
        if match is not None and match[1] >= threshold and not (lookup.incoming.same and
                                                                 match[0] == lookup.incoming.stored):
            counts[lookup.incoming.kind] = counts.get(lookup.incoming.kind, 0) + 1
    return ", ".join(f"{kind} {count}" for kind, count in sorted(counts.items())) or "none"


if __name__ == "__main__":
    main()
