"""`python -m bench all [--quick]`: every benchmark of bench/ side by side with llama.cpp, into docs/BENCHMARKS.md.

    python -m bench all                 # the full suite (hours on a 2-core box)
    python -m bench all --quick         # smaller models and fewer repetitions (under 30 minutes there)
    python -m bench all --only ceiling,decode      # printed only: docs/ holds whole runs

First it builds what the chosen benchmarks need and the cache lacks (llama.cpp's
tools, the native libllama, the portable builds: bench/prerequisites.py), saying
how long that takes; a benchmark whose build cannot be made is skipped, with the
command that makes it, and is not a failure. It fetches the models the suite
names (cached), runs the benchmarks one at a time (they must have the machine to
themselves), and rewrites the generated part of
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

import prerequisites  # noqa: E402
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
    to_build = prerequisites.missing((need for bench in chosen for need in bench.needs), prerequisites.builds())
    print(prerequisites.announce(to_build), file=sys.stderr, flush=True)
    unbuilt = prerequisites.make(to_build, build)
    started = time.monotonic()
    results = []
    for bench in chosen:
        command = bench.command(args.quick)
        skipped = prerequisites.skip_reason(bench.needs, unbuilt)
        if skipped is not None:
            print(f"\n{bench.name} is skipped: {skipped}", file=sys.stderr, flush=True)
            results.append(Result(bench, command, "", 0, 0.0, skipped))
            continue
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
    skipped = [result.bench.name for result in results if result.skipped]
    if failed or skipped or unbuilt:
        print("; ".join(part for part in (f"failed: {', '.join(failed)}" if failed else "",
                                          f"skipped: {', '.join(skipped)}" if skipped else "",
                                          f"not built: {', '.join(unbuilt)}" if unbuilt else "") if part),
              file=sys.stderr)
    return 1 if failed else 0  # a skipped benchmark says what to build; it is not a failure


def build(options: list[str]) -> int:
    """Run build_zipapp.py with `options` from the tree's root, showing its progress; its exit status."""
    print("$ python " + " ".join(options), file=sys.stderr, flush=True)
    return subprocess.run([sys.executable, *options], cwd=ROOT).returncode


if __name__ == "__main__":
    sys.exit(main())
