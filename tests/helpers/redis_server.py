"""A real redis-server for a test: ``supervisor.bench.redis.RedisServer`` (Debian's binary on a free port,
no persistence, tied to the test process, stopped when the fixture ends), with the binary taken from the
test's declared tool (``needs_tool("redis-server")``) unless a benchmark passes the one it found, and
the crash controls only tests use: ``kill`` SIGKILLs it (a crash) and ``start`` again brings it back on
the same port, empty, as a crashed Redis comes back."""

from __future__ import annotations

import signal
from pathlib import Path

from supervisor.bench.redis import RedisServer as _RedisServer
from tests.helpers.system import require_tool


class RedisServer(_RedisServer):
    def __init__(self, folder: Path, port: int | None = None, binary: str | None = None) -> None:
        super().__init__(folder, binary or require_tool("redis-server"), port)

    def kill(self) -> None:
        """SIGKILL, as a crash: no shutdown, no goodbye to clients."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def restart(self) -> None:
        self.kill()
        self.start()
