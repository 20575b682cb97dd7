"""One ARCA client connection: bytes in, commands run in order, their replies out together.

An asyncio Protocol rather than a stream coroutine: a pipelined read costs one callback
and one write, with no task switch between them, which is most of what a cheap command
(GET, PING) costs beside its parsing. A blocked XREAD pauses reading; the commands
pipelined behind it wait their turn, as in Redis. A client that does not read its
replies pauses reading too (the transport's flow control), so it cannot make ARCA buffer
without bound.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from reame.arca.connection_commands import Client
from reame.arca.resp import Error, ProtocolError, RequestParser, encode
from reame.arca.stream_commands import Blocked

if TYPE_CHECKING:
    from reame.arca.server import Arca


class Connection(asyncio.Protocol):
    def __init__(self, arca: Arca) -> None:
        self.arca = arca
        self.parser = RequestParser()
        self.client = Client("?")
        self.transport: asyncio.Transport | None = None
        self._queued: list[list[bytes]] = []  # commands pipelined behind a blocked one
        self._waiter: asyncio.Task | None = None  # the blocked command's wait
        self._write_paused = False
        self._refusal: ProtocolError | None = None  # bad input: answered once the commands before it are

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        peer = transport.get_extra_info("peername")
        if peer:
            self.client.address = f"{peer[0]}:{peer[1]}"
        self.arca.clients[self.client.id] = self.client
        self.arca.connections_received += 1

    def connection_lost(self, exc: Exception | None) -> None:
        self.arca.clients.pop(self.client.id, None)
        if self._waiter is not None:
            self._waiter.cancel()

    def data_received(self, data: bytes) -> None:
        if self._refusal is not None:  # what follows bad input is never read
            return
        try:
            commands = self.parser.feed(data)
        except ProtocolError as error:  # answered after the whole commands ahead of it, as Redis does
            commands, self._refusal = error.before, error
        if self._waiter is not None or self.client.closing:
            self._queued += commands
            return
        self._run(commands)

    def pause_writing(self) -> None:
        self._write_paused = True
        self._pause_reading()

    def resume_writing(self) -> None:
        self._write_paused = False
        if self._waiter is None:
            self._resume_reading()

    def _run(self, commands: list[list[bytes]]) -> None:
        out = bytearray()
        client, execute = self.client, self.arca.execute
        for index, command in enumerate(commands):
            reply = execute(client, command)
            if type(reply) is Blocked:
                self._send(out)
                self._queued = commands[index + 1:]
                self._pause_reading()
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
        reply = await self.arca.wait(blocked)
        self._waiter = None
        self._send(encode(reply, self.client.resp3))
        queued, self._queued = self._queued, []
        if not self._write_paused:
            self._resume_reading()
        self._run(queued)

    def _send(self, replies: bytes | bytearray) -> None:
        """The log reaches the OS before the client hears OK (it is fsynced within a second)."""
        self.arca.aof.flush()
        if replies and self.transport is not None and not self.transport.is_closing():
            self.transport.write(replies)

    def _close(self) -> None:
        """After the replies already written (QUIT, a protocol error)."""
        self.client.closing = True
        if self.transport is not None:
            self.transport.close()

    def _pause_reading(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.pause_reading()

    def _resume_reading(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.resume_reading()
