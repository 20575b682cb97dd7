"""HTTP transport: a bounded ThreadingHTTPServer, keep-alive, limits, auth, CORS, SSE.

An open connection costs a thread; a request being answered costs what its
route does. So the two are bounded apart: at most `max_connections` open
sockets (past it the oldest idle keep-alive connection is closed to make room,
and with none idle the newcomer gets a 503), and at most `max_requests`
requests answered at once (past it a 503 with Retry-After; `/health` is never
refused). A new connection must start its request within `header_timeout_s`
and a request's line and headers must arrive within `header_timeout_s` of its
first byte, its body within `request_timeout_s`; a connection idle for
`idle_timeout_s` between requests is closed. Framing follows RFC 9112 to the
letter (digits-only Content-Length, no conflicting duplicates, no
Content-Length beside Transfer-Encoding, no obs-fold, no space before a
header's colon, hex-only chunk sizes): anything else is a 400 and a closed
connection, so no proxy in front can read a request's end elsewhere than we do.
A body is read (under the size limit) before its route takes a request slot,
and a body no route reads is drained before the next request (or the
connection is closed), so an error never desynchronises a keep-alive
connection. SSE responses end the connection. The routes and what they answer
are in app.py and apis/.
"""

from __future__ import annotations

import email.errors
import hmac
import io
import json
import logging
import re
import select
import socket
import threading
import time
from collections.abc import Callable

from http import HTTPStatus
from http.server import BaseHTTPRequestHandler
from typing import Any, Protocol

from reame.server.settings import ServerSettings
from reame.server.client import Event, Frame, Header, HttpError, Line, Opening, Whole, json_body
from reame.server.sessions import key_owner

log = logging.getLogger("reame.server")

MAX_CHUNK_LINE_BYTES = 4096
# A closing connection reads what the client still sends for this long (and this much) before it closes.
LINGER_S = 2.0
LINGER_BYTES = 1 << 20
MAX_TRAILER_LINES = 64
DIGITS = re.compile(r"[0-9]+")
HEX_DIGITS = re.compile(rb"[0-9A-Fa-f]+")
OWS = " \t"  # optional whitespace around a field value (RFC 9110 §5.6.3)
UNLIMITED_ROUTES = ("/health",)  # answered even when every request slot is taken: what a monitor asks


class RequestReader(io.RawIOBase):
    """A connection's input, with its clocks. Before a request's first byte a read waits at most `first_s`
    (`header_s` on a new connection, `idle_s` between requests); from that byte, the line and headers must
    arrive within `header_s` and, once they have (`headers_read`), the whole request within `request_s`, so a
    client that trickles one byte at a time is cut off (408) instead of holding a connection. Between reads
    inside a request it waits at most `idle_s`. The socket's own timeout stays `idle_s`, for the answer's
    writes. `on_first_byte` tells the server the connection is no longer idle."""

    def __init__(self, sock: socket.socket, idle_s: float, header_s: float, request_s: float,
                 on_first_byte: Callable[[], None]) -> None:
        super().__init__()
        self.sock, self.idle_s, self.header_s, self.request_s = sock, idle_s, header_s, request_s
        self.on_first_byte = on_first_byte
        self.first_s = header_s
        self.started_at: float | None = None  # the current request's first byte
        self.deadline: float | None = None

    def readable(self) -> bool:
        return True

    def next_request(self, first: bool) -> None:
        self.started_at = self.deadline = None
        self.first_s = self.header_s if first else self.idle_s

    def headers_read(self) -> None:
        if self.started_at is not None:
            self.deadline = self.started_at + self.request_s

    @property
    def started(self) -> bool:
        """Whether the current request's first byte has arrived."""
        return self.started_at is not None

    def readinto(self, buffer: Any) -> int:
        timeout = self.idle_s if self.started_at is not None else self.first_s
        if self.deadline is not None:
            timeout = min(timeout, self.deadline - time.monotonic())
            if timeout <= 0:
                raise TimeoutError("the request did not arrive in time")
        self.sock.settimeout(timeout)
        try:
            received = self.sock.recv_into(buffer)
        finally:
            self.sock.settimeout(self.idle_s)
        if received and self.started_at is None:
            self.started_at = time.monotonic()
            self.deadline = self.started_at + self.header_s
            self.on_first_byte()
        return received


# What the stdlib's header parser reports about a multipart body it was not given (it never is: the body is read
# after the headers): a multipart/form-data request's well-formed headers, not a malformed header line.
BODY_DEFECTS = (email.errors.StartBoundaryNotFoundDefect, email.errors.CloseBoundaryNotFoundDefect,
                email.errors.MultipartInvariantViolationDefect, email.errors.NoBoundaryInMultipartDefect)


