"""dlopen the ggml and llama shared libraries in dependency order.

`libllama.so` finds its ggml libraries by RUNPATH only inside its build tree, so
each ggml library is loaded first with RTLD_GLOBAL: the dynamic linker then
resolves libllama's dependencies to the copies already in the process.
"""

from __future__ import annotations

import ctypes
import os

from reame import native
from reame.errors import ModelError

_loaded: ctypes.CDLL | None = None
_libraries: native.NativeLibraries | None = None


def load_libraries() -> ctypes.CDLL:
    """Load ggml-base, ggml-cpu, ggml and llama once; return the llama CDLL."""
    global _loaded, _libraries
    if _loaded is not None:
        return _loaded
    # An abort inside ggml must not try to attach a debugger to print a backtrace.
    os.environ.setdefault("GGML_NO_BACKTRACE", "1")
    libraries = native.locate()
    handle = None
    for stem in native.LIBRARY_STEMS:
        path = libraries.path_of(stem)
        if path is None and stem == "ggml-cpu" and libraries.cpu_variants:
            continue  # a portable build: ggml picks a CPU variant at run time (see backend init)
        if path is None:
            raise ModelError(f"lib{stem} missing in {libraries.lib_dir}; {native.BUILD_HINT}")
        try:
            handle = ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
        except OSError as error:
            raise ModelError(f"cannot load {path}: {error}; {native.BUILD_HINT}") from error
    assert handle is not None
    _loaded, _libraries = handle, libraries
    return handle


def loaded_libraries() -> native.NativeLibraries | None:
    """Where the loaded libraries came from (None before `load_libraries`)."""
    return _libraries
