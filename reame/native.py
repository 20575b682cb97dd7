"""Locate the pinned libllama build: override, bundled copy, then the build cache.

The pin and the cache layout live here so that `build_zipapp.py` (which builds)
and the binding (which loads) agree on where a build for this machine sits.
"""

from __future__ import annotations

import hashlib
import os
import platform
from dataclasses import dataclass
from pathlib import Path

from reame.errors import ModelError

LLAMA_COMMIT = "0c1e57098"
# Shared libraries of one build, in the order they must be loaded.
LIBRARY_STEMS = ("ggml-base", "ggml-cpu", "ggml", "llama")
BUILD_HINT = "build it with: python build_zipapp.py --lib (or set REAME_LIBLLAMA=/path/to/libllama.so)"


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


def build_key(portable: bool, tools: bool = False) -> str:
    """Directory name of one build: pin + machine + flags."""
    flags = "portable" if portable else "native"
    if tools:
        flags += "-tools"
    host = hashlib.sha256(cpu_identity().encode()).hexdigest()[:8] if not portable else "any"
    return f"{LLAMA_COMMIT}-{platform.system().lower()}-{platform.machine()}-{host}-{flags}"


def build_dir(portable: bool, tools: bool = False) -> Path:
    return cache_root() / "llama" / build_key(portable, tools)


@dataclass(frozen=True)
class NativeLibraries:
    """Where the shared libraries and the pinned headers of one build are."""

    lib_dir: Path
    include_dir: Path | None

    def path_of(self, stem: str) -> Path | None:
        for suffix in (".so", ".dylib"):
            candidate = self.lib_dir / f"lib{stem}{suffix}"
            if candidate.exists():
                return candidate
        return None


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
    for candidate in (build_dir(portable=False), build_dir(portable=True)):
        looked.append(str(candidate / "lib"))
        if (candidate / "manifest.json").exists():
            return NativeLibraries(candidate / "lib", candidate / "include")
    raise ModelError(f"libllama not found (looked in {', '.join(looked)}); {BUILD_HINT}")
