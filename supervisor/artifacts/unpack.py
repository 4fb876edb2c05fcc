"""Unpack a source tarball without letting it write anywhere but the target folder.

Every member is checked BEFORE anything is written, so a refused archive leaves nothing behind:
no absolute paths, no ``..`` that climbs out, no symlink or hardlink whose target lies outside, no
device files or FIFOs. Extraction then also runs through tarfile's ``data`` filter (which drops
setuid bits and would catch anything this check missed), but the error a user sees is ours.

Python 3.11.0-3.11.3 (Debian 12's python3 is 3.11.2) have no extraction filters at all: no
``extractall(filter=...)``, no ``tarfile.data_filter``, no ``tarfile.FilterError``. There the checked
members are extracted as sanitised copies doing what the ``data`` filter would do for an archive that
passed our checks: no setuid/setgid/sticky bits, no group/other write bits, owned by whoever unpacks
(never the archive's uid/gid, which root would otherwise apply).
"""

from __future__ import annotations

import copy
import os
import posixpath
import stat
import tarfile
from pathlib import Path

from supervisor.errors import CheckFailed


class UnsafeArchive(CheckFailed):
    pass


class _NoFilters(Exception):
    """Stands for ``tarfile.FilterError`` where tarfile has none; never raised."""


def _inside(name: str) -> bool:
    """True when a relative POSIX path, normalised, stays inside the folder it is relative to."""
    if name.startswith("/") or (len(name) > 1 and name[1] == ":"):
        return False
    norm = posixpath.normpath(name)
    return norm != ".." and not norm.startswith("../")


def check_member(member: tarfile.TarInfo) -> None:
    name = member.name
    if name.startswith("/"):
        raise UnsafeArchive(f"refusing archive member with an absolute path: {name!r}")
    if not _inside(name):
        raise UnsafeArchive(f"refusing archive member that would land outside the target folder: {name!r}")
    if member.issym():
        target = member.linkname
        resolved = posixpath.join(posixpath.dirname(name), target)
        if target.startswith("/") or not _inside(resolved):
            raise UnsafeArchive(f"refusing symlink {name!r} pointing outside the target folder: {target!r}")
    elif member.islnk():
        # Hardlink targets are archive paths, relative to the archive root.
        if not _inside(member.linkname):
            raise UnsafeArchive(
                f"refusing hardlink {name!r} to a file outside the target folder: {member.linkname!r}"
            )
    elif not (member.isfile() or member.isdir()):
        raise UnsafeArchive(f"refusing special file (device, FIFO or unknown type) in archive: {name!r}")


def has_filters() -> bool:
    """True when this Python's tarfile has extraction filters (3.11.4+, 3.12+)."""
    return hasattr(tarfile, "data_filter")


def sanitised(member: tarfile.TarInfo) -> tarfile.TarInfo:
    """A copy of a checked member with what the ``data`` filter would change, for Pythons without it."""
    out = copy.copy(member)
    mode = out.mode & ~(stat.S_ISUID | stat.S_ISGID | stat.S_ISVTX | stat.S_IWGRP | stat.S_IWOTH)
    if out.isfile() or out.islnk():
        # As the data filter: files are readable and writable by their owner, and executable by
        # group and others only if by the owner.
        if not mode & stat.S_IXUSR:
            mode &= ~(stat.S_IXGRP | stat.S_IXOTH)
        mode |= stat.S_IRUSR | stat.S_IWUSR
    out.mode = mode
    out.uid, out.gid = os.geteuid(), os.getegid()
    out.uname = out.gname = ""
    return out


def safe_extract(tarball: Path, dest: Path) -> None:
    """Extract ``tarball`` (any compression tarfile knows) into ``dest``, which must be empty or new."""
    dest.mkdir(parents=True, exist_ok=True)
    # Looked up here, not at import: on a Python without filters the name does not exist.
    filter_error: type[Exception] = getattr(tarfile, "FilterError", _NoFilters)
    try:
        with tarfile.open(tarball) as tar:
            members = tar.getmembers()
            for member in members:
                check_member(member)
            if has_filters():
                tar.extractall(dest, members=members, filter="data")
            else:
                # Every member passed check_member above and is sanitised here.
                tar.extractall(dest, members=[sanitised(m) for m in members])  # noqa: S202
    except filter_error as exc:
        raise UnsafeArchive(f"refusing archive {tarball.name}: {exc}") from None
    except (tarfile.TarError, EOFError, OSError) as exc:
        raise CheckFailed(f"cannot unpack {tarball}: {exc}") from None
