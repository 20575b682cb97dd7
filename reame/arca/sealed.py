"""The shared store's values sealed with the fleet's secret (`arca.secret`): whoever can write to the store but
does not hold the secret cannot make a node serve an answer, restore a KV or follow a semantic match.

A value a node writes (SET) is prefixed with an HMAC-SHA256 tag over its key and itself; one it reads (GET,
MGET) is used only if its tag is right for the key it was asked under, else it is a miss, counted. A stream
entry (XADD: the semantic index, the Palimpsest's corpus) carries a tag over its stream and fields in a field
of its own; an entry without a right one is skipped. Nodes of one fleet share the secret; a node without it
reads nothing the others wrote (and they nothing of its). Other commands pass through unchanged.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import struct
import threading
import time

from reame.arca.client import StoreCommands

log = logging.getLogger("reame.arca")

TAG_BYTES = 32
TAG_FIELD = b"reame-tag"
WARN_EVERY_S = 60.0


class SealedStore(StoreCommands):
    """`store` with every value sealed on the way in and checked on the way out. Thread-safe as `store` is."""

    def __init__(self, store: StoreCommands, secret: bytes) -> None:
        self.store = store
        self.timeout_s = store.timeout_s
        self._secret = secret
        self._lock = threading.Lock()
        self.refused = 0  # values read whose tag was wrong or missing
        self._warned_at = float("-inf")

    @property
    def failures(self) -> int:
        return self.store.failures

    def call(self, *words: bytes, timeout_s: float | None = None) -> object:
        command = words[0].upper() if words else b""
        if command == b"SET" and len(words) >= 3:
            return self.store.call(words[0], words[1], self.seal(words[1], words[2]), *words[3:], timeout_s=timeout_s)
        reply = self.store.call(*words, timeout_s=timeout_s)
        if command == b"GET" and len(words) == 2:
            return self.opened(words[1], reply)
        if command == b"MGET" and isinstance(reply, list) and len(reply) == len(words) - 1:
            return [self.opened(key, value) for key, value in zip(words[1:], reply)]
        return reply

    def xadd(self, stream: bytes, fields: dict[bytes, bytes], max_length: int) -> bytes | None:
        return self.store.xadd(stream, {**fields, TAG_FIELD: self._entry_tag(stream, fields)}, max_length)

    def xread(self, stream: bytes, after: bytes, count: int,
              block_ms: int | None) -> list[tuple[bytes, dict[bytes, bytes]]]:
        kept = []
        for entry_id, fields in self.store.xread(stream, after, count, block_ms):
            tag = fields.pop(TAG_FIELD, b"")
            if hmac.compare_digest(tag, self._entry_tag(stream, fields)):
                kept.append((entry_id, fields))
            else:
                self._refuse(stream)
        return kept

    def close(self) -> None:
        self.store.close()

    def seal(self, key: bytes, value: bytes) -> bytes:
        return self._tag(key, value) + value

    def opened(self, key: bytes, value: object) -> bytes | None:
        """The value under its seal, or None (counted) when the seal is not the fleet's for this key."""
        if not isinstance(value, bytes):
            return None
        tag, payload = value[:TAG_BYTES], value[TAG_BYTES:]
        if len(tag) == TAG_BYTES and hmac.compare_digest(tag, self._tag(key, payload)):
            return payload
        self._refuse(key)
        return None

    def _tag(self, key: bytes, value: bytes) -> bytes:
        mac = hmac.new(self._secret, struct.pack("<Q", len(key)) + key, hashlib.sha256)
        mac.update(value)
        return mac.digest()

    def _entry_tag(self, stream: bytes, fields: dict[bytes, bytes]) -> bytes:
        mac = hmac.new(self._secret, struct.pack("<Q", len(stream)) + stream, hashlib.sha256)
        for name in sorted(fields):
            mac.update(struct.pack("<QQ", len(name), len(fields[name])) + name + fields[name])
        return mac.digest()

    def _refuse(self, key: bytes) -> None:
        with self._lock:
            self.refused += 1
            warn = time.monotonic() - self._warned_at > WARN_EVERY_S
            if warn:
                self._warned_at = time.monotonic()
        if warn:
            log.warning("a value in the shared store (%r) is not sealed with this fleet's arca.secret: ignored "
                        "(%d so far); a node with another secret, or someone else, wrote it", key[:80], self.refused)
