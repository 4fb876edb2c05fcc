"""The states root: every conversation-states folder's life, from its name to its removal.

``ROOT/ALIAS-IDENTITY16`` is one identity's folder (``StateRoot.folder``); its files and their index are
``proxy.conversations.disk.StateDir``'s. Other processes share the root: a second daemon on the host (another
config, a ``llamagate bench`` run, a test), replicas on a shared volume. So a folder is never removed
while anyone uses it, and never removed by its own user's neighbours in the middle of a restart.

The life of a folder:
- **made**: ``Hold.take`` (or ``make`` for a folder not held yet) makes it 0700, its missing parents too;
- **held**: a daemon that serves the identity holds a shared ``flock`` on the lock file ``.held`` inside
  it for its life (``Hold``). Shared: replicas of one identity, on one host or on a shared volume, hold
  one folder together. The kernel drops the lock when the process dies: a crashed daemon holds nothing;
- **released**: a reload that no longer serves the identity (``Hold.release``), or the daemon's exit;
- **swept**: ``StateRoot.sweep`` (at a daemon's start: the alias's folders of other identities) and
  ``StateRoot.remove`` (a reload's drop) remove a folder only when nobody holds it (an exclusive lock
  taken without waiting) and it was last used more than ``grace_s`` ago (``GRACE_S``): a daemon between
  two runs (a restart, an upgrade, a reboot) finds its states again. Its last use is the later of the
  lock file's mtime (touched at every hold, spawn and release) and the folder's (every save renames a
  file into it);
- **lost**: the folder was removed under its holder anyway (by hand, ``rm -rf``): ``Hold.intact`` is
  false, and the holder's next ``Hold.take`` makes it again (**made again**) and says what was lost.

The race between a sweeper and a new holder: the sweeper holds the exclusive lock only while it checks
and renames the folder aside (``.removing-*``, on the same file system: atomic), then deletes the renamed
tree without any lock. A holder that opened the lock file just before waits on its shared lock, gets it
on a file no longer at the folder's path, sees that (``_same``: the path's inode against the open file's)
and starts again on a new folder. A holder that got its shared lock first makes the sweeper's
non-blocking exclusive lock fail: the folder stays.

Blocking work (the shared lock waits out a sweeper's rename, microseconds): callers on an event loop run
these in a thread.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import secrets
import shutil
import stat
import time
from collections.abc import Callable
from pathlib import Path

from proxy.conversations.disk import StateDir, StateDirError, check_private
from proxy.source import SlotStates

_log = logging.getLogger("llamagate.proxy")

LOCK_FILE = ".held"
# A folder nobody holds is kept this long after its last use: a daemon restarted, upgraded or rebooted
# within a day finds its conversations again; an identity nobody serves costs at most its budget
# (``llama.state_disk_mib``, 4 GiB by default) for one day.
GRACE_S = 24 * 3600.0
_ASIDE = ".removing-"
_IDENTITY_CHARS = 16  # the identity digest's hex prefix in a folder's name
# A holder that finds its folder swept away between opening its lock file and locking it starts again;
# three sweeps of one folder in a row would take three other daemons' starts in the same milliseconds.
_TAKE_ATTEMPTS = 3


def make_private(path: Path) -> None:
    """``path`` as a folder only this user can enter (made 0700 with its missing parents); refused when
    it is a link, not a folder, or another user's (``StateDirError``); ``FileNotFoundError`` when it
    was removed again meanwhile."""
    missing = [p for p in (path, *path.parents) if not p.exists()]
    for folder in reversed(missing):  # parents first, each 0700 (``mkdir(parents=True)`` uses the umask)
        folder.mkdir(mode=0o700, exist_ok=True)
    check_private(path)


class Hold:
    """One process's shared lock on one folder, held until ``release`` (or the process's end)."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd: int | None = fd

    @classmethod
    def take(cls, path: Path) -> Hold:
        """Make ``path`` if it is missing and hold it. Raises ``OSError``/``StateDirError`` when it cannot
        be made or is not ours."""
        for _ in range(_TAKE_ATTEMPTS):
            try:
                make_private(path)
                fd = os.open(path / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            except FileNotFoundError:  # swept between the mkdir and the open
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_SH)  # waits while a sweeper checks and renames (microseconds)
                if _same(fd, path):
                    os.utime(fd)  # its last use
                    return cls(path, fd)
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)  # locked a file a sweeper had just moved aside: the folder is made again
        raise StateDirError(f"{path} was removed {_TAKE_ATTEMPTS} times while being held")

    @property
    def held(self) -> bool:
        return self._fd is not None

    def intact(self) -> bool:
        """The folder at ``path`` is still the one held (not removed, not replaced)."""
        return self._fd is not None and _same(self._fd, self.path)

    def touch(self) -> None:
        """Mark the folder as used now (the grace period counts from its last use)."""
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.utime(self._fd)

    def release(self) -> None:
        """Let go (the grace period starts now)."""
        fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.utime(fd)
            os.close(fd)  # closing the last descriptor of the open file drops the lock


