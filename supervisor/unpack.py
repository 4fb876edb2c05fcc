"""Unpack a source tarball without letting it write anywhere but the target folder.

Every member is checked BEFORE anything is written, so a refused archive leaves nothing behind:
no absolute paths, no ``..`` that climbs out, no symlink or hardlink whose target lies outside, no
device files or FIFOs. Extraction then also runs through tarfile's ``data`` filter (which drops
setuid bits and would catch anything this check missed), but the error a user sees is ours.
"""

from __future__ import annotations

import posixpath
import tarfile
from pathlib import Path

from supervisor.errors import CheckFailed


class UnsafeArchive(CheckFailed):
    pass


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


def safe_extract(tarball: Path, dest: Path) -> None:
    """Extract ``tarball`` (any compression tarfile knows) into ``dest``, which must be empty or new."""
    dest.mkdir(parents=True, exist_ok=True)
    try:
        with tarfile.open(tarball) as tar:
            members = tar.getmembers()
            for member in members:
                check_member(member)
            tar.extractall(dest, members=members, filter="data")
    except tarfile.FilterError as exc:
        raise UnsafeArchive(f"refusing archive {tarball.name}: {exc}") from None
    except (tarfile.TarError, EOFError, OSError) as exc:
        raise CheckFailed(f"cannot unpack {tarball}: {exc}") from None
