import pytest

from reame import native
from reame.errors import ModelError


def test_missing_library_names_every_place_looked_and_how_to_build(tmp_path, monkeypatch):
    monkeypatch.delenv("REAME_LIBLLAMA", raising=False)
    monkeypatch.setenv("REAME_CACHE", str(tmp_path))
    with pytest.raises(ModelError) as raised:
        native.locate()
    message = str(raised.value)
    assert "\n" not in message
    assert str(tmp_path) in message and "python build_zipapp.py --lib" in message


def test_override_that_is_not_a_library_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("REAME_LIBLLAMA", str(tmp_path / "nothing.so"))
    with pytest.raises(ModelError) as raised:
        native.locate()
    assert "REAME_LIBLLAMA" in str(raised.value)


def test_override_directory_with_the_libraries_is_used(tmp_path, monkeypatch):
    (tmp_path / "libllama.so").write_bytes(b"")
    monkeypatch.setenv("REAME_LIBLLAMA", str(tmp_path))
    assert native.locate().lib_dir == tmp_path


def test_build_key_depends_on_pin_and_flags():
    native_key, portable_key = native.build_key(portable=False), native.build_key(portable=True)
    assert native.LLAMA_COMMIT in native_key and native_key != portable_key
    assert native.build_key(portable=False, tools=True) != native_key
