"""The one .pyz on an ARM machine, without ARM hardware: a minimal Debian arm64 root (tests/aarch64_root.py,
made by .ci/run) and its python3 under qemu-aarch64-static, as a Cortex-A72 (armv8.0, a Raspberry Pi 4)
and as a Neoverse-N1 (the free-tier Ampere A1 server). Emulation is slow: a few tokens each."""

import shutil
import subprocess

import pytest

from tests.aarch64_root import READY, default_root

QEMU = shutil.which("qemu-aarch64-static")
ROOT = default_root()
pytestmark = pytest.mark.skipif(not QEMU or not (ROOT / READY).exists(),
                                reason="needs qemu-aarch64-static and an arm64 root: python tests/aarch64_root.py")


def run_arm(pyz, tmp_path, cpu, *args, timeout=900):
    workdir, home = tmp_path / "empty", tmp_path / "home"
    workdir.mkdir(exist_ok=True)
    home.mkdir(exist_ok=True)
    shutil.copy(pyz, workdir / "reame.pyz")
    env = {"HOME": str(home), "PATH": "/usr/bin:/bin", "QEMU_CPU": cpu}
    return subprocess.run([QEMU, "-L", str(ROOT), str(ROOT / "usr/bin/python3"), "-I", "-S", "reame.pyz", *args],
                          cwd=workdir, env=env, capture_output=True, text=True, timeout=timeout)


def test_the_pyz_says_what_it_runs_on_arm(pyz, tmp_path):
    result = run_arm(pyz, tmp_path, "cortex-a72", "--version")
    assert result.returncode == 0, result.stderr
    assert "linux-aarch64" in result.stdout and "bundled in this .pyz" in result.stdout
    assert "portable build, CPU variant chosen at run time from armv8.0_1" in result.stdout
    assert "zstandard 0.25.0" in result.stdout


@pytest.mark.parametrize("cpu", ["cortex-a72", "neoverse-n1"])
def test_the_pyz_answers_a_prompt_on_arm(pyz, tmp_path, smollm2_path, cpu):
    result = run_arm(pyz, tmp_path, cpu, "run", str(smollm2_path), "Say hello.", "--raw", "--temp", "0",
                     "--max-tokens", "3", "--threads", "2", "--ctx", "256")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() and "generated 3 tokens" in result.stderr
    entries = sorted(path.name for path in (tmp_path / "home" / ".cache" / "reame" / "lib").iterdir())
    assert len(entries) == 2, entries  # the natives and the compiled Python files, nothing else
    extracted = tmp_path / "home" / ".cache" / "reame" / "lib" / next(name for name in entries
                                                                     if not name.endswith("-python"))
    assert extracted.name.endswith("-aarch64") and (extracted / "lib" / "libgomp.so.1").exists()
