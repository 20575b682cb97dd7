#!/usr/bin/env python3
"""The Conclave: an extraction exam (greedy vs best-of-5) and best-of-5's wall time vs 5 runs and llama-server.

    python bench/conclave.py                      # Qwen2.5-Coder-1.5B, 22 questions, 3 timed questions
    python bench/conclave.py --timed 1 --exam 6   # quicker

The exam: questions over one ~900-token report with near-duplicate numbers,
negations and facts found only in its footer; the report is the system message,
each question the user's, answers of at most 32 tokens. Each question is asked
greedily, then with best_of 5 (attempt 0 greedy, the others at temperature 0.7),
both to one Reame server (prefix cache on: the report is prefilled once).

Wall time, for `--timed` questions over a report no server has seen (a new
first line each time), one server computing at a time:
- Reame best-of-5: one request with best_of 5 (one prefill, early stop);
- Reame 5 sequential runs: the 5 attempts one after another, each over its own
  copy of the report (a prefill each, as 5 separate runs pay);
- llama-server -np 5: the same 5 attempts as 5 concurrent requests (same build,
  threads and context; llama-server prefills each one).
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import threading
import time
import urllib.request

from common import ROOT, bench_parser, machine, model_path, print_table, server_command
from server import free_port, wait_ready

from reame.conclave import EXPLORER_TEMPERATURE, numbers, words
from reame.native import LLAMA_COMMIT

ATTEMPTS = 5
MAX_TOKENS = 32
CONTEXT = 8192
INSTRUCTION = "Answer with just the value asked for, no explanation."

REPORT = """NORTHWIND LOGISTICS — QUARTERLY OPERATIONS REPORT, Q3 2026

1. Summary
Northwind Logistics runs four warehouses: Lisbon, Porto, Rotterdam and Lyon. In the third quarter the
network handled 48,210 shipments, up from 46,820 in the second quarter. The original target was 48,120
shipments, so the quarter ended 90 shipments above target. Revenue reached 7.42 million euros; the
budget had assumed 7.24 million euros. Operating costs were 5.81 million euros, against 5.18 million
euros in the same quarter of 2025.

2. Warehouses
Lisbon is the largest site, with 212 employees and 18,450 shipments this quarter. Its second loading dock
opened on 14 July. Porto employs 97 people and handled 9,870 shipments; Porto did not open its planned
cold-storage room, which was postponed to 2027. Rotterdam handled 12,340 shipments with 131 employees.
Rotterdam's planned expansion to a third dock was approved in March but has not started: no construction
contract has been signed. Lyon handled 7,550 shipments with 64 employees. The Lyon lease, which ends in
December, was not renewed; the Lyon team moves to a new building in Villeurbanne in January.

3. Fleet
The company owns 58 trucks and leases 23 more. Eleven of the owned trucks are electric. The average
delivery distance was 214 kilometres, compared with 241 kilometres last quarter, because more Porto
orders were served from Lisbon. Fuel spending fell to 612,000 euros from 621,000 euros. The oldest
truck in the fleet was bought in 2011; it is scheduled to be replaced, but not before 2027.

4. Service quality
On-time delivery was 96.4 percent, compared with 94.6 percent in the second quarter. Damaged parcels
fell to 0.31 percent of shipments. Customer complaints numbered 318, of which 183 concerned late
deliveries and 135 concerned damaged goods. Rotterdam had the best on-time rate at 98.1 percent; Lyon
had the lowest at 91.8 percent. Lisbon did not record a single lost parcel this quarter, while Porto
lost 4 parcels and Rotterdam lost 2.

5. Customers
The largest customer is Atlas Pharma, with 6,120 shipments, followed by Boreal Foods with 5,980 and
Cedro Textiles with 4,310. Atlas Pharma renewed its contract for three years in August. Boreal Foods
asked for a price review but did not cancel its contract. Delta Electronics, a customer since 2019,
ended its contract on 30 September and will not be served in the fourth quarter.

6. People
Total headcount at the end of September was 541, including 37 people at the head office in Lisbon.
Staff turnover was 3.9 percent for the quarter. The company hired 29 people and 21 left. A new safety
training programme started in Porto and Rotterdam; it did not start in Lyon because of the move.

