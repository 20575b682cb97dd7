"""The listening server: one thread per connection, at most `max_connections` open (past it the longest idle
keep-alive connection is closed to make room, or the newcomer gets a 503), `max_requests` request slots the
handlers take (http.py), and a graceful drain on shutdown. It owns the set of open connections and whether
each waits idle for its next request; handlers tell it (`idle`, `busy`)."""

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
        super().__init__((settings.host, settings.port), Handler)

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
