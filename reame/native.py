"""Locate the pinned libllama build: override, bundled copy, then the build cache.

The pin and the cache layout live here so that `build_zipapp.py` (which builds)
and the binding (which loads) agree on where a build for this machine sits.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import platform
import sys
import zipimport
from dataclasses import dataclass
from pathlib import Path

from reame.errors import ModelError

LLAMA_COMMIT = "0c1e57098"
# Shared libraries of one build, in the order they must be loaded.
LIBRARY_STEMS = ("ggml-base", "ggml-cpu", "ggml", "llama")
BUILD_HINT = "build it with: python build_zipapp.py --lib (or set REAME_LIBLLAMA=/path/to/libllama.so)"
# Inside dist/reame.pyz: manifest.json, and per machine <machine>/lib/ (libllama and ggml) and
# <machine>/python/cp3XX/zstandard/ (one build per supported CPython minor).
BUNDLE_DIR = "reame_native"
MACHINE_ALIASES = {"amd64": "x86_64", "x64": "x86_64", "arm64": "aarch64"}
# The .pyz this package came from and its manifest's sha256, set by its __main__.py (pyz_main.py):
# imported from the extracted, compiled copy of the .pyz's Python files, the package cannot find its
# .pyz by its loader, and knowing the sha spares a warm start opening the .pyz to read the manifest.
ARCHIVE: str | None = None
BUNDLE_SHA256: str | None = None


def cache_root() -> Path:
    """Root of every Reame cache (`$REAME_CACHE`, default `~/.cache/reame`)."""
    return Path(os.environ.get("REAME_CACHE") or Path.home() / ".cache" / "reame")


def cpu_identity() -> str:
    """What a native build depends on: the CPU model and its feature flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    wanted = {line for line in text.splitlines()
              if line.startswith(("model name", "flags", "Features", "CPU part"))}
    return "\n".join(sorted(wanted))


def build_key(portable: bool, tools: bool = False, arch: str = "") -> str:
    """Directory name of one build: pin + machine (this one unless `arch` names another) + flags."""
    flags = "portable" if portable else "native"
    if tools:
        flags += "-tools"
    host = hashlib.sha256(cpu_identity().encode()).hexdigest()[:8] if not portable else "any"
    return f"{LLAMA_COMMIT}-{platform.system().lower()}-{arch or machine()}-{host}-{flags}"


def build_dir(portable: bool, tools: bool = False, arch: str = "") -> Path:
    return cache_root() / "llama" / build_key(portable, tools, arch)


@dataclass(frozen=True)
class NativeLibraries:
    """Where the shared libraries and the pinned headers of one build are."""

    lib_dir: Path
    include_dir: Path | None

    @property
    def cpu_variants(self) -> list[Path]:
        """CPU backend libraries of a portable build (one per instruction-set level), if any."""
        return sorted(self.lib_dir.glob("libggml-cpu-*.so"))

    @property
    def build_name(self) -> str:
        """Which build this is, for facts measured on it: its directory (a build key, or a .pyz's hash and
        machine) and, for a build in the cache, when it was made: a rebuild (other patches, another compiler)
        keeps its key but may compute differently."""
        name = f"{self.lib_dir.parent.name}/{self.lib_dir.name}"
        try:
            built_at = json.loads((self.lib_dir.parent / "manifest.json").read_text()).get("built_at")
        except (OSError, ValueError, AttributeError):
            return name
        return f"{name} built {built_at}" if isinstance(built_at, str) else name

    def path_of(self, stem: str) -> Path | None:
        for suffix in (".so", ".dylib"):
            candidate = self.lib_dir / f"lib{stem}{suffix}"
            if candidate.exists():
                return candidate
        return None


def machine() -> str:
    """This CPU architecture as the bundle names it (x86_64, aarch64)."""
    name = platform.machine().lower()
    return MACHINE_ALIASES.get(name, name)


def python_tag() -> str:
    """This interpreter's CPython minor as a wheel tag (cp311)."""
    return f"cp{sys.version_info.major}{sys.version_info.minor}"


def describe_build(manifest: dict) -> str:
    """A build's kind in words, from its manifest.json."""
    if not manifest.get("portable"):
        return "native build for the CPU it was built on"
    variants = [name.removeprefix("libggml-cpu-").removesuffix(".so")
                for name in manifest.get("libraries", {}).get("cpu_variants", [])]
    return f"portable build, CPU variant chosen at run time from {', '.join(variants)}"


def running_archive() -> Path | None:
    """The .pyz this package runs from, or None when it runs from plain files."""
    if ARCHIVE is not None:
        return Path(ARCHIVE)
    loader = globals().get("__loader__")
    return Path(loader.archive) if isinstance(loader, zipimport.zipimporter) else None


