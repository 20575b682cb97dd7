"""Exact answers on one real node (SmolLM2): a repeat is a hit from RAM, and after a restart from disk,
with the identical answer and no token generated; a request that opts out is computed."""

import json
import os
import sys
import urllib.request
from pathlib import Path

from tests.live_server import live_server

ROOT = Path(__file__).resolve().parents[2]
CHAT = {"messages": [{"role": "user", "content": "Name three colours."}], "max_tokens": 24, "temperature": 0}


def ask(base: str, body: dict) -> tuple[str, dict]:
    request = urllib.request.Request(base + "/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return response.headers["X-Reame-Cache"], json.loads(response.read())


def generated(base: str) -> float:
    with urllib.request.urlopen(base + "/stats", timeout=30) as response:
        samples = json.loads(response.read())["samples"]
    return sum(s["value"] for s in samples if s["name"] == "reame_generated_tokens_total")


def test_a_repeat_is_answered_from_ram_then_from_disk_after_a_restart(native_libraries, smollm2_path, tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), REAME_CACHE_ANSWERS_DIR=str(tmp_path / "answers"),
               REAME_CACHE_DIR=str(tmp_path / "kv"), REAME_SPECULATIVE_PALIMPSEST_DIR=str(tmp_path / "pal"))
    command = [sys.executable, "-m", "reame", "run", str(smollm2_path), "--serve", "--port", "0", "--ctx", "2048",
               "--threads", "2"]
    with live_server(command, env=env) as server:
        said, first = ask(server.base, CHAT)
        assert said == "miss" and generated(server.base) == first["usage"]["completion_tokens"]
        said, again = ask(server.base, CHAT)
        assert said == "hit" and again["choices"] == first["choices"]
        assert generated(server.base) == first["usage"]["completion_tokens"]  # nothing more generated
        said, _ = ask(server.base, dict(CHAT, reame={"cache": False}))
        assert said == "bypass" and generated(server.base) == 2 * first["usage"]["completion_tokens"]
    with live_server(command, env=env) as restarted:
        said, after = ask(restarted.base, CHAT)
        assert said == "hit" and after["choices"] == first["choices"] and generated(restarted.base) == 0
