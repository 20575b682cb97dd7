"""What the stores keep is the users' data (issue 32): prefix cache snapshots, the Palimpsest's archive, ARCA's
append-only file and saved sessions are files only their owner reads, in directories only their owner enters,
whatever the umask; a symlink planted where a temp file goes is never written through."""

import os
import stat
import threading

import pytest

from reame.arca.resp import command_bytes
from reame.arca.server import Arca, ArcaSettings
from reame.arca.aof import AOF_NAME
from reame.cache.store import DiskStore, Snapshot, write_atomically
from reame.files import FileLock, create_private, private_directory
from reame.speculative.archive import Archive

from .test_arca_commands import run


@pytest.fixture(autouse=True)
def loose_umask():
    """The umask a careless service unit has: what the stores make must be private anyway."""
    old = os.umask(0o022)
    yield
    os.umask(old)


def mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_cache_snapshots_are_private(tmp_path):
    directory = tmp_path / "kv"
    store = DiskStore(directory, b"f" * 32, 10 << 20)
    assert store.write("snap", Snapshot(tuple(range(100)), b"state" * 100))
    files = [path for path in directory.iterdir() if path.is_file()]
    assert files and all(mode(path) == 0o600 for path in files), [(p.name, oct(mode(p))) for p in files]
    assert mode(directory) == 0o700


def test_the_palimpsest_archive_is_private(tmp_path):
    directory = tmp_path / "palimpsest"
    archive = Archive(directory, b"v" * 32, 1 << 20)
    archive.append([1, 2, 3, 4])
    assert mode(directory) == 0o700 and all(mode(path) == 0o600 for path in directory.iterdir())


def test_arcas_log_is_private_even_when_an_older_version_made_it_readable(tmp_path):
    tmp_path.chmod(0o755)
    (tmp_path / AOF_NAME).write_bytes(command_bytes(b"SET", b"k", b"v"))
    (tmp_path / AOF_NAME).chmod(0o644)
    arca = Arca(ArcaSettings(directory=tmp_path))
    try:
        run(arca, "SET", "answer", "42")
        assert mode(tmp_path) == 0o700 and mode(tmp_path / AOF_NAME) == 0o600
        assert run(arca, "GET", "k") == b"v"
    finally:
        arca.aof.close()


def test_lock_files_are_private(tmp_path):
    with FileLock(tmp_path / "store.lock"):
        pass
    assert mode(tmp_path / "store.lock") == 0o600


def test_a_symlink_planted_where_a_temp_file_goes_is_not_written_through(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious")
    directory = private_directory(tmp_path / "store")
    target = directory / "file"
    planted = target.with_name(f".{target.name}.{os.getpid()}.{threading.get_ident()}.tmp")  # the name it will use
    planted.symlink_to(victim)
    write_atomically(target, [b"data"])
    assert victim.read_text() == "precious" and target.read_bytes().startswith(b"data") and not planted.exists()
    (directory / "linked").symlink_to(victim)
    with pytest.raises(OSError):
        create_private(directory / "linked")
    assert victim.read_text() == "precious"
