"""Reame's sessions: a conversation's KV kept between requests, created, described, saved, loaded, deleted.
Each served model has its own: the body's `model` (creating) or `?model=` names it (none: the first model)."""

from __future__ import annotations

from reame.server.client import Asker, HttpError, Whole
from reame.server.routes import Route
from reame.server.service import Service
from reame.server.validation import Fields, query_model, requested_model


def create_session(app: Service, handler: Asker, _path: str) -> None:
    body = handler.read_json() if handler.read_body() else {}  # the body is optional
    sessions = app.ready_sessions(app.served(requested_model(Fields(body))))
    wanted = Fields(body).body.get("id")
    if wanted is not None and not isinstance(wanted, str):
        raise Fields(body).bad("id", "a string")
    session_id = sessions.create(handler.owner, wanted)
    handler.send(Whole(200, {"id": session_id, "object": "session"}))


def session(app: Service, handler: Asker, path: str) -> None:
    sessions, owner = app.ready_sessions(app.served(query_model(handler))), handler.owner
    session_id, _, action = path[len("/v1/sessions/"):].partition("/")
    if action == "" and handler.command == "GET":
        handler.send(Whole(200, sessions.describe(owner, session_id)))
    elif action == "" and handler.command == "DELETE":
        sessions.delete(owner, session_id)
        handler.send(Whole(200, {"id": session_id, "deleted": True}))
    elif action == "save" and handler.command == "POST":
        sessions.save(owner, session_id)
        handler.send(Whole(200, sessions.describe(owner, session_id)))
    elif action == "load" and handler.command == "POST":
        sessions.load(owner, session_id)
        handler.send(Whole(200, sessions.describe(owner, session_id)))
    elif action in ("", "save", "load"):
        raise HttpError(405, f"{handler.command} is not allowed on this session path", code="method_not_allowed")
    else:
        raise HttpError(404, f"unknown session action: {action}", code="not_found")


ROUTES = [
    Route("/v1/sessions", ("POST",), create_session),
    Route("/v1/sessions/", ("GET", "DELETE", "POST"), session, prefix=True),
]
