"""OpenAI's Files and Batch APIs on FakeBackend: uploads, batches answered line by line exactly as their routes
answer, owners, malformed lines, cancelling, resuming after a restart with every line answered once."""

import json
import os
import uuid

import pytest

from reame.engine import Engine
from reame.server.batches import Batches, BatchesBusy, parse_lines
from reame.server.client import HttpError
from reame.server.filestore import FileStore
from reame.server.settings import BatchLimits
from tests.fakes.backend import FakeBackend
from tests.waiting import wait_until

from .test_server import Live


def form(fields: dict[str, str], filename: str, data: bytes) -> tuple[bytes, str]:
    """A multipart/form-data body as the openai SDK sends an upload, and its Content-Type."""
    boundary = uuid.uuid4().hex
    parts = [f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n{value}\r\n'.encode()
             for name, value in fields.items()]
    parts.append(f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="{filename}"\r\n'
                 f"Content-Type: application/jsonl\r\n\r\n".encode() + data + b"\r\n")
    return b"".join(parts) + f"--{boundary}--\r\n".encode(), f"multipart/form-data; boundary={boundary}"


def chat_line(custom_id: str, text: str, **extra) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "reame", "messages": [{"role": "user", "content": text}], "max_tokens": 4,
                     "temperature": 0, **extra}}


def jsonl(lines: list) -> bytes:
    return b"".join((line if isinstance(line, bytes) else json.dumps(line).encode()) + b"\n" for line in lines)


class BatchServer(Live):
    def __init__(self, engine, directory, **settings):
        super().__init__(engine, batches=BatchLimits(directory, concurrency=2, **settings.pop("limits", {})),
                         **settings)
        self.app.batches.start()

    def upload(self, data: bytes, headers=None, purpose="batch"):
        body, content_type = form({"purpose": purpose}, "in.jsonl", data)
        response, answer = self.request("POST", "/v1/files", raw=body,
                                        headers={"Content-Type": content_type, **(headers or {})})
        return response.status, json.loads(answer)

    def run(self, lines: list, headers=None) -> dict:
        status, uploaded = self.upload(jsonl(lines), headers)
        assert status == 200, uploaded
        status, batch = self.json("POST", "/v1/batches", {"input_file_id": uploaded["id"], "endpoint":
                                                          "/v1/chat/completions", "completion_window": "24h"},
                                  headers)
        assert status == 200, batch
        wait_until(lambda: self.json("GET", f"/v1/batches/{batch['id']}", headers=headers)[1]["status"]
                   == "completed", what="the batch to complete")
        return self.json("GET", f"/v1/batches/{batch['id']}", headers=headers)[1]

    def records(self, file_id: str, headers=None) -> list:
        response, data = self.request("GET", f"/v1/files/{file_id}/content", headers=headers)
        assert response.status == 200
        return [json.loads(line) for line in data.splitlines()]

    def close(self):
        self.app.batches.close()
        super().close()


@pytest.fixture
def batch_server(engine, tmp_path):
    server = BatchServer(engine, tmp_path)
    yield server
    server.close()


def test_every_output_line_is_the_synchronous_answer(batch_server):
    lines = [chat_line(f"ticket-{n}", f"ticket number {n}") for n in range(6)]
    batch = batch_server.run(lines)
    assert batch["request_counts"] == {"total": 6, "completed": 6, "failed": 0}
    assert batch["error_file_id"] is None and batch["completed_at"] >= batch["created_at"]
    records = {record["custom_id"]: record for record in batch_server.records(batch["output_file_id"])}
    assert set(records) == {line["custom_id"] for line in lines}
    for line in lines:
        status, synchronous = batch_server.json("POST", "/v1/chat/completions", line["body"])
        response = records[line["custom_id"]]["response"]
        assert response["status_code"] == status == 200 and records[line["custom_id"]]["error"] is None
        assert response["body"]["choices"] == synchronous["choices"]
        assert response["body"]["usage"]["completion_tokens"] == synchronous["usage"]["completion_tokens"]


