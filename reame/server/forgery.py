"""Requests a web page could forge. Any page a user visits can make their browser send requests to a server
on 127.0.0.1: a "simple" cross-site POST (text/plain, a form) needs no preflight, and a page whose name
re-resolves to 127.0.0.1 (DNS rebinding) is even same-origin to the browser and reads the answers. A
keyless Reame on loopback, the default, would start a download or unload a model for it.

Three checks close that, before any route runs: the Host header must name this server (loopback names
when it is bound to loopback, `server.allowed_hosts` otherwise), a request a browser marks with an Origin
must come from this server's own origin or the configured CORS origin, and a request body must be declared
JSON (a browser sends that type only after a CORS preflight, which Reame answers only when CORS is on).
An upload route (/v1/files) also takes multipart/form-data, which a form sends without a preflight: there
the Origin check is what refuses a foreign page, and an upload runs nothing by itself."""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from email.message import Message

from reame.server.client import HttpError

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
JSON_TYPE = "application/json"
MULTIPART_TYPE = "multipart/form-data"


def host_name(value: str) -> str:
    """The name of a Host header or an origin's authority, lower case, without port or IPv6 brackets."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1:value.find("]")] if "]" in value else value
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


def is_loopback(host: str) -> bool:
    name = host_name(host)
    if name in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def allowed_hosts(bind_host: str, configured: Iterable[str]) -> frozenset[str] | None:
    """The Host names this server answers to; None = any. Configured names win (`*` = any); a server bound to
    loopback addresses only (`bind_host` lists them, comma-separated) answers to loopback names only (the
    DNS-rebinding hole); one bound elsewhere with no names configured answers to any, its API keys being what
    protects it."""
    names = frozenset(host_name(name) for name in configured if name.strip())
    bound = [host_name(host) for host in bind_host.split(",") if host.strip()]
    loopback = {host for host in bound if is_loopback(host)}
    if "*" in names:
        return None
    if names:
        return names | loopback
    if bound and len(loopback) == len(bound):
        return LOOPBACK_NAMES | loopback
    return None


def forged(method: str, headers: Message, has_body: bool, hosts: frozenset[str] | None, cors_origin: str,
           multipart: bool = False) -> HttpError | None:
    """Why this request may come from a page the user did not mean to ask, as the error to answer; None if not.
    `multipart`: the route takes uploads as multipart/form-data, which a page's form can send without a
    preflight: such a request still needs the right Host, and its Origin (every browser sends one with a
    form's POST) must be this server's own page or the CORS origin."""
    host = headers.get("Host", "")
    if hosts is not None and host and host_name(host) not in hosts:  # (no Host: not a browser)
        return HttpError(403, f"this server does not answer to the host name {host[:100]!r} (server.allowed_hosts "
                         "lists the names it does)", code="host_not_allowed")
    origin = headers.get("Origin")
    if origin is not None and not same_origin(origin, host) and cors_origin not in ("*", origin.strip()):
        return HttpError(403, f"a request from the web page at {origin[:100]!r} is refused: only this server's "
                         "own page, or server.cors_origin, may call it", code="origin_not_allowed")
    media_type = headers.get("Content-Type", "").split(";", 1)[0].strip().lower()
    if has_body and method != "GET" and media_type != JSON_TYPE and not (multipart and media_type == MULTIPART_TYPE):
        return HttpError(415, f"send the body as JSON with 'Content-Type: application/json' (got "
                         f"{media_type[:100]!r}; curl: -H 'Content-Type: application/json')",
                         code="unsupported_media_type")
    return None


def same_origin(origin: str, host: str) -> bool:
    """Whether `origin` (scheme://authority) is the server the Host header names, as the web page's calls are."""
    scheme, _, authority = origin.strip().lower().partition("://")
    return scheme in ("http", "https") and bool(authority) and authority == host.strip().lower()
