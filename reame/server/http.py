"""HTTP transport: a bounded ThreadingHTTPServer, keep-alive, limits, auth, CORS, SSE.

One thread per connection, at most `max_connections` at once (the next gets a
503 and is closed). HTTP/1.1 keep-alive with exact Content-Length on every
response; a connection idle for `idle_timeout_s` (or a client that sends its
request too slowly) is closed. Request bodies come with Content-Length or
chunked, under the size limit; a body no route reads is drained before the next
request (or the connection is closed), so an error never desynchronises a
keep-alive connection. SSE responses end the connection. Routing and the OpenAI logic live in openai_api.py.
"""

from __future__ import annotations

import hmac
import io
import json
import logging
import select
import socket
import threading
import time
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

log = logging.getLogger("reame.server")

MAX_CHUNK_LINE_BYTES = 4096
# A closing connection reads what the client still sends for this long (and this much) before it closes.
LINGER_S = 2.0
LINGER_BYTES = 1 << 20
MAX_TRAILER_LINES = 64


@dataclass(frozen=True)
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 8080
    api_keys: tuple[str, ...] = ()
    cors_origin: str = ""  # "" = CORS off; "*" or an origin to allow
    max_connections: int = 64
    max_body_bytes: int = 10 << 20
    idle_timeout_s: float = 30.0
    request_timeout_s: float = 60.0  # the whole request, from its first byte
    model_id: str = "reame"
    grace_s: float = 30.0
    request_log: bool = True
    metrics: bool = True  # serve GET /metrics
    extra: dict[str, Any] = field(default_factory=dict)


