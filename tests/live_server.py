"""A Reame server in a child process, for tests that talk to it as clients do."""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

LOAD_TIMEOUT_S = 120


def free_port() -> int:
    """A local TCP port nothing listens on (for servers that cannot pick their own)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class LiveServer:
    base: str
    process: subprocess.Popen
    log: list[str] = field(default_factory=list)  # its stderr lines so far
    killed: bool = False  # the test killed it (kill -9): no graceful stop to check

    def kill(self) -> None:
        """SIGKILL, as a crash or the OOM killer would: nothing of the server runs after it."""
        self.killed = True
        self.process.kill()
        self.process.wait(timeout=30)


@contextmanager
def live_server(command: list[str], **popen: object) -> Iterator[LiveServer]:
    """Start `command` (a `reame … --serve --port 0`), wait until /health answers 200, yield it;
    on exit stop it with SIGTERM and check that the graceful stop exits 0. Its stderr is read all along: a
    pipe nobody reads fills (64 KiB: ~1,300 request log lines of a test polling an endpoint) and then blocks
    every thread of the server that logs."""
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, **popen)  # type: ignore[call-overload]
    log: list[str] = []
    base = None
    assert process.stderr is not None
    for line in process.stderr:
        log.append(line)
        found = re.search(r"on (http://127\.0\.0\.1:\d+)", line)
        if found:
            base = found.group(1)
            break
    assert base, "the server did not say where it listens:\n" + "".join(log)
    reader = threading.Thread(target=log.extend, args=(process.stderr,), name="live-server-stderr", daemon=True)
    reader.start()
    deadline = time.monotonic() + LOAD_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            if urllib.request.urlopen(base + "/health", timeout=2).status == 200:
                break
        except OSError:
            time.sleep(0.1)
    server = LiveServer(base, process, log)
    try:
        yield server
    finally:
        if not server.killed:
            process.send_signal(signal.SIGTERM)
        reader.join(timeout=90)  # to the end of its stderr: it has exited
        if not server.killed:
            assert process.wait(timeout=60) == 0, "".join(server.log)  # a graceful stop exits 0


@contextmanager
def smollm2_server(smollm2_path: object, key: str, parallel: int) -> Iterator[str]:
    """`reame run SmolLM2 --serve` with an API key, 2048 tokens of context and 2 threads: its base URL."""
    import os
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    command = [sys.executable, "-m", "reame", "run", str(smollm2_path), "--serve", "--port", "0", "--api-key", key,
               "--parallel", str(parallel), "--ctx", "2048", "--threads", "2"]
    with live_server(command, env=dict(os.environ, PYTHONPATH=str(root))) as live:
        yield live.base


@contextmanager
def model_server(path: object, key: str = "", env: dict[str, str] | None = None) -> Iterator[LiveServer]:
    """`reame run MODEL --serve` (with an API key when `key`), 2048 tokens of context and 2 threads; `env`:
    settings as REAME_* variables."""
    import os
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    command = [sys.executable, "-m", "reame", "run", str(path), "--serve", "--port", "0", "--ctx", "2048",
               "--threads", "2"] + (["--api-key", key] if key else [])
    with live_server(command, env=dict(os.environ, PYTHONPATH=str(root), **(env or {}))) as live:
        yield live


def post_json(base: str, path: str, body: dict, timeout_s: float = 120) -> tuple[dict[str, str], dict]:
    """POST `body` as JSON to a live server; (response headers, the JSON answer)."""
    request = urllib.request.Request(base + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        return dict(response.headers), json.loads(response.read())
