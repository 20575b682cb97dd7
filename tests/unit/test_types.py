"""The type checker over reame/ (and the fake and real backends against the Backend protocol), as configured
in pyproject.toml: an attribute only the fake has, a None passed where a value is needed, a store wrapper that
lacks what its callers read — each was a bug mypy found before a user did."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_mypy_finds_no_type_errors(tmp_path):
    checked = subprocess.run([sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path / "mypy")], cwd=ROOT,
                             capture_output=True, text=True, timeout=600)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "Success: no issues found" in checked.stdout
