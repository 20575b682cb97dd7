"""dist/reame.pyz: copied alone into an empty directory, with an empty HOME and
`python -I -S` (no environment, no site-packages at all: the standard library
only), it answers a prompt under every supported CPython minor installed on
this machine."""

import json
import os
import shutil
import struct
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
import build_zipapp  # noqa: E402
from reame.cache.store import HEADER  # noqa: E402
from reame.native import machine, python_tag  # noqa: E402
from tests.live_server import live_server, post_json  # noqa: E402

ISOLATED = ("-I", "-S")
CODEC = struct.Struct("<I")
CODEC_OFFSET = struct.calcsize("<8sI32sI")  # a snapshot header's codec field: 0 raw, 1 zstd
assert HEADER.format.startswith("<8sI32sII")


def installed_python(minor: str) -> str | None:
    """The real interpreter of a CPython minor (on PATH or under pyenv), never a shim, or None."""
    pyenv = Path(os.environ.get("PYENV_ROOT") or Path.home() / ".pyenv")
    candidates = [shutil.which(f"python{minor}"), *sorted(pyenv.glob(f"versions/{minor}.*/bin/python{minor}"))]
    for candidate in filter(None, candidates):
        result = subprocess.run([str(candidate), "-c", "import sys; print(sys.executable)"],
                                capture_output=True, text=True)
        if result.returncode == 0:
            return result.stdout.strip()
    return None


@pytest.fixture(params=build_zipapp.PYTHON_MINORS)
def python(request) -> str:
    found = installed_python(request.param)
    if found is None:
        pytest.skip(f"CPython {request.param} is not installed here")
    return found