def framing_problem(headers: Any) -> str:
    """Why a request's framing headers cannot be trusted (RFC 9112 §6, §11.2), or "" when they can."""
    if any(not isinstance(defect, BODY_DEFECTS) for defect in headers.defects):
        return "malformed header line (whitespace before a header's colon, or no colon)"
    if any("\n" in value or "\r" in value for value in headers.values()):
        return "a header value folded over lines (obs-fold) is not accepted"
    lengths = headers.get_all("Content-Length") or []
    values = {part.strip(OWS) for value in lengths for part in value.split(",")}
    if any(not DIGITS.fullmatch(value) for value in values):
        return f"invalid Content-Length: {', '.join(lengths)!r}"
    if len(values) > 1:
        return "conflicting Content-Length headers"
    encodings = headers.get_all("Transfer-Encoding")
    if encodings is not None and lengths:
        return "Content-Length together with Transfer-Encoding"
    return ""


class Listener(Protocol):
    """What a handler asks of the server that accepted its connection (listener.py's ReameHTTPServer)."""

    settings: ServerSettings
    app: Any  # dispatches a request and counts responses (app.py's App)
    request_slots: threading.BoundedSemaphore
    stopping: bool

    def idle(self, connection: socket.socket) -> None: ...

    def busy(self, connection: socket.socket) -> None: ...


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "reame"
    sys_version = ""
    server: Listener  # type: ignore[assignment]  # (the socketserver stubs say BaseServer: ours is one)

    owner = ""  # whose request this is: set by `authorized()`
    response_headers: dict[str, str]  # set by a route for the response it sends (X-Reame-Cache)
    leases: list[Any]  # the models a request holds: the app lets them go when the request ends
    body: bytes | None  # the request's body, once read_body has read it

    def setup(self) -> None:
        settings = self.server.settings
        self.timeout = settings.idle_timeout_s  # type: ignore[misc]  # (the stubs make it a class variable)
        self.body_read, self.body, self.response_started = False, None, False
        self.requests_served = 0
        super().setup()
        self.reader = RequestReader(self.connection, settings.idle_timeout_s, settings.header_timeout_s,
                                    settings.request_timeout_s, lambda: self.server.busy(self.connection))
        self.rfile = io.BufferedReader(self.reader, 65536)

    def handle_one_request(self) -> None:
        """http.server's request loop, except that a request that began but did not arrive in time gets a
        408 before the connection closes (http.server drops it without a word); an idle one just closes."""
        self.server.idle(self.connection)  # until the next request's first byte (the reader says busy)
        self.reader.next_request(first=self.requests_served == 0)
        self.requests_served += 1
        self.response_headers = {}
        self.leases = []
        try:
            self.raw_requestline = self.rfile.readline(65537)
            self.server.busy(self.connection)  # (a pipelined request is read from the buffer: no first byte)
            if len(self.raw_requestline) > 65536:
                self.requestline, self.request_version, self.command = "", "", ""
                self.send_error(HTTPStatus.REQUEST_URI_TOO_LONG)
                return
            if not self.raw_requestline:
                self.close_connection = True
                return
            if not self.parse_request():
                return
            self.reader.headers_read()
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
                self.send(HttpError(408, "the request did not arrive in time", code="timeout").whole())

    def parse_request(self) -> bool:
        """http.server's parsing, then RFC 9112's framing rules it does not check (400 and close)."""
        if not super().parse_request():
            return False
        problem = framing_problem(self.headers)
        if problem:
            self.send_error(HTTPStatus.BAD_REQUEST, problem)
            return False
        return True

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        self.body_read, self.body, self.response_started = False, None, False
        try:
            self.read_body()  # before a request slot is taken: a slow body costs a thread, not a slot
        except HttpError as error:
            self.send(error.whole())
            return
        path = self.path.split("?", 1)[0]
        if path in UNLIMITED_ROUTES:
            self.server.app.dispatch(self)
            return
        if not self.server.request_slots.acquire(blocking=False):
            self.close_connection = True
            self.send(HttpError(503, f"{self.server.settings.max_requests} requests are being answered; retry "
                                "shortly", "server_error", "overloaded", headers={"Retry-After": "1"}).whole())
            return
        try:
            self.server.app.dispatch(self)
        finally:
            self.server.request_slots.release()

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
        self.send(HttpError(code, reason, code="bad_request").whole())

    # --- reading ---

    def read_body(self) -> bytes | None:
        """The request body, framed by Content-Length or chunked, read at most once per request (None:
        the request has none). HttpError for a body we will not read; it also closes the connection,
        whose next request could not be found."""
        if self.body_read:
            return self.body
        self.body_read = True
        encodings = self.headers.get_all("Transfer-Encoding")
        raw_length = self.headers.get("Content-Length")
        try:
            if encodings is not None:
                encoding = ", ".join(encodings)
                if encoding.strip(OWS).lower() != "chunked":
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
        """A body of Content-Length bytes (framing_problem checked the header: digits, no conflict)."""
        length = int(raw_length.split(",", 1)[0].strip(OWS))
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
            digits = self._read_line("chunk size").split(b";", 1)[0].rstrip(b" \t")
            if not HEX_DIGITS.fullmatch(digits) or len(digits) > 16:
                raise HttpError(400, "malformed chunk size in a chunked body", code="bad_request")
            size = int(digits, 16)
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
        return json_body(data)

    def authorized(self) -> bool:
        """Whether the request carries one of the server's keys; `owner` then names that key (sessions are
        its own), "" on a server without keys."""
        self.owner = ""
        keys = self.server.settings.api_keys
        if not keys:
            return True
        header = self.headers.get("Authorization", "")
        # Bearer, as OpenAI's clients send it; x-api-key, as Anthropic's do.
        token = header[7:] if header.startswith("Bearer ") else self.headers.get("x-api-key", "")
        # Compare with every key, so the time taken does not tell which one matched.
        results = [hmac.compare_digest(token.encode(), key.encode()) for key in keys]
        if any(results):
            self.owner = key_owner(keys[results.index(True)])
        return any(results)

    # --- writing ---

    def send_cors_headers(self) -> None:
        origin = self.server.settings.cors_origin
        if origin:
            self.send_header("Access-Control-Allow-Origin", origin)
            self.send_header("Access-Control-Allow-Methods", "GET, POST, DELETE, OPTIONS")
            self.send_header("Access-Control-Allow-Headers",
                             "Content-Type, Authorization, x-api-key, anthropic-version")
            self.send_header("Access-Control-Expose-Headers", "X-Reame-Cache, X-Reame-Node")

    def send_response(self, code: int, message: str | None = None) -> None:
        self.response_started = True
        super().send_response(code, message)
        if self.server.settings.node_name:  # which node of a fleet answered, behind a balancer
            self.send_header("X-Reame-Node", self.server.settings.node_name)

    def send(self, frame: Frame) -> None:
        """Send one frame of the answer (client.py); an event or a line raises OSError when the client has gone."""
        match frame:
            case Header(name, value):
                self.response_headers[name] = value
            case Whole(status, payload, headers, content_type):
                body = payload if isinstance(payload, bytes) else \
                    json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
                self._send_whole(status, body, content_type, headers or {})
            case Opening(content_type):
                self._open_stream(content_type)
            case Event(payload, name):
                data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False,
                                                                           separators=(",", ":"))
                self._write((f"event: {name}\n" if name else "") + f"data: {data}\n\n")
            case Line(payload):
                self._write(json.dumps(payload, ensure_ascii=False, separators=(",", ":")) + "\n")

    def _send_whole(self, status: int, body: bytes, content_type: str, headers: dict[str, str]) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for name, value in {**self.response_headers, **headers}.items():
            self.send_header(name, value)
        self.send_cors_headers()
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)
        self.server.app.count_response(status)

    def _open_stream(self, content_type: str) -> None:
        self.close_connection = True  # a stream has no length: it ends with the connection
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Cache-Control", "no-cache")
        self.send_header("X-Accel-Buffering", "no")  # nginx in front passes events on at once, whatever its config
        self.send_header("Connection", "close")
        for name, value in self.response_headers.items():
            self.send_header(name, value)
        self.send_cors_headers()
        self.end_headers()
        self.server.app.count_response(200)

    def _write(self, text: str) -> None:
        self.wfile.write(text.encode("utf-8"))
        self.wfile.flush()

    def gone(self) -> bool:
        """True when the client closed its end (checked while an answer is computed); the connection is then
        closed once the request ends."""
        if self.server.stopping:
            return False  # our own shutdown(SHUT_RD) looks like a close: let the answer finish
        try:  # poll(), not select(): select fails for a socket numbered 1024 or above
            poller = select.poll()
            poller.register(self.connection, select.POLLIN | select.POLLHUP | select.POLLERR)
            if not poller.poll(0):
                return False
            gone = self.connection.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except BlockingIOError:
            return False
        except (OSError, ValueError):
            gone = True
        if gone:
            self.close_connection = True
        return gone

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (http.server's signature)
        if self.server.settings.request_log:
            log.info("%s %s", self.address_string(), format % args)
