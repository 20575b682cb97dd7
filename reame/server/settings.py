"""The HTTP server's settings ([server] in the config file; docs/configuration.md): where it listens, who may
ask, its bounds and clocks. Read by the transport (http.py, listener.py) and by the routes that answer by
them (service.py), so they live apart from both."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from reame.model.sampling import SamplingParams


@dataclass(frozen=True)
class BatchLimits:
    """Where batches and their files live and what they may hold (server.batch_*; server/batches.py)."""

    directory: Path | None = None  # None: no Batch or Files API
    storage_bytes: int = 1 << 30  # every file together: inputs, outputs, error files
    max_lines: int = 50_000
    max_line_bytes: int = 1 << 20
    concurrency: int = 1  # lines answered at once


@dataclass(frozen=True)
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 8080
    api_keys: tuple[str, ...] = ()
    cors_origin: str = ""  # "" = CORS off; "*" or an origin to allow
    allowed_hosts: tuple[str, ...] = ()  # the Host names requests may address (forgery.allowed_hosts)
    max_connections: int = 256  # open sockets
    max_requests: int = 64  # requests being answered at once
    max_body_bytes: int = 10 << 20
    idle_timeout_s: float = 30.0
    header_timeout_s: float = 10.0  # a new connection's first byte, and a request's line and headers from its first
    request_timeout_s: float = 60.0  # the whole request, from its first byte
    node_name: str = ""  # every response's X-Reame-Node ("": none)
    grace_s: float = 30.0
    request_log: bool = True
    metrics: bool = True  # serve GET /metrics
    slots: bool = True  # serve GET /slots
    web_page: bool = True  # serve the built-in page at /
    cache_reuse: int = 64  # llama-server's routes: n_cache_reuse where a request sends none (0: off)
    allow_pull: bool = False  # Ollama's /api/pull fetches catalog models (false: 403)
    # What llama-server's routes sample with where a request says nothing ([generation], as llama-server's come
    # from its command line): temperature, top_k, top_p, min_p, repeat_penalty and the seed.
    sampling: SamplingParams = field(default_factory=lambda: SamplingParams(temperature=0.8, top_k=40, top_p=0.95,
                                                                            min_p=0.05, seed=42))
    batches: BatchLimits = field(default_factory=BatchLimits)
    extra: dict[str, Any] = field(default_factory=dict)
