"""A real, private PostgreSQL server for the store's tests (``postgres_server`` in tests/conftest.py):
Debian's ``initdb`` and ``postgres`` (``/usr/lib/postgresql/VERSION/bin``), a fresh cluster in a folder of
its own, on a free loopback port, tied to this process. Test servers live here, not in the wheel:
``llamagate bench scaleout --compare limits`` takes the operator's PostgreSQL (``--store-url``) instead
of starting one (tests/unit/test_wheel_starts_no_servers.py).

- **Tied.** ``postgres`` is started with ``child.spawn.popen_tied`` (PR_SET_PDEATHSIG: the kernel kills
  it when this process dies, even by SIGKILL); its backends notice the postmaster's death and exit (on
  Linux PostgreSQL arms the same signal for them). ``stop`` asks for a fast shutdown (SIGINT: open
  sessions are ended), then SIGKILL, and removes the folder.
- **Not as root.** PostgreSQL refuses to run as root. As root, the cluster belongs to the ``postgres``
  user (made by Debian's package; ``nobody`` without it), and both programs run as that user:
  ``Popen``'s ``user=`` switches before the tie is set (the kernel clears a parent-death signal when the
  credentials change, so the order matters, and ``popen_tied``'s hook runs after the switch).
- **Fast, not durable.** ``fsync=off`` and friends: a test's database is thrown away with the folder.
  Authentication is ``trust`` for the one superuser, ``llamagate``, on 127.0.0.1 only.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from supervisor.child.spawn import free_port, popen_tied, port_open, stop_popen
from supervisor.errors import StartupError

SUPERUSER = "llamagate"
_LIB = Path("/usr/lib/postgresql")


def postgres_bindir() -> Path | None:
    """Debian's newest PostgreSQL ``bin`` folder (it installs one per major version), else None."""
    if not _LIB.is_dir():
        return None
    found = [p / "bin" for p in _LIB.iterdir() if p.name.isdigit() and (p / "bin" / "postgres").exists()]
    found.sort(key=lambda p: int(p.parent.name), reverse=True)
    return found[0] if found else None


def _run_as() -> dict[str, Any]:
    """``Popen`` arguments that drop root for PostgreSQL's programs; none when not root."""
    if os.geteuid() != 0:
        return {}
    for name in ("postgres", "nobody"):
        try:
            entry = pwd.getpwnam(name)
        except KeyError:
            continue
        return {"user": entry.pw_uid, "group": entry.pw_gid, "extra_groups": []}
    raise StartupError(
        "running as root and neither a 'postgres' nor a 'nobody' user exists to run PostgreSQL"
    )


@dataclass
class Postgres:
    proc: subprocess.Popen[bytes]
    port: int
    folder: Path
    _databases: list[str] = field(default_factory=list)

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://{SUPERUSER}@127.0.0.1:{self.port}/{database}"

    def log_text(self) -> str:
        path = self.folder / "postgres.log"
        return path.read_text(encoding="utf-8", errors="replace") if path.exists() else ""

    def create_database(self, prefix: str = "llamagate") -> str:
        """A new empty database; its URL."""
        import psycopg

        name = f"{prefix}_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        self._databases.append(name)
        return self.url(name)

    def stop(self, grace_s: float = 10.0) -> int | None:
        # SIGINT is PostgreSQL's fast shutdown (SIGTERM's smart shutdown would wait for every client).
        code = stop_popen(self.proc, grace_s, signal.SIGINT)
        shutil.rmtree(self.folder, ignore_errors=True)
        return code


def start_postgres(*, port: int | None = None, ready_timeout_s: float = 60.0) -> Postgres:
    """initdb a fresh cluster in a new folder under the system's temporary folder, start ``postgres`` on
    127.0.0.1, and return once it accepts a connection. ``StartupError`` when it cannot."""
    bindir = postgres_bindir()
    if bindir is None:
        raise StartupError("PostgreSQL is not installed (Debian: apt-get install postgresql)")
    as_user = _run_as()
    # Not under the caller's tmp_path: pytest's folders are 0700 root, which the postgres user cannot enter.
    folder = Path(tempfile.mkdtemp(prefix="llamagate-pg-"))
    data = folder / "data"
    try:
        if as_user:
            os.chown(folder, as_user["user"], as_user["group"])
        log = (folder / "initdb.log").open("wb")
        with log:
            init = popen_tied(
                [bindir / "initdb", "-D", data, "-U", SUPERUSER, "--auth=trust", "-E", "UTF8", "--no-sync"],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=folder,
                **as_user,
            )
            if init.wait(120) != 0:
                raise StartupError(
                    f"initdb failed ({init.returncode}):\n{(folder / 'initdb.log').read_text()[-2000:]}"
                )
        port = port or free_port()
        argv: list[str | Path] = [
            bindir / "postgres",
            "-D",
            data,
            "-p",
            str(port),
            "-k",
            folder,  # the Unix socket here, not in /var/run/postgresql (Debian's own cluster's)
            "-c",
            "listen_addresses=127.0.0.1",
            "-c",
            "fsync=off",
            "-c",
            "synchronous_commit=off",
            "-c",
            "full_page_writes=off",
            "-c",
            "max_connections=100",
            "-c",
            "shared_buffers=16MB",
        ]
        with (folder / "postgres.log").open("wb") as out:
            proc = popen_tied(
                argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, cwd=folder, **as_user
            )
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    server = Postgres(proc, port, folder)
    deadline = time.monotonic() + ready_timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            text = server.log_text()[-2000:]
            server.stop()
            raise StartupError(f"postgres exited with {proc.returncode}:\n{text}")
        if port_open(port) and _accepts(server):
            return server
        time.sleep(0.05)
    server.stop()
    raise StartupError(
        f"postgres did not accept connections on 127.0.0.1:{port} within {ready_timeout_s:g} s"
    )


def _accepts(server: Postgres) -> bool:
    import psycopg

    try:
        with psycopg.connect(server.url(), connect_timeout=2):
            return True
    except psycopg.OperationalError:
        return False  # still starting ("the database system is starting up")
