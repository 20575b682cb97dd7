import sys
from pathlib import Path

import pytest

from reame.model.backend import ModelSettings
from reame.model.llama import LlamaBackend

N_CTX = 2048
N_SEQ = 4


def settings_for(path, **overrides) -> ModelSettings:
    values = dict(n_ctx=N_CTX, n_seq_max=N_SEQ, n_threads=2, n_batch=512)
    values.update(overrides)
    return ModelSettings(str(path), **values)


@pytest.fixture(scope="session")
def shared_backend(native_libraries, smollm2_path):
    backend = LlamaBackend(settings_for(smollm2_path))
    yield backend
    backend.close()


@pytest.fixture
def backend(shared_backend):
    """The session's backend with an empty KV cache."""
    shared_backend.clear()
    yield shared_backend
    shared_backend.clear()


@pytest.fixture(scope="session")
def pyz(native_libraries, tmp_path_factory):
    """dist/reame.pyz as the README's first command builds it: portable, every machine."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    import build_zipapp
    output = tmp_path_factory.mktemp("dist") / "reame.pyz"
    assert build_zipapp.main(["--output", str(output)]) == 0
    return output
