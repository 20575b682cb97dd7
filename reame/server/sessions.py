"""Named sessions: a conversation's KV kept between requests, saved to disk on request.

A session holds the tokens its KV covers and the sequence state blob; a request
that names it prefills only the tokens its prompt adds. `save` writes it to
`<directory>/<id>.session` in the prefix cache's snapshot format (magic,
version, model fingerprint, tokens, state, checksum; temp file, fsync, rename)
so it survives a restart; `load` reads it back, refusing a file that is
corrupt or belongs to another model or layout. Saved sessions are the user's
data: unlike cache snapshots they are never evicted. Ids are letters, digits,
`-` and `_` only: never a path.
"""

from __future__ import annotations

import hashlib
import re
import secrets
import threading
from pathlib import Path

from reame.cache.codec import CodecUnavailable
from reame.cache.store import ForeignFingerprint, Snapshot, decode, encode_parts, write_atomically
from reame.engine import SessionState
from reame.errors import CacheError
from reame.server.http import HttpError

ID_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,64}")


class Sessions:
    def __init__(self, directory: Path, fingerprint: bytes) -> None:
        self.directory = directory
        self.fingerprint = hashlib.sha256(fingerprint).digest()  # the 32 bytes a snapshot file carries
        self._lock = threading.Lock()
        self._sessions: dict[str, SessionState] = {}
        self._busy: set[str] = set()

    @staticmethod
    def check_id(session_id: str) -> str:
        if not ID_PATTERN.fullmatch(session_id):
            raise HttpError(400, "a session id is 1–64 letters, digits, '-' or '_'", param="session",
                            code="invalid_session_id")
        return session_id

    def create(self, session_id: str | None = None) -> str:
        with self._lock:
            session_id = self.check_id(session_id) if session_id else f"sess-{secrets.token_hex(8)}"
            if session_id in self._sessions:
                raise HttpError(409, f"session {session_id} exists", param="id", code="session_exists")
            self._sessions[session_id] = SessionState()
            return session_id

    def get(self, session_id: str) -> SessionState:
        self.check_id(session_id)
        with self._lock:
            session = self._sessions.get(session_id)
        if session is None:
            raise HttpError(404, f"unknown session: {session_id}", param="session", code="session_not_found")
        return session

    def acquire(self, session_id: str) -> SessionState:
        """The session, reserved for one request at a time (a second one gets 409)."""
        session = self.get(session_id)
        with self._lock:
            if session_id in self._busy:
                raise HttpError(409, f"session {session_id} is answering another request", param="session",
                                code="session_busy")
            self._busy.add(session_id)
        return session

    def release(self, session_id: str) -> None:
        with self._lock:
            self._busy.discard(session_id)

    def describe(self, session_id: str) -> dict[str, object]:
        session = self.get(session_id)
        return {"id": session_id, "object": "session", "tokens": len(session.tokens),
                "state_bytes": len(session.blob), "saved": self.path(session_id).exists()}

    def delete(self, session_id: str) -> None:
        self.get(session_id)
        with self._lock:
            self._sessions.pop(session_id, None)
        self.path(session_id).unlink(missing_ok=True)

    def path(self, session_id: str) -> Path:
        return self.directory / f"{self.check_id(session_id)}.session"

    def save(self, session_id: str) -> None:
        session = self.get(session_id)
        parts = encode_parts(self.fingerprint, Snapshot(tuple(session.tokens), session.blob), compress=True)
        self.directory.mkdir(parents=True, exist_ok=True)
        write_atomically(self.path(session_id), parts)

    def load(self, session_id: str) -> None:
        path = self.path(session_id)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise HttpError(404, f"no saved session {session_id}", param="session", code="session_not_found") from None
        try:
            saved = decode(data, self.fingerprint)
        except ForeignFingerprint:
            raise self._unusable(session_id, "it was saved by another model or context layout") from None
        except CodecUnavailable as error:
            raise self._unusable(session_id, str(error)) from None
        except CacheError as error:
            raise self._unusable(session_id, f"the file is damaged ({error})") from None
        with self._lock:
            self._sessions[session_id] = SessionState(tokens=list(saved.tokens), blob=saved.blob)

    @staticmethod
    def _unusable(session_id: str, why: str) -> HttpError:
        return HttpError(409, f"saved session {session_id} cannot be used: {why}", param="session",
                         code="session_unusable")
