"""ARCA's connections: pipelined replies in order (behind a blocked XREAD too), QUIT, flow control."""

import asyncio
import socket

import redis

from reame.arca.connection import Connection
from reame.arca.resp import command_bytes
from reame.arca.server import Arca, ArcaSettings
from tests.arca_thread import arca_thread
from tests.waiting import wait_until


def exchange(sock: socket.socket, data: bytes, expected: bytes) -> bytes:
    """Send `data`, read until `expected` is whole (or the connection ends)."""
    sock.sendall(data)
    got = b""
    while len(got) < len(expected):
        chunk = sock.recv(65536)
        if not chunk:
            break
        got += chunk
    return got


def until_closed(sock: socket.socket, data: bytes) -> bytes:
    """Send `data`, read everything until the server closes the connection."""
    sock.sendall(data)
    got = b""
    while chunk := sock.recv(4096):
        got += chunk
    return got


def test_commands_pipelined_behind_a_blocked_xread_are_answered_after_it_in_order(tmp_path):
    with arca_thread(tmp_path) as port, socket.create_connection(("127.0.0.1", port), timeout=20) as reader:
        writer = redis.Redis(port=port)
        reader.sendall(command_bytes(b"XREAD", b"BLOCK", b"0", b"STREAMS", b"s", b"$") + b"PING\r\nGET k\r\n")
        wait_until(lambda: b"cmd=xread" in writer.execute_command("CLIENT", "LIST"))  # PING, GET wait behind it
        writer.xadd("s", {"f": "v"}, id="1-1")
        answer = b"*1\r\n*2\r\n$1\r\ns\r\n*1\r\n*2\r\n$3\r\n1-1\r\n*2\r\n$1\r\nf\r\n$1\r\nv\r\n+PONG\r\n$-1\r\n"
        assert exchange(reader, b"", answer) == answer
        writer.close()


def test_quit_answers_what_came_before_it_and_nothing_after(tmp_path):
    with arca_thread(tmp_path) as port, socket.create_connection(("127.0.0.1", port), timeout=20) as sock:
        assert until_closed(sock, b"SET a 1\r\nQUIT\r\nSET b 2\r\n") == b"+OK\r\n+OK\r\n"
    with arca_thread(tmp_path) as port, socket.create_connection(("127.0.0.1", port), timeout=20) as sock:
        assert exchange(sock, b"MGET a b\r\n", b"*2\r\n$1\r\n1\r\n$-1\r\n") == b"*2\r\n$1\r\n1\r\n$-1\r\n"


def test_bad_input_is_answered_after_the_commands_ahead_of_it_then_the_connection_closes(tmp_path):
    with arca_thread(tmp_path) as port, socket.create_connection(("127.0.0.1", port), timeout=20) as sock:
        assert until_closed(sock, b"SET a 1\r\nGET a\r\n*1\r\n+PING\r\nSET b 2\r\n") == \
            b"+OK\r\n$1\r\n1\r\n-ERR Protocol error: expected '$', got '+'\r\n"


class FakeTransport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.written, self.reading, self.closed = b"", True, False

    def write(self, data) -> None:
        self.written += bytes(data)

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def get_extra_info(self, name, default=None):
        return ("127.0.0.1", 1) if name == "peername" else default


def test_a_client_that_does_not_read_its_replies_stops_being_read(tmp_path):
    """The transport says its buffer is full (pause_writing): ARCA stops reading that client until it drains,
    so a client cannot make it buffer replies without bound."""
    arca = Arca(ArcaSettings(directory=tmp_path))
    connection, transport = Connection(arca.state), FakeTransport()
    connection.connection_made(transport)
    connection.data_received(b"PING\r\n")
    connection.pause_writing()
    assert not transport.reading
    connection.resume_writing()
    assert transport.reading and transport.written == b"+PONG\r\n"
    connection.connection_lost(None)
    assert not arca.clients
    arca.aof.close()
