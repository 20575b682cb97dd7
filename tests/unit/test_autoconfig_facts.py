"""autoconfig reads a model's architecture facts from its GGUF once, then remembers them."""

import pytest

from reame import autoconfig, gguf

from .test_gguf import GOOD

FACTS = {"layers": 30, "kv_heads": 3, "key_size": 64, "value_size": 64, "context_train": 8192}


def test_the_facts_are_read_once_per_model(tmp_path, monkeypatch):
    monkeypatch.setenv("REAME_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "m.gguf"
    path.write_bytes(GOOD)
    assert autoconfig.architecture_facts(path) == FACTS

    def unread(_path):
        raise AssertionError("the GGUF was read again")

    monkeypatch.setattr(gguf, "read_metadata", unread)
    assert autoconfig.architecture_facts(path) == FACTS


@pytest.mark.parametrize("text", ['{"layers": 1}', "[]", '{"layers": -1, "kv_heads": 3, "key_size": 64, '
                                  '"value_size": 64, "context_train": 8192}',
                                  '{"layers": "30", "kv_heads": 3, "key_size": 64, "value_size": 64, '
                                  '"context_train": 8192}', "not json"])
def test_remembered_facts_that_are_not_facts_are_refused(text):
    with pytest.raises(ValueError):
        autoconfig.parse_facts(text)