def test_a_batch_line_is_background_work_for_the_engine(batch_server, engine, monkeypatch):
    submitted = []
    submit_together = engine.submit_together

    def recording(requests, sink):
        submitted.extend(request.background for request in requests)
        return submit_together(requests, sink)
    monkeypatch.setattr(engine, "submit_together", recording)
    batch_server.run([chat_line("line", "from a batch")])
    assert batch_server.json("POST", "/v1/chat/completions", chat_line("person", "from a person")["body"])[0] == 200
    assert submitted == [True, False]


def test_malformed_lines_and_refused_requests_go_to_the_error_file(batch_server):
    lines = [chat_line("good", "hello"), b"{not json", {"method": "POST", "url": "/v1/chat/completions"},
             chat_line("good", "a repeated custom_id"), chat_line("streamed", "hi", stream=True),
             {**chat_line("elsewhere", "hi"), "url": "/v1/embeddings"},
             chat_line("refused", "hi", max_tokens=-3)]
    batch = batch_server.run(lines)
    assert batch["request_counts"] == {"total": 7, "completed": 1, "failed": 6}
    errors = batch_server.records(batch["error_file_id"])
    assert [record["custom_id"] for record in errors] == [None, None, "good", "streamed", "elsewhere", "refused"]
    assert all(record["error"]["code"] == "invalid_request" for record in errors[:5])
    refused = errors[5]["response"]
    assert refused["status_code"] == 400 and refused["body"]["error"]["param"] == "max_tokens"
    assert [record["custom_id"] for record in batch_server.records(batch["output_file_id"])] == ["good"]


def test_files_and_batches_belong_to_their_key(engine, tmp_path):
    server = BatchServer(engine, tmp_path, api_keys=("alice-key", "bob-key"))
    try:
        alice, bob = {"Authorization": "Bearer alice-key"}, {"Authorization": "Bearer bob-key"}
        batch = server.run([chat_line("a", "hi")], alice)
        assert server.json("GET", f"/v1/batches/{batch['id']}", headers=bob)[0] == 404
        assert server.json("GET", f"/v1/files/{batch['output_file_id']}", headers=bob)[0] == 404
        assert server.request("GET", f"/v1/files/{batch['output_file_id']}/content", headers=bob)[0].status == 404
        assert server.json("GET", "/v1/batches", headers=bob)[1]["data"] == []
        assert [item["id"] for item in server.json("GET", "/v1/batches", headers=alice)[1]["data"]] == [batch["id"]]
        assert server.upload(b"x\n")[0] == 401  # no key
        status, files = server.json("GET", "/v1/files?purpose=batch_output", headers=alice)
        assert [item["id"] for item in files["data"]] == [batch["output_file_id"]]
        assert server.json("DELETE", f"/v1/files/{batch['input_file_id']}", headers=bob)[0] == 404
        assert server.json("DELETE", f"/v1/files/{batch['input_file_id']}", headers=alice)[1]["deleted"] is True
        assert server.json("GET", f"/v1/files/{batch['input_file_id']}", headers=alice)[0] == 404
    finally:
        server.close()


