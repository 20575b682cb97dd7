"""Fixtures the unit tests of the HTTP server share: an engine on FakeBackend, and a live server over it."""

import pytest

from reame.engine import Engine
from tests.fakes.backend import FakeBackend

from .test_server import Live


@pytest.fixture
def engine():
    with Engine(FakeBackend(n_ctx=1024, n_seq_max=4)) as engine:
        yield engine


@pytest.fixture
def live(engine):
    server = Live(engine)
    yield server
    server.close()
