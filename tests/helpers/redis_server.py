"""A real redis-server for a test (and for the benchmarks in tests/benchmarks/): Debian's binary on a free
port on loopback, no persistence (``--save '' --appendonly no``), in a folder of its own, tied to this
process (``child.spawn.popen_tied``: the kernel SIGKILLs it when this process dies, even by SIGKILL), and
stopped by the fixture that started it.

The binary is the test's declared tool (``needs_tool("redis-server")``) unless a benchmark passes the one
it found. The crash controls are for tests: ``kill`` SIGKILLs it (a crash) and ``start`` again brings it
back on the same port, empty, as a crashed Redis comes back.

Test servers live here, not in the wheel: ``llamagate bench scaleout --compare limits`` takes the
operator's Redis (``--redis-url``) instead of starting one (tests/unit/test_wheel_starts_no_servers.py)."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

from supervisor.child.spawn import free_port, popen_tied, port_open, stop_popen
from supervisor.errors import StartupError
from tests.helpers.system import require_tool

START_TIMEOUT_S = 20.0


class RedisServer:
    def __init__(self, folder: Path, port: int | None = None, binary: str | None = None) -> None:
        self.binary = binary or require_tool("redis-server")
        self.folder = folder
        self.port = port or free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        folder.mkdir(parents=True, exist_ok=True)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def start(self) -> RedisServer:
        """Start it and return once it listens; ``StartupError`` when it exits or does not listen."""
        argv = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly"]
        argv += ["no", "--dir", str(self.folder), "--protected-mode", "yes"]
        with (self.folder / "redis.log").open("ab") as log:
            self.proc = popen_tied(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not port_open(self.port):
            if self.proc.poll() is not None:
                raise StartupError(
                    f"redis-server exited {self.proc.returncode}: see {self.folder / 'redis.log'}"
                )
            if time.monotonic() > deadline:
                self.stop()
                raise StartupError(f"redis-server did not listen on {self.port} within {START_TIMEOUT_S:g} s")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        if self.proc is not None:
            stop_popen(self.proc, 5.0)

    def kill(self) -> None:
        """SIGKILL, as a crash: no shutdown, no goodbye to clients."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def restart(self) -> None:
        self.kill()
        self.start()
