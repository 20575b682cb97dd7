"""The build's percentage follows the real work: a small CMake project shaped like llama.cpp's (libraries
that need one another, an object library, make's /fast targets as the portable build calls them) is
configured and built for real, and every compile and link step make runs is one the plan counted."""

import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
import build_zipapp  # noqa: E402

PROJECT = """cmake_minimum_required(VERSION 3.16)
project(shaped C)
add_library(base SHARED base1.c base2.c base3.c)
add_library(feats OBJECT feats.c)
add_library(variant SHARED variant1.c variant2.c $<TARGET_OBJECTS:feats>)
target_link_libraries(variant PRIVATE base)
add_library(top SHARED top1.c top2.c)
target_link_libraries(top PRIVATE base)
"""
SOURCES = ("base1", "base2", "base3", "feats", "variant1", "variant2", "top1", "top2")
# As the portable build calls cmake --build: some targets with what they need, then /fast targets alone.
PORTABLE_LIKE = [["--target", "base", "feats", "variant"], ["--target", "top/fast"]]
NATIVE_LIKE = [["--target", "top", "variant"]]

pytestmark = pytest.mark.skipif(shutil.which("cmake") is None or shutil.which("cc") is None,
                                reason="needs cmake and a C compiler")


def configured(tmp_path: Path) -> Path:
    source, tree = tmp_path / "src", tmp_path / "build"
    source.mkdir()
    (source / "CMakeLists.txt").write_text(PROJECT)
    for name in SOURCES:
        (source / f"{name}.c").write_text(f"int {name}(void) {{ return {len(name)}; }}\n")
    subprocess.run(["cmake", "-S", str(source), "-B", str(tree), "-G", "Unix Makefiles"], check=True,
                   capture_output=True)
    return tree


@pytest.mark.parametrize("target_lists", [PORTABLE_LIKE, NATIVE_LIKE], ids=["portable-like", "native-like"])
def test_every_step_make_runs_is_planned_and_the_percentage_ends_at_the_last(tmp_path, capsys, target_lists):
    tree = configured(tmp_path)
    progress = build_zipapp.Progress(build_zipapp.planned_steps(tree, target_lists), time.monotonic())
    assert len(progress.planned) == len(SOURCES) + 3  # every object, and the three links
    log = tmp_path / "build.log"
    for targets in target_lists:
        build_zipapp.run_with_progress(["cmake", "--build", str(tree), *targets], log, "compile", progress)
    ran = {found.group(1) for line in log.read_text().splitlines()
           if (found := build_zipapp.BUILD_STEP.search(line.strip()))}
    assert ran == progress.planned == progress.done
    shown = [int(value) for value in re.findall(r"build: compile +(\d+)%", capsys.readouterr().err)]
    assert shown == sorted(shown) and shown[-1] == 100 and shown.count(100) == 1


def test_makes_own_percentage_reaches_100_before_the_fast_targets_run(tmp_path):
    """Why the build counts for itself: make's percentage is per call, so the portable build's first
    call ends at 100% while the /fast targets after it still have everything of theirs to compile."""
    tree = configured(tmp_path)
    log = tmp_path / "build.log"
    for targets in PORTABLE_LIKE:
        build_zipapp.run_with_progress(["cmake", "--build", str(tree), *targets], log, "compile")
    lines = log.read_text().splitlines()
    first_full = next(i for i, line in enumerate(lines) if "[100%]" in line)
    assert any("Building C object CMakeFiles/top.dir" in line for line in lines[first_full:])
