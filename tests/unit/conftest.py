"""Fixtures the unit tests of the HTTP server share: an engine on FakeBackend, a live server over it, and one whose
model can write any printable text (for structured output)."""

import pytest

from reame.engine import Engine
from tests.fakes.backend import FakeBackend, printable_rule

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


@pytest.fixture
def structured_server():
    with Engine(FakeBackend(n_ctx=2048, rule=printable_rule)) as engine:
        server = Live(engine)
        yield server
        server.close()
