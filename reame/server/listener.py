"""The listening server, on one address or several (`server.host` lists them, comma-separated, as
llama-server's --host does; IPv6 ones too): one thread per connection, at most `max_connections` open (past it
the longest idle keep-alive connection is closed to make room, or the newcomer gets a 503), `max_requests`
request slots the handlers take (http.py), and a graceful drain on shutdown. It owns the set of open
connections and whether each waits idle for its next request; handlers tell it (`idle`, `busy`)."""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import ThreadingHTTPServer
from typing import Any

from reame.server.client import HttpError
from reame.server.http import LINGER_BYTES, LINGER_S, Handler
from reame.server.settings import ServerSettings

# An idle keep-alive connection is closed to make room for a new one only after this long idle: one that just
# finished a request is likely to send its next.
EVICTABLE_AFTER_S = 0.5
MAX_REFUSING = 32  # refused connections answered (503, lingering close) at once; past it they are just closed


def listen_addresses(host: str) -> list[str]:
    """The addresses `server.host` lists (comma-separated; an IPv6 one with or without its brackets)."""
    hosts = [item.strip().removeprefix("[").removesuffix("]") for item in host.split(",") if item.strip()]
    return hosts or ["127.0.0.1"]


def address_family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def listening_socket(host: str, port: int, backlog: int) -> socket.socket:
    listening = socket.socket(address_family(host), socket.SOCK_STREAM)
    try:
        listening.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if listening.family == socket.AF_INET6:  # this address only: another entry may list the IPv4 one
            listening.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        listening.bind((host, port))
        listening.listen(backlog)
    except OSError:
        listening.close()
        raise
    return listening


class ReameHTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    # Connections the kernel holds until they are accepted: socketserver's 5 overflows when many clients
    # connect at once, and an overflowing backlog turns into resets the clients see.
    request_queue_size = 256

    def __init__(self, settings: ServerSettings, app: Any) -> None:
        self.settings = settings
        self.app = app
        self.request_slots = threading.BoundedSemaphore(settings.max_requests)
        self._refusers = threading.BoundedSemaphore(MAX_REFUSING)  # threads answering refused connections
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        # Open connections, and since when each waits idle for its next request (None: a request is under way).
        self._connections: dict[socket.socket, float | None] = {}
        self._busy = 0
        self.stopping = False
        first, *more = listen_addresses(settings.host)
        self.address_family = address_family(first)
        super().__init__((first, settings.port), Handler)
        # The other addresses listen on the first's port (its own, when port 0 picked one), each accepted on a
        # thread of its own into the same connection accounting.
        self.more_sockets: list[socket.socket] = []
        try:
            for host in more:
                self.more_sockets.append(listening_socket(host, self.server_address[1], self.request_queue_size))
        except OSError:  # an address that cannot be bound: none of them listens
            for listening in self.more_sockets:
                listening.close()
            self.server_close()
            raise

    def serve_forever(self, poll_interval: float = 0.5) -> None:
        for listening in self.more_sockets:
            threading.Thread(target=self._accept, args=(listening,), name="reame-http-more", daemon=True).start()
        super().serve_forever(poll_interval)

    def _accept(self, listening: socket.socket) -> None:
        """Accept connections on one more address until it is closed (shutdown)."""
        while True:
            try:
                request, address = listening.accept()
            except OSError:
                return
            try:
                self.process_request(request, address)
            except Exception:
                self.handle_error(request, address)
                self.shutdown_request(request)

    def shutdown(self) -> None:
        """Stop accepting, on every address."""
        for listening in self.more_sockets:
            try:  # wakes its accept()
                listening.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            listening.close()
        super().shutdown()

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._lock:
            room = len(self._connections) < self.settings.max_connections or self._evict_idle()
            if room:
                self._connections[request] = time.monotonic()
                self._busy += 1
        if not room:
            if not self._refusers.acquire(blocking=False):  # a flood: no thread each, just close
                self.close_request(request)
                return
            # Answered on a thread of its own: the lingering close must not hold up the accept loop.
            threading.Thread(target=self._refuse, args=(request,), name="reame-refuse", daemon=True).start()
            return
        super().process_request(request, client_address)

    def _evict_idle(self) -> bool:
        """Make room by closing the longest idle connection (idle for EVICTABLE_AFTER_S at least); lock held."""
        now = time.monotonic()
        idle = [(since, connection) for connection, since in self._connections.items()
                if since is not None and now - since >= EVICTABLE_AFTER_S]
        if not idle:
            return False
        connection = min(idle, key=lambda pair: pair[0])[1]
        self._connections[connection] = None  # its thread ends it; it no longer counts as idle meanwhile
        try:
            connection.shutdown(socket.SHUT_RDWR)  # wakes its thread, which sees the end and closes
        except OSError:
            pass
        return True

    def idle(self, connection: socket.socket) -> None:
        with self._lock:
            if connection in self._connections:
                self._connections[connection] = time.monotonic()

    def connections(self) -> dict[str, int]:
        """Open connections: answering or receiving a request ("busy"), or waiting for one ("idle")."""
        with self._lock:
            idle = sum(1 for since in self._connections.values() if since is not None)
            return {"busy": len(self._connections) - idle, "idle": idle}

    def busy(self, connection: socket.socket) -> None:
        with self._lock:
            if self._connections.get(connection) is not None:
                self._connections[connection] = None

    def _refuse(self, request: socket.socket) -> None:
        body = json.dumps(HttpError(503, "too many connections, retry later", "server_error",
                                    "overloaded").body()).encode()
        head = (f"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nConnection: close\r\n"
                f"Retry-After: 1\r\nContent-Length: {len(body)}\r\n\r\n").encode()
        try:
            request.settimeout(self.settings.idle_timeout_s)
            request.sendall(head + body)
        except OSError:
            pass
        try:
            self.shutdown_request(request)
        finally:
            self._refusers.release()

    def shutdown_request(self, request: Any) -> None:
        """Close gracefully: stop sending, then read and drop what the client still sends (a request we
        answered without reading, say) until it closes, for at most LINGER_S. Closing a socket with
        unread input makes the kernel send a reset, which a client sees as an error instead of our answer."""
        try:
            request.shutdown(socket.SHUT_WR)
            request.settimeout(LINGER_S)
            deadline, drained = time.monotonic() + LINGER_S, 0
            while drained < LINGER_BYTES and time.monotonic() < deadline:
                chunk = request.recv(65536)
                if not chunk:
                    break
                drained += len(chunk)
        except OSError:
            pass
        self.close_request(request)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self._lock:
                self._busy -= 1
                self._connections.pop(request, None)
                self._idle.notify_all()

    def drain(self, timeout_s: float) -> bool:
        """Graceful stop, after `shutdown()`: idle keep-alive connections are closed, requests in
        flight get up to `timeout_s` to finish. False if some were still running then."""
        self.stopping = True
        with self._lock:
            for connection in list(self._connections):
                try:  # wakes a thread waiting for the next request; a running one writes on
                    connection.shutdown(socket.SHUT_RD)
                except OSError:
                    pass
            return self._idle.wait_for(lambda: self._busy == 0, timeout_s)
