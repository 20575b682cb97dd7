"""`python -m reame batch FILE.jsonl` on SmolLM2 through libllama: every answer equals the one a server of the
same model gives the same request, and a run killed with SIGKILL halfway goes on when the command runs again,
each custom_id answered once."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from tests.live_server import model_server, post_json
from tests.waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]
TRIAGE = {"type": "object", "properties": {"team": {"type": "string", "enum": ["billing", "shipping", "account"]},
                                           "urgent": {"type": "boolean"}},
          "required": ["team", "urgent"], "additionalProperties": False}
TICKETS = ["I was charged twice for my order.", "My parcel has not arrived after three weeks.",
           "I cannot log in since I changed my password.", "The invoice shows the wrong address.",
           "The courier left the box in the rain.", "Please delete my account and my data.",
           "Why was my card declined?", "Tracking says delivered but nothing came."]


def body(ticket: str) -> dict:
    return {"messages": [{"role": "system", "content": "Triage the customer's ticket."},
                         {"role": "user", "content": ticket}],
            "max_tokens": 40, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "triage", "schema": TRIAGE}}}


def write_batch(path: Path, count: int) -> None:
    path.write_text("".join(json.dumps({"custom_id": f"ticket-{n}", "method": "POST", "url": "/v1/chat/completions",
                                        "body": body(TICKETS[n % len(TICKETS)] + f" (order {n})")}) + "\n"
                            for n in range(count)))


def command(path: Path, model: Path) -> list[str]:
    return [sys.executable, "-m", "reame", "batch", str(path), "--model", str(model), "--ctx", "2048", "--threads",
            "2", "--json"]


def environment(state: Path) -> dict:
    return dict(os.environ, PYTHONPATH=str(ROOT), REAME_SERVER_BATCH_DIR=str(state))


def answers(path: Path) -> dict[str, dict]:
    return {record["custom_id"]: record["response"] for record in map(json.loads, path.read_text().splitlines())}


def test_the_command_answers_as_the_server_does(native_libraries, smollm2_path, tmp_path):
    source = tmp_path / "tickets.jsonl"
    write_batch(source, 8)
    result = subprocess.run(command(source, smollm2_path), capture_output=True, text=True, timeout=600,
                            env=environment(tmp_path / "state"))
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["status"] == "completed" and (summary["completed"], summary["failed"]) == (8, 0)
    assert summary["output"] == str(tmp_path / "tickets.output.jsonl") and summary["errors"] is None
    assert "of 8 answered" in result.stderr  # the progress
    got = answers(tmp_path / "tickets.output.jsonl")
    assert list(got) == [f"ticket-{n}" for n in range(8)]
    with model_server(smollm2_path, env={"REAME_SERVER_BATCH_DIR": str(tmp_path / "server")}) as server:
        for n in range(8):
            _, alone = post_json(server.base, "/v1/chat/completions", body(TICKETS[n % len(TICKETS)] + f" (order {n})"))
            response = got[f"ticket-{n}"]
            assert response["status_code"] == 200
            assert response["body"]["choices"][0]["message"] == alone["choices"][0]["message"]
            json.loads(alone["choices"][0]["message"]["content"])  # the schema's JSON


def test_a_killed_run_goes_on_where_it_stopped(native_libraries, smollm2_path, tmp_path):
    source = tmp_path / "tickets.jsonl"
    write_batch(source, 16)
    state = tmp_path / "state"
    process = subprocess.Popen(command(source, smollm2_path), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               env=environment(state))
    try:
        def answered() -> int:
            journals = list((state / "batches").glob("batch_*.results"))
            return len(journals[0].read_bytes().splitlines()) if journals else 0
        wait_until(lambda: answered() >= 4, timeout_s=300, what="four answered lines")
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait()
    result = subprocess.run(command(source, smollm2_path), capture_output=True, text=True, timeout=600,
                            env=environment(state))
    assert result.returncode == 0, result.stderr
    assert "going on with batch_" in result.stderr
    ids = [record["custom_id"] for record in
           map(json.loads, (tmp_path / "tickets.output.jsonl").read_text().splitlines())]
    assert ids == [f"ticket-{n}" for n in range(16)]  # each once, in the input's order
