"""The conversations' states on disk: one private folder per child identity, its files and their index.

A restore reads a file into llama-server's memory, and a crafted state file overflows its heap there
(CVE-2026-43629). So a file is restored only when all of this holds (``StateDir.check``):
- it is in the folder made for the child's identity (``proxy.source.SlotStates``, made and held by
  ``proxy.conversations.root``): 0700, owned by us, reached without following a link; no request ever
  names a path (a file's name is the conversation's key, a hex digest, and the state's own digest);
- its record (``KEY.meta``, written by this program after the child wrote the state) names this
  identity and the requesting conversation's tenant, and the file's sha256 still matches the one recorded
  when it was saved. A file changed on disk, a file written for another model or context (another
  identity: another folder, and the record says so too) and another tenant's conversation's file (its key
  is another tenant's digest, and its record names that tenant) are never restored.

Writes are atomic for any reader, another replica sharing the folder included: the child writes the
state under a temporary name (``saving-*.state``), then the file is hashed, renamed to
``KEY.SHA16.state`` (a name that is never written twice with other bytes), and its record replaced by
rename; the replaced version's file is removed last. A reader that read the old record finds its file
gone at worst: the restore fails and the turn is computed, as on a miss. What is left between the hash
and the child's read (a file swapped in between) needs write access to a folder only this user can
write: the same access that could change the binary.

The budget (``SlotStates.budget_bytes``) holds after every save: while the folder holds more, the least
recently used state of the tenant holding the most bytes goes first, so one tenant's conversations
cannot push out everyone else's: a tenant loses states to another only while it holds more than that
one. Records are re-read from the folder when a key is not known here (a replica saved it) and before
an eviction, so replicas sharing the folder keep one budget between them (each evicting what it sees).

Blocking file work: the tier runs these methods in a thread (``asyncio.to_thread``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import secrets
import stat
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from proxy.source import SlotStates

_log = logging.getLogger("llamagate.proxy")

_KEY = re.compile(r"[0-9a-f]{32}")  # ``proxy.conversations.key``: 128 bits of a digest, in hex
_STATE = ".state"
_META = ".meta"
_TEMP = "saving-"
_FORMAT = 1
# A temporary file older than this is a save that never finished (the daemon died during it); younger
# ones may be another replica's save under way.
_STALE_TEMP_S = 3600.0
# Files are hashed in reads of this size, on the worker threads of ``asyncio.to_thread``. 1 MiB reads made
# the daemon's RSS grow with the saves: glibc raises its mmap threshold to a freed 1 MiB block's size, so
# the later blocks came from each worker thread's own malloc arena, which kept them: 16 hashes of a 10 MB
# file through ``asyncio.to_thread`` grew a process by 8.0 MiB, against 0.3-0.4 MiB in 64 KiB reads (and
# the one-shot benchmark's daemon by +4.0 MiB over its 16 saves, against +1.0 MiB with the tier off).
# A 64 KiB block stays below the default threshold and is reused from the arena's free list; a 10 MB
# state takes 150 reads, well under a millisecond of system calls.
_CHUNK = 64 * 1024


class StateDirError(Exception):
    """The folder cannot be used safely (not ours, not a folder, open to others)."""


@dataclass(frozen=True, slots=True)
class Entry:
    """One saved conversation state, as its record says."""

    key: str
    tenant: str
    file: str  # its name in the folder: KEY.SHA16.state
    sha256: str
    size: int
    tokens: int  # the slot's tokens when it was saved (the child's ``n_saved``)
    used: float  # wall-clock time of its save or last restore: the least recently used goes first


def check_private(path: Path, *, fix: bool = True) -> None:
    """``path`` is a folder only this user can enter (made so when it is open to others, unless not
    ``fix``); refused when it is a link, not a folder, or another user's; ``FileNotFoundError`` when it is
    missing. Folders are made by ``proxy.conversations.root`` (the one owner of their life), never here."""
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode):
        raise StateDirError(f"{path} is not a folder (a link or a file)")
    if info.st_uid != os.getuid():
        raise StateDirError(f"{path} belongs to uid {info.st_uid}, not to this process ({os.getuid()})")
    if info.st_mode & 0o077 and fix:
        path.chmod(0o700)


class StateDir:
    """The states of one identity's folder and their index (kept in memory, the records on disk)."""

    def __init__(
        self, states: SlotStates, clock: Callable[[], float] = time.time, *, read_only: bool = False
    ) -> None:
        """``read_only``: only read the index (``llamagate plan`` and status count it): the folder's mode
        and the leftovers of unfinished saves are left as they are."""
        self.path = Path(states.directory)
        self.identity = states.identity
        self.budget = states.budget_bytes
        self._clock = clock
        check_private(self.path, fix=not read_only)
        self._entries: dict[str, Entry] = {}
        self.rescan()
        if not read_only:
            self._sweep_temps()

    # --- what metrics and status read -------------------------------------------------------------------
    @property
    def bytes(self) -> int:
        return sum(e.size for e in self._entries.values())

    @property
    def files(self) -> int:
        return len(self._entries)

    def tenant_bytes(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for e in self._entries.values():
            out[e.tenant] = out.get(e.tenant, 0) + e.size
        return out

    def known(self, key: str) -> Entry | None:
        """The state of ``key`` as this process last saw it (no file read)."""
        return self._entries.get(key)

    # --- saving -----------------------------------------------------------------------------------------
    def temp_name(self) -> str:
        """A fresh name for the child to save a state under (inside the folder, never an existing file)."""
        return f"{_TEMP}{secrets.token_hex(8)}{_STATE}"

    def commit(self, temp: str, key: str, tenant: str, tokens: int) -> tuple[Entry, list[Entry]]:
        """Make the state the child just wrote under ``temp`` the saved state of ``key`` (of ``tenant``);
        then hold the budget. Returns the new entry and the ones evicted (the new one among them when it
        alone is larger than the budget)."""
        if not _KEY.fullmatch(key):
            raise ValueError("not a conversation key")
        fd = self._open(temp)
        try:
            info = os.fstat(fd)
            digest = _sha256(fd)
            os.fchmod(fd, 0o600)
        finally:
            os.close(fd)
        name = f"{key}.{digest[:16]}{_STATE}"
        (self.path / temp).replace(self.path / name)
        entry = Entry(key, tenant, name, digest, info.st_size, tokens, self._clock())
        old = self._read_meta(key)
        self._write_meta(entry)
        if old is not None and old.file != name:
            self._unlink(old.file)
        self._entries[key] = entry
        return entry, self._hold_budget()

    def discard_temp(self, temp: str) -> None:
        """A save that failed: its temporary file goes."""
        self._unlink(temp)

    # --- restoring --------------------------------------------------------------------------------------
    def check(self, key: str, tenant: str) -> tuple[Entry | None, str]:
        """The entry of ``key`` when its file may be restored for ``tenant``, else None; and why not
        ("" when it may, "none" when there is no state). The record is read from the folder (another
        replica may have saved a newer state), the file hashed in full."""
        if not _KEY.fullmatch(key):
            return None, "none"
        entry = self._read_meta(key)
        if entry is None:
            self._entries.pop(key, None)
            return None, "none"
        self._entries[key] = entry
        if entry.tenant != tenant:
            return None, "tenant"  # a key is the tenant's digest: only a forged record gets here
        try:
            fd = self._open(entry.file)
        except FileNotFoundError:
            self._forget(key)
            return None, "none"
        except (OSError, StateDirError):
            self._forget(key)
            return None, "unsafe"
        try:
            changed = os.fstat(fd).st_size != entry.size or _sha256(fd) != entry.sha256
        finally:
            os.close(fd)
        if changed:
            _log.warning(
                "a saved conversation state changed on disk: removed, not restored",
                extra={"fields": {"file": entry.file}},
            )
            self._forget(key)
            return None, "changed"
        return entry, ""

    def touch(self, key: str) -> None:
        """``key`` was restored: the most recently used now (here; other replicas keep their order)."""
        entry = self._entries.get(key)
        if entry is not None:
            self._entries[key] = Entry(**{**asdict(entry), "used": self._clock()})

    def forget(self, key: str, file: str) -> None:
        """Remove ``key``'s state when it is still ``file`` (it failed to restore: never offered again; a
        newer state saved meanwhile, by us or another replica, stays)."""
        entry = self._read_meta(key)
        if entry is None or entry.file == file:
            self._forget(key)

    # --- the folder -------------------------------------------------------------------------------------
    def rescan(self) -> None:
        """Read every record in the folder (at start, and before an eviction: replicas share it)."""
        found: dict[str, Entry] = {}
        for meta in self._names(_META):
            key = meta[: -len(_META)]
            entry = self._read_meta(key)
            if entry is not None:
                old = self._entries.get(key)
                found[key] = entry if old is None or old.file != entry.file else old
        self._entries = found

    def _hold_budget(self) -> list[Entry]:
        if self.bytes <= self.budget:
            return []
        self.rescan()
        evicted = []
        while self._entries and self.bytes > self.budget:
            victim = self._victim()
            self._forget(victim.key)
            evicted.append(victim)
        return evicted

    def _victim(self) -> Entry:
        """The least recently used state of the tenant that holds the most bytes."""
        held = self.tenant_bytes()
        tenant = max(held, key=lambda t: held[t])
        return min((e for e in self._entries.values() if e.tenant == tenant), key=lambda e: e.used)

    def _forget(self, key: str) -> None:
        entry = self._entries.pop(key, None) or self._read_meta(key)
        self._unlink(key + _META)  # the record first: a reader never finds a record without its file
        if entry is not None:
            self._unlink(entry.file)

    def _sweep_temps(self) -> None:
        now = time.time()
        for name in self._names(_STATE) + self._names(_META):
            if name.startswith(_TEMP):
                with contextlib.suppress(OSError):
                    if now - os.lstat(self.path / name).st_mtime > _STALE_TEMP_S:
                        self._unlink(name)

    def _names(self, suffix: str) -> list[str]:
        try:
            return [p.name for p in self.path.iterdir() if p.name.endswith(suffix)]
        except FileNotFoundError:
            return []

    def _open(self, name: str) -> int:
        """A regular file of the folder, opened without following a link."""
        fd = os.open(self.path / name, os.O_RDONLY | os.O_NOFOLLOW)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise StateDirError(f"{name} is not a regular file")
        return fd

    def _unlink(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            (self.path / name).unlink()

    def _read_meta(self, key: str) -> Entry | None:
        """``key``'s record, when it is well formed, of this identity and names a state of ``key``."""
        if not _KEY.fullmatch(key):
            return None
        try:
            fd = self._open(key + _META)
            try:
                raw = os.read(fd, 64 * 1024)
            finally:
                os.close(fd)
            meta = json.loads(raw)
            entry = Entry(
                key=meta["key"],
                tenant=meta["tenant"],
                file=meta["file"],
                sha256=meta["sha256"],
                size=int(meta["bytes"]),
                tokens=int(meta["tokens"]),
                used=float(meta["saved_at"]),
            )
        except (OSError, StateDirError, ValueError, KeyError, TypeError):
            return None
        valid = (
            meta.get("format") == _FORMAT
            and meta.get("identity") == self.identity
            and entry.key == key
            and isinstance(entry.tenant, str)
            and isinstance(entry.sha256, str)
            and entry.file == f"{key}.{entry.sha256[:16]}{_STATE}"
        )
        return entry if valid else None

    def _write_meta(self, entry: Entry) -> None:
        record = {
            "format": _FORMAT,
            "key": entry.key,
            "tenant": entry.tenant,
            "identity": self.identity,
            "file": entry.file,
            "sha256": entry.sha256,
            "bytes": entry.size,
            "tokens": entry.tokens,
            "saved_at": entry.used,
        }
        temp = self.path / f"{_TEMP}{secrets.token_hex(8)}{_META}"
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.write(fd, json.dumps(record).encode())
        finally:
            os.close(fd)
        temp.replace(self.path / (entry.key + _META))


def _sha256(fd: int) -> str:
    digest = hashlib.sha256()
    os.lseek(fd, 0, os.SEEK_SET)
    for chunk in _chunks(fd):
        digest.update(chunk)
    return digest.hexdigest()


def _chunks(fd: int) -> Iterator[bytes]:
    while chunk := os.read(fd, _CHUNK):
        yield chunk
