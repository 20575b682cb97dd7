"""The INI config: precedence, inline comments, and one clear line for every mistake."""

import logging
from pathlib import Path

import pytest

from reame import config
from reame.errors import ConfigError


def write(tmp_path, text):
    path = tmp_path / "reame.conf"
    path.write_text(text)
    return path


def test_precedence_is_defaults_then_file_then_environment_then_flags(tmp_path):
    path = write(tmp_path, "[model]\nthreads = 3\ncontext_length = 1024\n[generation]\nseed = 5\n")
    values = config.load(path, env={"REAME_MODEL_THREADS": "4", "REAME_GENERATION_SEED": "6"},
                         flags={"generation.seed": 7, "model.batch": None})
    assert values["model.context_length"].value == 1024 and values["model.context_length"].origin.endswith(":3")
    assert values["model.threads"].value == 4 and values["model.threads"].origin == "env REAME_MODEL_THREADS"
    assert values["generation.seed"].value == 7 and values["generation.seed"].origin == "flag"
    assert values["model.batch"].origin == "default"


def test_inline_comments_and_quotes(tmp_path):
    path = write(tmp_path, '; a comment\n[memory]\nkv_cache_type = q8_0   # f16 | q8_0 | q4_0\n'
                           'use_mmap = off ; no mapping\n[model]\npath = "models/a #1.gguf"  # quoted\n'
                           '# trailing\n')
    values = config.load(path, env={})
    assert values["memory.kv_cache_type"].value == "q8_0"
    assert values["memory.use_mmap"].value is False
    assert values["model.path"].value == "models/a #1.gguf"


def test_hash_inside_a_value_without_space_is_kept(tmp_path):
    values = config.load(write(tmp_path, "[model]\npath = m#1.gguf\n"), env={})
    assert values["model.path"].value == "m#1.gguf"


def test_unknown_key_names_the_closest_known_key_and_the_line(tmp_path):
    path = write(tmp_path, "[model]\n\nthread = 4\n")
    with pytest.raises(ConfigError) as raised:
        config.load(path, env={})
    message = str(raised.value)
    assert f"{path}:3" in message and "did you mean 'model.threads'" in message


@pytest.mark.parametrize("text, line, fragment", [
    ("[model]\nthreads = four\n", 2, "whole number"),
    ("[model]\nthreads = -1\n", 2, ">= 0"),
    ("[memory]\nuse_mlock = maybe\n", 2, "true or false"),
    ("[memory]\nkv_cache_type = q2\n", 2, "one of"),
    ("[generation]\ntemperature = warm\n", 2, "a number"),
    ("[model\nthreads = 2\n", 1, "unterminated section"),
    ("[]\n", 1, "empty section"),
    ("[model]\njust words\n", 2, "expected 'key = value'"),
    ("[model]\n= 3\n", 2, "empty key"),
    ('[model]\npath = "open\n', 2, "unterminated quoted"),
    ('[model]\npath = "a" b\n', 2, "after quoted value"),
])
def test_malformed_files_name_file_and_line(tmp_path, text, line, fragment):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as raised:
        config.load(path, env={})
    assert f"{path}:{line}" in str(raised.value) and fragment in str(raised.value)


def test_unreadable_or_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        config.load(tmp_path / "missing.conf", env={})
    binary = tmp_path / "binary.conf"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(ConfigError, match="cannot read"):
        config.load(binary, env={})


def test_bad_environment_value_names_the_variable():
    with pytest.raises(ConfigError, match="REAME_MODEL_THREADS"):
        config.load(env={"REAME_MODEL_THREADS": "lots"})


def test_unknown_environment_variable_is_ignored_with_a_hint(caplog, monkeypatch):
    monkeypatch.setattr(logging.getLogger("reame"), "propagate", True)  # the CLI may have cut it off
    values = config.load(env={"REAME_MODEL_THREAD": "2", "REAME_HOME": "/x"})
    assert values["model.threads"].origin == "default"
    assert "REAME_MODEL_THREADS" in caplog.text


def test_every_key_is_documented_with_its_environment_variable():
    from pathlib import Path
    text = (Path(__file__).resolve().parents[2] / "docs" / "configuration.md").read_text()
    from reame.config import KEYS
    missing = [key.name for key in KEYS if f"| `{key.name}` | `{key.env_name}` |" not in text]
    assert missing == []


