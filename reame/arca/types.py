"""What ARCA's modules share and nothing of ARCA's defines: its settings, a client's state, a blocked read.
Imports nothing else of arca/, so every other module may import it."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class ArcaSettings:
    host: str = "127.0.0.1"
    port: int = 6420
    directory: Path = Path("arca")
    max_bytes: int = 0  # 0: no budget
    requirepass: str = ""
    max_clients: int = 256  # Redis's maxclients
    timeout_s: float = 300.0  # close a client idle this long (0: never), as Redis's timeout
    max_query_bytes: int = 32 << 20  # Redis's client-query-buffer-limit: one client's unparsed input


class Client:
    """One connection's state. `disconnect` closes its connection (the daemon's chores call it for an idle one)."""

    ids = itertools.count(1)

    def __init__(self, address: str, disconnect: Callable[[], None] = lambda: None) -> None:
        self.id = next(Client.ids)
        self.address = address
        self.disconnect = disconnect
        self.name = b""
        self.library = b""
        self.authenticated = False
        self.resp3 = False
        self.created = self.last_active = time.monotonic()
        self.last_command = b"NULL"
        self.closing = False
        self.blocked = False  # waiting in XREAD BLOCK: not idle, however long it waits


class Blocked:
    """An XREAD BLOCK that found nothing yet: the connection waits for an XADD or the timeout."""

    def __init__(self, retry: Callable[[], Any], timeout_ms: int) -> None:
        self.retry, self.timeout_ms = retry, timeout_ms
