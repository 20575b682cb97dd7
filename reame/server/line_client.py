"""A batch's line as a route sees a request: a path, a JSON body and an owner, but no socket. The route runs
on it exactly as on an HTTP request (App.answer), so the batch's output line is the synchronous answer;
what the route sends is recorded instead of written."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from reame.server.client import Frame, Header, HttpError, Whole, json_body


class LineClient:
    command = "POST"

    def __init__(self, path: str, owner: str, body: bytes, gone: Callable[[], bool]) -> None:
        self.path, self.owner, self.body = path, owner, body
        self.leases: list[Any] = []
        self.close_connection = False
        self.status: int | None = None
        self.payload: Any = None
        self._gone = gone

    @property
    def response_started(self) -> bool:
        return self.status is not None

    def read_body(self) -> bytes | None:
        return self.body

    def read_json(self) -> Any:
        return json_body(self.body)

    def gone(self) -> bool:
        return self._gone()

    def discard_body(self) -> None:
        """Nothing to drain: the body is in memory."""

    def send(self, frame: Frame) -> None:
        if isinstance(frame, Whole):
            self.status, self.payload = frame.status, frame.payload
        elif not isinstance(frame, Header):  # a stream's frames: a batch's lines never ask for one
            error = HttpError(500, "the route answered a batch line with a stream", "server_error", "internal_error")
            self.status, self.payload = error.status, error.body()
