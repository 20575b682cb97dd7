#!/usr/bin/env python3
"""The fact exam: one business page in three forms, twenty questions graded OK / MISS / HALLU, against any
OpenAI-compatible server.

    python bench/fact_exam.py --server http://127.0.0.1:8080                     # both pages, every form
    python bench/fact_exam.py --server http://127.0.0.1:8081 --label llama-server --lang en --passes 2

Each page (bench/data/fact_exam/en.json and it.json, businesses of our own invention) comes as prose,
as compressed notes and as a fact sheet. The page, after an instruction to answer from it alone (and to
say "not stated" when it does not say), is the system message; each question is a user message, greedy,
at most --max-tokens, streamed. An answer is HALLU when its `reject` pattern matches (it states a wrong
fact), OK when its `accept` pattern matches, MISS otherwise; critical questions are those where a wrong
answer would cost the business or its customer. Printed per language and form: OK, MISS and HALLU of
20, critical HALLUs, the time to the first answer token of the form's first question (the page's
prefill), the median of the others (the page reused), and, once every form was asked, the first
question's again (--revisit, on by default): a server that kept the pages' prefixes answers it without
prefilling the page again. Reame's exact answer cache would answer a revisit from the stored answer:
measure Reame with REAME_CACHE_ANSWERS=0.
"""

from __future__ import annotations

import argparse
import http.client
import json
import re
import statistics
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

from common import print_table, read_stream

DATA = Path(__file__).resolve().parent / "data" / "fact_exam"
FORMS = ("prose", "compressed", "factsheet")


@dataclass(frozen=True)
class Graded:
    grade: str  # OK, MISS or HALLU
    critical: bool
    ttft_s: float
    answer: str


def grade(answer: str, question: dict) -> str:
    if re.search(question["reject"], answer, re.IGNORECASE):
        return "HALLU"
    return "OK" if re.search(question["accept"], answer, re.IGNORECASE) else "MISS"


def ask(server: str, model: str, api_key: str, system: str, question: str, max_tokens: int) -> tuple[str, float]:
    """(answer, seconds to its first token) of one streamed greedy chat request."""
    url = urllib.parse.urlsplit(server)
    connection = http.client.HTTPConnection(url.hostname, url.port or 80, timeout=600)
    body = json.dumps({"model": model, "temperature": 0, "max_tokens": max_tokens, "stream": True,
                       "stream_options": {"include_usage": True},
                       "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]})
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {api_key}"} if api_key else {})
    sent = time.perf_counter()
    connection.request("POST", url.path.rstrip("/") + "/v1/chat/completions", body=body, headers=headers)
    response = connection.getresponse()
    if response.status != 200:
        raise SystemExit(f"{server} answered {response.status}: {response.read()[:200]!r}")
    answer = read_stream(response)
    connection.close()
    return answer.text.strip(), answer.first - sent


def exam(args: argparse.Namespace, page: dict, form: str) -> list[Graded]:
    system = f"{page['instruction']}\n\n{page['forms'][form]}"
    graded = []
    for question in page["questions"][:args.questions]:
        answer, ttft = ask(args.server, args.model, args.api_key, system, question["q"], args.max_tokens)
        graded.append(Graded(grade(answer, question), question["critical"], ttft, answer))
        if args.show and graded[-1].grade != "OK":
            print(f"  {page['language']}/{form} {graded[-1].grade}: {question['q']} -> {answer!r}")
    return graded


def row(label: str, page: dict, form: str, graded: list[Graded], revisit: float | None) -> list[str]:
    count = {name: sum(g.grade == name for g in graded) for name in ("OK", "MISS", "HALLU")}
    later = [g.ttft_s for g in graded[1:]]
    return [label, page["language"], form, f"{count['OK']}/{len(graded)}", str(count["MISS"]),
            str(count["HALLU"]), str(sum(g.grade == "HALLU" and g.critical for g in graded)),
            f"{graded[0].ttft_s:.2f}", f"{statistics.median(later):.2f}" if later else "",
            f"{revisit:.2f}" if revisit is not None else ""]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", required=True, help="base URL of an OpenAI-compatible server")
    parser.add_argument("--label", default="", help="the server's name in the table (default: its URL)")
    parser.add_argument("--model", default="default", help="the request's model field")
    parser.add_argument("--api-key", default="", help="bearer key, if the server wants one")
    parser.add_argument("--lang", choices=("en", "it", "all"), default="all")
    parser.add_argument("--forms", nargs="+", choices=FORMS, default=list(FORMS))
    parser.add_argument("--questions", type=int, default=20, help="the first N questions of each page")
    parser.add_argument("--revisit", action=argparse.BooleanOptionalAction, default=True,
                        help="ask each form's first question again once every form was asked")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--show", action="store_true", help="print every answer that is not OK")
    args = parser.parse_args()
    pages = [json.loads((DATA / f"{lang}.json").read_text()) for lang in (("en", "it") if args.lang == "all"
                                                                         else (args.lang,))]
    started = time.perf_counter()
    exams = [(page, form, exam(args, page, form)) for page in pages for form in args.forms]
    revisits = [ask(args.server, args.model, args.api_key, f"{page['instruction']}\n\n{page['forms'][form]}",
                    page["questions"][0]["q"], args.max_tokens)[1] if args.revisit else None
                for page, form, _ in exams]
    rows = [row(args.label or args.server, page, form, graded, revisit)
            for (page, form, graded), revisit in zip(exams, revisits)]
    print(f"\nfact exam · {args.label or args.server} · {time.perf_counter() - started:.0f} s\n")
    print_table(["server", "lang", "form", "OK", "MISS", "HALLU", "critical HALLU", "first answer TTFT s",
                 "later TTFT s (median)", "revisit TTFT s"], rows)


if __name__ == "__main__":
    main()
