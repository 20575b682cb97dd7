"""One ARCA client connection: bytes in, commands run in order, their replies out together.

An asyncio Protocol rather than a stream coroutine: a pipelined read costs one callback
and one write, with no task switch between them, which is most of what a cheap command
(GET, PING) costs beside its parsing. A blocked XREAD pauses reading; the commands
pipelined behind it wait their turn, as in Redis. A client that does not read its
replies pauses reading too (the transport's flow control), so it cannot make ARCA buffer
without bound; nor can one that sends: its unparsed input (the query buffer) is bounded
by `max_query_bytes`, and before it authenticates (where a password is required) its
commands are read one at a time under Redis's unauthenticated limits (10 items, 16 KiB
bulks). A connection that sends what a browser sends (`POST`, `Host:`) is closed without
a word, as Redis does: a web page must not be able to write into the store.
"""

from __future__ import annotations

import asyncio
import logging
import time

from reame.arca.commands import execute
from reame.arca.resp import Error, ProtocolError, RequestParser, encode
from reame.arca.state import ArcaState
from reame.arca.types import Blocked, Client

log = logging.getLogger("reame.arca")

HTTP_COMMANDS = (b"POST", b"HOST:")  # what only a browser (or a cross-protocol attack) sends


class Connection(asyncio.Protocol):
    def __init__(self, state: ArcaState) -> None:
        self.state = state
        settings = state.settings
        self.parser = RequestParser(max_bulk=min(settings.max_query_bytes, RequestParser().max_bulk))
        self.client = Client("?", self._close)
        self.transport: asyncio.Transport | None = None
        self._queued: list[list[bytes]] = []  # commands pipelined behind a blocked one
        self._waiter: asyncio.Task | None = None  # the blocked command's wait
        self._write_paused = False
        self._refusal: ProtocolError | None = None  # bad input: answered once the commands before it are

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.state.connections_received += 1
        if len(self.state.clients) >= self.state.settings.max_clients:
            transport.write(encode(Error("ERR max number of clients reached")))
            self.client.closing = True
            transport.close()
            return
        peer = transport.get_extra_info("peername")
        if peer:
            self.client.address = f"{peer[0]}:{peer[1]}"
        self.state.clients[self.client.id] = self.client

    def connection_lost(self, exc: Exception | None) -> None:
        self.state.clients.pop(self.client.id, None)
        if self._waiter is not None:
            self._waiter.cancel()

    def _unauthenticated(self) -> bool:
        return bool(self.state.settings.requirepass) and not self.client.authenticated

    def data_received(self, data: bytes) -> None:
        if self._refusal is not None or self.client.closing:  # what follows bad input is never read
            return
        self.client.last_active = time.monotonic()
        if self._unauthenticated():
            self._before_authentication(data)
            return
        commands = self._parse(data)
        if self._waiter is not None:
            self._queued += commands
            return
        self._run(commands)

    def _before_authentication(self, data: bytes) -> None:
        """One command at a time, each read under the limits its turn has: AUTH lifts them for the rest."""
        self.parser.unauthenticated = True
        commands = self._parse(data, limit=1)
        while commands and not self.client.closing:
            self._run(commands)
            if not self._unauthenticated():
                self.parser.unauthenticated = False
                if self._refusal is None:
                    self._run(self._parse(b""))
                return
            commands = self._parse(b"", limit=1) if self._refusal is None else []
        if self._refusal is not None and not self.client.closing:
            self._run([])

    def _parse(self, data: bytes, limit: int | None = None) -> list[list[bytes]]:
        """The whole commands the input now holds; bad input, or a query buffer past its limit, is refused
        after the commands before it run (as Redis does)."""
        try:
            commands = self.parser.feed(data, limit)
        except ProtocolError as error:
            commands, self._refusal = error.before, error
            return commands
        if self.parser.pending_bytes > self.state.settings.max_query_bytes:
            self._refusal = ProtocolError(f"query buffer of {self.parser.pending_bytes} bytes is over the "
                                          f"client-query-buffer-limit of {self.state.settings.max_query_bytes}")
        return commands

    def pause_writing(self) -> None:
        self._write_paused = True
        self._pause_reading()

    def resume_writing(self) -> None:
        self._write_paused = False
        if self._waiter is None:
            self._resume_reading()

    def _run(self, commands: list[list[bytes]]) -> None:
        out = bytearray()
        client, state = self.client, self.state
        for index, command in enumerate(commands):
            if command[0].upper() in HTTP_COMMANDS:
                log.warning("closed a connection from %s that sent %r: something speaks HTTP to ARCA (a web page "
                            "a browser opened?)", client.address, command[0][:8])
                self._close()  # as Redis: the replies to what came with it in the same read are not sent
                return
            reply = execute(state, client, command)
            if isinstance(reply, Blocked):
                self._send(out)
                self._queued = commands[index + 1:]
                self._pause_reading()
                client.blocked = True
                self._waiter = asyncio.get_running_loop().create_task(self._unblock(reply))
                return
            out += encode(reply, client.resp3)
            if client.closing:
                self._send(out)
                self._close()
                return
        self._send(out)
        if self._refusal is not None:
            self._send(encode(Error(f"ERR Protocol error: {self._refusal}")))
            self._close()

    async def _unblock(self, blocked: Blocked) -> None:
        reply = await self.state.wait(blocked)
        self._waiter = None
        self.client.blocked = False
        self.client.last_active = time.monotonic()
        self._send(encode(reply, self.client.resp3))
        queued, self._queued = self._queued, []
        if not self._write_paused:
            self._resume_reading()
        self._run(queued)

    def _send(self, replies: bytes | bytearray) -> None:
        """The log reaches the OS before the client hears OK (it is fsynced within a second)."""
        if self.state.aof is not None:
            self.state.aof.flush()
        if replies and self.transport is not None and not self.transport.is_closing():
            self.transport.write(replies)

    def _close(self) -> None:
        """After the replies already written (QUIT, a protocol error, an idle client)."""
        self.client.closing = True
        if self.transport is not None:
            self.transport.close()

    def _pause_reading(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.pause_reading()

    def _resume_reading(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.resume_reading()
