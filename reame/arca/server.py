"""The ARCA daemon: a Redis-protocol server (RESP2, RESP3 after HELLO 3) on one asyncio event loop.

Every connection (connection.py) is served on the loop thread, which owns the keyspace
(store.py): commands run one at a time, so no locks. A connection's pipelined commands
are answered in order and their replies written together. Only standard Redis
commands, with Redis's replies and error texts, so redis-cli, redis-py and
redis-benchmark work unmodified, and a real Redis or Valkey can replace ARCA under
the same clients (reame/arca/client.py).

Safety: it binds 127.0.0.1 unless told otherwise; with `requirepass` every command
but AUTH, HELLO and QUIT needs authentication first (compared in constant time);
request sizes are bounded (resp.py); the keyspace has a byte budget (LRU eviction).

The commands live by family in connection_commands.py, key_commands.py and stream_commands.py, as
functions of the state they share (state.py), their table in commands.py; this module makes the state,
loads the log into it, serves connections over it and does the chores.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Callable
from pathlib import Path

from reame.arca.commands import COMMANDS, execute
from reame.arca.connection import Connection
from reame.arca.resp import Error, Reply
from reame.arca.state import ArcaState
from reame.arca.store import Keyspace, now_ms
from reame.arca.aof import AOF_NAME, AppendOnlyFile, LogDamaged, read_log, snapshot_records, truncate_log
from reame.arca.types import ArcaSettings, Blocked, Client
from reame.errors import ListenError
from reame.files import private_directory

log = logging.getLogger("reame.arca")

EXPIRE_EVERY_S = 0.1
EXPIRE_CYCLE_S = 0.025  # the most one active-expiry cycle holds the loop (Redis: 25 ms); the rest waits its turn
EXPIRE_SAMPLE = 20
SYNC_EVERY_S = 1.0
AUTH_DEADLINE_S = 10.0  # where a password is required, a client must authenticate this soon after connecting


class Arca:
    """The daemon: its state (the keyspace, its log, the clients), loaded from the log, served, kept."""

    def __init__(self, settings: ArcaSettings) -> None:
        self.settings = settings
        self.state = ArcaState(settings, COMMANDS)
        self.state.aof = self._load(settings.directory)

    @property
    def keyspace(self) -> Keyspace:
        return self.state.keyspace

    @property
    def aof(self) -> AppendOnlyFile:
        assert self.state.aof is not None
        return self.state.aof

    @property
    def clients(self) -> dict[int, Client]:
        return self.state.clients

    def execute(self, client: Client, command: list[bytes]) -> Reply | Blocked:
        return execute(self.state, client, command)

    # --- persistence ---

    def _load(self, directory: Path) -> AppendOnlyFile:
        """Replay the log; a torn last record (a crash mid-append) is cut off, damage anywhere else is a
        LogDamaged naming where, and nothing is loaded or changed (`reame arca --check-aof`)."""
        path = directory / AOF_NAME
        private_directory(directory)
        scan = read_log(path)
        if scan.damaged:
            raise LogDamaged(path, scan)
        if path.exists():
            truncate_log(path, scan.good)
        client = Client("aof")
        client.authenticated = True
        commands = scan.commands
        for command in commands:
            reply = self.execute(client, command)
            if isinstance(reply, Error):
                log.warning("the append-only file holds a command that failed: %s", reply)
        if commands:
            log.info("loaded %d keys from %s (%d commands)", len(self.keyspace), path, len(commands))
        return AppendOnlyFile(directory)

    async def rewrite(self) -> None:
        """Write the keyspace anew in a worker thread; writes made meanwhile are appended after it."""
        self.aof.start_rewrite()
        records = snapshot_records(self.keyspace)
        temporary = None
        try:
            temporary = await asyncio.to_thread(self.aof.write_rewrite, records)
            self.aof.finish_rewrite(temporary)
            log.info("rewrote the append-only file: %d keys, %d bytes", len(self.keyspace), self.aof.size())
        except OSError as error:
            log.warning("append-only file rewrite failed: %s", error)
            self.aof.abandon_rewrite(temporary)

    # --- serving ---

    async def serve(self, on_ready: Callable[[int], None] | None = None) -> None:
        try:
            server = await asyncio.get_running_loop().create_server(
                lambda: Connection(self.state), self.settings.host, self.settings.port, reuse_address=True)
        except OSError as error:
            self.aof.close()
            raise ListenError(self.settings.host, self.settings.port, error) from None
        port = server.sockets[0].getsockname()[1]
        log.info("ARCA listening on %s:%d (data in %s%s)", self.settings.host, port, self.settings.directory,
                 ", password required" if self.settings.requirepass else "")
        if on_ready is not None:
            on_ready(port)
        chores = asyncio.create_task(self._chores())
        try:
            await asyncio.get_running_loop().create_future()  # serving (create_server started it) until cancelled
        finally:
            # Not serve_forever nor `async with server`: since Python 3.12.1 both wait, once stopped, for every
            # connection to end, so a client that stays connected (a serving node's) held the shutdown forever.
            chores.cancel()
            server.close()
            for client in list(self.clients.values()):
                client.disconnect()
            self.aof.close()

    async def _chores(self) -> None:
        """Active expiry every 100 ms; fsync, a rewrite check and idle clients every second."""
        last_sync = time.monotonic()
        while True:
            await asyncio.sleep(EXPIRE_EVERY_S)
            self.expire_cycle()
            if time.monotonic() - last_sync >= SYNC_EVERY_S:
                last_sync = time.monotonic()
                self.close_idle_clients(last_sync)
                try:
                    await asyncio.to_thread(self.aof.sync)
                except OSError as error:
                    log.warning("cannot fsync the append-only file: %s", error)
                if self.aof.wants_rewrite():
                    await self.rewrite()

    def expire_cycle(self) -> None:
        """Redis's active expiry: samples of keys with a deadline while a quarter or more of a sample was dead,
        for at most EXPIRE_CYCLE_S (what is left waits for the next cycle; a read drops a dead key anyway)."""
        deadline = time.monotonic() + EXPIRE_CYCLE_S
        while self.keyspace.expire_some(now_ms(), EXPIRE_SAMPLE) >= EXPIRE_SAMPLE // 4 and \
                time.monotonic() < deadline:
            pass

    def close_idle_clients(self, now: float) -> None:
        """Close clients idle past `timeout_s` (never one waiting in a blocking read), and, where a password is
        required, clients that did not authenticate within AUTH_DEADLINE_S."""
        timeout = self.settings.timeout_s
        for client in list(self.clients.values()):
            idle = timeout and not client.blocked and now - client.last_active > timeout
            unauthenticated = self.settings.requirepass and not client.authenticated and \
                now - client.created > AUTH_DEADLINE_S
            if idle or unauthenticated:
                client.disconnect()


def run(settings: ArcaSettings, on_ready: Callable[[int], None] | None = None) -> int:
    """Serve until SIGINT/SIGTERM; the log is fsynced on the way out."""
    async def main() -> None:
        arca = Arca(settings)
        task = asyncio.create_task(arca.serve(on_ready))
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, task.cancel)
        try:
            await task
        except asyncio.CancelledError:
            pass
        log.info("ARCA stopped; the append-only file is synced")

    asyncio.run(main())
    return 0