def isolated(pyz: Path, tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """An empty working directory holding only the .pyz, and an environment with an empty HOME."""
    workdir, home = tmp_path / "empty", tmp_path / "home"
    workdir.mkdir(exist_ok=True)
    home.mkdir(exist_ok=True)
    shutil.copy(pyz, workdir / "reame.pyz")
    return workdir, {"HOME": str(home), "PATH": os.environ.get("PATH", "/usr/bin:/bin")}


def run_isolated(python: str, pyz: Path, tmp_path: Path, *args: str,
                 flags: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    workdir, env = isolated(pyz, tmp_path)
    return subprocess.run([python, *ISOLATED, *flags, "reame.pyz", *args], cwd=workdir, env=env,
                          capture_output=True, text=True, timeout=300)


def test_the_pyz_alone_answers_a_prompt_under_each_python(pyz, python, tmp_path, smollm2_path):
    result = run_isolated(python, pyz, tmp_path, "run", str(smollm2_path),
                          "What is the capital of France? Answer in one word.",
                          "--temp", "0", "--max-tokens", "16", "-q")
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
    natives, tree = extracted_parts(tmp_path)
    assert (natives / "lib" / "libllama.so").exists()
    tags = sorted(path.name for path in (natives / "python").iterdir())
    assert tags == ["cp" + minor.replace(".", "") for minor in build_zipapp.PYTHON_MINORS]
    assert (tree / "reame" / "cli.py").exists() and list(tree.glob(".compiled-cpython-3*-O0"))


def extracted_parts(tmp_path: Path) -> tuple[Path, Path]:
    """What a first run extracted under the empty HOME: this machine's native parts, and the Python
    files (compiled), and nothing else (no leftover temporary directory)."""
    entries = sorted((tmp_path / "home" / ".cache" / "reame" / "lib").iterdir())
    assert len(entries) == 2, entries
    natives, tree = sorted(entries, key=lambda entry: entry.name.endswith("-python"))
    assert natives.name.endswith("-" + machine()) and tree.name.endswith("-python")
    return natives, tree


def test_a_warm_run_imports_compiled_code_only(pyz, python, tmp_path, smollm2_path):
    """zipimport compiles every module from source on every start; a warm run must compile nothing. The warm
    run asks another prompt: a repeated one is answered from the answer cache before jinja2 or libllama load."""
    first = ("run", str(smollm2_path), "Hi", "--max-tokens", "1", "-q")
    assert run_isolated(python, pyz, tmp_path, *first).returncode == 0
    _, tree = extracted_parts(tmp_path)
    warm = run_isolated(python, pyz, tmp_path, "run", str(smollm2_path), "Hello", "--max-tokens", "1", "-q",
                        flags=("-v",))
    assert warm.returncode == 0, warm.stderr[-2000:]
    loaded = [line for line in warm.stderr.splitlines() if line.startswith("# code object from ")]
    from_tree = [line for line in loaded if str(tree) in line]
    assert any("reame/__pycache__/cli." in line for line in from_tree)
    assert any("jinja2/__pycache__/" in line for line in from_tree)
    compiled_from_source = [line for line in loaded if not line.rstrip("'").endswith(".pyc")]
    assert compiled_from_source == []
    assert "loaded from Zip" not in warm.stderr


def test_without_a_usable_cache_it_runs_from_the_pyz_and_says_so(pyz, tmp_path, smollm2_path):
    """A cache it cannot write (here a path under a file) costs speed, never the answer."""
    workdir, env = isolated(pyz, tmp_path)
    blocked = tmp_path / "not-a-directory"
    blocked.write_text("")
    result = subprocess.run([sys.executable, *ISOLATED, "reame.pyz", "run", str(smollm2_path), "Hi", "--temp", "0",
                             "--max-tokens", "4", "-q"], cwd=workdir, env={**env, "REAME_CACHE": str(blocked / "c")},
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()
    assert result.stderr.count("cannot keep compiled Python") == 1


def test_version_names_pin_build_and_this_pythons_zstandard(pyz, python, tmp_path):
    result = run_isolated(python, pyz, tmp_path, "--version")
    assert result.returncode == 0, result.stderr
    assert build_zipapp.LLAMA_COMMIT in result.stdout
    assert "bundled in this .pyz" in result.stdout and "portable build" in result.stdout
    assert f"zstandard {build_zipapp.ZSTANDARD_VERSION}" in result.stdout


def test_racing_first_runs_extract_once_and_both_work(pyz, tmp_path, smollm2_path):
    args = ["run", str(smollm2_path), "Hi", "--temp", "0", "--max-tokens", "4", "-q"]
    workdir, env = isolated(pyz, tmp_path)
    runs = [subprocess.Popen([sys.executable, *ISOLATED, "reame.pyz", *args], cwd=workdir, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outputs = [run.communicate(timeout=300) for run in runs]
    assert all(run.returncode == 0 for run in runs), outputs
    extracted_parts(tmp_path)


def test_under_a_python_without_zstandard_it_serves_caches_raw_and_saves_sessions(pyz, tmp_path, smollm2_path):
    workdir, env = isolated(pyz, tmp_path)
    assert subprocess.run([sys.executable, *ISOLATED, "reame.pyz", "--version"], cwd=workdir, env=env,
                          capture_output=True, timeout=120).returncode == 0
    natives, _ = extracted_parts(tmp_path)
    shutil.rmtree(natives / "python" / python_tag())  # as under a Python minor the file has no build for
    version = subprocess.run([sys.executable, *ISOLATED, "reame.pyz", "--version"], cwd=workdir, env=env,
                             capture_output=True, text=True, timeout=120)
    assert "zstandard missing (snapshots stored uncompressed)" in version.stdout
    command = [sys.executable, *ISOLATED, "reame.pyz", "run", str(smollm2_path), "--serve", "--port", "0",
               "--ctx", "2048", "--threads", "2"]
    with live_server(command, cwd=workdir, env=env) as live:
        document = "Every line of this document repeats what the line before it said. " * 20
        answer = post(live.base, "/v1/completions", {"prompt": document + "Summary:", "max_tokens": 4})
        assert answer["usage"]["prompt_tokens"] > 200
        session = post(live.base, "/v1/sessions", {"id": "no-zstd"})["id"]
        post(live.base, "/v1/chat/completions", {"session": session, "max_tokens": 4,
                                                 "messages": [{"role": "user", "content": document}]})
        assert post(live.base, f"/v1/sessions/{session}/save", {})["saved"] is True
        with urllib.request.urlopen(live.base + "/", timeout=30) as page:  # the web page travels in the file
            assert page.read() == (ROOT / "reame" / "web" / "index.html").read_bytes()
    log = "".join(live.log)
    assert "Traceback" not in log and log.count("zstandard module is not available") == 1
    cache = tmp_path / "home" / ".cache" / "reame"
    for saved in [*cache.glob("kv/*.kvs"), *cache.glob("sessions/*/no-zstd.session")]:
        assert CODEC.unpack_from(saved.read_bytes(), CODEC_OFFSET)[0] == 0  # stored raw
    assert list(cache.glob("kv/*.kvs")) and list(cache.glob("sessions/*/no-zstd.session"))


def post(base: str, path: str, body: dict) -> dict:
    return post_json(base, path, body)[1]


def place_model(source: Path, target: Path) -> Path:
    """`source` at `target` (a hard link where the filesystem allows one, else a copy)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(source, target)
    except OSError:
        shutil.copy(source, target)
    return target


CONFIG_PLACES = ("$REAME_CONFIG", "config/reame.conf", "reame.conf", "~/.config/reame/reame.conf", None)


@pytest.mark.parametrize("place", CONFIG_PLACES)
def test_bare_serve_reads_the_first_config_found_else_serves_the_default_model(pyz, tmp_path, smollm2_path, place):
    """`python reame.pyz --serve` in a directory holding only the file, with an empty HOME: each place of
    the search serves its config's model (every later place names a model that does not exist, so reading
    the wrong one fails); with none, the catalog's default model, from where a first run downloads it."""
    workdir, env = isolated(pyz, tmp_path)
    home = Path(env["HOME"])
    paths = {"$REAME_CONFIG": tmp_path / "mine.conf", "config/reame.conf": workdir / "config" / "reame.conf",
             "reame.conf": workdir / "reame.conf", "~/.config/reame/reame.conf": home / ".config/reame/reame.conf"}
    for later in CONFIG_PLACES[CONFIG_PLACES.index(place) + 1:]:
        if later is not None:
            paths[later].parent.mkdir(parents=True, exist_ok=True)
            paths[later].write_text(f"[model]\npath = {tmp_path / 'not-this-one.gguf'}\n")
    flags: tuple[str, ...] = ("--port", "0")
    if place is None:
        place_model(smollm2_path, home / ".reame" / "models" / smollm2_path.name)
        served, said = "smollm2-135m", "the catalog's default, smollm2-135m, as `reame run smollm2-135m --serve`"
    else:
        model = place_model(smollm2_path, tmp_path / f"chosen-{CONFIG_PLACES.index(place)}.gguf")
        paths[place].parent.mkdir(parents=True, exist_ok=True)
        paths[place].write_text(f"[model]\npath = {model}\nthreads = 2\n[server]\nport = 0\n")
        if place == "$REAME_CONFIG":
            env["REAME_CONFIG"] = str(paths[place])
        served, said, flags = model.stem, "config: " + ("REAME_CONFIG=" if place == "$REAME_CONFIG" else "found "), ()
    with live_server([sys.executable, *ISOLATED, "reame.pyz", "--serve", *flags], cwd=workdir, env=env) as live:
        with urllib.request.urlopen(live.base + "/v1/models", timeout=30) as response:
            assert [entry["id"] for entry in json.loads(response.read())["data"]] == [served]
        answer = post(live.base, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                                          "max_tokens": 4})
        assert answer["usage"]["completion_tokens"] >= 1
    assert said in "".join(live.log)


def test_under_a_permissive_umask_the_extracted_code_is_private(pyz, python, tmp_path):
    """Issue 49, finding 7: under umask 000 the tree and natives were 777/666, and a .pyc another local user
    planted ran as root at the next --version."""
    workdir, env = isolated(pyz, tmp_path)
    result = subprocess.run(["sh", "-c", f"umask 000 && exec {python} -I -S reame.pyz --version"], cwd=workdir,
                            env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    lib = tmp_path / "home" / ".cache" / "reame" / "lib"
    shared = [path for path in lib.rglob("*") if path.lstat().st_mode & 0o022]
    assert shared == [] and any(lib.glob("*-python")) and any(lib.glob(f"*-{machine()}"))


@pytest.mark.parametrize("where", ["python", "native"])
def test_code_another_user_could_write_is_refused_before_anything_is_imported(pyz, tmp_path, where):
    first = run_isolated(sys.executable, pyz, tmp_path, "--version")
    assert first.returncode == 0, first.stderr
    lib = tmp_path / "home" / ".cache" / "reame" / "lib"
    (tree,) = lib.glob("*-python" if where == "python" else f"*-{machine()}")
    planted = next(path for path in tree.rglob("*.pyc" if where == "python" else "*.so*"))
    assert tree.stat().st_mode & 0o777 == 0o700  # as extracted: no one else may enter it

    def opened_up() -> None:  # as an older version left it: others may enter, and one file is theirs to write
        tree.chmod(0o755)
        planted.chmod(0o666)

    def closed_again() -> None:
        planted.chmod(0o600)
        tree.chmod(0o700)
    for attack, undo in ((opened_up, closed_again),
                         (lambda: os.chown(tree, 65534, 65534), lambda: os.chown(tree, 0, 0)),
                         (lambda: lib.chmod(0o777), lambda: lib.chmod(0o700))):
        attack()
        refused = run_isolated(sys.executable, pyz, tmp_path, "--version")
        assert refused.returncode == 1 and "refusing to run code" in refused.stderr, refused.stderr
        assert str(lib) in refused.stderr and refused.stdout == ""
        undo()
    tree.chmod(0o755)  # entered by others, but nothing in it theirs to write: checked file by file, and run
    assert run_isolated(sys.executable, pyz, tmp_path, "--version").returncode == 0