def test_bad_uploads_and_batch_requests_get_a_clear_4xx(batch_server):
    assert batch_server.upload(b"x\n", purpose="fine-tune")[0] == 400
    assert batch_server.upload(b"x\n", {"Origin": "http://evil.example"})[0] == 403  # another page's form
    response, data = batch_server.request("POST", "/v1/files", raw=b"--x\r\n",
                                          headers={"Content-Type": "multipart/form-data"})
    assert response.status == 400 and json.loads(data)["error"]["code"] == "invalid_multipart"
    response, _ = batch_server.request("POST", "/v1/files", raw=b"purpose=batch", headers={"Content-Type":
                                                                                          "text/plain"})
    assert response.status == 415
    status, uploaded = batch_server.upload(b"\n\n")
    assert status == 200
    for body, param in [({"input_file_id": uploaded["id"], "endpoint": "/v1/chat/completions"}, "input_file_id"),
                        ({"input_file_id": "file-" + "0" * 24, "endpoint": "/v1/chat/completions"}, None),
                        ({"input_file_id": uploaded["id"], "endpoint": "/v1/models"}, "endpoint"),
                        ({"input_file_id": uploaded["id"], "endpoint": "/v1/completions",
                          "completion_window": "1h"}, "completion_window"),
                        ({"input_file_id": ["x"]}, "input_file_id"),
                        ({"input_file_id": uploaded["id"], "endpoint": "/v1/chat/completions",
                          "metadata": {str(n): "v" for n in range(17)}}, "metadata")]:
        status, answer = batch_server.json("POST", "/v1/batches", body)
        assert 400 <= status < 500 and answer["error"]["param"] == param, (body, answer)
    assert batch_server.json("GET", "/v1/batches/batch_../../etc")[0] == 404
    assert batch_server.json("GET", "/v1/files/../../etc/passwd")[0] == 404
    assert batch_server.json("GET", "/v1/batches?limit=0")[0] == 400
    for limit in ("9" * 5000, "%C2%B2", "-1"):  # past int()'s digits, a superscript digit, a sign
        assert batch_server.json("GET", f"/v1/files?limit={limit}")[0] == 400


def test_an_upload_past_the_storage_budget_is_refused(engine, tmp_path):
    server = BatchServer(engine, tmp_path, limits={"storage_bytes": 1000})
    try:
        assert server.upload(b"x" * 600)[0] == 200
        status, answer = server.upload(b"y" * 600)
        assert status == 413 and answer["error"]["code"] == "storage_full"
    finally:
        server.close()


def test_a_cancelled_batch_says_what_never_ran(tmp_path):
    gate_open = []
    with Engine(FakeBackend(n_ctx=1024, n_seq_max=4)) as engine:
        server = BatchServer(engine, tmp_path)
        server.app.batches.may_start = lambda: bool(gate_open)  # nothing starts until the test says
        try:
            status, uploaded = server.upload(jsonl([chat_line(f"c{n}", "hi") for n in range(3)]))
            status, batch = server.json("POST", "/v1/batches", {"input_file_id": uploaded["id"],
                                                                "endpoint": "/v1/chat/completions"})
            assert batch["status"] == "in_progress"
            response, metrics = server.request("GET", "/metrics")
            assert f'reame_batch_requests{{batch="{batch["id"]}",state="left"}} 3' in metrics.decode()
            status, cancelling = server.json("POST", f"/v1/batches/{batch['id']}/cancel")
            assert status == 200 and cancelling["status"] in ("cancelling", "cancelled")
            wait_until(lambda: server.json("GET", f"/v1/batches/{batch['id']}")[1]["status"] == "cancelled")
            done = server.json("GET", f"/v1/batches/{batch['id']}")[1]
            assert done["cancelled_at"] and done["output_file_id"] is None
            errors = server.records(done["error_file_id"])
            assert sorted(record["custom_id"] for record in errors) == ["c0", "c1", "c2"]
            assert {record["error"]["code"] for record in errors} == {"batch_cancelled"}
            assert server.json("POST", f"/v1/batches/{batch['id']}/cancel")[0] == 409
        finally:
            server.close()


class Recorder:
    """run_line for a Batches without a server: answers each line with its custom text, and counts."""

    def __init__(self):
        self.asked: list[str] = []

    def __call__(self, owner, url, body, gone):
        text = json.loads(body)["messages"][0]["content"]
        self.asked.append(text)
        return 200, {"text": text}


