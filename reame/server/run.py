"""Run the HTTP server: listen first, load the model, serve until SIGINT/SIGTERM, drain, exit 0.

The socket is open while the first model loads, so `/health` answers 503
"loading" until its engine is ready. On a signal the server stops accepting, lets
requests in flight finish within the grace period, then closes the engine.
"""

from __future__ import annotations

import logging
import signal
import threading
from typing import Callable

from reame.errors import ListenError
from reame.heap import return_large_blocks
from reame.server.settings import ServerSettings
from reame.server.listener import ReameHTTPServer
from reame.server.metrics import Sample
from reame.server.app import App
from reame.server.models import ModelPool

log = logging.getLogger("reame.server")


def serve(settings: ServerSettings, models: ModelPool, on_close: Callable[[], None] = lambda: None) -> int:
    """Serve until a signal: the first model is loaded before the server says it is ready, the others when
    a request names them. At the end every model is unloaded, then `on_close` runs (it closes what the models
    share: the semantic cache's embedding model)."""
    return_large_blocks()
    app = App(settings, models)
    try:
        server = ReameHTTPServer(settings, app)
    except OSError as error:
        raise ListenError(settings.host, settings.port, error) from None
    app.metrics.collector(lambda: [Sample("reame_http_connections", "gauge", "open HTTP connections, by state",
                                          {"state": state}, count) for state, count in server.connections().items()])
    host, port = server.server_address[:2]
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    listener = threading.Thread(target=server.serve_forever, name="reame-http", daemon=True)
    listener.start()
    auth = f"bearer auth on ({len(settings.api_keys)} key{'s' * (len(settings.api_keys) != 1)})" \
        if settings.api_keys else "no auth"
    cors = f"CORS {settings.cors_origin}" if settings.cors_origin else "CORS off"
    names = ", ".join(f"'{model.name}'" for model in models.models)
    log.info("serving %s on http://%s:%s (%s, %s); loading %s…", names, host, port, auth, cors, models.default.name)
    try:
        models.preload(models.default)
        models.start()
        app.ready = True
        if app.batches is not None:
            app.batches.start()  # unfinished batches resume now that a model is there to answer them
        log.info("ready (Ctrl-C to stop)")
        stop.wait()
    finally:
        log.info("shutting down: no new requests, %g s for those in flight", settings.grace_s)
        if app.batches is not None:
            app.batches.close()  # lines running end unanswered: the next start runs them again
        server.shutdown()
        if not server.drain(settings.grace_s):
            log.warning("requests still running after the grace period are cancelled")
        models.close()  # each engine owns its backend: freed once its thread has ended
        on_close()
        server.server_close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0
