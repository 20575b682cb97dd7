"""build_zipapp.py fails with one clear line: bad checksum, missing tools, no pip, no network."""

import json
import os
import re
import subprocess
import sys
import tomllib
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
import build_zipapp  # noqa: E402


def test_a_source_archive_with_the_wrong_checksum_is_removed(tmp_path):
    archive = tmp_path / f"llama_cpp_python-{build_zipapp.SDIST_VERSION}.tar.gz"
    archive.write_bytes(b"tampered")
    with pytest.raises(build_zipapp.BuildError) as raised:
        build_zipapp.fetch_sdist(tmp_path)
    assert "checksum mismatch" in str(raised.value) and "\n" not in str(raised.value)
    assert not archive.exists()


def test_missing_tools_are_named_with_the_command_that_installs_them(monkeypatch):
    monkeypatch.setattr(build_zipapp.shutil, "which", lambda tool: None)
    with pytest.raises(build_zipapp.MissingPrerequisite) as raised:
        build_zipapp.preflight(compiling=[build_zipapp.machine()], downloads=[])
    assert str(raised.value).startswith("cmake and a C++ compiler missing: install with `apt-get install cmake g++`")


def test_a_missing_cross_compiler_is_named_with_its_package_and_the_way_around_it(monkeypatch):
    other = next(arch for arch in build_zipapp.ARCHES if arch != build_zipapp.machine())
    monkeypatch.setattr(build_zipapp.shutil, "which", lambda tool: None if "linux-gnu" in tool else tool)
    with pytest.raises(build_zipapp.MissingPrerequisite) as raised:
        build_zipapp.preflight(compiling=[build_zipapp.machine(), other], downloads=[])
    package = f"g++-{other.replace('_', '-')}-linux-gnu"
    assert str(raised.value) == (f"the {other} cross compiler missing: install with `apt-get install {package}` "
                                 "(Debian/Ubuntu; or build for this machine only: --arch native) and run again")


def test_the_default_pyz_is_for_every_machine_this_one_first():
    assert build_zipapp.selected_arches("all")[0] == build_zipapp.machine()
    assert sorted(build_zipapp.selected_arches("all")) == sorted(build_zipapp.ARCHES)
    assert build_zipapp.selected_arches("native") == [build_zipapp.machine()]


@pytest.mark.parametrize("arch, variants", [("aarch64", build_zipapp.ARM_VARIANTS),
                                            ("x86_64", build_zipapp.X86_VARIANTS)])
def test_a_portable_build_names_its_variants_and_links_libllama_without_the_others(arch, variants):
    steps = build_zipapp.compile_targets(portable=True, tools=False, arch=arch)
    assert steps[0] == ["--target", "ggml-base", *(f"ggml-cpu-{v}" for v in variants)]
    assert steps[1:] == [["--target", "ggml/fast"], ["--target", "llama/fast"]]


def test_no_x86_build_carries_amx_kernels():
    """The pinned ggml's AMX kernels die of SIGILL under some hypervisors that advertise AMX."""
    assert "sapphirerapids" not in build_zipapp.X86_VARIANTS
    native = build_zipapp.cmake_options(portable=False, tools=False, arch="x86_64")
    assert f"-DCMAKE_C_FLAGS={build_zipapp.NO_AMX}" in native and f"-DCMAKE_CXX_FLAGS={build_zipapp.NO_AMX}" in native
    assert not any("amx" in option for option in build_zipapp.cmake_options(portable=True, tools=False,
                                                                             arch="x86_64"))


def cached_manifest(libraries: dict | None = None, **fields) -> str:
    """A cache manifest as this build_zipapp.py writes it (recipe and source as today's)."""
    return json.dumps({"recipe": build_zipapp.BUILD_RECIPE, "source": build_zipapp.source_pin(),
                       "libraries": libraries or {}, **fields})


def test_a_build_made_by_an_earlier_recipe_is_built_again(tmp_path):
    (tmp_path / "manifest.json").write_text('{"libraries": {}}')
    assert not build_zipapp.is_built(tmp_path, portable=False)
    (tmp_path / "manifest.json").write_text(cached_manifest(recipe=build_zipapp.BUILD_RECIPE - 1))
    assert not build_zipapp.is_built(tmp_path, portable=False)
    (tmp_path / "manifest.json").write_text(cached_manifest())
    assert build_zipapp.is_built(tmp_path, portable=False)


def test_a_build_made_with_other_patches_is_built_again(tmp_path):
    (tmp_path / "manifest.json").write_text(cached_manifest(source=f"{build_zipapp.SDIST_SHA256} patches 0"))
    assert not build_zipapp.is_built(tmp_path, portable=False)


