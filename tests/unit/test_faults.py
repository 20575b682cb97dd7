"""Faults: a writer killed mid-write (snapshots, sessions), a full disk, an unusable cache directory.
After each, only verified data is served and the server keeps answering."""

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from reame.cache import PrefixCache
from reame.cache.store import DiskStore
from reame.engine import Engine
from tests.fakes.backend import FakeBackend
from reame.server.sessions import SessionError, Sessions

from tests.waiting import wait_until

from .test_server import Live

ROOT = Path(__file__).resolve().parents[2]
FINGERPRINT = b"k" * 32
BLOB_BYTES = 12 << 20  # three write slices: a kill lands mid-file


def start_child(code: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), *args], stdout=subprocess.PIPE,
                            text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))


def kill_mid_write(child: subprocess.Popen, directory: Path, writes: int) -> None:
    """SIGKILL the child while it writes its `writes`-th file: once it said it started that write (a
    line on stdout per write) and the temporary file is on disk."""
    for _ in range(writes):
        assert child.stdout.readline(), "the child ended before the kill"
    wait_until(lambda: any(path.name.endswith(".tmp") for path in directory.iterdir()) or child.poll() is not None,
               what="the write to begin")
    os.kill(child.pid, signal.SIGKILL)
    child.wait(30)


SNAPSHOT_WRITER = """
    import sys, time
    from pathlib import Path
    from reame.cache.store import DiskStore, Snapshot
    disk = DiskStore(Path(sys.argv[1]), b"k" * 32, 1 << 34, compress=False)
    for index in range(100):
        print(index, flush=True)
        disk.write(f"s{index}", Snapshot((index,) * 8, bytes([index]) * {blob}), pause=lambda: time.sleep(0.05))
""".replace("{blob}", str(BLOB_BYTES))


def test_a_snapshot_writer_killed_mid_write_leaves_only_whole_verified_snapshots(tmp_path):
    kill_mid_write(start_child(SNAPSHOT_WRITER, str(tmp_path)), tmp_path, writes=3)
    assert any(path.name.endswith(".tmp") for path in tmp_path.iterdir()), "killed between two writes"
    disk = DiskStore(tmp_path, FINGERPRINT, 1 << 34)
    assert not any(path.name.endswith(".tmp") for path in tmp_path.iterdir()), "the dead writer's file is removed"
    assert disk.entries
    for name, tokens in disk.entries.items():
        index = int(name[1:])
        snapshot = disk.read(name)
        assert snapshot is not None and snapshot.tokens == tokens == (index,) * 8
        assert bytes(snapshot.blob) == bytes([index]) * BLOB_BYTES


SESSION_SAVER = """
    import sys
    from pathlib import Path
    from reame.engine import SessionState
    from reame.server.sessions import Sessions
    sessions = Sessions(Path(sys.argv[1]), b"model")
    session = sessions.acquire("", sessions.create("", "chat"))
    sessions.release("", "chat")
    for turn in range(100):
        session.state = SessionState(tuple(range(turn + 1)), bytes([turn]) * {blob})
        print(turn, flush=True)
        sessions.save("", "chat")
""".replace("{blob}", str(BLOB_BYTES))


def test_a_session_save_killed_midway_restarts_with_the_last_whole_save(tmp_path):
    kill_mid_write(start_child(SESSION_SAVER, str(tmp_path)), tmp_path, writes=3)  # turns 0, 1 saved; 2 cut
    sessions = Sessions(tmp_path, b"model")
    try:
        sessions.load("", "chat")
    except SessionError as error:  # killed before the first save finished: nothing to load, nothing wrong
        assert error.code == "session_not_found"
        return
    state = sessions.acquire("", "chat").state
    turn = len(state.tokens) - 1
    assert turn >= 0 and state.tokens == tuple(range(turn + 1))  # the tokens and blob of one and the same save
    assert bytes(state.blob) == bytes([turn]) * BLOB_BYTES


@pytest.fixture
def tiny_disk(tmp_path):
    """A 48 KiB tmpfs: a disk that fills after a few snapshots (needs root to mount)."""
    mount_point = tmp_path / "tiny"
    mount_point.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=48k", "tmpfs", str(mount_point)],
                             capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    yield mount_point
    subprocess.run(["umount", str(mount_point)], check=True)


def test_a_full_disk_keeps_the_server_answering_and_says_so(tiny_disk, caplog):
    cache = PrefixCache(b"c" * 32, tiny_disk / "kv", block_tokens=4, min_new_tokens=16, ram_budget_bytes=0)
    with caplog.at_level("WARNING", logger="reame.cache"), \
            Engine(FakeBackend(n_ctx=8192, n_seq_max=2, n_batch=512), cache=cache) as engine:
        server = Live(engine)
        try:
            for index in range(12):
                document = f"document number {index} with enough words to be snapshotted. " * 40
                status, body = server.json("POST", "/v1/completions", {"prompt": document, "max_tokens": 2})
                assert status == 200
            assert engine.idle.wait(10)  # every answer has ended, and its snapshots are queued to the writer
            cache.close()  # flushes the writer queue
            metrics = server.request("GET", "/metrics")[1].decode()
        finally:
            server.close()
    errors = next(line for line in metrics.splitlines() if line.startswith("reame_prefix_cache_write_errors_total"))
    assert int(float(errors.split()[-1])) > 0
    said = [record for record in caplog.records if "cannot write KV snapshots" in record.getMessage()]
    assert len(said) == 1, "said once, not once per snapshot"


def test_an_unusable_cache_directory_is_a_warning_and_the_engine_runs_without_a_cache(tmp_path, caplog):
    from reame import assembly, config
    from reame.settings import from_values
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    settings = from_values(config.load(None, env={"REAME_CACHE_DIR": str(blocker / "kv")}))
    with caplog.at_level("WARNING", logger="reame"):
        assert assembly.prefix_cache(settings, b"f" * 32, serving=True) is None
    assert "the prefix cache is off: cannot use its directory" in caplog.text