def bundle_manifest() -> dict | None:
    """What the running .pyz carries (`{"sha256", "llama_commit", "machines": {machine: {...}}}`)."""
    archive = running_archive()
    if archive is None:
        return None
    import zipfile
    with zipfile.ZipFile(archive) as bundle:
        try:
            return json.loads(bundle.read(f"{BUNDLE_DIR}/manifest.json"))
        except KeyError:
            return None


def unsupported_machine(manifest: dict) -> str:
    """The one line for a machine the .pyz carries no build for."""
    carried = ", ".join(f"linux-{name}" for name in sorted(manifest["machines"]))
    return (f"this reame.pyz carries libllama for {carried} only; this machine is "
            f"{platform.system().lower()}-{machine()}: build one here with python build_zipapp.py")


def activate_bundle() -> Path | None:
    """Extract this machine's native parts of the .pyz once, to ~/.cache/reame/lib/<sha256>-<machine>/,
    and put the zstandard build for this Python minor on sys.path. Safe when two first runs race: each
    extracts to its own temporary directory and the first rename wins. A cache that cannot hold them
    (read-only, full) costs a private temporary copy for this run, said once. Returns the directory, or
    None outside a .pyz or when the .pyz carries nothing for this machine (`locate` then says so)."""
    archive = running_archive()
    known = cache_root() / "lib" / f"{BUNDLE_SHA256}-{machine()}"
    if BUNDLE_SHA256 is not None and (known / "lib").is_dir():
        return with_zstandard(known)
    manifest = bundle_manifest()
    if manifest is None or machine() not in manifest["machines"]:
        return None
    assert archive is not None
    name = f"{manifest['sha256']}-{machine()}"
    target = cache_root() / "lib" / name
    try:
        extract_natives(archive, target)
    except OSError as error:
        import shutil
        import tempfile
        scratch = Path(tempfile.mkdtemp(prefix="reame-native-"))
        atexit.register(shutil.rmtree, scratch, ignore_errors=True)
        print(f"reame: cannot keep libllama in {target.parent} ({error.strerror or error}); extracting it "
              f"to {scratch} for this run only", file=sys.stderr)
        target = scratch / name
        extract_natives(archive, target)
    return with_zstandard(target)


def with_zstandard(natives: Path) -> Path:
    """`natives` (an extracted bundle), after putting its zstandard build for this Python on sys.path."""
    python_dir = natives / "python" / python_tag()
    if python_dir.is_dir() and str(python_dir) not in sys.path:
        sys.path.insert(0, str(python_dir))
    return natives


def extract_natives(archive: Path, target: Path) -> None:
    """This machine's part of the .pyz's BUNDLE_DIR into `target`, unless it is there already."""
    if (target / "lib").exists():
        return
    import shutil
    import tempfile
    import zipfile
    mask = os.umask(0o077)  # this user's alone, whatever their umask: the .pyz refuses code others could write
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".extract-", dir=target.parent))
        try:
            prefix = f"{BUNDLE_DIR}/{machine()}/"
            with zipfile.ZipFile(archive) as bundle:
                for member in bundle.infolist():
                    if not member.filename.startswith(prefix) or member.is_dir():
                        continue
                    destination = staging / member.filename[len(prefix):]
                    destination.parent.mkdir(parents=True, exist_ok=True)
                    with bundle.open(member) as source, destination.open("wb") as out:
                        shutil.copyfileobj(source, out)
                    destination.chmod(0o755 if destination.suffix == ".so" or ".so." in destination.name else 0o644)
            staging.chmod(0o700)  # no one else enters it: the .pyz then need not check what is inside
            os.rename(staging, target)
        except OSError:
            if not (target / "lib").exists():
                raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    finally:
        os.umask(mask)


def locate() -> NativeLibraries:
    """Find the libraries, or raise ModelError naming every place looked."""
    looked: list[str] = []
    override = os.environ.get("REAME_LIBLLAMA")
    if override:
        path = Path(override).expanduser()
        lib_dir = path if path.is_dir() else path.parent
        if (lib_dir / "libllama.so").exists() or (lib_dir / "libllama.dylib").exists():
            include = lib_dir.parent / "include"
            return NativeLibraries(lib_dir, include if include.is_dir() else None)
        raise ModelError(f"REAME_LIBLLAMA={override} does not point at libllama.so; {BUILD_HINT}")
    bundled = activate_bundle()
    if bundled is not None:
        return NativeLibraries(bundled / "lib", None)
    manifest = bundle_manifest()
    if manifest is not None:
        raise ModelError(unsupported_machine(manifest))
    for candidate in (build_dir(portable=False), build_dir(portable=True)):
        looked.append(str(candidate / "lib"))
        if (candidate / "manifest.json").exists():
            return NativeLibraries(candidate / "lib", candidate / "include")
    raise ModelError(f"libllama not found (looked in {', '.join(looked)}); {BUILD_HINT}")
