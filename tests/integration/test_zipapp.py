"""dist/reame.pyz: copied alone into an empty directory, with an empty HOME and
`python -I` (no site-packages of the user, no environment), it answers a prompt."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
import build_zipapp  # noqa: E402


@pytest.fixture(scope="module")
def pyz(native_libraries, tmp_path_factory) -> Path:
    output = tmp_path_factory.mktemp("dist") / "reame.pyz"
    assert build_zipapp.main(["--output", str(output)]) == 0  # the portable build users get
    return output


def run_isolated(pyz: Path, tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    workdir, home = tmp_path / "empty", tmp_path / "home"
    workdir.mkdir(exist_ok=True)
    home.mkdir(exist_ok=True)
    shutil.copy(pyz, workdir / "reame.pyz")
    env = {"HOME": str(home), "PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    return subprocess.run([sys.executable, "-I", "reame.pyz", *args], cwd=workdir, env=env,
                          capture_output=True, text=True, timeout=300)


def test_the_pyz_alone_answers_a_prompt(pyz, tmp_path, smollm2_path):
    result = run_isolated(pyz, tmp_path, "run", str(smollm2_path), "What is the capital of France?",
                          "--temp", "0", "--max-tokens", "16", "-q")
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
    extracted = list((tmp_path / "home" / ".cache" / "reame" / "lib").iterdir())
    assert len(extracted) == 1 and (extracted[0] / "lib" / "libllama.so").exists()


def test_version_names_pin_build_and_zstandard(pyz, tmp_path):
    result = run_isolated(pyz, tmp_path, "--version")
    assert result.returncode == 0, result.stderr
    assert build_zipapp.LLAMA_COMMIT in result.stdout
    assert "bundled in this .pyz" in result.stdout and "zstandard 0." in result.stdout
    assert "portable build" in result.stdout


def test_racing_first_runs_extract_once_and_both_work(pyz, tmp_path, smollm2_path):
    args = ["run", str(smollm2_path), "Hi", "--temp", "0", "--max-tokens", "4", "-q"]
    workdir, home = tmp_path / "empty", tmp_path / "home"
    workdir.mkdir()
    home.mkdir()
    shutil.copy(pyz, workdir / "reame.pyz")
    env = {"HOME": str(home), "PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    runs = [subprocess.Popen([sys.executable, "-I", "reame.pyz", *args], cwd=workdir, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outputs = [run.communicate(timeout=300) for run in runs]
    assert all(run.returncode == 0 for run in runs), outputs
    entries = list((home / ".cache" / "reame" / "lib").iterdir())
    assert len(entries) == 1, entries  # no leftover temporary directories
