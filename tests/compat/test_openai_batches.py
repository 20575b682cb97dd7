"""OpenAI's Batch API through the real `openai` SDK against a live Reame on SmolLM2-135M: an upload, a batch of
ticket-triage requests with a JSON schema, its output equal to the synchronous answers; a server killed with
kill -9 halfway and started again finishes the batch with every custom_id answered exactly once."""

import io
import json

import openai
import pytest

from tests.live_server import model_server
from tests.waiting import wait_until

MODEL = "smollm2-135m"
SCHEMA = {"type": "object", "properties": {"team": {"type": "string", "enum": ["billing", "shipping", "account"]},
                                           "urgent": {"type": "boolean"}},
          "required": ["team", "urgent"], "additionalProperties": False}
TICKETS = ["I was charged twice for my order.", "My parcel has not arrived after two weeks.",
           "I cannot log in since I changed my email.", "Please refund the duplicate payment today!",
           "The tracking number does not work.", "How do I delete my account?", "The invoice shows the wrong VAT.",
           "The box arrived crushed.", "My password reset email never comes.", "Cancel my subscription now."]


def triage_body(ticket: str, max_tokens: int = 24) -> dict:
    return {"model": MODEL, "temperature": 0, "max_tokens": max_tokens,
            "messages": [{"role": "system", "content": "Route the support ticket to a team."},
                         {"role": "user", "content": ticket}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "triage", "schema": SCHEMA}}}


def input_file(bodies: list[dict]) -> io.BytesIO:
    lines = [{"custom_id": f"ticket-{n}", "method": "POST", "url": "/v1/chat/completions", "body": body}
             for n, body in enumerate(bodies)]
    return io.BytesIO("".join(json.dumps(line) + "\n" for line in lines).encode())


def start(path, directory, key=""):
    # Answers computed, not kept: a synchronous answer is compared with a batch's computation, not its copy.
    return model_server(path, key, env={"REAME_SERVER_BATCH_DIR": str(directory), "REAME_CACHE_ANSWERS": "0",
                                             "REAME_SERVER_BATCH_CONCURRENCY": "1"})


def finished(client: openai.OpenAI, batch_id: str, status: str = "completed", timeout_s: float = 600):
    wait_until(lambda: client.batches.retrieve(batch_id).status in (status, "failed"), timeout_s,
               f"the batch to be {status}")
    return client.batches.retrieve(batch_id)


def test_a_triage_batch_equals_the_synchronous_answers(native_libraries, smollm2_path, tmp_path):
    with start(smollm2_path, tmp_path, "batch-key") as live:
        client = openai.OpenAI(base_url=live.base + "/v1", api_key="batch-key", max_retries=0)
        uploaded = client.files.create(file=("tickets.jsonl", input_file([triage_body(t) for t in TICKETS])),
                                       purpose="batch")
        assert uploaded.purpose == "batch" and uploaded.bytes > 0
        batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                      completion_window="24h", metadata={"job": "triage"})
        assert batch.status == "in_progress" and batch.metadata == {"job": "triage"}
        batch = finished(client, batch.id)
        assert batch.status == "completed" and batch.error_file_id is None
        assert batch.request_counts.total == batch.request_counts.completed == len(TICKETS)
        assert batch.id in [listed.id for listed in client.batches.list()]
        records = [json.loads(line) for line in client.files.content(batch.output_file_id).text.splitlines()]
        assert sorted(record["custom_id"] for record in records) == sorted(f"ticket-{n}" for n in range(10))
        for record in records:
            ticket = TICKETS[int(record["custom_id"].split("-")[1])]
            synchronous = client.chat.completions.create(**triage_body(ticket))
            assert record["response"]["status_code"] == 200 and record["error"] is None
            said = record["response"]["body"]["choices"][0]["message"]["content"]
            assert said == synchronous.choices[0].message.content
            if record["response"]["body"]["choices"][0]["finish_reason"] == "stop":
                assert json.loads(said)["team"] in ("billing", "shipping", "account")
            assert said.startswith("{")
        with pytest.raises(openai.NotFoundError):
            openai.OpenAI(base_url=live.base + "/v1", api_key="batch-key", max_retries=0).batches.retrieve(
                "batch_" + "0" * 24)


def test_a_server_killed_halfway_finishes_the_batch_with_each_line_answered_once(native_libraries, smollm2_path,
                                                                                  tmp_path):
    bodies = [triage_body(f"{TICKETS[n % len(TICKETS)]} (case {n})", max_tokens=48) for n in range(24)]
    with start(smollm2_path, tmp_path) as live:
        client = openai.OpenAI(base_url=live.base + "/v1", api_key="none", max_retries=0)
        uploaded = client.files.create(file=("tickets.jsonl", input_file(bodies)), purpose="batch")
        batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                      completion_window="24h")
        wait_until(lambda: client.batches.retrieve(batch.id).request_counts.completed >= 6, 300,
                   "a quarter of the batch")
        live.kill()
    with start(smollm2_path, tmp_path) as live:
        client = openai.OpenAI(base_url=live.base + "/v1", api_key="none", max_retries=0)
        resumed = client.batches.retrieve(batch.id)
        assert resumed.request_counts.completed < len(bodies)  # it was killed halfway, not after the end
        done = finished(client, batch.id)
        assert done.status == "completed" and done.request_counts.completed == len(bodies)
        records = [json.loads(line) for line in client.files.content(done.output_file_id).text.splitlines()]
        custom_ids = [record["custom_id"] for record in records]
        assert sorted(custom_ids) == sorted(f"ticket-{n}" for n in range(len(bodies)))  # each exactly once
        assert any("resumes" in line for line in live.log)