class HttpError(Exception):
    """An error to answer in OpenAI's shape."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
                 code: str | None = None, param: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.code, self.param = status, message, kind, code, param
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class RequestReader(io.RawIOBase):
    """A connection's input, with two clocks. A read waits at most `idle_s`; and from a request's first
    byte, the whole request (line, headers, body) must arrive within `request_s`, so a client that
    trickles one byte at a time is cut off (408) instead of holding a connection forever. The socket's
    own timeout stays `idle_s` between reads, for the writes of the answer."""

    def __init__(self, sock: socket.socket, idle_s: float, request_s: float) -> None:
        super().__init__()
        self.sock, self.idle_s, self.request_s = sock, idle_s, request_s
        self.deadline: float | None = None  # set by a request's first byte

    def readable(self) -> bool:
        return True

    def next_request(self) -> None:
        self.deadline = None

    @property
    def started(self) -> bool:
        """Whether the current request's first byte has arrived."""
        return self.deadline is not None

    def readinto(self, buffer: Any) -> int:
        timeout = self.idle_s
        if self.deadline is not None:
            timeout = min(timeout, self.deadline - time.monotonic())
            if timeout <= 0:
                raise TimeoutError("the request did not arrive in time")
        self.sock.settimeout(timeout)
        try:
            received = self.sock.recv_into(buffer)
        finally:
            self.sock.settimeout(self.idle_s)
        if received and self.deadline is None:
            self.deadline = time.monotonic() + self.request_s
        return received


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "reame"
    sys_version = ""
    server: "ReameHTTPServer"

    def setup(self) -> None:
        settings = self.server.settings
        self.timeout = settings.idle_timeout_s
        self.body_read, self.body, self.response_started = False, None, False
        super().setup()
        self.reader = RequestReader(self.connection, settings.idle_timeout_s, settings.request_timeout_s)
        self.rfile = io.BufferedReader(self.reader, 65536)

    def handle_one_request(self) -> None:
        """http.server's request loop, except that a request that began but did not arrive in time gets a
        408 before the connection closes (http.server drops it without a word); an idle one just closes."""
        self.reader.next_request()
        try:
            self.raw_requestline = self.rfile.readline(65537)
            if len(self.raw_requestline) > 65536:
                self.requestline, self.request_version, self.command = "", "", ""
                self.send_error(HTTPStatus.REQUEST_URI_TOO_LONG)
                return
            if not self.raw_requestline:
                self.close_connection = True
                return
            if not self.parse_request():
                return
            method = getattr(self, "do_" + self.command, None)
            if method is None:
                self.send_error(HTTPStatus.NOT_IMPLEMENTED, f"Unsupported method ({self.command!r})")
                return
            method()
            self.wfile.flush()
        except TimeoutError:
            self.close_connection = True
            if self.reader.started and not self.response_started:
                self.requestline, self.request_version, self.command = "", "HTTP/1.1", "POST"
                self.send_json(408, HttpError(408, "the request did not arrive in time", code="timeout").body())

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        self.body_read, self.body, self.response_started = False, None, False
        self.server.app.dispatch(self)
        if not self.close_connection:
            self.discard_body()

    do_POST = do_DELETE = do_PUT = do_PATCH = do_HEAD = do_GET

    def do_OPTIONS(self) -> None:  # noqa: N802
        if not self.server.settings.cors_origin:
            self.do_GET()
            return
        self.body_read, self.body, self.response_started = False, None, False
        self.discard_body()
        self.send_response(204)
        self.send_cors_headers()
        self.send_header("Access-Control-Max-Age", "600")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """http.server's own errors (bad request line, headers too long…) in OpenAI's JSON shape."""
        if self.request_version == "HTTP/0.9":
            self.request_version = "HTTP/1.1"  # never answer without a status line
        self.close_connection = True
        reason = message or self.responses.get(code, ("error",))[0]
        self.send_json(code, HttpError(code, reason, code="bad_request").body())

    # --- reading ---

    def read_body(self) -> bytes | None:
        """The request body, framed by Content-Length or chunked, read at most once per request (None:
        the request has none). HttpError for a body we will not read; it also closes the connection,
        whose next request could not be found."""
        if self.body_read:
            return self.body
        self.body_read = True
        encoding = self.headers.get("Transfer-Encoding")
        raw_length = self.headers.get("Content-Length")
        try:
            if encoding is not None:
                if encoding.strip().lower() != "chunked" or raw_length is not None:
                    raise HttpError(501, f"Transfer-Encoding {encoding!r} is not supported; send Content-Length "
                                    "or chunked", code="not_implemented")
                self.body = self._read_chunked(self.server.settings.max_body_bytes)
            elif raw_length is not None:
                self.body = self._read_length(raw_length, self.server.settings.max_body_bytes)
        except HttpError:
            self.close_connection = True
            raise
        except (TimeoutError, OSError):
            self.close_connection = True
            raise HttpError(408, "the request body did not arrive in time", code="timeout") from None
        return self.body

    def _read_length(self, raw_length: str, limit: int) -> bytes:
        try:
            length = int(raw_length)
            if length < 0:
                raise ValueError
        except ValueError:
            raise HttpError(400, f"invalid Content-Length: {raw_length!r}", code="bad_request") from None
        if length > limit:
            raise HttpError(413, f"request body of {length} bytes exceeds the limit of {limit}",
                            code="payload_too_large")
        data = self.rfile.read(length)
        if len(data) != length:
            raise HttpError(400, "the request body is shorter than its Content-Length", code="bad_request")
        return data

    def _read_chunked(self, limit: int) -> bytes:
        """A chunked body (RFC 9112 §7.1), its extensions and trailers read and dropped, at most `limit` bytes."""
        parts: list[bytes] = []
        total = 0
        while True:
            size_line = self._read_line("chunk size")
            try:
                size = int(size_line.split(b";", 1)[0].strip(), 16)
                if size < 0:
                    raise ValueError
            except ValueError:
                raise HttpError(400, "malformed chunk size in a chunked body", code="bad_request") from None
            if size == 0:
                break
            total += size
            if total > limit:
                raise HttpError(413, f"chunked request body exceeds the limit of {limit} bytes",
                                code="payload_too_large")
            data = self.rfile.read(size)
            if len(data) != size or self._read_line("chunk end") != b"":
                raise HttpError(400, "a chunk of the body is shorter than its size", code="bad_request")
            parts.append(data)
        for _ in range(MAX_TRAILER_LINES):
            if self._read_line("trailer") == b"":
                return b"".join(parts)
        raise HttpError(400, "too many trailer lines after a chunked body", code="bad_request")

    def _read_line(self, what: str) -> bytes:
        line = self.rfile.readline(MAX_CHUNK_LINE_BYTES + 1)
        if not line.endswith(b"\n") or len(line) > MAX_CHUNK_LINE_BYTES:
            raise HttpError(400, f"malformed {what} line in a chunked body", code="bad_request")
        return line.rstrip(b"\r\n")

    def discard_body(self) -> None:
        """Read and drop a body no route read, so the next request on this keep-alive connection starts
        where it should; a body that cannot be read closes the connection instead."""
        try:
            self.read_body()
        except HttpError:
            pass

    def read_json(self) -> Any:
        """The request body as JSON; HttpError for anything we will not read."""
        data = self.read_body()
        if data is None:
            raise HttpError(411, "a JSON body with Content-Length is required", code="length_required")
        try:
            return json.loads(data)
        except (ValueError, UnicodeDecodeError, RecursionError):
            raise HttpError(400, "the request body is not valid JSON", code="invalid_json") from None

    def authorized(self) -> bool:
        keys = self.server.settings.api_keys
        if not keys:
            return True
        header = self.headers.get("Authorization", "")
        token = header[7:] if header.startswith("Bearer ") else ""
        # Compare with every key, so the time taken does not tell which one matched.
        results = [hmac.compare_digest(token.encode(), key.encode()) for key in keys]
        return any(results)

    # --- writing ---

    def send_cors_headers(self) -> None:
        origin = self.server.settings.cors_origin
        if origin:
            self.send_header("Access-Control-Allow-Origin", origin)
            self.send_header("Access-Control-Allow-Methods", "GET, POST, DELETE, OPTIONS")
            self.send_header("Access-Control-Allow-Headers", "Content-Type, Authorization")

    def send_response(self, code: int, message: str | None = None) -> None:
        self.response_started = True
        super().send_response(code, message)

    def send_body(self, status: int, body: bytes, content_type: str, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_cors_headers()
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)
        self.server.app.count_response(status)

    def send_json(self, status: int, payload: Any, headers: dict[str, str] | None = None) -> None:
        body = json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
        self.send_body(status, body, "application/json", headers)

    def send_error_json(self, error: HttpError) -> None:
        self.send_json(error.status, error.body(), error.headers)

    def start_sse(self) -> None:
        self.close_connection = True  # an event stream has no length: it ends with the connection
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("X-Accel-Buffering", "no")  # nginx in front passes events on at once, whatever its config
        self.send_header("Connection", "close")
        self.send_cors_headers()
        self.end_headers()
        self.server.app.count_response(200)

    def send_event(self, payload: Any) -> None:
        """One SSE frame; raises OSError when the client has gone."""
        data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False,
                                                                   separators=(",", ":"))
        self.wfile.write(b"data: " + data.encode("utf-8") + b"\n\n")
        self.wfile.flush()

    def client_gone(self) -> bool:
        """True when the client closed its end (checked while a non-streamed answer is computed)."""
        if self.server.stopping:
            return False  # our own shutdown(SHUT_RD) looks like a close: let the answer finish
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            if not readable:
                return False
            return self.connection.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):
            return True

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (http.server's signature)
        if self.server.settings.request_log:
            log.info("%s %s", self.address_string(), format % args)


class ReameHTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    # Connections the kernel holds until they are accepted: socketserver's 5 overflows when many clients
    # connect at once, and an overflowing backlog turns into resets the clients see.
    request_queue_size = 256

    def __init__(self, settings: ServerSettings, app: Any) -> None:
        self.settings = settings
        self.app = app
        self._slots = threading.BoundedSemaphore(settings.max_connections)
        self._busy = 0
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._connections: set[socket.socket] = set()
        self.stopping = False
        super().__init__((settings.host, settings.port), Handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            # Answered on a thread of its own: the lingering close must not hold up the accept loop.
            threading.Thread(target=self._refuse, args=(request,), name="reame-refuse", daemon=True).start()
            return
        with self._lock:
            self._busy += 1
            self._connections.add(request)
        super().process_request(request, client_address)

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
        self.shutdown_request(request)

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
            self._slots.release()
            with self._lock:
                self._busy -= 1
                self._connections.discard(request)
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
