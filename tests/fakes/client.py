"""A client without a socket: what an API family's route reads of a request (its JSON body, who asks) and
the frames it sends back (reame/server/client.py), recorded. A route runs on it as it runs on http.Handler,
so each family's encoding can be checked frame by frame with no server."""

from __future__ import annotations

from typing import Any

from reame.server.client import Event, Frame, Header, Line, Opening, Whole


class RecordingClient:
    def __init__(self, path: str, body: dict[str, Any], owner: str = "", command: str = "POST") -> None:
        self.path, self.command, self.body, self.owner = path, command, body, owner
        self.leases: list[Any] = []
        self.headers: dict[str, str] = {}  # the headers the answer was sent with
        self.status: int | None = None  # 200 once a stream opens, or a whole answer's status
        self.content_type = ""
        self.frames: list[tuple[str, Any]] = []  # ("data" | an SSE event name | "line" | "json", payload)

    def read_body(self) -> bytes | None:
        return b"{}"

    def read_json(self) -> Any:
        return self.body

    def gone(self) -> bool:
        return False

    def send(self, frame: Frame) -> None:
        match frame:
            case Header(name, value):
                self.headers[name] = value
            case Whole(status, payload, headers, content_type):
                self.status, self.content_type = status, content_type
                self.headers.update(headers or {})
                self.frames.append(("json", payload))
            case Opening(content_type):
                self.status, self.content_type = 200, content_type
            case Event(payload, name):
                self.frames.append((name or "data", payload))
            case Line(payload):
                self.frames.append(("line", payload))


def run_route(app: Any, path: str, body: dict[str, Any], command: str = "POST") -> RecordingClient:
    """The route for `path` on a recording client, as App.dispatch runs it (the models let go after)."""
    from reame.server.app import ROUTER
    client = RecordingClient(path, body, command=command)
    route, routed = ROUTER.find(path)
    assert route is not None
    try:
        route.handler(app, client, routed)
    finally:
        app.release_models(client)
    return client
