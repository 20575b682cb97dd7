"""`reame batch FILE.jsonl` on FakeBackend: the output equals what the server answers, malformed lines go to the
error file, an interrupted run goes on where it stopped (each line answered once), results an earlier run never
wrote are written, and the progress a person reads."""

import hashlib
import io
import json

import pytest

from reame.batch_file import (OWNER, Progress, batch_input, earlier_batch, endpoint_of, progress_line, read_input,
                              result_paths, run_batch_file, short_duration)
from reame.engine import Engine
from reame.errors import ConfigError
from reame.server.app import App
from reame.server.batches import Batch, Batches
from reame.server.filestore import FileStore
from reame.server.models import ModelPool, ServedModel
from reame.server.settings import BatchLimits, ServerSettings

from tests.fakes.backend import FakeBackend, default_rule

from .test_batches import chat_line, jsonl
from .test_server import FAKE_FACTS, Live


def pool(engine) -> ModelPool:
    """One model, not loaded yet (the command loads it), whose engine is `engine`."""
    return ModelPool([ServedModel("reame", facts=FAKE_FACTS)], lambda _model: engine)


def settings(directory, **limits) -> ServerSettings:
    return ServerSettings(port=0, request_log=False, batches=BatchLimits(directory, **limits))


def quiet(_batch) -> None:
    pass


def given(path):
    return batch_input(path, 1 << 20, None)


@pytest.fixture
def source(tmp_path):
    path = tmp_path / "tickets.jsonl"
    path.write_bytes(jsonl([chat_line(f"t{n}", f"ticket number {n}") for n in range(5)] + [b"{not json"]))
    return path


def test_the_output_is_what_the_server_answers_and_malformed_lines_are_errors(engine, tmp_path, source):
    destinations = result_paths(source, None, None)
    outcome = run_batch_file(pool(engine), settings(tmp_path / "state"), given(source), destinations, quiet)
    assert outcome.batch["status"] == "completed" and not outcome.whole
    assert outcome.batch["request_counts"] == {"total": 6, "completed": 5, "failed": 1}
    assert (outcome.output, outcome.errors) == (tmp_path / "tickets.output.jsonl", tmp_path / "tickets.errors.jsonl")
    answers = [json.loads(line) for line in outcome.output.read_text().splitlines()]
    assert [answer["custom_id"] for answer in answers] == [f"t{n}" for n in range(5)]
    live = Live(engine)
    try:
        for n, answer in enumerate(answers):
            status, alone = live.json("POST", "/v1/chat/completions", chat_line("", f"ticket number {n}")["body"])
            assert status == answer["response"]["status_code"] == 200
            assert answer["response"]["body"]["choices"] == alone["choices"]
    finally:
        live.close()
    [error] = [json.loads(line) for line in outcome.errors.read_text().splitlines()]
    assert error["custom_id"] is None and error["error"]["code"] == "invalid_request"
    assert FileStore(tmp_path / "state" / "files", 1 << 20).listed(OWNER) == []  # the user has them: none kept


def test_an_interrupted_run_goes_on_where_it_stopped_and_answers_each_line_once(engine, tmp_path, source):
    state = tmp_path / "state"

    def interrupt(batch):
        if batch["request_counts"]["completed"] >= 2:
            raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        run_batch_file(pool(engine), settings(state), given(source), result_paths(source, None, None), interrupt)
    seen = []
    outcome = run_batch_file(pool(engine), settings(state), given(source), result_paths(source, None, None),
                             seen.append)
    assert seen[0]["id"] == outcome.batch["id"] and seen[0]["request_counts"]["completed"] >= 2  # the same batch
    answers = [json.loads(line)["custom_id"] for line in outcome.output.read_text().splitlines()]
    assert answers == [f"t{n}" for n in range(5)]


def test_results_an_earlier_run_never_wrote_are_written_without_answering_again(tmp_path, source):
    calls = []

    def counted(history):
        calls.append(len(history))
        return default_rule(history)
    state = tmp_path / "state"
    engine = Engine(FakeBackend(n_ctx=1024, n_seq_max=4, rule=counted)).start()
    files = FileStore(state / "files", 1 << 20)
    served = pool(engine)
    served.preload(served.default)
    app = App(settings(state), served)
    app.ready = True
    data = source.read_bytes()
    record = files.create(OWNER, data, source.name, "batch")
    digest = hashlib.sha256(data).hexdigest()
    app.batches.close()
    runs = Batches(state / "batches", files, BatchLimits(state), app.answer_line)
    made = runs.create(OWNER, record.id, "/v1/chat/completions", "24h", {"input_sha256": digest})
    runs.start()
    while runs.wait(OWNER, made["id"], 1.0)["status"] != "completed":
        pass
    errors_id = runs.get(OWNER, made["id"])["error_file_id"]
    runs.close()
    # The command was killed after the batch ended, having written the error file but not the output file.
    (tmp_path / "tickets.errors.jsonl").write_bytes(files.content(files.get(OWNER, errors_id)))
    files.delete(OWNER, errors_id)
    answered = len(calls)
    try:
        outcome = run_batch_file(pool(engine), settings(state), given(source), result_paths(source, None, None), quiet)
    finally:
        engine.close()
    assert outcome.batch["id"] == made["id"] and len(calls) == answered  # nothing decoded again
    assert len(outcome.output.read_text().splitlines()) == 5
    assert outcome.errors == tmp_path / "tickets.errors.jsonl"