def test_the_original_reames_shipped_config_file_loads_with_warnings_only(caplog):
    original = Path(__file__).resolve().parents[1] / "fixtures" / "original-reame.conf"
    with caplog.at_level("WARNING", logger="reame.config"):
        values = config.load(original, env={})
    assert values["server.max_requests"].value == 10
    assert values["server.cors_origin"].value == "*" and values["server.metrics"].value is True
    assert values["speculative.lookup"].value is True and values["speculative.max_draft_tokens"].value == 8
    assert values["cache.dir"].value == ".reame-cache" and values["cache.disk_mb"].value == 20480
    assert values["model.threads"].value == 14 and values["memory.kv_cache_type"].value == "q8_0"
    assert values["cache.disk_mb"].origin.endswith(":34")
    said = [record.getMessage() for record in caplog.records]
    assert len(said) == 12 and all(record.levelname == "WARNING" for record in caplog.records)
    assert any("'cache.directory' is the original Reame's name for 'cache.dir'" in line for line in said)
    assert any("'server.threads' was never used by the original Reame and does nothing here" in line
               for line in said)


@pytest.mark.parametrize("text, key, value", [
    ("[cache]\ndirectory =\n", "cache.enabled", False),
    ("[cache]\nmax_size_mb = 0\n", "cache.disk_mb", 1 << 30),
    ("[speculative]\nmode = model\n", "speculative.lookup", False),
    ("[server]\nenable_cors = false\n", "server.cors_origin", ""),
    ("[cache]\ndirectory = old\ndir = new\n", "cache.dir", "new"),
])
def test_original_keys_are_translated(tmp_path, text, key, value):
    assert config.load(write(tmp_path, text), env={})[key].value == value


def test_an_unknown_key_still_fails_and_suggests_old_and_new_names(tmp_path):
    with pytest.raises(ConfigError, match="did you mean 'cache.directory'"):
        config.load(write(tmp_path, "[cache]\ndirectori = x\n"), env={})
    with pytest.raises(ConfigError, match="unknown key 'server.nonsense'"):
        config.load(write(tmp_path, "[server]\nnonsense = 1\n"), env={})


def test_settings_are_typed_frozen_and_built_once_from_the_values(tmp_path):
    import dataclasses

    from reame.settings import from_values
    keys = tmp_path / "keys"
    keys.write_text("# one per line\nkey-two\n")
    path = write(tmp_path, f"[server]\napi_key = key-one\napi_key_file = {keys}\nmax_request_size_mb = 2\n"
                           "[cache]\ndisk_mb = 3\n[generation]\ntemperature = 0\n")
    settings = from_values(config.load(path, env={}))
    assert settings.server.api_keys == ("key-one", "key-two")
    assert settings.server.max_body_bytes == 2 << 20 and settings.cache.disk_budget_bytes == 3 << 20
    assert settings.generation.greedy and settings.generation.top_k == 40
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.server.port = 1
    assert ("server.api_key", "key-one", f"{path}:2") in settings.origins


def test_an_unreadable_key_file_is_a_config_error(tmp_path):
    from reame.settings import from_values
    path = write(tmp_path, f"[server]\napi_key_file = {tmp_path / 'missing'}\n")
    with pytest.raises(ConfigError, match="cannot read server.api_key_file"):
        from_values(config.load(path, env={}))


def test_the_originals_arca_remote_names_an_arca_by_host_and_port(tmp_path):
    from reame.arca.client import StoreAddress
    for text, port in (("[arca]\nremote = 10.0.0.5:6421\n", 6421), ("[arca]\nremote = 10.0.0.5\n", 6420)):
        remote = config.load(write(tmp_path, text), env={})["arca.remote"].value
        assert StoreAddress.parse(remote) == StoreAddress("10.0.0.5", port, "", 0)


def test_server_models_name_sources_with_names_and_aliases(tmp_path):
    from reame.settings import ModelSpec, from_values
    path = write(tmp_path, "[server]\nmodels = qwen2.5-coder-0.5b, coder|qwen = /m/a=b.gguf ,, tiny=smollm2-135m\n"
                           "max_loaded_models = 1\nmodels_ram_mb = 512\nkeep_alive_seconds = -1\n")
    server = from_values(config.load(path, env={})).server
    assert server.models == (ModelSpec("qwen2.5-coder-0.5b"), ModelSpec("/m/a=b.gguf", ("coder", "qwen")),
                             ModelSpec("smollm2-135m", ("tiny",)))
    assert (server.max_loaded_models, server.models_ram_bytes, server.keep_alive_s) == (1, 512 << 20, -1)


@pytest.mark.parametrize("listed", ["=smollm2-135m", "a||b=smollm2-135m", "coder=", "x" * 101 + "=smollm2-135m",
                                    "bell\x07=smollm2-135m"])
def test_a_malformed_server_models_entry_names_itself(listed):
    from reame.settings import from_values
    with pytest.raises(ConfigError, match="server.models entry"):
        from_values(config.load(None, env={"REAME_SERVER_MODELS": listed}))
