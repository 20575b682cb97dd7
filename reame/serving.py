"""A serving node from typed settings: the HTTP server's settings, its sessions, its answer cache.

Apart from assembly.py so that a one-shot prompt never imports the HTTP server.
"""

from __future__ import annotations

import logging
import socket
from pathlib import Path

from reame import catalog
from reame.assembly import Plan, answer_cache, model_settings, new_engine, semantic_cache
from reame.engine import Engine
from reame.model.llama import LlamaBackend
from reame.native import cache_root
from reame.server.http import ServerSettings
from reame.server.serve import serve
from reame.server.sessions import Sessions
from reame.settings import Settings

log = logging.getLogger("reame")


def server_settings(settings: Settings, default_model_id: str, model_path: str = "") -> ServerSettings:
    server = settings.server
    return ServerSettings(
        host=server.host, port=server.port, api_keys=server.api_keys, cors_origin=server.cors_origin,
        max_connections=server.max_connections, max_requests=server.max_requests, max_body_bytes=server.max_body_bytes,
        idle_timeout_s=server.idle_timeout_s, header_timeout_s=server.header_timeout_s,
        request_timeout_s=server.request_timeout_s,
        grace_s=server.shutdown_grace_s, model_id=server.model_id or default_model_id,
        node_name=header_safe(server.node_name or socket.gethostname()), model_path=model_path,
        request_log=server.request_logging, metrics=server.metrics)


def header_safe(text: str) -> str:
    """`text` as a header value can carry it: printable ASCII, at most 64 characters."""
    return "".join(c for c in text if " " <= c <= "~")[:64]


def serve_model(settings: Settings, path: Path, entry: catalog.ModelEntry | None, chosen: Plan) -> int:
    """Listen, load the model, serve until a signal (server/serve.py)."""
    http = server_settings(settings, entry.name if entry else path.stem, str(path))
    n_seq = chosen["server.parallel"].value
    model = model_settings(path, settings, chosen, n_seq)

    def load_engine() -> Engine:
        backend = LlamaBackend(model)
        facts = backend.describe()
        log.info("model %s: %s, %.0fM parameters, context %s tokens, %s threads, %s slot(s)", path.name,
                 facts["description"], facts["parameters"] / 1e6, facts["n_ctx"], facts["n_threads"], n_seq)
        # The chat template is compiled on first use: here, before the server says it is ready, not in
        # the first request (a one-shot raw prompt never compiles it).
        log.info("tools: %s", "the model's own template lays them out" if backend.template_supports_tools
                 else "described to the model in a message of Reame's (its template has no tools)")
        return new_engine(backend, settings, serving=True).start()

    sessions = Sessions(cache_root() / "sessions" / http.model_id, model.kv_fingerprint(), settings.server.sessions)
    fingerprint = model.kv_fingerprint()
    answers = answer_cache(settings, fingerprint, ram=True)
    return serve(http, load_engine, path.name, sessions, answers,
                 semantic_cache(settings, fingerprint, answers))
