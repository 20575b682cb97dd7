"""What ARCA's commands read and change: the keyspace, its log, the clients, the counters INFO shows.

One owner: the daemon's event loop thread (commands run one at a time, so no locks). The commands are
plain functions of this state (key_commands.py, stream_commands.py, connection_commands.py); the daemon
(server.py) makes it, replays the log into it and serves connections over it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping

from reame.arca.resp import Reply, command_bytes
from reame.arca.store import Keyspace
from reame.arca.aof import AppendOnlyFile
from reame.arca.types import ArcaSettings, Blocked, Client

CORPUS_PREFIX = b"reame:corpus:"  # the streams of the corpus the nodes share (reame/speculative/corpus.py)


class ArcaState:
    def __init__(self, settings: ArcaSettings, command_table: Mapping[bytes, tuple[object, int]]) -> None:
        self.settings = settings
        self.keyspace = Keyspace(settings.max_bytes)
        self.command_table = command_table  # what COMMAND describes
        self.clients: dict[int, Client] = {}
        self.started = time.time()
        self.commands_processed = 0
        self.connections_received = 0
        self.aof: AppendOnlyFile | None = None  # None while the log itself is replayed: nothing is appended
        self._stream_added = asyncio.Event()  # set (and replaced) whenever an XADD lands
        self.corpus_keys: set[bytes] = set()  # corpus streams XADD made (ARCA.DRAFT drops the gone ones)

    def log(self, *words: bytes | str | int) -> None:
        """Append a write to the log, as the command that replays it."""
        self.log_record(command_bytes(*words))

    def log_record(self, record: bytes) -> None:
        if self.aof is not None:
            self.aof.append(record)

    def stream_added(self) -> None:
        """An XADD landed: wake the blocked reads."""
        event, self._stream_added = self._stream_added, asyncio.Event()
        event.set()

    async def wait(self, blocked: Blocked) -> Reply:
        """The blocked command's reply: when an XADD gives it something, or None at its timeout."""
        deadline = None if blocked.timeout_ms == 0 else time.monotonic() + blocked.timeout_ms / 1000
        while True:
            event = self._stream_added
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return None
            try:
                await asyncio.wait_for(event.wait(), remaining)
            except asyncio.TimeoutError:
                return None
            reply = blocked.retry()
            if reply is not None:
                return reply
