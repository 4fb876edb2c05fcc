"""The public listener: bound before anything slow, served by a uvicorn that leaves signals to the daemon.

Its own module because both the daemon (the proxy's port) and observability (the metrics port) use it.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator

import uvicorn


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: the daemon decides what a signal means."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def bind_listener(host: str, port: int) -> socket.socket:
    """Bind the public port before anything slow happens, so 'port in use' fails in a second."""
    from supervisor.errors import StartupError

    sock: socket.socket | None = None
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as exc:
        if sock is not None:
            sock.close()
        raise StartupError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.setblocking(False)
    return sock
