"""The product's unpack run by a real Python without tarfile extraction filters (Debian 12's python3, 3.11.2).

tests/unit/test_unpack.py stands an old ``tarfile`` in for the real one; a stand-in only proves what it
was written to do (one called the real ``filter=`` argument, which 3.11.2 lacks, and failed there only).
Here ``supervisor.artifacts.unpack.safe_extract`` itself runs in that interpreter, in a subprocess, on
small archives built by this test: a normal tree comes out sanitised as the ``data`` filter would leave
it, an unsafe member is refused before anything is written, a corrupt file is a clear error. Skipped
where no such Python exists (a newer Debian, or a 3.11 with the filters backported).
"""

from __future__ import annotations

import json
import os
import subprocess
import tarfile
from pathlib import Path
from typing import Any

import pytest

from tests.unit.test_unpack import _file, _link, _tar

REPO = Path(__file__).resolve().parents[2]
# Interpreters that may lack tarfile filters; the first one that does is used.
OLD_PYTHONS = ("/usr/bin/python3", "/usr/bin/python3.11")
# supervisor.artifacts.unpack needs only the standard library and supervisor.errors, so the old
# interpreter runs it straight from the checkout, without the virtual environment's packages.
DRIVER = """
import json, sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from supervisor.artifacts.unpack import UnsafeArchive, has_filters, safe_extract
from supervisor.errors import CheckFailed
out = {"version": sys.version.split()[0], "has_filters": has_filters()}
try:
    safe_extract(Path(sys.argv[2]), Path(sys.argv[3]))
    out["outcome"] = "extracted"
except UnsafeArchive as exc:
    out["outcome"], out["message"] = "refused", str(exc)
except CheckFailed as exc:
    out["outcome"], out["message"] = "failed", str(exc)
print(json.dumps(out))
"""


def _python_without_filters() -> str | None:
    for python in OLD_PYTHONS:
        if not Path(python).is_file():
            continue
        probe = subprocess.run(
            [python, "-c", "import sys, tarfile; sys.exit(0 if not hasattr(tarfile, 'data_filter') else 1)"],
            check=False,
        )
        if probe.returncode == 0:
            return python
    return None


@pytest.fixture(scope="module")
def old_python() -> str:
    python = _python_without_filters()
    if python is None:
        pytest.skip(f"no Python without tarfile filters here (looked at {', '.join(OLD_PYTHONS)})")
    return python


def unpack_with(python: str, tarball: Path, dest: Path) -> dict[str, Any]:
    run = subprocess.run(
        [python, "-c", DRIVER, str(REPO), str(tarball), str(dest)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert run.returncode == 0, f"safe_extract crashed on {python}:\n{run.stderr}"
    out: dict[str, Any] = json.loads(run.stdout)
    assert out["has_filters"] is False, out
    return out


def test_a_normal_tree_is_extracted_sanitised(old_python: str, tmp_path: Path) -> None:
    suid = _file("top/suid")
    suid.mode = 0o4777
    foreign = _file("top/foreign")
    foreign.uid, foreign.gid, foreign.uname, foreign.gname = 1234, 1234, "someone", "someone"
    tb = _tar(
        tmp_path / "ok.tar.gz",
        [
            _file("top/a.txt"),
            suid,
            foreign,
            _link("top/sub/l", "../a.txt", tarfile.SYMTYPE),
            _link("top/h", "top/a.txt", tarfile.LNKTYPE),
        ],
    )
    dest = tmp_path / "out"
    out = unpack_with(old_python, tb, dest)
    assert out["outcome"] == "extracted", out
    assert (dest / "top/a.txt").read_bytes() == b"xxx"
    assert (dest / "top/sub/l").read_bytes() == b"xxx"
    assert (dest / "top/h").read_bytes() == b"xxx"
    # What the data filter would have done: no setuid bit, no group/other write, and every file owned
    # by whoever unpacks (as root, tarfile alone would give top/foreign to uid 1234).
    assert (dest / "top/suid").stat().st_mode & 0o7777 == 0o755
    assert (dest / "top/foreign").stat().st_uid == os.geteuid()
    assert (dest / "top/foreign").stat().st_gid == os.getegid()


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
def test_an_unsafe_member_is_refused_and_nothing_is_written(
    old_python: str, tmp_path: Path, member: tarfile.TarInfo, message: str
) -> None:
    tb = _tar(tmp_path / "evil.tar.gz", [_file("top/a.txt"), member])
    dest = tmp_path / "work" / "out"
    out = unpack_with(old_python, tb, dest)
    assert out["outcome"] == "refused", out
    assert message in out["message"]
    assert list(dest.iterdir()) == []
    assert not (tmp_path / "escaped.txt").exists()


def test_a_corrupt_tarball_is_a_clear_error(old_python: str, tmp_path: Path) -> None:
    bogus = tmp_path / "x.tar.gz"
    bogus.write_bytes(b"not a tarball")
    out = unpack_with(old_python, bogus, tmp_path / "out")
    assert out["outcome"] == "failed", out
    assert "cannot unpack" in out["message"]
