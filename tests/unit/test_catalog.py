import pytest

from reame import catalog


@pytest.mark.parametrize("name, expected", [
    ("smollm2-135m", "smollm2-135m"), ("SMOLLM2", "smollm2-135m"), ("smol", "smollm2-135m"),
    ("qwen2.5-coder-1.5b", "qwen2.5-coder-1.5b"), ("gemma", "gemma3-270m"),
])
def test_names_aliases_and_unique_prefixes_resolve(name, expected):
    assert catalog.resolve(name).name == expected


@pytest.mark.parametrize("name", ["qwen", "qwen2.5-coder", "nothing", "model.gguf"])
def test_ambiguous_or_unknown_names_do_not_resolve(name):
    assert catalog.resolve(name) is None


def test_every_source_carries_a_sha256():
    for entry in catalog.CATALOG:
        assert entry.sources
        for source in entry.sources:
            assert len(source.sha256) == 64 and int(source.sha256, 16) >= 0
