"""A tiny HTTP server on a loopback port answering GETs with JSON, standing in for a daemon in tests of
commands that only read it (``llamagate status``)."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

# path -> (status, JSON body)
Answer = Callable[[str], tuple[int, Any]]


@contextmanager
def json_stub(answer: Answer) -> Iterator[int]:
    """Serve ``answer`` until the block ends; yields the port."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            status, payload = answer(self.path)
            body = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)