7. Outlook
For the fourth quarter the company expects between 49,000 and 50,500 shipments. The board has approved
an investment of 1.35 million euros, of which 0.85 million euros go to the Rotterdam dock once a
contract is signed and 0.5 million euros to new electric trucks. No price increase is planned before
March 2027.

-----
Footer: Prepared by the Operations Control team (report owner: Marta Ferreira). Figures audited by
Keller & Brandt on 9 October 2026. Document revision 4. Questions: operations desk, extension 2417.
Confidential — internal distribution only.
"""

# (question, expected answer): see `correct`.
EXAM = [
    ("How many shipments did the network handle in Q3 2026?", "48210"),
    ("What was the shipment target for the quarter?", "48120"),
    ("How many shipments did the network handle in the second quarter?", "46820"),
    ("What was the revenue in million euros?", "7.42"),
    ("What were the operating costs in million euros this quarter?", "5.81"),
    ("How many shipments did Rotterdam handle?", "12340"),
    ("How many employees does Porto have?", "97"),
    ("Did Porto open its cold-storage room this quarter? Answer yes or no.", "no"),
    ("Was the Lyon lease renewed? Answer yes or no.", "no"),
    ("Has construction of Rotterdam's third dock started? Answer yes or no.", "no"),
    ("How many trucks does the company own?", "58"),
    ("How many trucks does the company lease?", "23"),
    ("What was the average delivery distance this quarter, in kilometres?", "214"),
    ("What was the on-time delivery rate this quarter, in percent?", "96.4"),
    ("How many customer complaints concerned late deliveries?", "183"),
    ("Which warehouse had the lowest on-time rate?", "Lyon"),
    ("How many parcels did Porto lose?", "4"),
    ("How many shipments did Boreal Foods have?", "5980"),
    ("Which customer ended its contract on 30 September?", "Delta Electronics"),
    ("What was the total headcount at the end of September?", "541"),
    ("Who is the report owner?", "Marta Ferreira"),
    ("Which firm audited the figures?", "Keller Brandt"),
    ("What is the document revision number?", "4"),
    ("What is the extension of the operations desk?", "2417"),
]


def correct(question: str, answer: str, expected: str) -> bool:
    """The expected number(s) and no other number but the question's own (`... in Q3 2026`); or, for a
    word answer, an answer of a few words holding all of the expected ones."""
    wanted = numbers(expected)
    if wanted:
        said = numbers(answer)
        return all(n in said for n in wanted) and all(n in wanted or n in numbers(question) for n in said)
    said = words(answer)
    return len(said) <= 8 and all(word in said for word in words(expected))


def messages(question: str, header: str = "") -> list[dict[str, str]]:
    return [{"role": "system", "content": header + REPORT}, {"role": "user", "content": f"{question} {INSTRUCTION}"}]


def post(port: int, body: dict) -> dict:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=1800) as response:
        return json.loads(response.read())


def attempt_bodies(question: str, header: str, seed: int) -> list[dict]:
    """The Conclave's 5 attempts as plain requests: the anchor greedy, the explorers seed + i at 0.7."""
    base = {"messages": messages(question, header), "max_tokens": MAX_TOKENS}
    return [dict(base, temperature=0, seed=seed)] + \
        [dict(base, temperature=EXPLORER_TEMPERATURE, seed=seed + i) for i in range(1, ATTEMPTS)]


def best_of(port: int, question: str, header: str = "", seed: int = 1) -> dict:
    return post(port, {"messages": messages(question, header), "max_tokens": MAX_TOKENS, "temperature": 0,
                       "seed": seed, "reame": {"best_of": ATTEMPTS}})


def sequential(port: int, question: str, copy: str, seed: int) -> None:
    """The 5 attempts one after another, each over its own copy of the report: 5 prefills."""
    for k, body in enumerate(attempt_bodies(question, "", seed)):
        post(port, dict(body, messages=messages(question, f"{copy}S{k}\n")))


def timed(function) -> float:
    started = time.perf_counter()
    function()
    return time.perf_counter() - started


