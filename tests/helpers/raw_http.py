"""Raw-socket HTTP for tests of the front door: what a client sees when the server answers and hangs up."""

from __future__ import annotations

import socket


def read_until_closed(s: socket.socket) -> bytes:
    """Everything the server sends until it closes (a reset counts as the close)."""
    out = b""
    while True:
        try:
            chunk = s.recv(65536)
        except ConnectionResetError:
            return out
        if not chunk:
            return out
        out += chunk


def status_of(answer: bytes) -> int:
    assert answer.startswith(b"HTTP/1.1 "), answer[:200]
    return int(answer[9:12])
