"""The CPU time of work done in the calling thread, for the tests that bound what hostile input may cost.

`time.process_time()` counts every thread of the process: a server thread an earlier test left answering, a
garbage collection over the objects of 1,900 tests. Once it charged a 10-byte batch file's parse 0.23 s in CI and
the bound failed on a parse that takes microseconds. The bounds are about the code under test, so the clock is
the calling thread's and, unless the test also bounds memory, the collector waits until the clock stops."""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass
class CpuClock:
    """Seconds of CPU the calling thread spent inside a `cpu_clock()` block; set when the block ends."""

    seconds: float = 0.0


@contextmanager
def cpu_clock(*, pause_collector: bool = True) -> Iterator[CpuClock]:
    """Time the block on the calling thread's CPU clock. A test that also measures peak memory passes
    `pause_collector=False`: with the collector paused, garbage in reference cycles would count as held."""
    clock = CpuClock()
    paused = pause_collector and gc.isenabled()
    if paused:
        gc.disable()
    started = time.thread_time()
    try:
        yield clock
    finally:
        clock.seconds = time.thread_time() - started
        if paused:
            gc.enable()
