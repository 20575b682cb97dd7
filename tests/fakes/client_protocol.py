"""Checked by mypy (tests/unit/test_types.py): the recording client and the socket's handler both satisfy the
Asker protocol the routes are written against, so the families checked without sockets run as they do on one."""

from reame.server.client import Asker
from reame.server.http import Handler
from tests.fakes.client import RecordingClient


def as_askers(recording: RecordingClient, handler: Handler) -> tuple[Asker, Asker]:
    return recording, handler
