"""Every command in README.md and docs/*.md (the ```sh blocks) is accounted for: run here verbatim with the
real model and the one-file build (or `python -m reame` when dist/reame.pyz was not built), or listed in
ELSEWHERE with what runs it, or, for what needs root on a systemd host or a second machine, with the test
that checks what it installs or runs. A command added to the docs without either fails this test."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import pytest

from tests.live_server import free_port, live_server
from tests.waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PYZ = ROOT / "dist" / "reame.pyz"

# Commands run elsewhere, or not runnable here (prefix -> what runs or checks them).
ELSEWHERE = {
    "python build_zipapp.py": ".ci/run runs the README's (build and run) and --lib; python -m bench all runs "
                              "--bench-tools; the other flags are a 10-minute compile each: their choices are "
                              "unit-tested in tests/unit/test_build_script.py, not built here",
    "python -m pip install -e '.[test]' && python -m pytest": ".ci/run (the README's test command)",
    "git clone": ".ci/run works on a clean clone",
    "python bench/": "python -m bench all; their options are checked by test_benchmark_commands_use_real_options",
    "python -m bench": "bench/__main__.py; tests/unit/test_bench_report.py",
    "sudo ": "needs root on a systemd host, not run here; tests/compat/test_deploy.py checks what it installs (the "
             "unit under systemd-analyze verify, nginx with the snippet in front of a live server)",
    "journalctl ": "needs a systemd host, not run here",
    "echo \"REAME_SERVER_API_KEY=": "writes the unit's environment file as root, not run here",
    "scp ": "needs a second machine, not run here; tests/integration/test_aarch64.py runs the pyz on aarch64 "
            "(qemu-user)",
    "ssh ": "needs a second machine, not run here; tests/integration/test_aarch64.py runs the same command's pyz",
}

FILES = {
    "report.txt": "Quarterly report. Sales rose 4% in the north and fell 2% in the south. Costs were flat. "
                  "The new warehouse opens in March.\n",
    "manual.txt": "The XR-7 router restarts when its reset button is held for ten seconds.\n",
    "faq.txt": "Q: Does the XR-7 support IPv6? A: Yes, from firmware 2.1.\n",
    "prefix.txt": "Release notes for version 3.2 of the billing service:\n",
    "question.txt": "Which is larger, 17 or 71? Answer with the number only.\n",
}


def doc_commands() -> list[tuple[str, str]]:
    """(file, command) for every command line of every ```sh block (comments dropped)."""
    found = []
    for path in DOCS:
        for block in re.findall(r"```sh\n(.*?)```", path.read_text(), re.S):
            for line in block.replace("\\\n", " ").splitlines():  # continued lines joined
                command = re.sub(r"\s+# .*$", "", line).strip()  # a comment after the command
                if command and not command.startswith("#"):
                    found.append((path.name, command))
    return found


def program() -> str:
    return f"{sys.executable} {PYZ}" if PYZ.exists() else f"{sys.executable} -m reame"


def as_run_here(command: str) -> str:
    """The command with `python dist/reame.pyz` / `reame` made this test's program."""
    command = command.replace("python dist/reame.pyz", program())
    return re.sub(r"(^|\$\()reame ", lambda m: m.group(1) + program() + " ", command)


@pytest.fixture
def place(tmp_path):
    for name, text in FILES.items():
        (tmp_path / name).write_text(text)
    env = dict(os.environ, PYTHONPATH=str(ROOT), REAME_CACHE_DIR=str(tmp_path / "kv"),
               REAME_SPECULATIVE_PALIMPSEST_DIR=str(tmp_path / "palimpsest"), REAME_ARCA_DIR=str(tmp_path / "arca"))
    return tmp_path, env


def shell(command: str, place, stdin: str = "", timeout_s: float = 600) -> subprocess.CompletedProcess:
    directory, env = place
    return subprocess.run(["bash", "-c", command], cwd=directory, env=env, input=stdin, capture_output=True,
                          text=True, timeout=timeout_s)


def check_answer(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip(), result.stderr[-2000:]


def run_one_shot(command, place):
    check_answer(shell(as_run_here(command), place))


def run_script_capture(command, place):
    result = shell(as_run_here(command) + '\nprintf "%s" "$summary"', place)
    check_answer(result)


def run_chat(command, place):
    result = shell(as_run_here(command), place, stdin="Say hello.\n/exit\n")
    check_answer(result)


def run_print_config(command, place):
    result = shell(as_run_here(command), place)
    assert result.returncode == 0, result.stderr
    assert "model.context_length" in result.stdout + result.stderr


def run_warm(command, place):
    result = shell(as_run_here(command), place)
    assert result.returncode == 0, result.stderr[-2000:]
    if "--json" in command:
        report = json.loads(result.stdout.splitlines()[0])
        assert report["file"] == "manual.txt" and report["tokens"] > 0


def run_conclave(command, place):
    result = shell(as_run_here(command), place)
    check_answer(result)
    assert re.search(r"CONCLAVE consensus=\d/5", result.stderr), result.stderr[-2000:]


def started(command: str, place, pattern: str) -> tuple[subprocess.Popen, int]:
    """A long-running command in the background, and the port its log says it listens on."""
    directory, env = place
    process = subprocess.Popen(["bash", "-c", "exec " + command], cwd=directory, env=env, stderr=subprocess.PIPE,
                               stdout=subprocess.DEVNULL, text=True)
    assert process.stderr is not None
    for line in process.stderr:
        found = re.search(pattern, line)
        if found:
            # The rest of its log is read too, or a full pipe blocks the daemon's next log line (as live_server).
            threading.Thread(target=process.stderr.read, daemon=True).start()
            return process, int(found.group(1))
    raise AssertionError(f"{command} never said where it listens (exit {process.wait()})")


def stop(process: subprocess.Popen) -> None:
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=60) == 0


def run_web(command, place):
    """The server as the docs start it, through the tests' one way of running a server (tests/live_server.py:
    its log read all along, /health awaited, a graceful stop that exits 0)."""
    directory, env = place
    env["REAME_SERVER_PORT"] = "0"  # 8080 may be taken here; the command is otherwise as written
    with live_server(["bash", "-c", "exec " + as_run_here(command)], cwd=directory, env=env) as server:
        def healthy() -> bool:
            try:
                with urllib.request.urlopen(f"{server.base}/health", timeout=5) as response:
                    return response.status == 200
            except OSError:
                return False
        wait_until(healthy, timeout_s=300)
        with urllib.request.urlopen(f"{server.base}/", timeout=10) as response:
            assert b"<html" in response.read().lower()


def run_arca_default(command, place):
    place[1]["REAME_ARCA_PORT"] = "0"  # 6420 may be taken here
    process, port = started(as_run_here(command), place, r"ARCA listening on 127\.0\.0\.1:(\d+)")
    try:
        ping = subprocess.run(["redis-cli", "-p", str(port), "PING"], capture_output=True, text=True, timeout=30)
        assert ping.stdout.strip() == "PONG"
    finally:
        stop(process)


def run_arca_with_password(command, place):
    """The second ARCA command of docs/arca.md, then its redis-cli line, on a free port and a scratch directory."""
    directory, env = place
    port = free_port()
    env["SECRET"] = "s3cret"
    daemon = as_run_here(command).replace("6420", str(port)).replace("/var/lib/reame-arca", str(directory / "a"))
    process, _ = started(daemon, place, r"ARCA listening on 127\.0\.0\.1:(\d+)")
    try:
        cli_line = next(line for _, line in doc_commands() if line.startswith("redis-cli"))
        result = shell(cli_line.replace("6420", str(port)), place)
        assert result.stdout.strip() == "PONG", result.stdout + result.stderr
    finally:
        stop(process)


def run_check_aof(command, place):
    """docs/arca.md's `--check-aof` then `--check-aof --fix`, on a log damaged in its middle (REAME_ARCA_DIR)."""
    directory, _ = place
    log = directory / "arca" / "appendonly.aof"
    if not log.exists():  # the first of the two commands: make the damaged log both read
        log.parent.mkdir(parents=True, exist_ok=True)
        records = [f"*3\r\n$3\r\nSET\r\n$4\r\nkey{i}\r\n$1\r\nv\r\n".encode() for i in range(20)]
        records[10] = records[10].replace(b"$3", b"$9")
        log.write_bytes(b"".join(records))
    result = shell(as_run_here(command), place)
    if "--fix" in command:
        assert result.returncode == 0 and "moved the file to" in result.stdout, result.stdout + result.stderr
        assert len(list(log.parent.glob("appendonly.aof.damaged-*"))) == 1
    else:
        assert result.returncode == 1 and "damage" in result.stdout, result.stdout + result.stderr


RUN_HERE = {
    'python dist/reame.pyz run smollm2-135m "Write a haiku about CPUs"': run_one_shot,
    'python dist/reame.pyz run qwen2.5-coder-1.5b "Write a Python function that reverses a string" --temp 0':
        run_one_shot,
    "summary=$(python dist/reame.pyz run qwen2.5-coder-1.5b -q --temp 0 - < report.txt)": run_script_capture,
    "python dist/reame.pyz run qwen2.5-coder-1.5b": run_chat,
    "python dist/reame.pyz run qwen2.5-coder-1.5b --print-config": run_print_config,
    'python dist/reame.pyz run qwen2.5-coder-1.5b --ctx 16384 --kv-type q8_0 "…"': run_one_shot,
    "python dist/reame.pyz run qwen2.5-coder-1.5b --serve": run_web,
    "python dist/reame.pyz arca": run_arca_default,
    'python dist/reame.pyz arca --port 6420 --dir /var/lib/reame-arca --max-mb 512 --requirepass "$SECRET"':
        run_arca_with_password,
    'redis-cli -p 6420 -a "$SECRET" PING': None,  # run by run_arca_with_password, against that daemon
    "python dist/reame.pyz arca --check-aof": run_check_aof,
    "python dist/reame.pyz arca --check-aof --fix": run_check_aof,
    "reame warm qwen2.5-coder-1.5b manual.txt faq.txt": run_warm,
    "reame warm qwen2.5-coder-1.5b --as raw prefix.txt": run_warm,
    "reame warm qwen2.5-coder-1.5b --json manual.txt": run_warm,
    'reame run qwen2.5-coder-1.5b "$(cat question.txt)" --best-of 5 --temp 0 -q': run_conclave,
}


def test_every_docs_command_is_run_somewhere():
    uncovered = [f"{name}: {command}" for name, command in doc_commands()
                 if command not in RUN_HERE and not any(command.startswith(prefix) for prefix in ELSEWHERE)]
    assert not uncovered, "docs commands no test runs (add them to RUN_HERE or ELSEWHERE):\n" + "\n".join(uncovered)
    stale = [command for command in RUN_HERE if command not in {c for _, c in doc_commands()}]
    assert not stale, f"RUN_HERE lists commands the docs no longer have: {stale}"


@pytest.mark.parametrize("command", [command for command, runner in RUN_HERE.items() if runner is not None])
def test_the_docs_command_works_as_written(command, place):
    RUN_HERE[command](command, place)


def test_benchmark_commands_use_real_options():
    for name, command in doc_commands():
        found = re.match(r"python (bench/\w+\.py)(.*)$", command)
        if not found:
            continue
        script = ROOT / found.group(1)
        assert script.exists(), f"{name}: {command}: no such script"
        usage = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, cwd=ROOT,
                               timeout=60, env=dict(os.environ, PYTHONPATH=str(ROOT)))
        assert usage.returncode == 0, usage.stderr[-1000:]
        for option in re.findall(r"(?<![\w-])(--[a-z][\w-]*)", found.group(2)):
            assert option in usage.stdout, f"{name}: {command}: {script.name} has no {option}"