def test_a_directory_another_process_runs_is_a_clear_error(engine, tmp_path, source):
    state = tmp_path / "state"
    holder = Batches(state / "batches", FileStore(state / "files", 1 << 20), BatchLimits(state), lambda *_: None)
    try:
        with pytest.raises(ConfigError, match="in use by another Reame process"):
            run_batch_file(pool(engine), settings(state), given(source), result_paths(source, None, None), quiet)
    finally:
        holder.close()


def test_input_problems_are_clear_errors_before_anything_runs(engine, tmp_path, source):
    with pytest.raises(ConfigError, match="larger than the batch storage"):
        read_input(source, 100)
    (tmp_path / "blank.jsonl").write_text("\n \n")
    with pytest.raises(ConfigError, match="is empty"):
        read_input(tmp_path / "blank.jsonl", 1 << 20)
    with pytest.raises(ConfigError, match="cannot read"):
        read_input(tmp_path / "missing.jsonl", 1 << 20)
    with pytest.raises(ConfigError, match="--endpoint must be one of"):
        endpoint_of(b"", "/v1/models")
    with pytest.raises(ConfigError, match="pass --endpoint"):
        endpoint_of(b'{"url": "/v1/models"}\n[1]\nnot json\n', None)
    assert endpoint_of(b'[]\n{"url": "/v1/embeddings"}\n', None) == "/v1/embeddings"
    with pytest.raises(ConfigError, match="three different files"):
        result_paths(source, str(source), None)
    with pytest.raises(ConfigError, match="three different files"):
        result_paths(source, "same.jsonl", "same.jsonl")
    too_many = settings(tmp_path / "state", max_lines=2)
    with pytest.raises(ConfigError, match="tickets.jsonl: "):
        run_batch_file(pool(engine), too_many, given(source), result_paths(source, None, None), quiet)


def test_earlier_batches_of_other_inputs_are_left_alone(engine, tmp_path, source):
    state = tmp_path / "state"
    run_batch_file(pool(engine), settings(state), given(source), result_paths(source, None, None), quiet)
    app = App(settings(state), pool(engine))
    try:
        assert earlier_batch(app, app.batches, hashlib.sha256(source.read_bytes()).hexdigest(),
                             "/v1/chat/completions") is None  # finished and written: a new run starts over
    finally:
        app.batches.close()


def test_progress_reads_as_a_person_expects():
    assert [short_duration(s) for s in (0.4, 45, 185, 7620)] == ["0 s", "45 s", "3 min 05 s", "2 h 07 min"]
    batch = {"id": "batch_x", "status": "in_progress", "request_counts": {"total": 200, "completed": 36, "failed": 1},
             "estimated_seconds_left": 320}
    assert progress_line(batch) == "batch_x: 37 of 200 answered (18%), 1 failed, about 5 min 20 s left"
    done = {**batch, "status": "completed", "estimated_seconds_left": None,
            "request_counts": {"total": 200, "completed": 200, "failed": 0}}
    assert progress_line(done) == "batch_x: 200 of 200 answered (100%): completed"

    class Terminal(io.StringIO):
        def isatty(self):
            return True
    terminal = Terminal()
    show = Progress(terminal)
    show(batch)
    show(batch)  # the same line is not drawn again
    show(done)
    assert terminal.getvalue() == "\r" + progress_line(batch) + "\r" + progress_line(done).ljust(
        len(progress_line(batch))) + "\n"
    log = io.StringIO()
    show = Progress(log, every_s=3600)
    show(batch)
    show({**batch, "request_counts": {"total": 200, "completed": 40, "failed": 1}})  # within the interval: not shown
    show(done)
    assert log.getvalue().splitlines() == [progress_line(batch), progress_line(done)]


def test_the_estimate_is_the_lines_left_at_this_process_pace(monkeypatch):
    batch = Batch({"id": "batch_x", "status": "in_progress", "request_counts": {"total": 10}}, OWNER)
    assert batch.seconds_left() is None  # no line started yet
    monkeypatch.setattr("reame.server.batches.time.monotonic", lambda: 100.0)
    batch.pace_since, batch.done_before, batch.done = 90.0, 3, {0, 1, 2}
    assert batch.seconds_left() is None  # none answered by this process yet
    batch.done |= {3, 4}
    assert batch.seconds_left() == 25  # 2 lines in 10 s, 5 left
    batch.fields["status"] = "finalizing"
    assert batch.seconds_left() is None and batch.public()["estimated_seconds_left"] is None


def test_the_command_refuses_a_bad_file_before_it_looks_for_a_model(tmp_path, capsys):
    from reame.cli import main
    assert main(["batch", str(tmp_path / "missing.jsonl"), "--model", "no-such-model"]) == 2
    assert "cannot read" in capsys.readouterr().err  # not "unknown model": the file was read first
    (tmp_path / "t.jsonl").write_text('{"custom_id": "a", "url": "/v1/models"}\n')
    assert main(["batch", str(tmp_path / "t.jsonl"), "--model", "no-such-model"]) == 2
    assert "pass --endpoint" in capsys.readouterr().err
    assert main(["batch", str(tmp_path / "t.jsonl"), "--best-of", "3"]) == 2  # a flag the command cannot honour
    assert "in its body" in capsys.readouterr().err
