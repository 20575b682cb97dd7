"""`reame batch FILE.jsonl`: an OpenAI batch input file answered on this machine, progress on stderr, the
output (and error) file written beside it.

No second implementation: the file goes through the server's own pieces without a socket (server/app.py's
App, server/batches.py's Batches) into the batch directory a server of the same model uses, so each line is
answered exactly as `/v1/batches` would answer it, and an interrupted run (Ctrl-C, a kill, a reboot) goes on
where it stopped when the same command runs again: the batch is found by its input's sha256.
"""

from __future__ import annotations

import hashlib
import json
import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from reame.errors import ConfigError
from reame.files import write_file_atomically
from reame.server.app import App
from reame.server.batches import ACTIVE, ENDPOINTS, Batches
from reame.server.client import HttpError
from reame.server.models import ModelPool
from reame.server.settings import ServerSettings

log = logging.getLogger("reame")

OWNER = ""  # whose batches a server without API keys lists: it shows (and could finish) the command's
WAIT_S = 1.0  # the longest wait between two looks at the batch (a line answered wakes it sooner)
Report = Callable[[dict[str, Any]], None]


@dataclass
class Outcome:
    """How a batch ended, and the files written from it (None: nothing of that kind to write)."""

    batch: dict[str, Any]
    output: Path | None
    errors: Path | None
    seconds: float

    @property
    def whole(self) -> bool:
        """Every line answered with a success."""
        counts = self.batch["request_counts"]
        return self.batch["status"] == "completed" and counts["completed"] == counts["total"]


def result_paths(source: Path, output: str | None, errors: str | None) -> tuple[Path, Path]:
    """Where the answers and the errors go: as given, else beside the input (`tickets.jsonl` ->
    `tickets.output.jsonl`, `tickets.errors.jsonl`); never over the input itself."""
    stem = source.name[:-len(".jsonl")] if source.name.endswith(".jsonl") else source.name
    paths = (Path(output) if output else source.with_name(stem + ".output.jsonl"),
             Path(errors) if errors else source.with_name(stem + ".errors.jsonl"))
    if source.resolve() in (path.resolve() for path in paths) or paths[0].resolve() == paths[1].resolve():
        raise ConfigError("the output, the error file and the input must be three different files")
    return paths


@dataclass
class BatchInput:
    """A batch input file as read, and the endpoint its batch is for."""

    path: Path
    data: bytes
    endpoint: str


def batch_input(source: Path, budget_bytes: int, endpoint: str | None) -> BatchInput:
    """The input file and its endpoint, read before any model loads (a wrong file fails at once)."""
    data = read_input(source, budget_bytes)
    return BatchInput(source, data, endpoint_of(data, endpoint))


def read_input(source: Path, budget_bytes: int) -> bytes:
    """The input file, refused past the batch storage budget before it is read whole."""
    try:
        with source.open("rb") as stream:
            data = stream.read(budget_bytes + 1)
    except OSError as error:
        raise ConfigError(f"cannot read {source}: {error.strerror}") from None
    if len(data) > budget_bytes:
        raise ConfigError(f"{source} is larger than the batch storage ({budget_bytes >> 20} MiB, "
                          "server.batch_storage_mb)")
    if not data.strip():
        raise ConfigError(f"{source} is empty")
    return data


def endpoint_of(data: bytes, given: str | None) -> str:
    """The endpoint the batch is for: `given`, else the url of the first line that names one of the Batch
    API's endpoints (lines naming another get an error entry each, as in a server's batch)."""
    if given is not None:
        if given not in ENDPOINTS:
            raise ConfigError(f"--endpoint must be one of {', '.join(ENDPOINTS)}")
        return given
    for line in data.splitlines():
        try:
            url = json.loads(line).get("url")
        except (ValueError, AttributeError, RecursionError):
            continue
        if url in ENDPOINTS:
            return str(url)
    raise ConfigError(f"no line's url is one of {', '.join(ENDPOINTS)}: pass --endpoint")


def earlier_batch(app: App, batches: Batches, digest: str, endpoint: str) -> dict[str, Any] | None:
    """The batch an earlier run of the same input left behind, if any: one still running (it goes on), or one
    that ended after that run stopped looking (its files are still in the store: they are written now)."""
    assert app.files is not None
    kept = {record.id for record in app.files.listed(OWNER, "batch_output")}
    for batch in batches.listed(OWNER):
        metadata = batch.get("metadata") or {}
        if metadata.get("input_sha256") != digest or batch["endpoint"] != endpoint:
            continue
        if batch["status"] in ACTIVE or {batch["output_file_id"], batch["error_file_id"]} & kept:
            return batch
    return None


