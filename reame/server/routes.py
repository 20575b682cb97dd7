"""The route table: a path (or a path prefix), the methods it answers, whether it needs an API key, and its
handler `(app, handler, path)`. The App answers 404 for a path no route has, 401 for a route that needs a key
the request lacks, and 405 (with Allow) for a method it does not answer, before any handler runs."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Route:
    path: str
    methods: tuple[str, ...]
    handler: Callable[..., None]
    prefix: bool = False  # matches every path starting with `path` (the rest names a resource)
    public: bool = False  # answered without a key: nothing behind it is secret
    error_body: Callable[[Any], dict[str, Any]] | None = None  # the API family's error shape (None: OpenAI's)
    multipart: bool = False  # takes a multipart/form-data body (an upload) as well as JSON


class Router:
    def __init__(self, routes: Sequence[Route]) -> None:
        self.routes = list(routes)
        self._exact = {route.path: route for route in routes if not route.prefix}
        self._prefixed = sorted((route for route in routes if route.prefix), key=lambda route: -len(route.path))

    def find(self, path: str) -> tuple[Route | None, str]:
        """The route for `path` and the path as that route knows it. OpenAI's routes answer without their
        /v1 too, as llama-server's do: a client whose base_url lacks it keeps working."""
        for candidate in (path, "/v1" + path) if not path.startswith("/v1/") else (path,):
            route = self._exact.get(candidate) or next(
                (route for route in self._prefixed if candidate.startswith(route.path)), None)
            if route is not None:
                return route, candidate
        return None, path
