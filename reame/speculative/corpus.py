"""The shared corpus: every node's finished generations in one stream of the store, read by the others
into their Palimpsest, so one node's answers draft for the rest.

The stream is `reame:corpus:<vocabulary hash>` (one per tokenizer: another model's tokens are never
read), trimmed to about CORPUS_ENTRIES entries; an entry is `node <id> tokens <int32 LE>`. A publisher
thread sends this node's generations (the engine thread only queues them); a reader thread blocks in
XREAD for the others', starting from the stream's beginning, so a new node learns what the others
wrote before it started. Like every store use, a store that is down costs nothing but the drafts.
"""

from __future__ import annotations

import logging
import queue
import threading
import uuid
from collections.abc import Callable, Sequence

from reame.arca.client import StoreCommands
from reame.files import pack_tokens, unpack_tokens
from reame.speculative.palimpsest import Palimpsest

log = logging.getLogger("reame.arca")

CORPUS_ENTRIES = 10_000
READ_BATCH = 100
BLOCK_MS = 1000
MAX_QUEUED = 1000  # generations waiting to be sent; more are dropped (drafts are a speed-up)


class Corpus:
    def __init__(self, connect: Callable[[], StoreCommands], vocabulary: bytes, palimpsest: Palimpsest) -> None:
        """`connect`: a new client of the shared store (the publisher and the reader each have one)."""
        self.stream = b"reame:corpus:" + vocabulary.hex()[:32].encode()
        self.node = uuid.uuid4().hex[:16].encode()
        self.palimpsest = palimpsest
        self.sent = self.absorbed = 0
        self._outbox: queue.Queue[list[int] | None] = queue.Queue(MAX_QUEUED)
        self._stop = threading.Event()
        self._publisher_store, self._reader_store = connect(), connect()
        self._threads = [threading.Thread(target=self._publish, name="reame-corpus-out", daemon=True),
                         threading.Thread(target=self._read, name="reame-corpus-in", daemon=True)]
        palimpsest.listener = self.offer
        for thread in self._threads:
            thread.start()

    def offer(self, tokens: Sequence[int]) -> None:
        """A generation this node recorded (engine thread: never waits)."""
        try:
            self._outbox.put_nowait(list(tokens))
        except queue.Full:
            pass

    def close(self) -> None:
        self.palimpsest.listener = None
        self._stop.set()
        self._outbox.put(None)
        for thread in self._threads:
            thread.join(timeout=BLOCK_MS / 1000 + 2)
        self._publisher_store.close()
        self._reader_store.close()

    def _publish(self) -> None:
        while True:
            tokens = self._outbox.get()
            if tokens is None:
                return
            if self._publisher_store.xadd(self.stream, {b"node": self.node, b"tokens": pack_tokens(tokens)},
                                          CORPUS_ENTRIES) is not None:
                self.sent += 1

    def _read(self) -> None:
        after = b"0"
        while not self._stop.is_set():
            entries = self._reader_store.xread(self.stream, after, READ_BATCH, BLOCK_MS)
            if not entries:
                self._stop.wait(0.05 if self._reader_store.failures == 0 else 1.0)
                continue
            for entry_id, fields in entries:
                after = entry_id
                if fields.get(b"node") != self.node and b"tokens" in fields:
                    try:
                        self.palimpsest.absorb(unpack_tokens(fields[b"tokens"]))
                    except ValueError:
                        continue  # not int32s: not ours
                    self.absorbed += 1
