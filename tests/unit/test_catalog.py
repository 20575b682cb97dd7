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


def test_every_pinned_source_carries_a_sha256_and_only_the_originals_names_are_unpinned():
    for entry in catalog.CATALOG:
        assert entry.sources
        for source in entry.sources:
            assert source.sha256 is None or (len(source.sha256) == 64 and int(source.sha256, 16) >= 0)
    assert [entry.name for entry in catalog.CATALOG if not entry.pinned] == [
        "tinyllama", "qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-3b", "olmoe", "qwen3.5-9b"]


@pytest.mark.parametrize("name, expected", [
    ("tinyllama", "tinyllama"), ("TINY", "tinyllama"), ("olm", "olmoe"), ("qwen2.5-1.5b", "qwen2.5-1.5b"),
    ("qwen2.5-3", "qwen2.5-3b"), ("qwen3.5-9b", "qwen3.5-9b"), ("Qwen2.5-0.5B", "qwen2.5-0.5b"),
])
def test_the_original_catalog_names_resolve_with_its_unique_prefix_rule(name, expected):
    assert catalog.resolve(name).name == expected


def test_the_original_entries_keep_its_urls_contexts_and_files():
    olmoe, qwen9 = catalog.resolve("olmoe"), catalog.resolve("qwen3.5-9b")
    assert olmoe.filename == "olmoe-1b-7b-instruct-q4_k_m.gguf" and olmoe.default_ctx == 4096
    assert olmoe.sources[0].url.endswith("/OLMoE-1B-7B-0924-Instruct-Q4_K_M.gguf")
    assert qwen9.default_ctx == 8192 and catalog.resolve("tinyllama").default_ctx == 2048
