"""Checked by mypy (tests/unit/test_types.py): the fake and the real backend both satisfy the Backend protocol
that the engine is written against, so the fake cannot drift into attributes only it has."""

from reame.model.backend import Backend
from reame.model.llama import LlamaBackend
from tests.fakes.backend import FakeBackend


def as_backends(fake: FakeBackend, real: LlamaBackend) -> tuple[Backend, Backend]:
    return fake, real
