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


def test_a_store_that_trickles_its_reply_is_down_at_the_deadline_not_per_byte():
    """Issue 49, finding 3: the timeout was per recv, so a store sending a byte every 0.1 s held the client's
    lock 8.5 s and more, blocking every other caller."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    stop = threading.Event()

    def serve() -> None:
        connection, _ = listener.accept()
        with connection, listener:
            connection.recv(65536)
            try:
                for byte in b"$100\r\n" + b"x" * 100:
                    if stop.wait(0.1):
                        return
                    connection.sendall(bytes([byte]))
            except OSError:
                pass
    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    client = StoreClient(StoreAddress("127.0.0.1", port, "", 0), timeout_s=0.5)
    started = time.perf_counter()
    assert client.get(b"key") is None
    assert time.perf_counter() - started < 1.0 and client.failures == 1
    stop.set()
    client.close()
    thread.join(5)


def test_a_reply_of_many_small_items_is_refused_within_bounded_memory():
    """36 MiB of small items on the wire became +659 MiB of Python objects."""
    port, thread = hostile_store(b"*1000000\r\n" + b"*1\r\n:1\r\n" * 100_000)
    client = StoreClient(StoreAddress("127.0.0.1", port, "", 0), timeout_s=2.0)
    tracemalloc.start()
    assert client.call(b"MGET", b"a") is None
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 16 << 20 and client.failures == 1
    client.close()
    thread.join(5)


def test_a_cluster_redirection_to_a_node_the_slot_map_does_not_name_is_not_followed(monkeypatch):
    """50 GETs opened 201 connections and sent AUTH <password> to 200 addresses the node was never given."""
    from reame.arca import cluster
    from reame.arca.cluster import ClusterAddress, ClusterClient
    seed = ("127.0.0.1", 7000)
    slots = [[0, cluster.SLOTS - 1, [b"127.0.0.1", 7000]]]
    asked: list[tuple[str, int]] = []

    class Node:
        def __init__(self, address, timeout_s) -> None:
            asked.append((address.host, address.port))
            self.failures = 0

        def request(self, words, timeout_s=None, asking=False):
            if words == (b"CLUSTER", b"SLOTS"):
                return slots
            return cluster.ReplyError(f"MOVED 1 10.0.{len(asked)}.1:6379")

        def close(self) -> None:
            pass
    monkeypatch.setattr(cluster, "StoreClient", Node)
    client = ClusterClient(ClusterAddress((seed,), "the password"))
    for _ in range(50):
        assert client.get(b"key") is None
    assert set(asked) == {seed}  # one connection, to the node the map names
