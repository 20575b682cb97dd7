"""What an answer says to its client, whatever carries it: the frames an API family sends (a whole answer, a
stream's opening, its events or lines), the two things a route and the exchange may do with the client (ask
whether it has gone, send it a frame) and the refusal a route raises. http.Handler is the client a socket
gives; tests/fakes/client.py records the frames instead, so every family's encoding is checked without one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Protocol

JSON = "application/json"
SSE = "text/event-stream"
# Objects and arrays a request body may hold: every route's request is far smaller (a prompt fits a context),
# and each parsed empty object costs ~80 bytes of RAM that Python does not give back at once (a 3 MiB body of
# 2^20 of them added ~100 MiB to the server's RSS).
MAX_JSON_CONTAINERS = 100_000


@dataclass(frozen=True)
class Header:
    """A header of whatever answer follows, the whole one or a stream's opening (X-Reame-Cache)."""

    name: str
    value: str


@dataclass(frozen=True)
class Whole:
    """A whole answer: a status and its body, `payload` as JSON, or bytes sent as they are (of
    `content_type`)."""

    status: int
    payload: Any
    headers: dict[str, str] | None = None
    content_type: str = JSON


@dataclass(frozen=True)
class Opening:
    """A stream begins (200): server-sent events, or another stream (Ollama's NDJSON). It ends with the
    connection."""

    content_type: str = SSE


@dataclass(frozen=True)
class Event:
    """One server-sent event: JSON, or a string sent as it is ("[DONE]"); `name` for Anthropic's and the
    Responses API's named events."""

    payload: Any
    name: str = ""


@dataclass(frozen=True)
class Line:
    """One line of a JSON-lines stream (Ollama's)."""

    payload: Any


Frame = Header | Whole | Opening | Event | Line


class Client(Protocol):
    """Whom an answer goes to. `send` raises OSError once the client has gone mid-stream."""

    def gone(self) -> bool: ...

    def send(self, frame: Frame) -> None: ...


class Asker(Client, Protocol):
    """A request as a route sees it: what it asks (its path, method and body), who asks (`owner`, an API
    key's), the models it holds until it ends (`leases`, kept by service.Service.model), and its client."""

    path: str
    command: str
    owner: str
    leases: list[Any]

    def read_body(self) -> bytes | None:
        """The body's bytes, None without one."""

    def read_json(self) -> Any:
        """The body as JSON; HttpError for anything else."""


CONTEXT_EXCEEDED = "exceed_context_size_error"  # llama-server's error type of a prompt over the context


class HttpError(Exception):
    """An error to answer in OpenAI's shape (or the route's family's: routes.Route.error_body). `details`: more
    fields of the error object (llama-server's counts of a prompt over the context)."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
                 code: str | None = None, param: str | None = None, headers: dict[str, str] | None = None,
                 details: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.code, self.param = status, message, kind, code, param
        self.headers = headers or {}
        self.details = details or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code,
                          **self.details}}

    def whole(self) -> Whole:
        """The error as a whole answer in OpenAI's shape."""
        return Whole(self.status, self.body(), self.headers)


def json_body(data: bytes, what: str = "the request body") -> Any:
    """A request's JSON (an HTTP body, a batch's line); 400 for anything else, or for more objects and arrays
    than MAX_JSON_CONTAINERS, counted before parsing."""
    if data.count(b"{") + data.count(b"[") > MAX_JSON_CONTAINERS:  # (braces in strings count too: an upper bound)
        raise HttpError(400, f"{what} holds more than {MAX_JSON_CONTAINERS} JSON objects and arrays",
                        code="invalid_json")
    try:
        return json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise HttpError(400, f"{what} is not valid JSON", code="invalid_json") from None
