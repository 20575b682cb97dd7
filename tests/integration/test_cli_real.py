"""`python -m reame run` end to end on the real model."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def reame(*args, stdin: str | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "reame", *args], capture_output=True, text=True,
                          input=stdin, env=env, timeout=300)


def test_one_shot_prompt_streams_the_answer_and_a_stats_line(native_libraries, smollm2_path):
    result = reame("run", str(smollm2_path), "What is the capital of France?", "--temp", "0",
                   "--max-tokens", "24", "--threads", "2")
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
    assert "prompt" in result.stderr and "tok/s" in result.stderr and "generated" in result.stderr


def test_quiet_prints_only_the_answer_and_reads_stdin(native_libraries, smollm2_path):
    result = reame("run", str(smollm2_path), "-", "--temp", "0", "--max-tokens", "8", "--quiet",
                   stdin="Say hello.")
    assert result.returncode == 0
    assert result.stdout.strip() and result.stderr == ""


def test_raw_mode_skips_the_chat_template(native_libraries, smollm2_path):
    templated = reame("run", str(smollm2_path), "The sky is", "--temp", "0", "--max-tokens", "8", "-q")
    raw = reame("run", str(smollm2_path), "The sky is", "--temp", "0", "--max-tokens", "8", "-q", "--raw")
    assert templated.returncode == raw.returncode == 0
    assert templated.stdout != raw.stdout