class StateRoot:
    """The folders under one root (``llama.state_dir``): their names, what they hold, their removal."""

    def __init__(
        self, path: Path, *, grace_s: float = GRACE_S, clock: Callable[[], float] = time.time
    ) -> None:
        self.path = path
        self.grace_s = grace_s
        self._clock = clock

    def folder(self, alias: str, identity: str) -> Path:
        """The folder of ``alias``'s states under ``identity`` (created by nothing here)."""
        return self.path / f"{alias}-{identity[:_IDENTITY_CHARS]}"

    @staticmethod
    def alias_of(folder: Path) -> str:
        """The alias a folder is named for (``folder``'s inverse)."""
        return folder.name[: -1 - _IDENTITY_CHARS]

    @staticmethod
    def held(states: SlotStates) -> tuple[int, int]:
        """The states the folder's records name and their bytes: the same count as ``StateDir.files``
        and ``StateDir.bytes``; (0, 0) when the folder is missing or unusable."""
        try:
            index = StateDir(states, read_only=True)
        except (OSError, StateDirError):
            return 0, 0
        return index.files, index.bytes

    def sweep(self, alias: str, keep: Path | None) -> list[Path]:
        """Remove ``alias``'s folders other than ``keep`` that nobody holds and nobody used within the
        grace period (identities no longer served); the folders removed. Only folders named for the model
        are touched, and leftovers of an interrupted removal."""
        try:
            paths = sorted(self.path.iterdir())
        except FileNotFoundError:
            return []
        removed = []
        for path in paths:
            name = path.name
            if name.startswith(_ASIDE):
                _rmtree(path)  # a sweeper that died between its rename and its removal
                continue
            ours = name.startswith(alias + "-") and len(name) == len(alias) + 1 + _IDENTITY_CHARS
            if ours and path != keep and self.remove(path):
                removed.append(path)
        return removed

    def remove(self, folder: Path) -> bool:
        """Remove ``folder`` when nobody holds it and it was last used more than the grace period ago;
        whether it was removed."""
        try:
            info = os.lstat(folder)
        except FileNotFoundError:
            return False
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
            return False  # a link, a file, another user's: never ours to remove
        try:
            fd, made = _lock_file(folder)
        except OSError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # BlockingIOError: held, in use by a daemon (this one included)
            os.close(fd)
            return False
        try:
            # A lock file made just now says nothing of the folder's use: its mtime (taken before) does.
            used = info.st_mtime if made else max(os.lstat(folder).st_mtime, os.fstat(fd).st_mtime)
            idle = self._clock() - used
            if idle < self.grace_s:
                if made:  # leave it as found, or its next sweep would count its use from now
                    (folder / LOCK_FILE).unlink()
                    os.utime(folder, ns=(info.st_atime_ns, info.st_mtime_ns))
                _log.info(
                    "conversation states of an identity not served here kept: used recently",
                    extra={"fields": {"folder": str(folder), "idle_s": round(idle), "grace_s": self.grace_s}},
                )
                return False
            aside = folder.with_name(f"{_ASIDE}{folder.name}-{secrets.token_hex(4)}")
            folder.rename(aside)  # the name is free at once: a new holder makes a fresh folder
        except OSError:
            return False
        finally:
            os.close(fd)
        _rmtree(aside)
        _log.info(
            "conversation states of an identity no longer served removed",
            extra={"fields": {"folder": str(folder), "idle_s": round(idle)}},
        )
        return True


def _lock_file(folder: Path) -> tuple[int, bool]:
    """The folder's lock file, open, and whether it was made now. A sweeper makes a missing one, so
    that a holder making it at the same moment meets the sweeper's lock, never a rename it cannot see."""
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
    for _ in range(2):
        try:
            return os.open(folder / LOCK_FILE, flags), False
        except FileNotFoundError:
            pass
        try:
            return os.open(folder / LOCK_FILE, flags | os.O_CREAT | os.O_EXCL, 0o600), True
        except FileExistsError:  # a holder made it meanwhile: lock that one
            continue
    raise BlockingIOError(f"{folder / LOCK_FILE} changes under us")


def _same(fd: int, path: Path) -> bool:
    """``fd`` is the lock file now at ``path`` (the folder was not swept or replaced since it was opened)."""
    try:
        at_path = (path / LOCK_FILE).lstat()
    except OSError:
        return False
    held = os.fstat(fd)
    return (held.st_dev, held.st_ino) == (at_path.st_dev, at_path.st_ino)


def _rmtree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
