"""Entry point for `python -m reame` and for dist/reame.pyz."""

import atexit
import os
import sys
import time

began = time.perf_counter()  # the startup line (cli.Startup) counts Reame's imports from here

from reame import native  # noqa: E402
from reame.cli import main  # noqa: E402


def leave(status: int) -> None:
    """Exit without the interpreter's finalisation, which tears down every module and object one by one
    (50-100 ms of a one-shot prompt, after the answer): by now the engine, its caches and the Palimpsest
    are closed and their files written; what remains is flushed and the exit functions (logging's, a
    temporary libllama's removal) run first."""
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more can reach the reader
            pass
    os._exit(status)


def run() -> int:
    native.activate_bundle()  # inside a .pyz: native parts extracted once, zstandard importable
    try:
        return main(began=began)
    except BrokenPipeError:  # stdout's reader went away (`| head -1`): no traceback, and status 1
        return 1


if __name__ == "__main__":
    leave(run())
