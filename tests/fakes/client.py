"""A client without a socket: what an API family's route reads of a request (its JSON body, who asks) and
what it sends back (a whole answer, or a stream's frames), recorded. A route runs on it as it runs on
http.Handler, so each family's encoding can be checked frame by frame with no server."""

from __future__ import annotations

from typing import Any


class RecordingClient:
    def __init__(self, path: str, body: dict[str, Any], owner: str = "") -> None:
        self.path, self.command, self.body, self.owner = path, "POST", body, owner
        self.leases: list[Any] = []
        self.response_headers: dict[str, str] = {}
        self.close_connection = False
        self.status: int | None = None  # 200 once a stream starts, or a whole answer's status
        self.content_type = ""
        self.frames: list[tuple[str, Any]] = []  # ("data" | an SSE event name | "line" | "json", payload)

    def read_json(self) -> Any:
        return self.body

    def client_gone(self) -> bool:
        return False

    def start_sse(self, content_type: str = "text/event-stream") -> None:
        self.status, self.content_type = 200, content_type

    def send_event(self, payload: Any) -> None:
        self.frames.append(("data", payload))

    def send_named_event(self, name: str, payload: Any) -> None:
        self.frames.append((name, payload))

    def send_line(self, payload: Any) -> None:
        self.frames.append(("line", payload))

    def send_json(self, status: int, payload: Any, headers: dict[str, str] | None = None) -> None:
        self.status, self.content_type = status, "application/json"
        self.frames.append(("json", payload))
