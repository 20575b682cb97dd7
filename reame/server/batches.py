"""OpenAI's Batch API, run by the server itself: a JSONL file of requests answered in the box's idle time,
each line exactly as its synchronous route answers it, surviving a crash.

A batch lives in `<batch dir>/batches/`: its record (`<id>.json`, the batch object and its owner, rewritten
atomically when its status changes), a copy of its input (`<id>.input`, so deleting the uploaded file does
not lose it) and a journal (`<id>.results`, one JSON line per answered input line, appended and fsynced
before the line counts as done). A server killed at any point starts again, reads the journal (a torn last
line is cut off), and runs only the lines it does not hold: every `custom_id` is answered exactly once. A
line computed but not yet journaled when the server died is computed again; with the exact answer cache on,
a greedy one comes back from it.

Lines run on `concurrency` worker threads through `run_line` (the App's route dispatch, so an output line is
what the route would have answered), only while `may_start()` says the models have room (no interactive
request waiting), and in an order that puts requests sharing a prefix side by side (sorted by their
messages or prompt as text), so a common system prompt or document is prefilled once and then found in the
prefix cache. A malformed line is an entry in the error file, never a failed batch.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from reame.files import create_private, private_directory, read_private, write_file_atomically
from reame.server.client import HttpError, json_body
from reame.server.filestore import FileStore
from reame.server.settings import BatchLimits

log = logging.getLogger("reame.batches")

BATCH_ID = re.compile(r"batch_[0-9a-f]{24}")
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses")
COMPLETION_WINDOWS = {"24h": 24 * 3600}
MAX_RECORD_BYTES = 1 << 16
ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")
WAIT_S = 0.05  # how often an idle worker looks again for room (interactive requests may have ended)
RETRIED_STATUSES = (429, 503)  # answers that say "not now", not "no": the line is run again later
RETRY_WAIT_S = 1.0

# (owner, url, body bytes, gone) -> (HTTP status, JSON body) of the route's answer; None: not answered (gone)
RunLine = Callable[[str, str, bytes, Callable[[], bool]], "tuple[int, Any] | None"]


@dataclass
class Line:
    """One request of a batch's input: its place in the file, its custom_id, its body as sent."""

    index: int
    custom_id: str
    body: bytes
    order: str  # what requests sharing a prefix have in common at the start: the sort key


@dataclass
class Batch:
    """A batch's public object, its owner, and (in RAM) its lines and what is done of them."""

    fields: dict[str, Any]
    owner: str
    lines: list[Line] = field(default_factory=list)
    done: set[int] = field(default_factory=set)
    pending: list[Line] = field(default_factory=list)  # not done and not running, in the order they run
    running: int = 0
    completed: int = 0
    failed: int = 0
    pace_since: float | None = None  # when this process started its first line (monotonic seconds)
    done_before: int = 0  # lines done by then: the pace counts only the lines this process answered

    @property
    def id(self) -> str:
        return str(self.fields["id"])

    @property
    def status(self) -> str:
        return str(self.fields["status"])

    def public(self) -> dict[str, Any]:
        """OpenAI's batch object, with Reame's estimate of the seconds left (None when it has none)."""
        counts = {"total": self.fields["request_counts"]["total"], "completed": self.completed, "failed": self.failed}
        return {**self.fields, "request_counts": counts, "estimated_seconds_left": self.seconds_left()}

    def seconds_left(self) -> int | None:
        """The lines left at the pace of the lines this process has answered so far (time spent stepping
        aside for interactive requests included): None before the first one, or once the batch is not running."""
        answered = len(self.done) - self.done_before
        if self.status != "in_progress" or self.pace_since is None or answered < 1:
            return None
        left = self.fields["request_counts"]["total"] - len(self.done)
        return max(min(left, 1), round(left * (time.monotonic() - self.pace_since) / answered))  # never "0 s" early


