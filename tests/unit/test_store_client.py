"""The store client a node uses against a store that sends nonsense: a value larger than any the node
asks for, arrays too large or too deep, malformed numbers and lines that never end are a store that is
down (None, and a backoff), answered in bounded time and memory, never an exception out of a call."""

import socket
import threading
import time
import tracemalloc

import pytest

from reame.arca.client import StoreAddress, StoreClient


def hostile_store(reply: bytes) -> tuple[int, threading.Thread]:
    """A one-connection server that answers any command with `reply` (then keeps the socket open)."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def serve() -> None:
        connection, _ = listener.accept()
        with connection, listener:
            connection.recv(65536)
            try:
                connection.sendall(reply)
                connection.recv(65536)  # until the client gives up and closes
            except OSError:
                pass
    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return port, thread


@pytest.mark.parametrize("reply", [
    b"$99999999999\r\n",  # a 100 GB value announced
    b"*99999999999\r\n",  # an array of 10^11 items announced
    b"*1\r\n" * 20 + b":1\r\n",  # nested 20 deep
    b":12ab\r\n", b"$-x\r\n", b":" + b"9" * 30 + b"\r\n",  # malformed numbers
    b"+" + b"x" * 200_000,  # a line that never ends
    b"?what\r\n",  # not RESP
])
def test_a_hostile_reply_is_a_store_that_is_down_in_bounded_time_and_memory(reply):
    port, thread = hostile_store(reply)
    client = StoreClient(StoreAddress("127.0.0.1", port, "", 0), timeout_s=2.0)
    tracemalloc.start()
    started = time.perf_counter()
    assert client.get(b"key") is None
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert time.perf_counter() - started < 3 and peak < 8 << 20
    assert client.failures == 1  # marked down: the next calls wait for the backoff
    assert client.mget([b"a", b"b"]) == [None, None]
    client.close()
    thread.join(5)
