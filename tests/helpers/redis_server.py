"""A real redis-server for a test: Debian's binary on a free port, no persistence (``--save ''
--appendonly no``), in a folder of the test's own, tied to the test process (``popen_tied``: the kernel
SIGKILLs it when pytest dies, even by SIGKILL) and stopped when the fixture ends. ``kill`` SIGKILLs it
and ``restart`` brings it back on the same port, empty, as a crashed Redis comes back."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

from supervisor.child.spawn import free_port, popen_tied, port_open, stop_popen
from tests.helpers.system import require_tool

START_TIMEOUT_S = 20.0


class RedisServer:
    def __init__(self, folder: Path, port: int | None = None, binary: str | None = None) -> None:
        # A test declares the tool (``needs_tool``); a benchmark passes the binary it found.
        self.binary = binary or require_tool("redis-server")
        self.folder = folder
        self.port = port or free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        folder.mkdir(parents=True, exist_ok=True)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        log = (self.folder / "redis.log").open("ab")
        self.proc = popen_tied(
            [
                self.binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.folder),
                "--protected-mode",
                "yes",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        log.close()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not port_open(self.port):
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"redis-server exited {self.proc.returncode}: see {self.folder / 'redis.log'}"
                )
            if time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not listen on {self.port} within {START_TIMEOUT_S:g} s")
            time.sleep(0.02)
        return self

    def kill(self) -> None:
        """SIGKILL, as a crash: no shutdown, no goodbye to clients."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def restart(self) -> None:
        self.kill()
        self.start()

    def stop(self) -> None:
        if self.proc is not None:
            stop_popen(self.proc, 5.0)
