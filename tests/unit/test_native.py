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


def test_a_machine_the_pyz_has_no_build_for_gets_one_line_naming_what_it_holds(monkeypatch):
    from reame import native
    from reame.errors import ModelError
    monkeypatch.delenv("REAME_LIBLLAMA", raising=False)
    monkeypatch.setattr(native, "bundle_manifest", lambda: {"sha256": "0" * 64, "machines": {"x86_64": {},
                                                                                            "aarch64": {}}})
    monkeypatch.setattr(native.platform, "machine", lambda: "riscv64")
    assert native.activate_bundle() is None
    with pytest.raises(ModelError) as raised:
        native.locate()
    assert str(raised.value) == ("this reame.pyz carries libllama for linux-aarch64, linux-x86_64 only; this machine "
                                 "is linux-riscv64: build one here with python build_zipapp.py")


@pytest.mark.parametrize("reported, expected", [("x86_64", "x86_64"), ("AMD64", "x86_64"), ("aarch64", "aarch64"),
                                                ("arm64", "aarch64"), ("riscv64", "riscv64")])
def test_machine_names_are_the_bundles(monkeypatch, reported, expected):
    from reame import native
    monkeypatch.setattr(native.platform, "machine", lambda: reported)
    assert native.machine() == expected


def test_a_library_without_an_optional_symbol_loads_and_only_that_feature_fails(monkeypatch):
    from reame.ctypes_llama import api

    class Library:
        def __getattr__(self, name):
            if name == "llama_get_embeddings_seq":
                raise AttributeError(name)
            return type("Function", (), {"argtypes": None, "restype": None})()

    monkeypatch.setattr(api._lib, "load_libraries", lambda: Library())
    monkeypatch.setattr(api, "_bound", False)
    monkeypatch.setattr(api, "_missing", set())
    for name in api.declared_names():  # the fake bindings are undone after the test
        monkeypatch.setitem(vars(api), name, vars(api).get(name))
    api.load()
    assert not api.available("llama_get_embeddings_seq") and api.available("llama_decode")
    with pytest.raises(ModelError, match="lacks llama_get_embeddings_seq, which embeddings needs"):
        api.llama_get_embeddings_seq(None, 0)
    monkeypatch.setattr(api, "_bound", False)
    monkeypatch.setattr(Library, "__getattr__", lambda self, name: (_ for _ in ()).throw(AttributeError(name)))
    with pytest.raises(ModelError, match="lacks llama_model_default_params: it is not the pinned build"):
        api.load()


def test_a_rebuilt_library_is_another_build_for_the_facts_measured_on_it(tmp_path):
    """The exactness probe's remembered answer is keyed by build_name: a rebuild in the same cache directory
    (other patches) must not inherit it; a directory without a manifest (a .pyz's extraction) is its name."""
    lib_dir = tmp_path / "0c1e57098-linux-x86_64-native" / "lib"
    lib_dir.mkdir(parents=True)
    libraries = native.NativeLibraries(lib_dir, None)
    assert libraries.build_name == "0c1e57098-linux-x86_64-native/lib"
    (lib_dir.parent / "manifest.json").write_text('{"built_at": "2026-12-06T02:44:01Z"}')
    first = libraries.build_name
    (lib_dir.parent / "manifest.json").write_text('{"built_at": "2026-12-06T06:09:01Z"}')
    assert first != libraries.build_name and first.startswith("0c1e57098-linux-x86_64-native/lib")
    (lib_dir.parent / "manifest.json").write_text("[1, 2]")
    assert libraries.build_name == "0c1e57098-linux-x86_64-native/lib"