def parse_lines(data: bytes, endpoint: str, limits: BatchLimits) -> tuple[list[Line], list[dict[str, Any]]]:
    """The input file's requests, and an error-file entry for each line that is not one (bad JSON, a missing
    or repeated custom_id, another method or endpoint, a streamed request). 400 for a file that holds no
    line at all or more than the limits allow."""
    raw_lines = data.split(b"\n")
    if raw_lines and not raw_lines[-1].strip():
        raw_lines.pop()
    if not any(line.strip() for line in raw_lines):
        raise HttpError(400, "the input file holds no request", param="input_file_id", code="invalid_file")
    if len(raw_lines) > limits.max_lines:
        raise HttpError(400, f"the input file has {len(raw_lines)} lines; a batch holds at most {limits.max_lines} "
                        "(server.batch_max_lines)", param="input_file_id", code="too_many_lines")
    lines: list[Line] = []
    errors: list[dict[str, Any]] = []
    seen: set[str] = set()
    for index, raw in enumerate(raw_lines):
        try:
            line = _request_line(index, raw, endpoint, limits, seen)
        except ValueError as error:
            custom_id = _custom_id_of(raw)
            errors.append(error_entry(index, custom_id, "invalid_request", str(error)))
            continue
        seen.add(line.custom_id)
        lines.append(line)
    return lines, errors


def _request_line(index: int, raw: bytes, endpoint: str, limits: BatchLimits, seen: set[str]) -> Line:
    if len(raw) > limits.max_line_bytes:
        raise ValueError(f"line {index + 1} has {len(raw)} bytes; a line holds at most {limits.max_line_bytes}")
    try:
        request = json_body(raw, f"line {index + 1}")
    except HttpError as error:
        raise ValueError(error.message) from None
    if not isinstance(request, dict):
        raise ValueError(f"line {index + 1} is not a JSON object")
    custom_id = request.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id or len(custom_id) > 512:
        raise ValueError(f"line {index + 1} has no custom_id (a string of 1-512 characters)")
    if custom_id in seen:
        raise ValueError(f"line {index + 1} repeats the custom_id {custom_id[:100]!r}: each must be unique")
    if request.get("method") != "POST":
        raise ValueError(f"line {index + 1}: 'method' must be 'POST'")
    if request.get("url") != endpoint:
        raise ValueError(f"line {index + 1}: 'url' must be this batch's endpoint {endpoint!r}")
    body = request.get("body")
    if not isinstance(body, dict):
        raise ValueError(f"line {index + 1}: 'body' must be a JSON object")
    if body.get("stream"):
        raise ValueError(f"line {index + 1}: a batch answers whole; 'stream' must be false")
    prefix = body.get("messages", body.get("prompt", body.get("input", body.get("instructions", ""))))
    order = json.dumps([body.get("model"), prefix], ensure_ascii=False)
    return Line(index, custom_id, json.dumps(body).encode(), order)


def _custom_id_of(raw: bytes) -> str | None:
    try:
        value = json_body(raw).get("custom_id")
    except (HttpError, AttributeError):
        return None
    return value if isinstance(value, str) else None


def error_entry(index: int, custom_id: str | None, code: str, message: str) -> dict[str, Any]:
    """An error-file line for a request that got no answer."""
    return _entry(index, custom_id, None, {"code": code, "message": message})


def answer_entry(index: int, custom_id: str, status: int, body: Any) -> dict[str, Any]:
    """An output-file line (2xx) or an error-file line (any other status) for an answered request."""
    return _entry(index, custom_id, {"status_code": status, "request_id": "req_" + secrets.token_hex(12),
                                     "body": body}, None)


def _entry(index: int, custom_id: str | None, response: dict[str, Any] | None,
           error: dict[str, str] | None) -> dict[str, Any]:
    """A journal entry: the input line's index and its record, as OpenAI's output and error files write it."""
    return {"index": index, "record": {"id": "batch_req_" + secrets.token_hex(12), "custom_id": custom_id,
                                       "response": response, "error": error}}


def is_output(entry: dict[str, Any]) -> bool:
    response = entry["record"]["response"]
    return response is not None and 200 <= response["status_code"] < 300


class BatchesBusy(Exception):
    """Another process holds the batch directory."""


