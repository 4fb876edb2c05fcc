from __future__ import annotations

import io
import os
import tarfile
import types
from pathlib import Path
from typing import Any

import pytest

from supervisor.artifacts import unpack
from supervisor.artifacts.unpack import UnsafeArchive, safe_extract
from supervisor.errors import CheckFailed


def _tar(path: Path, members: list[tarfile.TarInfo]) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for m in members:
            data = b"x" * m.size if m.isfile() else None
            tar.addfile(m, io.BytesIO(data) if data is not None else None)
    return path


def _file(name: str, size: int = 3) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size = size
    return info


def _link(name: str, target: str, kind: bytes) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = target
    return info


def test_a_normal_tree_with_inside_links_is_extracted(tmp_path: Path) -> None:
    tb = _tar(
        tmp_path / "ok.tar.gz",
        [
            _file("top/a.txt"),
            _link("top/sub/l", "../a.txt", tarfile.SYMTYPE),
            _link("top/h", "top/a.txt", tarfile.LNKTYPE),
        ],
    )
    dest = tmp_path / "out"
    safe_extract(tb, dest)
    assert (dest / "top/a.txt").read_bytes() == b"xxx"
    assert (dest / "top/sub/l").read_bytes() == b"xxx"
    assert (dest / "top/h").read_bytes() == b"xxx"


def test_dotdot_member_is_refused_and_nothing_is_written(tmp_path: Path) -> None:
    # A good member comes first: the check runs over every member before anything is written.
    tb = _tar(tmp_path / "evil.tar.gz", [_file("top/a.txt"), _file("top/../../escaped.txt")])
    dest = tmp_path / "work" / "out"
    with pytest.raises(UnsafeArchive, match=r"outside the target folder: 'top/../../escaped.txt'"):
        safe_extract(tb, dest)
    assert not (tmp_path / "work" / "escaped.txt").exists()
    assert not (tmp_path / "escaped.txt").exists()
    assert list(dest.iterdir()) == []


@pytest.mark.parametrize(
    ("member", "message"),
    [
        (_file("/etc/evil"), "absolute path"),
        (_file(".."), "outside the target folder"),
        (_link("top/l", "/etc/passwd", tarfile.SYMTYPE), "symlink 'top/l' pointing outside"),
        (_link("top/l", "../../x", tarfile.SYMTYPE), "symlink 'top/l' pointing outside"),
        (_link("top/h", "../x", tarfile.LNKTYPE), "hardlink 'top/h'"),
        (_link("top/dev", "", tarfile.CHRTYPE), "special file"),
        (_link("top/fifo", "", tarfile.FIFOTYPE), "special file"),
    ],
)
def test_unsafe_members_are_refused(tmp_path: Path, member: tarfile.TarInfo, message: str) -> None:
    tb = _tar(tmp_path / "evil.tar.gz", [_file("top/a.txt"), member])
    dest = tmp_path / "out"
    with pytest.raises(UnsafeArchive, match=message):
        safe_extract(tb, dest)
    assert list(dest.iterdir()) == []


def test_a_file_that_is_not_a_tarball_is_a_clear_error(tmp_path: Path) -> None:
    bogus = tmp_path / "x.tar.gz"
    bogus.write_bytes(b"not a tarball")
    with pytest.raises(Exception, match="cannot unpack"):
        safe_extract(bogus, tmp_path / "out")


# --- Python 3.11.0-3.11.3 (Debian 12's python3 is 3.11.2): tarfile without extraction filters.


def _no_filter(member: tarfile.TarInfo, dest_path: str) -> tarfile.TarInfo:
    return member


class _TarFileWithoutFilters(tarfile.TarFile):
    """3.11.2's TarFile, on 3.11.2 and on any newer Python.

    Where tarfile has filters, ``extractall()`` called without ``filter=`` applies the class's
    ``extraction_filter`` (unset: a DeprecationWarning on 3.12-3.13, the ``data`` filter from 3.14); one
    that returns every member unchanged makes it extract as 3.11.2 does, without the stand-in ever
    passing ``filter=`` (which 3.11.2 does not have). 3.11.2 knows no ``extraction_filter`` and ignores it.
    """

    extraction_filter = staticmethod(_no_filter)

    def extractall(  # type: ignore[override]
        self, path: Any = ".", members: Any = None, *, numeric_owner: bool = False
    ) -> None:
        """3.11.2's signature: no ``filter`` argument (passing one is a TypeError), no filtering."""
        super().extractall(path, members, numeric_owner=numeric_owner)


_FILTER_NAMES = {"data_filter", "tar_filter", "fully_trusted_filter", "FilterError"}


@pytest.fixture
def old_tarfile(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    fake = types.ModuleType("tarfile")
    for name in dir(tarfile):
        if name not in _FILTER_NAMES and not name.endswith("FilterError"):
            setattr(fake, name, getattr(tarfile, name))
    fake.open = _TarFileWithoutFilters.open  # type: ignore[attr-defined]
    fake.TarFile = _TarFileWithoutFilters  # type: ignore[attr-defined]
    monkeypatch.setattr(unpack, "tarfile", fake)
    assert not unpack.has_filters()
    return fake


def test_without_tarfile_filters_a_normal_tree_is_extracted(
    old_tarfile: types.ModuleType, tmp_path: Path
) -> None:
    suid = _file("top/suid")
    suid.mode = 0o4777
    tb = _tar(
        tmp_path / "ok.tar.gz",
        [
            _file("top/a.txt"),
            suid,
            _link("top/sub/l", "../a.txt", tarfile.SYMTYPE),
            _link("top/h", "top/a.txt", tarfile.LNKTYPE),
        ],
    )
    dest = tmp_path / "out"
    safe_extract(tb, dest)
    assert (dest / "top/a.txt").read_bytes() == b"xxx"
    assert (dest / "top/sub/l").read_bytes() == b"xxx"
    assert (dest / "top/h").read_bytes() == b"xxx"
    # What the data filter would have done: no setuid bit, no group/other write.
    assert (dest / "top/suid").stat().st_mode & 0o7777 == 0o755
    assert (dest / "top/a.txt").stat().st_uid == os.geteuid()


@pytest.mark.parametrize(
    ("member", "message"),
    [
        (_file("/etc/evil"), "absolute path"),
        (_file("top/../../escaped.txt"), "outside the target folder"),
        (_link("top/l", "/etc/passwd", tarfile.SYMTYPE), "symlink 'top/l' pointing outside"),
        (_link("top/h", "../x", tarfile.LNKTYPE), "hardlink 'top/h'"),
        (_link("top/fifo", "", tarfile.FIFOTYPE), "special file"),
    ],
)
def test_without_tarfile_filters_unsafe_members_are_still_refused(
    old_tarfile: types.ModuleType, tmp_path: Path, member: tarfile.TarInfo, message: str
) -> None:
    tb = _tar(tmp_path / "evil.tar.gz", [_file("top/a.txt"), member])
    dest = tmp_path / "work" / "out"
    with pytest.raises(UnsafeArchive, match=message):
        safe_extract(tb, dest)
    assert list(dest.iterdir()) == []
    assert not (tmp_path / "escaped.txt").exists()


def test_without_tarfile_filters_a_corrupt_tarball_is_a_clear_error(
    old_tarfile: types.ModuleType, tmp_path: Path
) -> None:
    bogus = tmp_path / "x.tar.gz"
    bogus.write_bytes(b"not a tarball")
    with pytest.raises(CheckFailed, match="cannot unpack") as info:
        safe_extract(bogus, tmp_path / "out")
    assert not isinstance(info.value, UnsafeArchive)
