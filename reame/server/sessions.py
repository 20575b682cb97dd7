"""Named sessions: a conversation's KV kept between requests, saved to disk on request.

A session holds the tokens its KV covers and the sequence state blob, as one
immutable `SessionState` that the engine swaps in when a turn ends; a request
that names it prefills only the tokens its prompt adds. `save` writes it to
`<directory>/[<owner>/]<id>.session` in the prefix cache's snapshot format
(magic, version, model fingerprint, tokens, state, checksum; private temp file,
fsync, rename) so it survives a restart; `load` reads it back, refusing a file
that is corrupt or belongs to another model or layout. Ids are letters,
digits, `-` and `_` only: never a path.

A session belongs to the API key that made it (`owner`, a hash of the key; ""
on a server without keys): another key neither sees nor touches it (404, as
for a session that does not exist), and two keys may use the same id apart.
What sessions may cost is bounded (`SessionLimits`): a count per key and in all
(past them, creating one is a 429), the RAM their states take (past it the
least recently used idle ones are written to disk and read back when next
used), and an idle lifetime after which a session is deleted, in RAM and on
disk.

Threading: HTTP threads call everything here. A request, a save, a load and a
delete each hold the session's reservation while they run, so none of them
sees a session another one is changing (the second one gets `session_busy`).
"""

from __future__ import annotations

import hashlib
import logging
import re
import secrets
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from reame.cache.codec import CodecUnavailable
from reame.cache.store import ForeignFingerprint, Snapshot, decode, encode_parts, write_atomically
from reame.engine import Session, SessionState
from reame.errors import CacheError, ReameError
from reame.files import private_directory
from reame.settings import SessionLimits

log = logging.getLogger("reame.server")

ID_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,64}")
SUFFIX = ".session"
EXPIRY_EVERY_S = 60.0  # how often idle sessions (and saved files) are looked over for expiry


