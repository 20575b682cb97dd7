"""OpenAI's Files and Batch APIs: upload a JSONL file of requests (`purpose: batch`), create a batch over
it, poll it, download its output and error files, cancel it. Files and batches belong to the API key that
made them. The batches themselves run in server/batches.py."""

from __future__ import annotations

import re
from typing import Any

from reame.server import multipart
from reame.server.batches import Batches
from reame.server.client import Asker, HttpError, Whole
from reame.server.filestore import FileStore
from reame.server.apis.responses import checked_metadata
from reame.server.routes import Route
from reame.server.service import Service
from reame.server.validation import Fields, query_value

LIMIT = re.compile(r"[0-9]{1,5}")  # a page's size: ASCII digits only (int() of a long one raises)


def file_store(app: Service) -> FileStore:
    files = app.files
    if files is None:
        raise HttpError(404, "the Files and Batch APIs are off on this server", code="not_found")
    return files


def batch_runs(app: Service) -> Batches:
    batches = app.batches
    if batches is None:
        raise HttpError(404, "the Files and Batch APIs are off on this server", code="not_found")
    return batches


def files(app: Service, handler: Asker, _path: str) -> None:
    """POST /v1/files: an upload (multipart/form-data: `file` and `purpose`); GET: the owner's files."""
    store = file_store(app)
    if handler.command == "GET":
        purpose = query_value(handler, "purpose")
        records = [record.public() for record in store.listed(handler.owner, purpose)]
        if query_value(handler, "order") == "asc":
            records.reverse()
        send_page(handler, records)
        return
    body = handler.read_body() or b""
    headers = getattr(handler, "headers", None)  # an HTTP request's (a batch's line never uploads)
    parts = multipart.parse(body, headers.get("Content-Type", "") if headers is not None else "")
    purpose_part = parts.get("purpose")
    if purpose_part is None or purpose_part.data.decode("utf-8", "replace").strip() != "batch":
        raise HttpError(400, "'purpose' must be 'batch': this server keeps files for batches only",
                        param="purpose", code="invalid_value")
    upload = parts.get("file")
    if upload is None or upload.filename is None:
        raise HttpError(400, "send the file as the 'file' field of the form", param="file", code="missing_file")
    if not upload.data:
        raise HttpError(400, "the file is empty", param="file", code="invalid_file")
    record = store.create(handler.owner, upload.data, upload.filename, "batch")
    handler.send(Whole(200, record.public()))


def one_file(app: Service, handler: Asker, path: str) -> None:
    """GET /v1/files/{id}, its bytes at /v1/files/{id}/content, DELETE /v1/files/{id}."""
    store = file_store(app)
    file_id, _, rest = path[len("/v1/files/"):].partition("/")
    if rest not in ("", "content") or (rest and handler.command != "GET"):
        raise HttpError(404, f"unknown endpoint: {handler.command} {path[:200]}", code="not_found")
    record = store.get(handler.owner, file_id)
    if handler.command == "DELETE":
        store.delete(handler.owner, file_id)
        handler.send(Whole(200, {"id": record.id, "object": "file", "deleted": True}))
    elif rest == "content":
        handler.send(Whole(200, store.content(record), content_type="application/octet-stream"))
    else:
        handler.send(Whole(200, record.public()))


def batches(app: Service, handler: Asker, _path: str) -> None:
    """POST /v1/batches: a batch over an uploaded file; GET: the owner's batches."""
    runs = batch_runs(app)
    if handler.command == "GET":
        send_page(handler, runs.listed(handler.owner))
        return
    fields = Fields(handler.read_json())
    input_file_id = fields.body.get("input_file_id")
    if not isinstance(input_file_id, str):
        raise HttpError(400, "'input_file_id' must be the id of an uploaded file", param="input_file_id",
                        code="invalid_value")
    endpoint, window = fields.body.get("endpoint"), fields.body.get("completion_window", "24h")
    if not isinstance(endpoint, str) or not isinstance(window, str):
        raise HttpError(400, "'endpoint' and 'completion_window' must be strings", param="endpoint",
                        code="invalid_value")
    metadata = fields.body.get("metadata")
    checked_metadata(metadata)
    handler.send(Whole(200, runs.create(handler.owner, input_file_id, endpoint, window, metadata)))


def one_batch(app: Service, handler: Asker, path: str) -> None:
    """GET /v1/batches/{id}; POST /v1/batches/{id}/cancel."""
    runs = batch_runs(app)
    batch_id, _, action = path[len("/v1/batches/"):].partition("/")
    if (handler.command, action) == ("GET", ""):
        handler.send(Whole(200, runs.get(handler.owner, batch_id)))
    elif (handler.command, action) == ("POST", "cancel"):
        handler.send(Whole(200, runs.cancel(handler.owner, batch_id)))
    else:
        raise HttpError(404, f"unknown endpoint: {handler.command} {path[:200]}", code="not_found")


def send_page(handler: Asker, items: list[dict[str, Any]]) -> None:
    """A list as OpenAI pages it: `limit` (1-10,000) items after the id `after`."""
    limit_text = query_value(handler, "limit") or "20"
    if not LIMIT.fullmatch(limit_text) or not 1 <= int(limit_text) <= 10_000:
        raise HttpError(400, "'limit' must be an integer from 1 to 10000", param="limit", code="invalid_value")
    after = query_value(handler, "after")
    if after is not None:
        ids = [item["id"] for item in items]
        items = items[ids.index(after) + 1:] if after in ids else []
    page = items[:int(limit_text)]
    handler.send(Whole(200, {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                            "last_id": page[-1]["id"] if page else None, "has_more": len(items) > len(page)}))


ROUTES: list[Route] = [
    Route("/v1/files", ("GET", "POST"), files, multipart=True),
    Route("/v1/files/", ("GET", "DELETE"), one_file, prefix=True),
    Route("/v1/batches", ("GET", "POST"), batches),
    Route("/v1/batches/", ("GET", "POST"), one_batch, prefix=True),
]
