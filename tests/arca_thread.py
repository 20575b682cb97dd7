"""An ARCA daemon on a thread of the test process (its own event loop), for tests of its clients."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from reame.arca.server import Arca, ArcaSettings


@contextmanager
def arca_thread(directory: Path, **settings: object) -> Iterator[int]:
    """Yield the port of an ARCA serving on 127.0.0.1 until the block ends."""
    ready = threading.Event()
    state: dict[str, object] = {}

    def main() -> None:
        async def serve() -> None:
            arca = Arca(ArcaSettings(port=0, directory=directory, **settings))  # type: ignore[arg-type]
            state["task"] = asyncio.current_task()
            await arca.serve(lambda port: (state.__setitem__("port", port), ready.set()))

        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        state["loop"] = loop
        try:
            loop.run_until_complete(serve())
        except asyncio.CancelledError:
            pass
        finally:  # the connections' tasks end too, before the loop closes
            pending = asyncio.all_tasks(loop)
            for task in pending:
                task.cancel()
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop.close()

    thread = threading.Thread(target=main, daemon=True)
    thread.start()
    assert ready.wait(10), "ARCA did not start"
    try:
        yield int(state["port"])  # type: ignore[arg-type]
    finally:
        loop = state["loop"]
        loop.call_soon_threadsafe(state["task"].cancel)  # type: ignore[attr-defined,union-attr]
        thread.join(10)