def test_a_failed_download_is_one_line(tmp_path, monkeypatch):
    class Failed:
        returncode = 1
        stderr = "ERROR: Could not find a version that satisfies the requirement\nERROR: No matching distribution"

    monkeypatch.setattr(build_zipapp.subprocess, "run", lambda *a, **k: Failed())
    with pytest.raises(build_zipapp.BuildError) as raised:
        build_zipapp.fetch_sdist(tmp_path)
    message = str(raised.value)
    assert "cannot download" in message and "No matching distribution" in message and "\n" not in message


def test_a_wheel_with_the_wrong_checksum_is_removed_and_not_used(tmp_path, monkeypatch):
    monkeypatch.setenv("REAME_CACHE", str(tmp_path))
    wheel = build_zipapp.Wheel("zstandard", "0.25.0", "0" * 64, "3.12", "x86_64")
    tampered = build_zipapp.wheel_cache() / "zstandard-0.25.0-cp312-cp312-manylinux2014_x86_64.whl"
    tampered.parent.mkdir(parents=True)
    tampered.write_bytes(b"tampered")
    assert wheel.cached() is None
    assert not tampered.exists()
    monkeypatch.setattr(build_zipapp.subprocess, "run",
                        lambda *a, **k: subprocess.CompletedProcess(a, 1, "", "ERROR: x"))
    with pytest.raises(build_zipapp.BuildError, match="cannot download zstandard==0.25.0 for CPython 3.12 on x86_64"):
        wheel.fetch()


def test_binary_wheels_are_asked_for_their_platform_and_pure_ones_for_none():
    binary = build_zipapp.Wheel("zstandard", "0.25.0", "", "3.13", "aarch64")
    assert binary.pip_options() == ["--platform", "manylinux2014_aarch64", "--python-version", "3.13",
                                    "--implementation", "cp", "--abi", "cp313"]
    assert build_zipapp.Wheel("jinja2", "3.1.6", "").pip_options() == []


def test_every_supported_python_minor_has_a_pinned_zstandard_wheel_per_machine():
    floor = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    assert floor == ">=" + build_zipapp.PYTHON_MINORS[0]
    minors = [int(minor.split(".")[1]) for minor in build_zipapp.PYTHON_MINORS]
    assert minors == list(range(minors[0], minors[0] + len(minors)))
    assert set(build_zipapp.ZSTANDARD_SHA256) == {(minor, arch) for minor in build_zipapp.PYTHON_MINORS
                                                  for arch in build_zipapp.WHEEL_PLATFORMS}


def test_a_pure_package_is_unpacked_without_its_compiled_speedups(tmp_path):
    wheel = tmp_path / "m.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for name in ("markupsafe/__init__.py", "markupsafe/_native.py", "markupsafe/_speedups.cpython-311.so",
                     "markupsafe/_speedups.c", "markupsafe-3.0.3.dist-info/RECORD"):
            archive.writestr(name, b"x")
    build_zipapp.unpack_pure_package(wheel, "markupsafe", tmp_path / "out")
    assert sorted(path.name for path in (tmp_path / "out" / "markupsafe").iterdir()) == ["__init__.py", "_native.py"]


def test_only_the_package_and_its_c_backend_are_unpacked(tmp_path):
    wheel = tmp_path / "z.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for name in ("__init__.py", "backend_c.cpython-312-x86_64-linux-gnu.so", "_cffi.cpython-312-x86_64.so",
                     "backend_cffi.py", "py.typed"):
            archive.writestr(f"zstandard/{name}", b"content")
        archive.writestr("zstandard-0.25.0.dist-info/METADATA", b"")
    build_zipapp.unpack_zstandard(wheel, tmp_path / "out", "x86_64")
    assert sorted(path.name for path in (tmp_path / "out" / "zstandard").iterdir()) == [
        "__init__.py", "backend_c.cpython-312-x86_64-linux-gnu.so"]


def test_preflight_asks_nothing_when_everything_is_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("REAME_CACHE", str(tmp_path))
    here = build_zipapp.machine()
    manifest = build_zipapp.build_dir(True, arch=here) / "manifest.json"
    manifest.parent.mkdir(parents=True)
    manifest.write_text(cached_manifest({"runtime": ["libgomp.so.1"]}))
    monkeypatch.setattr(build_zipapp.Wheel, "cached", lambda wheel: tmp_path)
    asked = []
    monkeypatch.setattr(build_zipapp, "preflight", lambda compiling, downloads: asked.append((compiling, downloads)))
    build_zipapp.preflight_for([(here, True)], tools=False, packing=True)
    build_zipapp.preflight_for([(here, False)], tools=False, packing=False)
    assert asked[0] == ([], [])
    assert asked[1] == ([here], [f"the llama.cpp source (llama-cpp-python=={build_zipapp.SDIST_VERSION})"])