class Batches:
    """Every batch of every owner: created, listed, cancelled by the routes, run by the worker threads."""

    def __init__(self, directory: Path, files: FileStore, limits: BatchLimits, run_line: RunLine,
                 may_start: Callable[[], bool] = lambda: True) -> None:
        self.directory = private_directory(directory)
        self._lock_fd = os.open(self.directory / ".lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                                0o600)
        try:  # one server runs a directory's batches: two would answer the same lines
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(self._lock_fd)
            raise BatchesBusy(f"another process runs the batches of {directory}") from None
        self.files = files
        self.limits = limits
        self.run_line = run_line
        self.may_start = may_start
        self._batches: dict[str, Batch] = {}
        self._changed = threading.Condition()
        self._stopping = False
        self._workers: list[threading.Thread] = []
        self._load()

    # --- the routes' side -----------------------------------------------------------------------------

    def create(self, owner: str, input_file_id: str, endpoint: str, completion_window: str,
               metadata: dict[str, str] | None) -> dict[str, Any]:
        """A new batch over the owner's uploaded file, validated line by line; the batch object."""
        if endpoint not in ENDPOINTS:
            raise HttpError(400, f"'endpoint' must be one of {', '.join(ENDPOINTS)}", param="endpoint",
                            code="invalid_value")
        if completion_window not in COMPLETION_WINDOWS:
            raise HttpError(400, "'completion_window' must be '24h'", param="completion_window",
                            code="invalid_value")
        record = self.files.get(owner, input_file_id)
        if record.purpose != "batch":
            raise HttpError(400, f"the file {input_file_id!r} was not uploaded with purpose 'batch'",
                            param="input_file_id", code="invalid_file")
        data = self.files.content(record)
        lines, errors = parse_lines(data, endpoint, self.limits)
        now = int(time.time())
        batch_id = "batch_" + secrets.token_hex(12)
        fields = {"id": batch_id, "object": "batch", "endpoint": endpoint, "errors": None,
                  "input_file_id": input_file_id, "completion_window": completion_window, "status": "in_progress",
                  "output_file_id": None, "error_file_id": None, "created_at": now, "in_progress_at": now,
                  "expires_at": now + COMPLETION_WINDOWS[completion_window], "finalizing_at": None,
                  "completed_at": None, "failed_at": None, "expired_at": None, "cancelling_at": None,
                  "cancelled_at": None, "request_counts": {"total": len(lines) + len(errors), "completed": 0,
                                                           "failed": 0},
                  "metadata": metadata}
        batch = Batch(fields, owner)
        write_file_atomically(self._path(batch_id, ".input"), data)
        with create_private(self._path(batch_id, ".results")):
            pass
        for entry in errors:
            self._journal(batch, entry)
        self._save(batch)
        self._start(batch, lines)
        log.info("batch %s: %d requests for %s (%d malformed)", batch_id, len(lines) + len(errors), endpoint,
                 len(errors))
        return batch.public()

    def get(self, owner: str, batch_id: str) -> dict[str, Any]:
        with self._changed:
            return self._owned(owner, batch_id).public()

    def listed(self, owner: str) -> list[dict[str, Any]]:
        """The owner's batches, newest first."""
        with self._changed:
            batches = [batch.public() for batch in self._batches.values() if batch.owner == owner]
        return sorted(batches, key=lambda fields: (-fields["created_at"], fields["id"]))

    def wait(self, owner: str, batch_id: str, seconds: float) -> dict[str, Any]:
        """The batch object once a line is answered or the batch changes, or after `seconds`."""
        with self._changed:
            self._owned(owner, batch_id)
            self._changed.wait(seconds)
            return self._owned(owner, batch_id).public()

    def unfinished(self) -> list[dict[str, Any]]:
        """Every owner's batches still running, for the metrics."""
        with self._changed:
            return [batch.public() for batch in self._batches.values() if batch.status in ACTIVE]

    def cancel(self, owner: str, batch_id: str) -> dict[str, Any]:
        """Stop starting its lines; lines running end unanswered (their clients are gone), and the batch is
        cancelled with the files of what was done."""
        with self._changed:
            batch = self._owned(owner, batch_id)
            if batch.status not in ("validating", "in_progress"):
                raise HttpError(409, f"the batch is {batch.status}: only a batch in progress can be cancelled",
                                code="invalid_state")
            batch.fields.update(status="cancelling", cancelling_at=int(time.time()))
            batch.pending = []
            self._save(batch)
            self._changed.notify_all()
        self._finish_if_done(batch)
        return self.get(owner, batch_id)

    def _owned(self, owner: str, batch_id: str) -> Batch:
        batch = self._batches.get(batch_id) if BATCH_ID.fullmatch(batch_id) else None
        if batch is None or batch.owner != owner:
            raise HttpError(404, f"no batch with id {batch_id[:64]!r}", code="batch_not_found")
        return batch

    # --- state on disk ---------------------------------------------------------------------------------

    def _path(self, batch_id: str, suffix: str) -> Path:
        return self.directory / (batch_id + suffix)

    def _save(self, batch: Batch) -> None:
        write_file_atomically(self._path(batch.id, ".json"),
                              json.dumps({"batch": batch.fields, "owner": batch.owner}).encode())

    def _journal(self, batch: Batch, entry: dict[str, Any]) -> None:
        """Append one answered line, durably, and count it."""
        data = (json.dumps(entry) + "\n").encode()
        fd = os.open(self._path(batch.id, ".results"), os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        with self._changed:
            batch.done.add(entry["index"])
            if is_output(entry):
                batch.completed += 1
            else:
                batch.failed += 1
            self._changed.notify_all()

    def _entries(self, batch_id: str) -> list[dict[str, Any]]:
        """The journal's entries; a line torn by a crash mid-append is cut off the file."""
        path = self._path(batch_id, ".results")
        data = path.read_bytes()
        whole = data[:data.rfind(b"\n") + 1]
        if len(whole) != len(data):
            os.truncate(path, len(whole))
        return [json.loads(line) for line in whole.splitlines()]

    def _load(self) -> None:
        """Every batch on disk; the unfinished ones resume where their journal ends."""
        for path in sorted(self.directory.glob("batch_*.json")):
            batch_id = path.name[:-len(".json")]
            try:
                saved = json.loads(read_private(path, MAX_RECORD_BYTES))
                batch = Batch(saved["batch"], saved["owner"])
                entries = self._entries(batch_id)
            except (OSError, ValueError, KeyError, TypeError):
                log.warning("batch %s is unreadable: left aside", batch_id)
                continue
            if batch.id != batch_id:
                continue
            batch.done = {entry["index"] for entry in entries}
            batch.completed = sum(map(is_output, entries))
            batch.failed = len(entries) - batch.completed
            self._batches[batch_id] = batch
            if batch.status in ACTIVE:
                data = self._path(batch_id, ".input").read_bytes()
                lines, _ = parse_lines(data, batch.fields["endpoint"], self.limits)
                log.info("batch %s resumes: %d of %d requests answered", batch_id, len(batch.done),
                         batch.fields["request_counts"]["total"])
                self._start(batch, lines)

    def _start(self, batch: Batch, lines: list[Line]) -> None:
        with self._changed:
            self._batches[batch.id] = batch
            batch.lines = lines
            if batch.status in ("validating", "in_progress"):
                batch.pending = sorted((line for line in lines if line.index not in batch.done),
                                       key=lambda line: (line.order, line.index))
            self._changed.notify_all()
        self._finish_if_done(batch, resuming=True)

    # --- running -----------------------------------------------------------------------------------------

    def start(self) -> None:
        """The worker threads (server.batch_concurrency of them)."""
        for number in range(self.limits.concurrency):
            worker = threading.Thread(target=self._work, name=f"reame-batch-{number}", daemon=True)
            worker.start()
            self._workers.append(worker)

    def close(self) -> None:
        """Stop: lines running are abandoned unanswered (the next start runs them again)."""
        with self._changed:
            self._stopping = True
            self._changed.notify_all()
        for worker in self._workers:
            worker.join()
        self._workers = []
        os.close(self._lock_fd)  # (the flock goes with it)

    def _work(self) -> None:
        while True:
            taken = self._take()
            if taken is None:
                return
            batch, line = taken
            try:
                self._run(batch, line)
            except Exception:  # a bug: the line is left for the next start, the worker goes on
                log.exception("batch %s: request %r failed", batch.id, line.custom_id)
            finally:
                with self._changed:
                    batch.running -= 1
                    self._changed.notify_all()
                self._finish_if_done(batch)

    def _take(self) -> tuple[Batch, Line] | None:
        """The next line to run, once the models have room for it; None when stopping."""
        while True:
            with self._changed:
                if self._stopping:
                    return None
                batch = self._next_batch()
                if batch is not None and self.may_start():
                    if batch.pace_since is None:
                        batch.pace_since, batch.done_before = time.monotonic(), len(batch.done)
                    batch.running += 1
                    return batch, batch.pending.pop(0)
                expired = self._expire_overdue()
                if not expired:
                    self._changed.wait(WAIT_S)
            for batch in expired:
                self._finish_if_done(batch)

    def _next_batch(self) -> Batch | None:
        """The oldest batch in progress with a line to start."""
        ready = [batch for batch in self._batches.values() if batch.status == "in_progress" and batch.pending]
        return min(ready, key=lambda batch: (batch.fields["created_at"], batch.id)) if ready else None

    def _run(self, batch: Batch, line: Line) -> None:
        def gone() -> bool:
            return self._stopping or batch.status != "in_progress"
        answered = self.run_line(batch.owner, batch.fields["endpoint"], line.body, gone)
        if answered is None or gone():
            return
        status, body = answered
        if status in RETRIED_STATUSES:  # a full queue, a model loading or busy: the line waits its turn again
            with self._changed:
                if batch.status == "in_progress":
                    batch.pending.insert(0, line)
                    self._changed.wait(RETRY_WAIT_S)
                    return
        self._journal(batch, answer_entry(line.index, line.custom_id, status, body))

    def _expire_overdue(self) -> list[Batch]:
        """Batches past their completion window: they start no more lines."""
        now = time.time()
        expired = [batch for batch in self._batches.values()
                   if batch.status == "in_progress" and now >= batch.fields["expires_at"]]
        for batch in expired:
            batch.fields.update(status="cancelling", expired_at=int(now))
            batch.pending = []
            self._save(batch)
        return expired

    def _finish_if_done(self, batch: Batch, resuming: bool = False) -> None:
        """Once no line is left to run or running: the output and error files, and the final status. Only
        one caller finalizes (the one that moves the batch to finalizing), or a start resuming one."""
        with self._changed:
            if batch.pending or batch.running:
                return
            if batch.status in ("validating", "in_progress", "cancelling"):
                batch.fields.update(status="finalizing", finalizing_at=int(time.time()))
                self._save(batch)
            elif not (resuming and batch.status == "finalizing"):
                return
        self._finalize(batch)

    def _finalize(self, batch: Batch) -> None:
        entries = sorted(self._entries(batch.id), key=lambda entry: entry["index"])
        answered = {entry["index"] for entry in entries}
        ending = "expired" if batch.fields.get("expired_at") else "cancelled" if batch.fields.get("cancelling_at") \
            else "completed"
        if ending != "completed":  # what never ran is said in the error file
            code = "batch_expired" if ending == "expired" else "batch_cancelled"
            entries += [error_entry(line.index, line.custom_id, code, f"the batch was {ending} before this request "
                                    "ran") for line in batch.lines if line.index not in answered]
        outputs = [entry["record"] for entry in entries if is_output(entry)]
        errors = [entry["record"] for entry in entries if not is_output(entry)]
        now = int(time.time())
        try:
            for records, key, name in ((outputs, "output_file_id", "output"), (errors, "error_file_id", "errors")):
                if records:
                    data = "".join(json.dumps(record) + "\n" for record in records).encode()
                    batch.fields[key] = self.files.create(batch.owner, data, f"{batch.id}_{name}.jsonl",
                                                          "batch_output").id
            batch.fields.update(status=ending, **{f"{ending}_at": now} if ending != "expired" else {})
        except (HttpError, OSError) as error:
            message = error.message if isinstance(error, HttpError) else str(error)
            batch.fields.update(status="failed", failed_at=now,
                                errors={"object": "list", "data": [{"code": "output_not_written", "message": message,
                                                                    "param": None, "line": None}]})
        with self._changed:
            self._save(batch)
            self._changed.notify_all()
        log.info("batch %s %s: %d answered, %d failed", batch.id, batch.status, len(outputs), len(errors))
