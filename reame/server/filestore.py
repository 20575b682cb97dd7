"""The files of OpenAI's Files API (/v1/files): a batch's input as uploaded, and the output and error files
its batch writes. Each belongs to the API key that made it (`owner`); another key sees a 404, as for a
file that does not exist.

On disk, under `<batch dir>/files/`, a file is two private files: its bytes (`<id>`) and its record
(`<id>.json`), the record written last, each atomically: a file exists once its record does, so a crash
mid-upload leaves bytes without a record, removed at the next start. Ids are checked against their pattern
before they name a path. All files together stay within a byte budget (server.batch_storage_mb): an upload
past it is refused (413) rather than anything deleted.
"""

from __future__ import annotations

import json
import logging
import re
import secrets
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from reame.files import private_directory, read_private, write_file_atomically
from reame.server.client import HttpError

log = logging.getLogger("reame.server")

FILE_ID = re.compile(r"file-[0-9a-f]{24}")
RECORD_SUFFIX = ".json"
MAX_RECORD_BYTES = 4096
MAX_FILENAME_CHARS = 255
PURPOSES = ("batch", "batch_output")  # what an upload may say, and what a batch's files say


@dataclass(frozen=True)
class FileRecord:
    id: str
    bytes: int
    created_at: int
    filename: str
    purpose: str
    owner: str

    def public(self) -> dict[str, Any]:
        """The file object as OpenAI answers it."""
        return {"id": self.id, "object": "file", "bytes": self.bytes, "created_at": self.created_at,
                "filename": self.filename, "purpose": self.purpose, "status": "processed", "expires_at": None,
                "status_details": None}


class FileStore:
    """The files, their records in RAM (read at start) and their bytes on disk. Thread-safe."""

    def __init__(self, directory: Path, budget_bytes: int) -> None:
        self.directory = private_directory(directory)
        self.budget_bytes = budget_bytes
        self._lock = threading.Lock()
        self._records: dict[str, FileRecord] = {}
        self._load()

    def _load(self) -> None:
        """The records on disk; bytes without a record (an upload cut short) and unreadable records go."""
        for path in self.directory.iterdir():
            name = path.name
            if name.startswith("."):  # a temp file of a write that never finished
                path.unlink(missing_ok=True)
            elif name.endswith(RECORD_SUFFIX):
                record = self._read_record(path)
                if record is None:
                    log.warning("file record %s is unreadable: removed with its file", name)
                    path.unlink(missing_ok=True)
                    (self.directory / name[:-len(RECORD_SUFFIX)]).unlink(missing_ok=True)
                else:
                    self._records[record.id] = record
        for path in self.directory.iterdir():
            if FILE_ID.fullmatch(path.name) and path.name not in self._records:
                path.unlink(missing_ok=True)

    def _read_record(self, path: Path) -> FileRecord | None:
        try:
            fields = json.loads(read_private(path, MAX_RECORD_BYTES))
            record = FileRecord(**fields)
            size = (self.directory / record.id).stat().st_size
        except (OSError, ValueError, TypeError):
            return None
        valid = FILE_ID.fullmatch(record.id) and path.name == record.id + RECORD_SUFFIX and size == record.bytes
        return record if valid else None

    def create(self, owner: str, data: bytes, filename: str, purpose: str) -> FileRecord:
        """A new file holding `data`; 413 past the budget."""
        record = FileRecord("file-" + secrets.token_hex(12), len(data), int(time.time()),
                            filename[:MAX_FILENAME_CHARS], purpose, owner)
        with self._lock:
            used = sum(existing.bytes for existing in self._records.values())
            if used + len(data) > self.budget_bytes:
                raise HttpError(413, f"the server's file storage is full ({used >> 20} of "
                                f"{self.budget_bytes >> 20} MiB used, server.batch_storage_mb): delete files first",
                                code="storage_full")
            self._records[record.id] = record  # reserved: a concurrent upload counts it
        try:
            write_file_atomically(self.directory / record.id, data)
            write_file_atomically(self.directory / (record.id + RECORD_SUFFIX),
                                  json.dumps(asdict(record)).encode())
        except BaseException:
            with self._lock:
                del self._records[record.id]
            (self.directory / record.id).unlink(missing_ok=True)
            raise
        return record

    def get(self, owner: str, file_id: str) -> FileRecord:
        """The owner's file; 404 for another's, a missing one or an id that is not one."""
        with self._lock:
            record = self._records.get(file_id) if FILE_ID.fullmatch(file_id) else None
        if record is None or record.owner != owner:
            raise HttpError(404, f"no file with id {file_id[:64]!r}", code="file_not_found")
        return record

    def content(self, record: FileRecord) -> bytes:
        return (self.directory / record.id).read_bytes()

    def listed(self, owner: str, purpose: str | None = None) -> list[FileRecord]:
        """The owner's files, newest first."""
        with self._lock:
            records = [record for record in self._records.values()
                       if record.owner == owner and purpose in (None, record.purpose)]
        return sorted(records, key=lambda record: (-record.created_at, record.id))

    def delete(self, owner: str, file_id: str) -> None:
        record = self.get(owner, file_id)
        with self._lock:
            self._records.pop(record.id, None)
        (self.directory / (record.id + RECORD_SUFFIX)).unlink(missing_ok=True)
        (self.directory / record.id).unlink(missing_ok=True)
