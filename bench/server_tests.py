#!/usr/bin/env python3
"""llama.cpp's own server tests (tools/server/tests at the pin) against Reame and llama-server, side by side.

    python bench/server_tests.py                       # Reame, then llama-server (the pinned build's tools)
    python bench/server_tests.py --target reame        # Reame only (tests/compat/test_llama_server_suite.py)
    python bench/server_tests.py --files test_infill   # some of the files

The tests come from the pinned llama-cpp-python sdist (the one every build uses), unchanged but for their
conftest.py: its session fixture downloads every preset's model from the internet, which this one does not
(the shim replaces the downloads by local stand-ins, bench/llama_server_shim.py). Each test starts its server
through the shim as `LLAMA_SERVER_BIN_PATH`; both targets get the same stand-in models, so a test that
asserts the text of the model it would have downloaded fails for both. A test whose model has no stand-in
here is counted apart ("no model here"). Prints a table per file, the tests Reame fails with their first
error line, and writes the outcome of every test as JSON (--json).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import xml.etree.ElementTree as ElementTree
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from build_zipapp import SDIST_NAME, SDIST_VERSION, fetch_sdist, sdist_dir  # noqa: E402

# The files the issue names: the native API, the OpenAI routes through it, metrics, slots, the compat layers.
FILES = ("test_basic", "test_chat_completion", "test_completion", "test_ctx_shift", "test_embedding",
         "test_infill", "test_metrics", "test_slot_save", "test_tokenize", "test_compat_anthropic",
         "test_compat_oai_responses")
NO_STAND_IN_MARK = "return code 3"  # the shim's NO_STAND_IN, as utils.ServerProcess.start reports it
CONFTEST = '''"""bench/server_tests.py's conftest: llama.cpp's, without the session fixture that downloads every
preset's model (the shim serves local stand-ins) and without its xdist port spreading (one worker)."""
import pytest
from utils import *


@pytest.fixture(autouse=True)
def stop_server_after_each_test():
    yield
    for server in set(server_instances):
        server.stop()
'''


def extract_tests(destination: Path) -> Path:
    """tools/server/tests of the pinned llama.cpp, from the sdist every build uses (downloaded if missing)."""
    archive = fetch_sdist(sdist_dir())
    prefix = f"{SDIST_NAME.replace('-', '_')}-{SDIST_VERSION}/vendor/llama.cpp/tools/server/tests/"
    with tarfile.open(archive) as bundle:
        for member in bundle.getmembers():
            if member.isfile() and member.name.startswith(prefix):
                relative = member.name[len(prefix):]
                if relative.endswith(".py") or relative.endswith(".ini"):
                    target = destination / relative
                    target.parent.mkdir(parents=True, exist_ok=True)
                    source = bundle.extractfile(member)
                    assert source is not None
                    target.write_bytes(source.read())
    (destination / "conftest.py").write_text(CONFTEST)
    return destination


def wrapper(directory: Path, target: str, llama_server: str) -> Path:
    """The executable the tests start as llama-server: the shim, for `target`."""
    path = directory / f"server-{target}"
    extra = f" --llama-server {llama_server}" if target == "llama-server" else ""
    path.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{ROOT / "bench" / "llama_server_shim.py"}" '
                    f'--target {target}{extra} "$@"\n')
    path.chmod(0o755)
    return path


def run(tests: Path, target: str, files: list[str], llama_server: str, timeout_s: float) -> dict[str, dict]:
    """Every test's outcome against `target`: {"file::name": {"outcome", "message"}}."""
    report = tests / f"report-{target}.xml"
    env = dict(os.environ, LLAMA_SERVER_BIN_PATH=str(wrapper(tests, target, llama_server)),
               LLAMA_CACHE=str(tests / "tmp"), PYTHONPATH=str(ROOT))
    env.pop("PYTEST_ADDOPTS", None)
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
                    f"--junitxml={report}", *[f"unit/{name}.py" for name in files]], cwd=tests, env=env,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=timeout_s, check=False)
    outcomes: dict[str, dict] = {}
    for case in ElementTree.parse(report).getroot().iter("testcase"):
        name = f"{case.get('classname', '').split('.')[-1]}::{case.get('name')}"
        problem = next((child for child in case if child.tag in ("failure", "error", "skipped")), None)
        if problem is None:
            outcomes[name] = {"outcome": "passed", "message": ""}
            continue
        message = (problem.get("message") or problem.text or "").strip().splitlines()
        first = message[0][:200] if message else ""
        outcome = "skipped" if problem.tag == "skipped" else \
            "no model here" if NO_STAND_IN_MARK in (problem.text or "") + first else "failed"
        outcomes[name] = {"outcome": outcome, "message": first}
    return outcomes


def table(results: dict[str, dict[str, dict]], files: list[str]) -> str:
    targets = list(results)
    rows = ["| file | tests | " + " | ".join(f"{target} passed" for target in targets) + " | no model here |",
            "|---|---|" + "---|" * len(targets) + "---|"]
    totals = [0] * (len(targets) + 2)
    for name in files:
        first = results[targets[0]]
        names = [test for test in first if test.startswith(name + "::")]
        passed = [sum(results[target].get(test, {}).get("outcome") == "passed" for test in names)
                  for target in targets]
        missing = sum(first[test]["outcome"] == "no model here" for test in names)
        for index, value in enumerate([len(names), *passed, missing]):
            totals[index] += value
        rows.append(f"| {name} | {len(names)} | " + " | ".join(map(str, passed)) + f" | {missing} |")
    rows.append("| all | " + " | ".join(map(str, totals)) + " |")
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", choices=("both", "reame", "llama-server"), default="both")
    parser.add_argument("--files", nargs="+", default=list(FILES), metavar="NAME")
    parser.add_argument("--json", metavar="FILE", help="write every test's outcome per target here")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds for one target's whole run")
    args = parser.parse_args()
    targets = ["reame", "llama-server"] if args.target == "both" else [args.target]
    llama_server = ""
    if "llama-server" in targets:
        sys.path.insert(0, str(ROOT / "bench"))
        from common import llama_tool
        llama_server = str(llama_tool("llama-server"))
    results: dict[str, dict[str, dict]] = {}
    with tempfile.TemporaryDirectory(prefix="llama-server-tests-") as directory:
        tests = extract_tests(Path(directory))
        for target in targets:
            results[target] = run(tests, target, args.files, llama_server, args.timeout)
    print(f"llama.cpp's server tests at the pin ({', '.join(args.files)}), stand-in models "
          "(bench/llama_server_shim.py)\n")
    print(table(results, args.files))
    failed = sorted((test, outcome["message"]) for test, outcome in results.get("reame", {}).items()
                    if outcome["outcome"] == "failed")
    if failed:
        print("\nReame fails:")
        for test, message in failed:
            print(f"- {test}: {message}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
