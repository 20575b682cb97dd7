"""build_zipapp.py fails with one clear line: bad checksum, missing tools, no network."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import build_zipapp  # noqa: E402


def test_a_source_archive_with_the_wrong_checksum_is_removed(tmp_path):
    archive = tmp_path / f"llama_cpp_python-{build_zipapp.SDIST_VERSION}.tar.gz"
    archive.write_bytes(b"tampered")
    with pytest.raises(build_zipapp.BuildError) as raised:
        build_zipapp.fetch_sdist(tmp_path)
    assert "checksum mismatch" in str(raised.value) and "\n" not in str(raised.value)
    assert not archive.exists()


def test_missing_cmake_is_named(monkeypatch):
    monkeypatch.setattr(build_zipapp.shutil, "which", lambda tool: None)
    with pytest.raises(build_zipapp.BuildError, match="'cmake' not found"):
        build_zipapp.require_tools()


def test_a_failed_download_is_one_line(tmp_path, monkeypatch):
    class Failed:
        returncode = 1
        stderr = "ERROR: Could not find a version that satisfies the requirement\nERROR: No matching distribution"

    monkeypatch.setattr(build_zipapp.subprocess, "run", lambda *a, **k: Failed())
    with pytest.raises(build_zipapp.BuildError) as raised:
        build_zipapp.fetch_sdist(tmp_path)
    message = str(raised.value)
    assert "cannot download" in message and "No matching distribution" in message and "\n" not in message


def test_main_reports_a_build_error_in_one_line_and_exits_1(monkeypatch, capsys):
    def fail(*args):
        raise build_zipapp.BuildError("something specific broke")

    monkeypatch.setattr(build_zipapp, "build", fail)
    assert build_zipapp.main(["--lib"]) == 1
    assert capsys.readouterr().err == "build failed: something specific broke\n"
