"""`python -m bench all` plans its builds before the first benchmark: on a machine without the native
build (a fresh one after the README's first command: the portable builds only), it says it will build
the tools and the native library, and a benchmark whose build cannot be made is skipped with its command."""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import prerequisites  # noqa: E402
from report import Result, report_text  # noqa: E402
from suite import SUITE  # noqa: E402

import build_zipapp  # noqa: E402
from reame import native  # noqa: E402

FACTS = {"date": "2026-12-02", "cpu": "a CPU", "cores": "2", "arch": "x86_64", "kernel flags": "avx2",
         "python": "3.11.7", "llama.cpp": "0c1e57098"}


def fake_build(portable: bool, tools: bool, arch: str) -> None:
    directory = native.build_dir(portable, tools, arch)
    (directory / "bin").mkdir(parents=True)
    for tool in build_zipapp.BENCH_TOOLS if tools else ():
        (directory / "bin" / tool).write_text("")
    libraries = {"runtime": ["libgomp.so.1"]} if portable else {}
    (directory / "manifest.json").write_text(json.dumps({"recipe": build_zipapp.BUILD_RECIPE,
                                                          "source": build_zipapp.source_pin(),
                                                          "libraries": libraries}))


@pytest.fixture
def after_the_readme(tmp_path, monkeypatch):
    """A cache holding what the README's first command builds: the portable library of every machine."""
    monkeypatch.setenv("REAME_CACHE", str(tmp_path))
    for arch in build_zipapp.ARCHES:
        fake_build(True, False, arch)


def needs(benches) -> list[str]:
    return [need for bench in benches for need in bench.needs]


def test_a_fresh_machine_builds_the_tools_and_the_native_library_first(after_the_readme):
    to_build = prerequisites.missing(needs(SUITE), prerequisites.builds())
    assert [build.name for build in to_build] == ["tools", "native"]
    line = prerequisites.announce(to_build)
    assert "about 19 minutes" in line
    assert "python build_zipapp.py --lib --bench-tools" in line
    assert "native (~5 min: python build_zipapp.py --lib)" in line


def test_what_the_cache_holds_is_not_built_again(after_the_readme):
    fake_build(False, True, native.machine())
    fake_build(False, False, native.machine())
    assert prerequisites.missing(needs(SUITE), prerequisites.builds()) == []
    assert prerequisites.announce([]) == "every build the benchmarks need is in the cache"


def test_only_the_benchmarks_chosen_decide_what_is_built(after_the_readme):
    portable_only = [bench for bench in SUITE if bench.name == "portable"]
    assert [build.name for build in prerequisites.missing(needs(portable_only), prerequisites.builds())] == ["native"]


def test_a_build_that_cannot_be_made_skips_what_needs_it_and_says_how_to_make_it(after_the_readme):
    to_build = prerequisites.missing(needs(SUITE), prerequisites.builds())
    made = []

    def run(options: list[str]) -> int:
        made.append(options)
        return 0 if "--bench-tools" in options else 1  # the tools build, then a native build that fails

    unbuilt = prerequisites.make(to_build, run)
    assert made == [["build_zipapp.py", "--lib", "--bench-tools"], ["build_zipapp.py", "--lib"]]
    assert unbuilt == {"native": "python build_zipapp.py --lib"}
    reasons = {bench.name: prerequisites.skip_reason(bench.needs, unbuilt) for bench in SUITE}
    assert reasons["startup"] is None
    assert reasons["portable"] == "needs the native build, which could not be made: python build_zipapp.py --lib"
    assert all(reason for name, reason in reasons.items() if name != "startup")


def test_a_skipped_benchmark_is_in_the_report_with_its_command(after_the_readme):
    portable = next(bench for bench in SUITE if bench.name == "portable")
    decode = next(bench for bench in SUITE if bench.name == "decode")
    results = [Result(portable, portable.command(True), "", 0, 0.0,
                      "needs the native build, which could not be made: python build_zipapp.py --lib"),
               Result(decode, decode.command(True), "| model | tok/s |\n|---|---|\n| m | 1 |", 0, 12.0)]
    text = report_text(results, FACTS, True, 60.0, [])
    assert ("**Skipped**: it needs the native build, which could not be made: python build_zipapp.py --lib."
            in text)
    assert "| m | 1 |" in text