def test_a_portable_build_cached_without_its_openmp_runtime_is_built_again(tmp_path):
    (tmp_path / "manifest.json").write_text(cached_manifest({"cpu_variants": ["libggml-cpu-x64.so"]}))
    assert not build_zipapp.is_built(tmp_path, portable=True)
    assert build_zipapp.is_built(tmp_path, portable=False)


def test_a_tools_build_cached_without_one_of_the_tools_is_built_again(tmp_path):
    (tmp_path / "manifest.json").write_text(cached_manifest())
    (tmp_path / "bin").mkdir()
    for tool in build_zipapp.BENCH_TOOLS[:-1]:
        (tmp_path / "bin" / tool).write_text("")
    assert not build_zipapp.is_built(tmp_path, portable=False, tools=True)
    (tmp_path / "bin" / build_zipapp.BENCH_TOOLS[-1]).write_text("")
    assert build_zipapp.is_built(tmp_path, portable=False, tools=True)
    assert build_zipapp.is_built(tmp_path, portable=False)


def test_main_reports_a_build_error_in_one_line_and_exits_1(monkeypatch, capsys):
    def fail(*args):
        raise build_zipapp.BuildError("something specific broke")

    monkeypatch.setattr(build_zipapp, "preflight_for", lambda *args: None)
    monkeypatch.setattr(build_zipapp, "build", fail)
    assert build_zipapp.main(["--lib"]) == 1
    assert capsys.readouterr().err == "build failed: something specific broke\n"


# --- the real script on a machine that lacks something: one line, exit 2, before any work ----

def run_build(python: str, tmp_path: Path, path: str, **pip_env: str) -> subprocess.CompletedProcess:
    env = {"PATH": path, "HOME": str(tmp_path / "home"), "REAME_CACHE": str(tmp_path / "cache"), **pip_env}
    return subprocess.run([python, str(ROOT / "build_zipapp.py"), "--output", str(tmp_path / "reame.pyz")],
                          env=env, capture_output=True, text=True, timeout=120)


def assert_refused(result: subprocess.CompletedProcess, tmp_path: Path, says: str) -> None:
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("build cannot start: "), result.stderr
    assert says in result.stderr
    assert not (tmp_path / "cache" / "llama").exists() and not (tmp_path / "reame.pyz").exists()


