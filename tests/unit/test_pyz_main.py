"""The .pyz's __main__.py: its Python files extracted and compiled once, and a cache it cannot use."""

import sys
import zipfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import pyz_main  # noqa: E402

FILES = {"__main__.py": "print('boot')\n", "reame/__init__.py": "VALUE = 1\n", "reame/cli.py": "def main(): ...\n",
         "jinja2/__init__.py": "X = 2\n", "broken/newer.py": "def (:\n", "reame/web/index.html": "<html>",
         "reame_native/manifest.json": "{}", "reame_native/x86_64/lib/libllama.so": "ELF"}


@pytest.fixture
def archive(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("REAME_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(pyz_main, "PYTHON_TREE", "abc123")
    path = tmp_path / "reame.pyz"
    with zipfile.ZipFile(path, "w") as bundle:
        for name, text in FILES.items():
            bundle.writestr(name, text)
    return path


def test_the_python_files_are_extracted_and_compiled_once(archive, tmp_path):
    tree = pyz_main.prepared_tree(str(archive))
    assert tree == str(tmp_path / "cache" / "lib" / "abc123-python")
    files = sorted(str(path.relative_to(tree)) for path in Path(tree).rglob("*")
                   if path.is_file() and "__pycache__" not in path.parts)
    assert files == sorted(["reame/__init__.py", "reame/cli.py", "jinja2/__init__.py", "broken/newer.py",
                            "reame/web/index.html", Path(pyz_main.compiled_mark(tree)).name])
    tag = sys.implementation.cache_tag
    assert (Path(tree) / "reame" / "__pycache__" / f"cli.{tag}.pyc").exists()
    assert not (Path(tree) / "broken" / "__pycache__").exists()  # left to fail on import, as from the .pyz
    compiled = (Path(tree) / "reame" / "__pycache__" / f"cli.{tag}.pyc").stat().st_mtime_ns
    assert pyz_main.prepared_tree(str(archive)) == tree
    assert (Path(tree) / "reame" / "__pycache__" / f"cli.{tag}.pyc").stat().st_mtime_ns == compiled
    assert [path.name for path in (tmp_path / "cache" / "lib").iterdir()] == ["abc123-python"]


def test_an_interrupted_compile_is_finished_by_the_next_run(archive, tmp_path):
    tree = Path(pyz_main.prepared_tree(str(archive)))
    Path(pyz_main.compiled_mark(str(tree))).unlink()
    for pyc in tree.rglob("*.pyc"):
        pyc.unlink()
    assert pyz_main.prepared_tree(str(archive)) == str(tree)
    assert (tree / "reame" / "__pycache__" / f"cli.{sys.implementation.cache_tag}.pyc").exists()


def test_a_cache_it_cannot_write_leaves_it_on_the_pyz_and_says_why(archive, tmp_path, monkeypatch, capsys):
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    monkeypatch.setenv("REAME_CACHE", str(blocked / "cache"))
    assert pyz_main.prepared_tree(str(archive)) is None
    message = capsys.readouterr().err
    assert message.count("cannot keep compiled Python") == 1 and str(blocked / "cache") in message


def test_the_cache_root_is_reame_natives():
    from reame import native
    assert pyz_main.cache_root() == str(native.cache_root())