def concurrently(port: int, bodies: list[dict]) -> None:
    threads = [threading.Thread(target=post, args=(port, body)) for body in bodies]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def start(command: list[str], port: int, env: dict[str, str]) -> subprocess.Popen:
    process = subprocess.Popen(command, env=dict(os.environ, PYTHONPATH=str(ROOT), **env),
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_ready(port, process, timeout_s=300)
    return process


def main() -> None:
    parser = bench_parser(__doc__, "qwen2.5-coder-1.5b", tokens=MAX_TOKENS, reps=1,
                          tokens_help="(fixed: answers of at most 32 tokens)", reps_help="(unused)")
    parser.add_argument("--exam", type=int, default=len(EXAM), help="exam questions to ask")
    parser.add_argument("--timed", type=int, default=3, help="questions timed cold, three ways")
    args = parser.parse_args()
    path = str(model_path(args.model))
    reame_port, llama_port = free_port(), free_port()
    # The timed runs must not find the report in a cache: no prefix cache, no Palimpsest.
    quiet = {"REAME_CACHE_ENABLED": "0", "REAME_SPECULATIVE_PALIMPSEST": "0"}
    reame = start(server_command("reame", path, reame_port, args.threads, CONTEXT, ATTEMPTS), reame_port, quiet)
    llama = start(server_command("llama", path, llama_port, args.threads, CONTEXT, ATTEMPTS), llama_port, {})
    try:
        exam = EXAM[:args.exam]
        greedy_right, vote_right, consensus, wrong_votes = 0, 0, collections.Counter(), []
        for question, expected in exam:
            greedy = post(reame_port, {"messages": messages(question), "max_tokens": MAX_TOKENS, "temperature": 0})
            greedy_text = greedy["choices"][0]["message"]["content"]
            elected = best_of(reame_port, question)
            vote = elected["reame"]["conclave"][0]
            text = elected["choices"][0]["message"]["content"]
            greedy_right += correct(question, greedy_text, expected)
            vote_right += correct(question, text, expected)
            consensus[vote["consensus"]] += 1
            if not correct(question, text, expected):
                wrong_votes.append((question, expected, greedy_text, text, vote))
        walls: dict[str, list[float]] = {"best-of-5": [], "5 sequential": [], "llama-server -np 5": []}
        for q in range(args.timed):
            question = EXAM[q * 7 % len(EXAM)][0]
            copy = f"[copy {time.time_ns()}]\n"
            runs = [
                ("best-of-5", lambda: best_of(reame_port, question, copy + "A\n", seed=q + 1)),
                ("5 sequential", lambda: sequential(reame_port, question, copy, q + 1)),
                ("llama-server -np 5", lambda: concurrently(llama_port, attempt_bodies(question, copy + "L\n", q + 1))),
            ]
            for name, run in runs[q % 3:] + runs[:q % 3]:
                walls[name].append(timed(run))
    finally:
        for process in (reame, llama):
            process.terminate()
            process.wait(60)
    print(f"# The Conclave: {args.model}, {machine()}, {args.threads} threads, llama.cpp {LLAMA_COMMIT}\n")
    print(f"## Extraction exam: {len(exam)} questions over a {len(REPORT.split())}-word report\n")
    print_table(["answers", "right", "accuracy"],
                [["greedy", str(greedy_right), f"{greedy_right / len(exam):.0%}"],
                 [f"best-of-{ATTEMPTS}", str(vote_right), f"{vote_right / len(exam):.0%}"]])
    print("\nconsensus (votes for the winner out of 5): " +
          ", ".join(f"{k}/5: {consensus[k]}" for k in sorted(consensus)))
    for question, expected, greedy_text, text, vote in wrong_votes:
        answers = [c["answer"] for c in vote["candidates"]]
        print(f"- wrong vote: {question!r} expected {expected!r}; elected {text!r} "
              f"({vote['consensus']}/5; greedy said {greedy_text!r}; answers {answers})")
    print(f"\n## Wall time per question, cold report (median of {args.timed})\n")
    best = sorted(walls["best-of-5"])[len(walls["best-of-5"]) // 2]
    rows = []
    for name, values in walls.items():
        median = sorted(values)[len(values) // 2]
        rows.append([name, f"{median:.1f} ({min(values):.1f}–{max(values):.1f})", f"{median / best:.2f}×"])
    print_table(["way", "seconds", "vs best-of-5"], rows)


if __name__ == "__main__":
    main()
