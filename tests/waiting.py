"""Waiting on an observable condition in tests, never on a fixed sleep."""

from __future__ import annotations

import time
from collections.abc import Callable

POLL_S = 0.005


def wait_until(condition: Callable[[], object], timeout_s: float = 10.0, what: str = "the condition") -> None:
    """Return as soon as `condition()` is true; fail the test if it is not within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(POLL_S)
