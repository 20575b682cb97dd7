"""Talking to a server over a raw socket in tests, as a hostile client would."""

from __future__ import annotations

import socket


def until_closed(sock: socket.socket, *parts: bytes) -> bytes:
    """Send `parts` (stopping when the server closes), then read everything until it closes."""
    try:
        for part in parts:
            sock.sendall(part)
    except (BrokenPipeError, ConnectionResetError):
        pass
    got = b""
    try:
        while chunk := sock.recv(65536):
            got += chunk
    except ConnectionResetError:
        pass
    return got
