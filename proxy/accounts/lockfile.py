"""One daemon per store file: an exclusive ``flock`` on ``<store>.lock`` for the daemon's life.

Why refuse a second daemon instead of sharing: each daemon counts budget windows in memory and writes
them in batches, so two daemons on one file would each see only their own requests and a tenant's
budget would silently double; sharing limits across replicas is the Redis issue's job. Commands
(``llamagate keys``, ``usage``) take no lock: SQLite's WAL lets them read and write beside the daemon.
The kernel drops the lock when the daemon exits however it exits (SIGKILL included), so a stale lock
file never blocks a restart; the file is left in place (removing it would race with a starting daemon).
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from proxy.accounts.store import StoreError


def lock_path(store: Path) -> Path:
    return store.with_name(store.name + ".lock")


class DaemonLock:
    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd: int | None = fd

    @classmethod
    def acquire(cls, store: Path) -> DaemonLock:
        path = lock_path(store)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)  # not inherited by children (O_CLOEXEC)
        except OSError as exc:
            raise StoreError(f"{path}: cannot open the store's lock file: {exc.strerror or exc}") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "unknown"
            os.close(fd)
            raise StoreError(
                f"{store}: in use by another llamagate daemon (pid {holder}); one daemon per store "
                "file: give each daemon its own store.path"
            ) from None
        except OSError as exc:
            os.close(fd)
            raise StoreError(f"{path}: cannot lock: {exc.strerror or exc}") from exc
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        return cls(path, fd)

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None