def test_no_cmake_and_no_compiler_stop_the_build_at_once(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    os.symlink(sys.executable, bin_dir / "python3")
    result = run_build(sys.executable, tmp_path, str(bin_dir))
    other = next(arch for arch in build_zipapp.ARCHES if arch != build_zipapp.machine())
    assert_refused(result, tmp_path, f"cmake, a C++ compiler and the {other} cross compiler missing: install with "
                                     f"`apt-get install cmake g++ g++-{other.replace('_', '-')}-linux-gnu`")


def test_no_pip_stops_the_build_at_once(tmp_path):
    venv.create(tmp_path / "venv", with_pip=False)
    result = run_build(str(tmp_path / "venv" / "bin" / "python"), tmp_path, os.environ["PATH"])
    assert_refused(result, tmp_path, "pip missing: install with `apt-get install python3-pip`")


def test_no_package_index_stops_the_build_at_once(tmp_path):
    result = run_build(sys.executable, tmp_path, os.environ["PATH"], PIP_CONFIG_FILE=os.devnull,
                       PIP_INDEX_URL="http://127.0.0.1:9/simple")
    assert_refused(result, tmp_path, "no package index answers pip")
    assert "the llama.cpp source" in result.stderr and "the wheels the .pyz carries" in result.stderr


def test_the_pyz_main_names_its_python_tree_and_bundle(monkeypatch, tmp_path):
    source = build_zipapp.pyz_main("a" * 64, "b" * 64)
    assert f'PYTHON_TREE = "{"a" * 64}"' in source and f'BUNDLE_SHA256 = "{"b" * 64}"' in source
    compile(source, "__main__.py", "exec")
    monkeypatch.setattr(build_zipapp, "ROOT", tmp_path)
    (tmp_path / "pyz_main.py").write_text("PYTHON_TREE = None\n")
    with pytest.raises(build_zipapp.BuildError, match="PYTHON_TREE"):
        build_zipapp.pyz_main("a", "b")


def test_the_python_tree_hash_follows_names_and_bytes(tmp_path):
    (tmp_path / "reame").mkdir()
    (tmp_path / "reame" / "a.py").write_text("x = 1\n")
    first = build_zipapp.python_tree_hash(tmp_path)
    (tmp_path / "reame" / "a.py").write_text("x = 2\n")
    second = build_zipapp.python_tree_hash(tmp_path)
    (tmp_path / "reame" / "a.py").rename(tmp_path / "reame" / "b.py")
    assert len({first, second, build_zipapp.python_tree_hash(tmp_path)}) == 3


def test_the_percentage_of_a_real_aarch64_build_follows_its_steps_where_makes_own_stopped_at_100():
    """tests/fixtures/build-aarch64-portable.log is the build.log of `python build_zipapp.py` cross-compiling
    the portable aarch64 library on a fresh cache (paths shortened): make's own percentage said 100% at the
    tenth of 170 steps; the build's counts every step it planned, in steps of 10 in a log."""
    lines = (ROOT / "tests" / "fixtures" / "build-aarch64-portable.log").read_text().splitlines()
    planned = {line.removeprefix("planned ") for line in lines if line.startswith("planned ")}
    progress = build_zipapp.Progress(planned, started=0.0)
    shown: list[int] = []
    makes_full_at = None
    for line in lines:
        text = progress.line(line, interactive=False)
        if text:
            shown.append(int(re.search(r"compile +(\d+)%", text).group(1)))
        if makes_full_at is None and line.startswith("[100%]"):
            makes_full_at = len(progress.done)
    assert len(planned) == 170 and progress.done == planned
    assert makes_full_at is not None and makes_full_at <= len(planned) // 10
    assert shown == sorted(shown) and shown[-1] == 100 and shown.count(100) == 1
    assert all(later - earlier <= 11 for earlier, later in zip(shown, shown[1:]))


# --- Reame's patches to the pinned source ---------------------------------------------------------------

PATCH = """What the patch does, in words: text before the first file is its description.

--- a/src/one.c
+++ b/src/one.c
@@ -1,3 +1,4 @@
 int a;
-int b;
+int b2;
+int b3;
 int c;
@@ -6,2 +7,2 @@
 int f;
-int g;
+int g2;
--- a/two.h
+++ b/two.h
@@ -1 +1 @@
-old
+new
"""


def test_a_patch_is_applied_hunk_by_hunk_where_it_says(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "one.c").write_text("int a;\nint b;\nint c;\nint d;\nint e;\nint f;\nint g;\n")
    (tmp_path / "two.h").write_text("old\n")
    build_zipapp.apply_patch(PATCH, tmp_path, "0001-test.patch")
    patched = "int a;\nint b2;\nint b3;\nint c;\nint d;\nint e;\nint f;\nint g2;\n"
    assert (tmp_path / "src" / "one.c").read_text() == patched
    assert (tmp_path / "two.h").read_text() == "new\n"


def test_a_patch_made_for_another_source_stops_the_build(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "one.c").write_text("int a;\nint B;\nint c;\nint d;\nint e;\nint f;\nint g;\n")
    (tmp_path / "two.h").write_text("old\n")
    with pytest.raises(build_zipapp.BuildError, match="does not match src/one.c at line 1"):
        build_zipapp.apply_patch(PATCH, tmp_path, "0001-test.patch")


def test_the_unpacked_source_is_redone_when_a_patch_changes(tmp_path, monkeypatch):
    monkeypatch.setattr(build_zipapp, "PATCHES", tmp_path)
    (tmp_path / "0001-a.patch").write_text(PATCH)
    before = build_zipapp.source_pin()
    (tmp_path / "0001-a.patch").write_text(PATCH.replace("+new", "+newer"))
    assert build_zipapp.source_pin() != before
    assert build_zipapp.source_pin().startswith(build_zipapp.SDIST_SHA256)


def test_the_projects_patches_are_well_formed_diffs():
    patches = sorted(build_zipapp.PATCHES.glob("*.patch"))
    assert patches
    for patch in patches:
        text = patch.read_text()
        files = [line[len("+++ b/"):] for line in text.splitlines() if line.startswith("+++ b/")]
        assert files and all(not name.startswith("/") and ".." not in name for name in files)


@pytest.mark.parametrize("text, message", [
    ("--- a/../outside.c\n+++ b/../outside.c\n@@ -1 +1 @@\n-a\n+b\n", "outside the source tree"),
    ("--- a/two.h\n+++ b/two.h\n@@ -1,3 +1,3 @@\n-old\n+new\n", "a hunk ends early"),
    ("--- a/two.h\nno plus line\n", "expected '--- a/FILE' and '\\+\\+\\+ b/FILE'"),
])
def test_a_malformed_or_escaping_patch_stops_the_build(tmp_path, text, message):
    (tmp_path / "two.h").write_text("old\n")
    with pytest.raises(build_zipapp.BuildError, match=message):
        build_zipapp.apply_patch(text, tmp_path, "0002-bad.patch")
    assert (tmp_path / "two.h").read_text() == "old\n"
