"""`python -m bench all [--quick]`: every benchmark of bench/ side by side with llama.cpp, into docs/BENCHMARKS.md.

    python -m bench all                 # the full suite (hours on a 2-core box)
    python -m bench all --quick         # smaller models and fewer repetitions (under 30 minutes there)
    python -m bench all --only ceiling,decode      # printed only: docs/ holds whole runs

It builds libllama and llama.cpp's tools from the pinned source (cached), fetches
the models the suite names (cached), runs the benchmarks one at a time (they must
have the machine to themselves), and rewrites the generated part of
docs/BENCHMARKS.md: the machine, every benchmark's tables as it printed them,
with its command, and charts (docs/bench/*.svg). The hand-written analyses below
that part are kept.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from report import Result, machine_facts, write_report  # noqa: E402
from suite import SUITE  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["all"], help="run the whole suite")
    parser.add_argument("--quick", action="store_true", help="smaller models, fewer repetitions")
    parser.add_argument("--only", help="comma-separated benchmark names (the report is then printed, not written: "
                        "docs/BENCHMARKS.md holds whole runs): " + ", ".join(b.name for b in SUITE))
    parser.add_argument("--no-write", action="store_true", help="print the report, leave docs/ alone")
    args = parser.parse_args()
    chosen = [bench for bench in SUITE if not args.only or bench.name in args.only.split(",")]
    unknown = set(args.only.split(",")) - {bench.name for bench in SUITE} if args.only else set()
    if unknown:
        parser.error(f"unknown benchmark {', '.join(sorted(unknown))}")
    build = [sys.executable, str(ROOT / "build_zipapp.py"), "--lib", "--bench-tools"]
    print("$ " + " ".join(build[1:]), file=sys.stderr, flush=True)
    if subprocess.run(build, cwd=ROOT).returncode != 0:
        print("the build failed: nothing was measured", file=sys.stderr)
        return 1
    started = time.monotonic()
    results = []
    for bench in chosen:
        command = bench.command(args.quick)
        print(f"\n$ python {' '.join(command)}", file=sys.stderr, flush=True)
        began = time.monotonic()
        run = subprocess.run([sys.executable, *command], cwd=ROOT, stdout=subprocess.PIPE, text=True)
        results.append(Result(bench, command, run.stdout, run.returncode, time.monotonic() - began))
        print(run.stdout, file=sys.stderr, flush=True)
        if run.returncode != 0:
            print(f"{bench.name} failed (exit {run.returncode}); the suite goes on", file=sys.stderr)
    write = not (args.no_write or args.only)
    report = write_report(results, machine_facts(), args.quick, time.monotonic() - started,
                          ROOT / "docs" if write else None)
    if not write:
        print(report)
    failed = [result.bench.name for result in results if result.returncode != 0]
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
