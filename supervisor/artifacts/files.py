"""Checks of the files llamagate serves: sha256 of binaries and models, and the GGUF magic.

Hashing a 2 GB model takes seconds, so ``sha256_file`` remembers digests in ``<cache>/hashes.json``,
keyed by the resolved path and trusted only while (size, mtime_ns, inode) are unchanged: a daemon
restart then costs a ``stat``, not a re-hash. A file rewritten in place gets a new mtime; a file that
is replaced gets a new inode. Someone who edits a file and then resets its mtime defeats the cache,
which is why ``verify`` hashes the binary fresh (``sha256_fresh``; 15 MB is cheap).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import re
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from supervisor.errors import CheckFailed, DigestMismatch, NotAGguf, UsageError
from supervisor.paths import cache_root, new_file_mode

log = logging.getLogger("llamagate.artifacts")

GGUF_MAGIC = b"GGUF"
HASH_CACHE_NAME = "hashes.json"
_SHA256 = re.compile(r"[0-9a-f]{64}")
_CHUNK = 1 << 20


def is_sha256(value: str) -> bool:
    return bool(_SHA256.fullmatch(value))


def sha256_fresh(path: Path, *, on_bytes: Callable[[int], None] | None = None) -> str:
    """Hash a file from disk, no cache. ``on_bytes`` gets the running byte count (for progress)."""
    digest = hashlib.sha256()
    done = 0
    with path.open("rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
            done += len(chunk)
            if on_bytes is not None:
                on_bytes(done)
    return digest.hexdigest()


def sha256_file(path: Path, *, cache: Path | None = None) -> str:
    """sha256 of ``path``, remembered under the cache root (default: llamagate's cache)."""
    root = cache if cache is not None else cache_root()
    resolved = path.resolve()
    st = resolved.stat()
    key = str(resolved)
    stamp = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "inode": st.st_ino}
    entry = _load(root).get(key)
    if isinstance(entry, dict) and all(entry.get(k) == v for k, v in stamp.items()):
        cached = entry.get("sha256")
        if isinstance(cached, str) and is_sha256(cached):
            return cached
    digest = sha256_fresh(resolved)
    # Store only if the file did not change while we read it.
    after = resolved.stat()
    if (after.st_size, after.st_mtime_ns, after.st_ino) == (st.st_size, st.st_mtime_ns, st.st_ino):
        _remember(root, key, {**stamp, "sha256": digest})
    return digest


def check_gguf(path: Path) -> None:
    """Refuse anything that is not a readable file starting with the GGUF magic."""
    if not path.exists():
        raise CheckFailed(f"model file not found: {path}")
    if path.is_dir():
        raise CheckFailed(f"model path is a directory, not a GGUF file: {path}")
    try:
        with path.open("rb") as fh:
            head = fh.read(4)
    except OSError as exc:
        raise CheckFailed(f"model file unreadable: {path}: {exc}") from None
    if head != GGUF_MAGIC:
        raise NotAGguf(
            f"not a GGUF model file: {path} (starts with {head!r}, a GGUF file starts with {GGUF_MAGIC!r})"
        )


def verify_model(path: Path, expected_sha256: str, *, cache: Path | None = None) -> str:
    """Check the magic, then the sha256. Returns the digest; raises NotAGguf or DigestMismatch."""
    expected = expected_sha256.strip().lower()
    if not is_sha256(expected):
        raise UsageError(f"expected model sha256 must be 64 hex characters, got {expected_sha256!r}")
    check_gguf(path)
    found = sha256_file(path, cache=cache)
    if found != expected:
        raise DigestMismatch(f"model {path}", expected, found)
    return found


def _cache_file(root: Path) -> Path:
    return root / HASH_CACHE_NAME


def _load(root: Path) -> dict[str, Any]:
    try:
        data = json.loads(_cache_file(root).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _remember(root: Path, key: str, entry: dict[str, Any]) -> None:
    """Read-modify-write under a file lock, replace atomically. The cache is an optimisation:
    failing to write it (read-only cache, full disk) is logged and otherwise ignored."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        with (root / f"{HASH_CACHE_NAME}.lock").open("a") as lock_fh:
            fcntl.flock(lock_fh, fcntl.LOCK_EX)
            data = _load(root)
            # Drop entries of files that are gone, so the cache does not grow without bound.
            data = {k: v for k, v in data.items() if Path(k).exists()}
            data[key] = entry
            fd, tmp = tempfile.mkstemp(prefix=f".{HASH_CACHE_NAME}.", suffix=".tmp", dir=root)
            try:
                # Readable like any new file (mkstemp makes 0600): see paths.new_file_mode.
                os.fchmod(fd, new_file_mode())
                with os.fdopen(fd, "w", encoding="utf-8") as fh:
                    json.dump(data, fh, indent=1, sort_keys=True)
                Path(tmp).replace(_cache_file(root))
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
    except OSError as exc:
        log.debug("hash cache not written", extra={"fields": {"root": str(root), "error": str(exc)}})
