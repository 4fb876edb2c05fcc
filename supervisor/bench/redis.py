"""A real redis-server for ``llamagate bench scaleout --limits`` and the tests: Debian's binary on a free
port on loopback, no persistence (``--save '' --appendonly no``), in a folder of its own, tied to this
process (``child.spawn.popen_tied``: the kernel SIGKILLs it when this process dies, even by SIGKILL).
The tests' crash controls (kill, restart) are theirs: ``tests/helpers/redis_server.py``."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

from supervisor.child.spawn import free_port, popen_tied, port_open, stop_popen
from supervisor.errors import StartupError

START_TIMEOUT_S = 20.0


def redis_binary() -> str | None:
    """redis-server on PATH or where Debian puts it; None when it is missing."""
    return shutil.which("redis-server") or shutil.which("redis-server", path="/usr/bin:/usr/sbin")


class RedisServer:
    def __init__(self, folder: Path, binary: str, port: int | None = None) -> None:
        self.binary = binary
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


def start_redis(folder: Path) -> RedisServer:
    """A started redis-server in ``folder``; ``StartupError`` naming the package when it is missing."""
    binary = redis_binary()
    if binary is None:
        raise StartupError("redis-server is not installed (Debian: apt-get install redis-server)")
    return RedisServer(folder, binary).start()