def new_batch(app: App, batches: Batches, source: Path, data: bytes, digest: str, endpoint: str) -> dict[str, Any]:
    """A batch over `data`; its uploaded copy is deleted once the batch has its own."""
    assert app.files is not None  # App makes the file store with the batches
    record = app.files.create(OWNER, data, source.name, "batch")
    try:
        return batches.create(OWNER, record.id, endpoint, "24h",
                              {"created_by": "reame batch", "input_sha256": digest, "input_name": source.name[:512]})
    finally:
        app.files.delete(OWNER, record.id)


def run_batch_file(models: ModelPool, settings: ServerSettings, source: BatchInput, destinations: tuple[Path, Path],
                   report: Report) -> Outcome:
    """Run `source` as a batch on `models` (loaded here, closed by the caller) and write its output and error
    files to `destinations`; `report` sees the batch each time a line is answered."""
    data, endpoint = source.data, source.endpoint
    digest = hashlib.sha256(data).hexdigest()
    app = App(settings, models)
    batches = app.batches
    if batches is None:
        raise ConfigError("the batch directory is in use by another Reame process (a server of this model?): "
                          "send the file to it through /v1/batches, or set server.batch_dir"
                          if settings.batches.directory is not None else "batches are off (server.batches = false)")
    started = time.monotonic()
    try:
        try:
            batch = earlier_batch(app, batches, digest, endpoint)
            if batch is not None:
                counts = batch["request_counts"]
                log.info("%s: going on with %s (%d of %d answered by an earlier run)", source.path.name, batch["id"],
                         counts["completed"] + counts["failed"], counts["total"])
            else:
                batch = new_batch(app, batches, source.path, data, digest, endpoint)
        except HttpError as error:
            raise ConfigError(f"{source.path}: {error.message}") from None
        models.preload(models.default)
        models.start()
        app.ready = True
        batches.start()
        while batch["status"] in ACTIVE:
            report(batch)
            batch = batches.wait(OWNER, batch["id"], WAIT_S)
        report(batch)
    finally:
        batches.close()  # a line still running (Ctrl-C) is answered again by the next run
    return Outcome(batch, *written(app, batch, destinations), seconds=time.monotonic() - started)


def written(app: App, batch: dict[str, Any], destinations: tuple[Path, Path]) -> tuple[Path | None, Path | None]:
    """The batch's output and error files copied to `destinations` and deleted from the file store (the
    command's user has them where they asked). One no longer in the store was written by an earlier run that
    was stopped before it wrote the other."""
    assert app.files is not None
    kept = {record.id for record in app.files.listed(OWNER, "batch_output")}
    paths: list[Path | None] = []
    for key, destination in zip(("output_file_id", "error_file_id"), destinations):
        file_id = batch.get(key)
        if file_id not in kept:
            paths.append(destination if file_id is not None and destination.exists() else None)
            continue
        write_file_atomically(destination, app.files.content(app.files.get(OWNER, file_id)))
        app.files.delete(OWNER, file_id)
        paths.append(destination)
    return paths[0], paths[1]


def short_duration(seconds: float) -> str:
    """`seconds` as people read a wait: 45 s, 3 min 05 s, 2 h 07 min."""
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds // 60 % 60:02d} min"


def progress_line(batch: dict[str, Any]) -> str:
    """One line of progress: 37 of 200 answered (18%), 1 failed, about 5 min 20 s left."""
    counts = batch["request_counts"]
    done = counts["completed"] + counts["failed"]
    text = f"{batch['id']}: {done} of {counts['total']} answered ({100 * done // max(1, counts['total'])}%)"
    if counts["failed"]:
        text += f", {counts['failed']} failed"
    left = batch.get("estimated_seconds_left")
    if left is not None:
        text += f", about {short_duration(left)} left"
    return text if batch["status"] == "in_progress" else f"{text}: {batch['status']}"


class Progress:
    """Progress on stderr: one line redrawn in place on a terminal, a line every `every_s` seconds (and the
    last) in a log file."""

    def __init__(self, stream: Any = None, every_s: float = 10.0) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.live = self.stream.isatty()
        self.every_s = every_s
        self.shown = ""
        self.shown_at = -float("inf")

    def __call__(self, batch: dict[str, Any]) -> None:
        text = progress_line(batch)
        final = batch["status"] not in ACTIVE
        now = time.monotonic()
        if text == self.shown or not (final or self.live or now - self.shown_at >= self.every_s):
            return
        if self.live:
            self.stream.write("\r" + text.ljust(len(self.shown)) + ("\n" if final else ""))
        else:
            self.stream.write(text + "\n")
        self.stream.flush()
        self.shown, self.shown_at = text, now