class SessionError(ReameError):
    """A session request that cannot be served; `status` is the HTTP status it maps to."""

    def __init__(self, status: int, message: str, code: str, param: str = "session",
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.param, self.headers = status, code, param, headers or {}


def key_owner(key: str) -> str:
    """The owner name of sessions made with the API key `key` (never the key itself)."""
    return "k" + hashlib.sha256(key.encode()).hexdigest()[:16]


@dataclass
class _Entry:
    """One session as the registry keeps it. `session` is None while its state lives only on disk."""

    session: Session | None
    used: float  # time.time() of its last use
    busy: bool = False


class Sessions:
    def __init__(self, directory: Path, fingerprint: bytes, limits: SessionLimits = SessionLimits()) -> None:
        self.directory = directory
        self.fingerprint = hashlib.sha256(fingerprint).digest()  # the 32 bytes a snapshot file carries
        self.limits = limits
        self._lock = threading.Lock()
        self._entries: dict[tuple[str, str], _Entry] = {}
        self._expired_at = 0.0

    @staticmethod
    def check_id(session_id: str) -> str:
        if not ID_PATTERN.fullmatch(session_id):
            raise SessionError(400, "a session id is 1–64 letters, digits, '-' or '_'", "invalid_session_id")
        return session_id

    def create(self, owner: str, session_id: str | None = None) -> str:
        self._expire()
        with self._lock:
            session_id = self.check_id(session_id) if session_id else f"sess-{secrets.token_hex(8)}"
            if (owner, session_id) in self._entries:
                raise SessionError(409, f"session {session_id} exists", "session_exists", param="id")
            self._check_room(owner)
            self._entries[(owner, session_id)] = _Entry(Session(), time.time())
            return session_id

    def _check_room(self, owner: str) -> None:
        """429 when `owner` or the server holds as many sessions as it may (lock held)."""
        mine = sum(1 for holder, _ in self._entries if holder == owner)
        if mine >= self.limits.per_key:
            raise SessionError(429, f"this key holds {mine} sessions, the most it may (server.max_sessions_per_key): "
                               "delete one first", "too_many_sessions", param="id")
        if len(self._entries) >= self.limits.total:
            raise SessionError(429, f"the server holds {len(self._entries)} sessions, the most it may "
                               "(server.max_sessions); retry later", "too_many_sessions", param="id",
                               headers={"Retry-After": "60"})

    def _entry(self, owner: str, session_id: str) -> _Entry:
        """The session's record (lock held); 404 when `owner` has no such session."""
        entry = self._entries.get((owner, self.check_id(session_id)))
        if entry is None:
            raise SessionError(404, f"unknown session: {session_id}", "session_not_found")
        return entry

    def acquire(self, owner: str, session_id: str) -> Session:
        """The session, reserved until `release` (a second reservation gets 409 session_busy); one whose state
        went to disk is read back first."""
        self._expire()
        with self._lock:
            entry = self._reserve(owner, session_id)
            session = entry.session
        if session is not None:
            return session
        try:
            session = Session(self._read(owner, session_id))
        except BaseException:
            self.release(owner, session_id)
            raise
        with self._lock:
            entry.session = session
        return session

    def release(self, owner: str, session_id: str) -> None:
        with self._lock:
            entry = self._entries.get((owner, session_id))
            if entry is not None:
                entry.busy, entry.used = False, time.time()
        self._spill()

    def _reserve(self, owner: str, session_id: str) -> _Entry:
        """Reserve the session (lock held)."""
        entry = self._entry(owner, session_id)
        if entry.busy:
            raise SessionError(409, f"session {session_id} is answering another request", "session_busy")
        entry.busy = True
        return entry

    def describe(self, owner: str, session_id: str) -> dict[str, object]:
        with self._lock:
            entry = self._entry(owner, session_id)
            state = entry.session.state if entry.session is not None else None
        saved = self.path(owner, session_id).exists()
        if state is None:  # on disk only: what the file holds
            state = self._read(owner, session_id)
        return {"id": session_id, "object": "session", "tokens": len(state.tokens),
                "state_bytes": len(state.blob), "saved": saved}

    def delete(self, owner: str, session_id: str) -> None:
        with self._lock:
            self._reserve(owner, session_id)
            del self._entries[(owner, session_id)]
        self.path(owner, session_id).unlink(missing_ok=True)

    def path(self, owner: str, session_id: str) -> Path:
        return (self.directory / owner if owner else self.directory) / f"{self.check_id(session_id)}{SUFFIX}"

    def save(self, owner: str, session_id: str) -> None:
        session = self.acquire(owner, session_id)
        try:
            self._write(owner, session_id, session.state)  # one read: tokens and blob of the same moment
        finally:
            self.release(owner, session_id)

    def _write(self, owner: str, session_id: str, state: SessionState) -> None:
        path = self.path(owner, session_id)
        try:
            parts = encode_parts(self.fingerprint, Snapshot(state.tokens, state.blob), compress=True)
            private_directory(path.parent)
            write_atomically(path, parts)
        except OSError as error:
            raise SessionError(507, f"cannot save session {session_id}: {error.strerror or error}",
                               "session_not_saved") from None

    def load(self, owner: str, session_id: str) -> None:
        """Read a saved session back (after a restart, say); one not known yet counts against the limits."""
        self._expire()
        with self._lock:
            known = (owner, self.check_id(session_id)) in self._entries
            if not known:
                self._check_room(owner)
                self._entries[(owner, session_id)] = _Entry(None, time.time())
            entry = self._reserve(owner, session_id)
        try:
            state = self._read(owner, session_id)
            with self._lock:
                if entry.session is None:
                    entry.session = Session()
                entry.session.state = state
        except BaseException:
            if not known:
                with self._lock:
                    self._entries.pop((owner, session_id), None)
            raise
        finally:
            self.release(owner, session_id)

    def _read(self, owner: str, session_id: str) -> SessionState:
        try:
            data = self.path(owner, session_id).read_bytes()
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
        return SessionState(saved.tokens, saved.blob)

    @staticmethod
    def _unusable(session_id: str, why: str) -> SessionError:
        return SessionError(409, f"saved session {session_id} cannot be used: {why}", "session_unusable")

    # --- bounds ---

    def ram_bytes(self) -> int:
        with self._lock:
            return sum(len(entry.session.state.blob) for entry in self._entries.values() if entry.session)

    def _spill(self) -> None:
        """While the states in RAM take more than the budget, write the least recently used idle one to disk
        and keep only its record (the next request reads it back)."""
        while True:
            with self._lock:
                held = [(entry.used, key, entry, entry.session.state) for key, entry in self._entries.items()
                        if entry.session is not None and entry.session.state.blob]
                if sum(len(state.blob) for _, _, _, state in held) <= self.limits.ram_bytes:
                    return
                idle = [item for item in held if not item[2].busy]
                if not idle:
                    return
                _, (owner, session_id), entry, state = min(idle, key=lambda item: item[0])
                entry.busy = True  # held while it is written, as a save would hold it
            try:
                self._write(owner, session_id, state)
                with self._lock:
                    entry.session = None
            except SessionError as error:
                log.warning("cannot move session %s out of RAM (%s); it stays", session_id, error)
                return
            finally:
                with self._lock:
                    entry.busy = False

    def _expire(self) -> None:
        """Delete sessions idle for longer than their lifetime, in RAM and on disk (at most once a minute)."""
        now = time.time()
        if not self.limits.idle_s or now - self._expired_at < EXPIRY_EVERY_S:
            return
        self._expired_at = now
        deadline = now - self.limits.idle_s
        with self._lock:
            gone = [key for key, entry in self._entries.items() if entry.used < deadline and not entry.busy]
            for key in gone:
                del self._entries[key]
            live = set(self._entries)
        for owner, session_id in gone:
            self.path(owner, session_id).unlink(missing_ok=True)
        for path in [*self.directory.glob(f"*{SUFFIX}"), *self.directory.glob(f"k*/*{SUFFIX}")]:
            owner = "" if path.parent == self.directory else path.parent.name
            try:
                if (owner, path.name[:-len(SUFFIX)]) not in live and path.stat().st_mtime < deadline:
                    path.unlink()
            except OSError:
                pass