def test_a_line_told_not_now_runs_again_later(tmp_path):
    answers = [(503, {"error": {"code": "model_busy"}}), (429, {"error": {}}), (200, {"text": "at last"})]
    asked = []

    def busy_then_free(owner, url, body, gone):
        asked.append(url)
        return answers[len(asked) - 1]
    files = FileStore(tmp_path / "files", 1 << 20)
    batches = Batches(tmp_path / "batches", files, BatchLimits(tmp_path), busy_then_free)
    record = files.create("", jsonl([chat_line("only", "hi")]), "in.jsonl", "batch")
    batch = batches.create("", record.id, "/v1/chat/completions", "24h", None)
    batches.start()
    try:
        wait_until(lambda: batches.get("", batch["id"])["status"] == "completed")
    finally:
        batches.close()
    assert len(asked) == 3 and batches.get("", batch["id"])["request_counts"]["completed"] == 1


def test_a_restart_answers_every_line_exactly_once(tmp_path):
    """A batch whose journal holds some answers (the last one torn by the crash) resumes with only the rest."""
    files = FileStore(tmp_path / "files", 1 << 20)
    first = Recorder()
    batches = Batches(tmp_path / "batches", files, BatchLimits(tmp_path), first, may_start=lambda: False)
    data = jsonl([chat_line(f"r{n}", f"text {n}") for n in range(5)])
    record = files.create("", data, "in.jsonl", "batch")
    batch = batches.create("", record.id, "/v1/chat/completions", "24h", None)
    lines, _ = parse_lines(data, "/v1/chat/completions", BatchLimits())
    journal = tmp_path / "batches" / f"{batch['id']}.results"
    with open(journal, "a") as out:  # two lines answered before the crash, a third torn mid-append
        for line in lines[:2]:
            out.write(json.dumps({"index": line.index, "record": {"custom_id": line.custom_id, "response": {
                "status_code": 200, "body": {"text": "before"}}, "error": None}}) + "\n")
        out.write('{"index": 2, "rec')
    with pytest.raises(BatchesBusy):  # one process runs a directory's batches
        Batches(tmp_path / "batches", files, BatchLimits(tmp_path), Recorder())
    batches.close()  # the crash
    second = Recorder()
    resumed = Batches(tmp_path / "batches", FileStore(tmp_path / "files", 1 << 20), BatchLimits(tmp_path),
                      second)
    assert resumed.get("", batch["id"])["request_counts"]["completed"] == 2
    resumed.start()
    try:
        wait_until(lambda: resumed.get("", batch["id"])["status"] == "completed")
    finally:
        resumed.close()
    assert sorted(second.asked) == ["text 2", "text 3", "text 4"] and first.asked == []
    done = resumed.get("", batch["id"])
    output = resumed.files.content(resumed.files.get("", done["output_file_id"])).decode().splitlines()
    assert [json.loads(line)["custom_id"] for line in output] == ["r0", "r1", "r2", "r3", "r4"]
    assert os.stat(journal).st_mode & 0o077 == 0


def test_lines_sharing_a_prefix_run_side_by_side():
    system = {"role": "system", "content": "Triage the ticket."}
    lines = [{"custom_id": str(n), "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": "m", "messages": ([system] if n % 2 else []) + [{"role": "user", "content": f"t{n}"}]}}
             for n in range(6)]
    parsed, errors = parse_lines(jsonl(lines), "/v1/chat/completions", BatchLimits())
    assert errors == []
    order = [line.custom_id for line in sorted(parsed, key=lambda line: (line.order, line.index))]
    assert order[:3] == ["1", "3", "5"] or order[3:] == ["1", "3", "5"]


def test_an_input_past_the_line_limits_is_refused():
    with pytest.raises(HttpError) as refused:
        parse_lines(jsonl([chat_line(str(n), "x") for n in range(3)]), "/v1/chat/completions",
                    BatchLimits(max_lines=2))
    assert refused.value.status == 400 and refused.value.code == "too_many_lines"
    parsed, errors = parse_lines(jsonl([chat_line("long", "x" * 500)]), "/v1/chat/completions",
                                 BatchLimits(max_line_bytes=100))
    assert parsed == [] and "at most 100" in errors[0]["record"]["error"]["message"]
