"""libllama, loaded once per process, its log lines through our logger (errors remembered for the messages
we raise)."""

from __future__ import annotations

import collections
import logging
import os
import re
import threading
from dataclasses import dataclass

from reame.ctypes_llama import types as t  # plain ctypes declarations: importing it loads no library

_llama_log = logging.getLogger("reame.llama")
_recent_errors: collections.deque[str] = collections.deque(maxlen=4)
# What llama.cpp logs, as errors and a warning, of a decode that Backend.interrupt stopped (ggml's status 1,
# GGML_STATUS_ABORTED; llama_decode's 2): expected, so kept at debug level.
_INTERRUPTED_DECODE = re.compile(r"(compute_async failed with error 1|compute status: 1|failed to decode, ret = 2"
                                 r"|removing memory module entries for seq_id = \d+, pos = \[\d+, \+inf\))$")


@dataclass
class _LogState:
    """llama.cpp logs a line in pieces (GGML_LOG_LEVEL_CONT): the line so far, and its level."""

    partial: str = ""
    level: int = 0


_log_state = _LogState()
_log_callback = None  # keeps the ctypes callback alive
_init_lock = threading.Lock()
_backend_ready = False


def _on_llama_log(level: int, text: bytes | None, _user: object) -> None:
    # Called from inside llama_decode too (dozens of debug lines when a graph is rebuilt): lines
    # nobody reads are dropped before any work, unless REAME_LLAMA_VERBOSE asked for them.
    if level != t.GGML_LOG_LEVEL_CONT:
        _log_state.level = level
    if _log_state.level < t.GGML_LOG_LEVEL_WARN and not _llama_log.isEnabledFor(logging.DEBUG):
        return
    chunk = (text or b"").decode("utf-8", "replace")
    _log_state.partial += chunk
    if not _log_state.partial.endswith("\n"):
        return
    line = _log_state.partial.rstrip()
    _log_state.partial = ""
    if not line:
        return
    level = _log_state.level
    if _INTERRUPTED_DECODE.search(line):
        _llama_log.debug("%s", line)
    elif level == t.GGML_LOG_LEVEL_ERROR:
        _recent_errors.append(line)
        _llama_log.error("%s", line)
    elif level == t.GGML_LOG_LEVEL_WARN:
        _llama_log.warning("%s", line)
    else:
        _llama_log.debug("%s", line)


def init_native() -> None:
    """Load the library, route its logs, init the backend: once per process."""
    global _backend_ready, _log_callback
    with _init_lock:
        if _backend_ready:
            return
        from reame.ctypes_llama import _lib, api
        api.load()
        if os.environ.get("REAME_LLAMA_VERBOSE"):
            _llama_log.setLevel(logging.DEBUG)
        elif _llama_log.level == logging.NOTSET:
            _llama_log.setLevel(logging.ERROR)
        _log_callback = t.ggml_log_callback(_on_llama_log)
        api.llama_log_set(_log_callback, None)
        libraries = _lib.loaded_libraries()
        if libraries is not None and libraries.cpu_variants:
            api.ggml_backend_load_all_from_path(os.fsencode(libraries.lib_dir))
        api.llama_backend_init()
        _backend_ready = True


def forget_llama_errors() -> None:
    """A new model is loading: errors from before are not its."""
    _recent_errors.clear()


def last_llama_error() -> str:
    return f" ({_recent_errors[-1]})" if _recent_errors else ""
