"""What the benchmarks need built before the first one starts, which of it the cache holds, and what
building the rest takes.

`python -m bench all` once built the tools only, and on a fresh machine the
portable-vs-native benchmark then stopped, 27 minutes in, for want of a native
build. Now each benchmark names its builds (suite.py), the suite makes the
missing ones first, saying how long that takes, and a benchmark whose build
could not be made is reported as skipped with the command that makes it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import build_zipapp  # noqa: E402
from reame import native  # noqa: E402


@dataclass(frozen=True)
class Build:
    """One build in ~/.cache/reame/llama/ that benchmarks need, and the build_zipapp.py options that make it."""

    name: str
    options: tuple[str, ...]
    minutes: int  # about what it took on a 2-core x86-64 host (2026-12), from the cached source
    targets: tuple[tuple[bool, bool, str], ...]  # (portable, tools, machine) of each build directory it makes

    @property
    def command(self) -> str:
        return " ".join(("python build_zipapp.py", *self.options))

    def cached(self) -> bool:
        return all(build_zipapp.is_built(native.build_dir(portable, tools, arch), portable, tools)
                   for portable, tools, arch in self.targets)


def builds() -> dict[str, Build]:
    """Every build a benchmark may name, for this machine."""
    here = native.machine()
    others = tuple(arch for arch in build_zipapp.ARCHES if arch != here)
    return {
        "tools": Build("tools", ("--lib", "--bench-tools"), 14, ((False, True, here),)),
        "native": Build("native", ("--lib",), 5, ((False, False, here),)),
        "portable": Build("portable", ("--lib", "--portable"), 12, ((True, False, here),)),
        # What the .pyz carries: the portable build of every machine (the README's first command makes it).
        "pyz": Build("pyz", ("--lib", "--portable", "--arch", "all"), 22,
                     ((True, False, here), *((True, False, arch) for arch in others))),
    }


def missing(needed: Iterable[str], known: dict[str, Build]) -> list[Build]:
    """The builds among `needed` (in first-named order, once each) that the cache does not hold."""
    ordered = list(dict.fromkeys(needed))
    return [known[name] for name in ordered if not known[name].cached()]


def announce(to_build: Sequence[Build]) -> str:
    """One line saying what will be built before the first benchmark and about how long it takes."""
    if not to_build:
        return "every build the benchmarks need is in the cache"
    parts = ", ".join(f"{build.name} (~{build.minutes} min: {build.command})" for build in to_build)
    total = sum(build.minutes for build in to_build)
    return f"building first, about {total} minutes on 2 cores, cached afterwards: {parts}"


def make(to_build: Sequence[Build], run: Callable[[list[str]], int]) -> dict[str, str]:
    """Make each build with `run` (the build_zipapp.py command line; its exit status); the builds that
    failed, by name, with the command that makes them."""
    failed = {}
    for build in to_build:
        if run(["build_zipapp.py", *build.options]) != 0:
            failed[build.name] = build.command
    return failed


def skip_reason(needs: Iterable[str], unbuilt: dict[str, str]) -> str | None:
    """Why a benchmark needing `needs` cannot run (a build that could not be made, and its command), or None."""
    absent = [name for name in needs if name in unbuilt]
    if not absent:
        return None
    return "; ".join(f"needs the {name} build, which could not be made: {unbuilt[name]}" for name in absent)
