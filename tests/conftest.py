"""Shared fixtures. Tests under tests/integration are marked `integration` and
share one real model (SmolLM2-135M, fetched once into ~/.cache/reame/models)."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Tests that run the CLI or a server get a prefix cache and kept answers of their own, never the user's.
os.environ.setdefault("REAME_CACHE_DIR", tempfile.mkdtemp(prefix="reame-test-kv-"))
os.environ.setdefault("REAME_CACHE_ANSWERS_DIR", tempfile.mkdtemp(prefix="reame-test-answers-"))
os.environ.setdefault("REAME_SERVER_BATCH_DIR", tempfile.mkdtemp(prefix="reame-test-batches-"))


@pytest.fixture(autouse=True)
def answers_of_its_own(monkeypatch, tmp_path_factory):
    """Each test its own kept answers: a prompt another test ran is computed, not answered from disk."""
    monkeypatch.setenv("REAME_CACHE_ANSWERS_DIR", str(tmp_path_factory.mktemp("answers")))


def pytest_collection_modifyitems(config, items):
    for item in items:
        parts = Path(str(item.fspath)).parts
        if "integration" in parts or "compat" in parts:
            item.add_marker(pytest.mark.integration)


@pytest.fixture(scope="session")
def native_libraries():
    """The pinned libllama, built on first use (a cached build is found at once)."""
    from reame import native
    from reame.errors import ModelError
    try:
        return native.locate()
    except ModelError:
        sys.path.insert(0, str(ROOT))
        import build_zipapp
        build_zipapp.build(portable=False, tools=False, jobs=2)
        return native.locate()


@pytest.fixture(scope="session")
def model_path():
    """A catalog model's file by name, fetched and verified on first use (then found at once)."""
    from reame import catalog, fetch, native

    def path(name: str) -> Path:
        return fetch.ensure_model(catalog.resolve(name), native.cache_root() / "models")
    return path


@pytest.fixture(scope="session")
def smollm2_path(model_path) -> Path:
    return model_path("smollm2-135m")


@pytest.fixture
def no_zstandard(monkeypatch):
    """This process as a Python without the zstandard module: `import zstandard` fails."""
    from reame.cache import codec
    monkeypatch.setitem(sys.modules, "zstandard", None)
    codec._zstandard.cache_clear()
    yield
    codec._zstandard.cache_clear()


@pytest.fixture(autouse=True)
def reame_logger_as_by_default():
    """cli.configure_logging (which CLI tests run) gives the "reame" logger a handler of its own and
    stops propagation; every test starts from the default, so caplog sees Reame's log lines."""
    import logging
    logger = logging.getLogger("reame")
    logger.handlers[:] = []
    logger.propagate = True
    logger.setLevel(logging.NOTSET)
