"""Named sessions: a conversation's KV kept between requests, saved to disk on request.

A session holds the tokens its KV covers and the sequence state blob, as one
immutable `SessionState` that the engine swaps in when a turn ends; a request
that names it prefills only the tokens its prompt adds. `save` writes it to
`<directory>/<id>.session` in the prefix cache's snapshot format (magic,
version, model fingerprint, tokens, state, checksum; temp file, fsync, rename)
so it survives a restart; `load` reads it back, refusing a file that is
corrupt or belongs to another model or layout. Saved sessions are the user's
data: unlike cache snapshots they are never evicted. Ids are letters, digits,
`-` and `_` only: never a path.

Threading: HTTP threads call everything here. A request, a save, a load and a
delete each hold the session's reservation while they run, so none of them
sees a session another one is changing (the second one gets `session_busy`).
"""

from __future__ import annotations

import hashlib
import re
import secrets
import threading
from pathlib import Path

from reame.cache.codec import CodecUnavailable
from reame.cache.store import ForeignFingerprint, Snapshot, decode, encode_parts, write_atomically
from reame.engine import Session, SessionState
from reame.errors import CacheError, ReameError

ID_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,64}")


class SessionError(ReameError):
    """A session request that cannot be served; `status` is the HTTP status it maps to."""

    def __init__(self, status: int, message: str, code: str, param: str = "session") -> None:
        super().__init__(message)
        self.status, self.code, self.param = status, code, param


class Sessions:
    def __init__(self, directory: Path, fingerprint: bytes) -> None:
        self.directory = directory
        self.fingerprint = hashlib.sha256(fingerprint).digest()  # the 32 bytes a snapshot file carries
        self._lock = threading.Lock()
        self._sessions: dict[str, Session] = {}
        self._busy: set[str] = set()

    @staticmethod
    def check_id(session_id: str) -> str:
        if not ID_PATTERN.fullmatch(session_id):
            raise SessionError(400, "a session id is 1–64 letters, digits, '-' or '_'", "invalid_session_id")
        return session_id

    def create(self, session_id: str | None = None) -> str:
        with self._lock:
            session_id = self.check_id(session_id) if session_id else f"sess-{secrets.token_hex(8)}"
            if session_id in self._sessions:
                raise SessionError(409, f"session {session_id} exists", "session_exists", param="id")
            self._sessions[session_id] = Session()
            return session_id

    def get(self, session_id: str) -> Session:
        self.check_id(session_id)
        with self._lock:
            session = self._sessions.get(session_id)
        if session is None:
            raise SessionError(404, f"unknown session: {session_id}", "session_not_found")
        return session

    def acquire(self, session_id: str) -> Session:
        """The session, reserved until `release` (a second reservation gets 409 session_busy)."""
        session = self.get(session_id)
        self._reserve(session_id)
        return session

    def release(self, session_id: str) -> None:
        with self._lock:
            self._busy.discard(session_id)

    def _reserve(self, session_id: str) -> None:
        with self._lock:
            if session_id in self._busy:
                raise SessionError(409, f"session {session_id} is answering another request", "session_busy")
            self._busy.add(session_id)

    def describe(self, session_id: str) -> dict[str, object]:
        state = self.get(session_id).state
        return {"id": session_id, "object": "session", "tokens": len(state.tokens),
                "state_bytes": len(state.blob), "saved": self.path(session_id).exists()}

    def delete(self, session_id: str) -> None:
        self.acquire(session_id)
        try:
            with self._lock:
                self._sessions.pop(session_id, None)
            self.path(session_id).unlink(missing_ok=True)
        finally:
            self.release(session_id)

    def path(self, session_id: str) -> Path:
        return self.directory / f"{self.check_id(session_id)}.session"

    def save(self, session_id: str) -> None:
        state = self.acquire(session_id).state  # one read: tokens and blob of the same moment
        try:
            parts = encode_parts(self.fingerprint, Snapshot(state.tokens, state.blob), compress=True)
            self.directory.mkdir(parents=True, exist_ok=True)
            write_atomically(self.path(session_id), parts)
        except OSError as error:
            raise SessionError(507, f"cannot save session {session_id}: {error.strerror or error}",
                               "session_not_saved") from None
        finally:
            self.release(session_id)

    def load(self, session_id: str) -> None:
        path = self.path(session_id)
        self._reserve(session_id)
        try:
            try:
                data = path.read_bytes()
            except FileNotFoundError:
                raise SessionError(404, f"no saved session {session_id}", "session_not_found") from None
            try:
                saved = decode(data, self.fingerprint)
            except ForeignFingerprint:
                raise self._unusable(session_id, "it was saved by another model or context layout") from None
            except CodecUnavailable as error:
                raise self._unusable(session_id, str(error)) from None
            except CacheError as error:
                raise self._unusable(session_id, f"the file is damaged ({error})") from None
            with self._lock:
                session = self._sessions.setdefault(session_id, Session())
            session.state = SessionState(saved.tokens, saved.blob)
        finally:
            self.release(session_id)

    @staticmethod
    def _unusable(session_id: str, why: str) -> SessionError:
        return SessionError(409, f"saved session {session_id} cannot be used: {why}", "session_unusable")
