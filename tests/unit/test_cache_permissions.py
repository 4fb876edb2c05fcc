"""A cache built by root (a container image's build stage) is usable by the unprivileged service user.

The receipt and the hash cache are written atomically through ``mkstemp``, which makes 0600 files:
seen in a real image as ``build receipt unreadable: Permission denied`` for uid 10001. They now get
the mode of any new file (0o666 less the umask), like everything else in the cache.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from supervisor.artifacts.build import ensure_binary
from supervisor.artifacts.files import HASH_CACHE_NAME, sha256_file
from supervisor.paths import new_file_mode, umask
from supervisor.progress import NullProgress
from tests.fakes.toolchain import FakeProject, fake_project

NOBODY = 65534


@pytest.fixture
def with_umask() -> Iterator[Callable[[int], None]]:
    before = os.umask(0o022)
    os.umask(before)

    def set_umask(mask: int) -> None:
        os.umask(mask)

    try:
        yield set_umask
    finally:
        os.umask(before)


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A folder any user may enter (pytest's tmp_path is 0700), removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix="llamagate-perm-"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _build(proj: FakeProject) -> tuple[Path, Path]:
    """Build with the fake toolchain, hash a file through the hash cache; (install folder, hash cache)."""
    installed = ensure_binary(proj.lock, cache=proj.cache, progress=NullProgress())
    sha256_file(proj.tarball, cache=proj.cache)
    return installed.folder, proj.cache / HASH_CACHE_NAME


def test_umask_is_read_without_changing_it(with_umask: Callable[[int], None]) -> None:
    for mask in (0o022, 0o077, 0o002):
        with_umask(mask)
        assert umask() == mask
        assert umask() == mask  # reading it did not reset it
        assert new_file_mode() == 0o666 & ~mask


def test_under_the_usual_umask_receipt_and_hash_cache_are_world_readable(
    with_umask: Callable[[int], None], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with_umask(0o022)
    folder, hashes = _build(fake_project(tmp_path, monkeypatch))
    assert _mode(folder / "receipt.json") == 0o644
    assert _mode(hashes) == 0o644
    assert _mode(folder / "build.log") == 0o644
    assert _mode(folder / "llama-server") == 0o755
    assert _mode(folder) == 0o755


def test_a_private_umask_keeps_them_private(
    with_umask: Callable[[int], None], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with_umask(0o077)
    folder, hashes = _build(fake_project(tmp_path, monkeypatch))
    assert _mode(folder / "receipt.json") == 0o600
    assert _mode(hashes) == 0o600


@pytest.mark.skipif(os.geteuid() != 0, reason="switching to another user needs root")
def test_another_user_can_read_what_root_built(
    with_umask: Callable[[int], None], open_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with_umask(0o022)
    folder, hashes = _build(fake_project(open_dir, monkeypatch))
    for path in (folder / "receipt.json", hashes):
        read = subprocess.run(
            ["/bin/cat", str(path)], user=NOBODY, group=NOBODY, capture_output=True, text=True, check=False
        )
        assert read.returncode == 0, f"{path}: {read.stderr}"
        assert read.stdout == path.read_text()
    run = subprocess.run(
        ["/bin/sh", "-c", f'test -x "{folder / "llama-server"}"'], user=NOBODY, group=NOBODY, check=False
    )
    assert run.returncode == 0
