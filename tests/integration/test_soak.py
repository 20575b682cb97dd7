"""The short soak (bench/soak.py) on the real model: misbehaving and hostile clients against a few slots, and
the server back to its baseline afterwards (no reset, no invalid answer, every attack answered as promised, no
leaked KV, threads or files)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_short_soak_holds_every_check(native_libraries, smollm2_path):
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "soak.py"), "--clients", "16", "--hostile", "4",
                             "--seconds", "10", "--max-queue", "8", "--model", str(smollm2_path)],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "| NO" not in result.stdout
