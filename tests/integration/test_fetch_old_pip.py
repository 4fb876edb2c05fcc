"""The real source fetch with the pip a fresh Debian 12 venv brings (23.0.1), then the real unpack on a
Python without tarfile extraction filters (Debian 12's own python3 is 3.11.2) when the machine has one.

Seen on a fresh Debian 12 machine: ``pip download --progress-bar raw`` failed with pip 23 ("invalid
choice: 'raw'"), and with a newer pip the unpack failed on 3.11.2 (no ``extractall(filter=...)``).
The fetch downloads the pinned 76 MB sdist from the registry (pip's HTTP cache makes a second run quick)
into a private cache folder; nothing is built.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from supervisor.artifacts.fetch import FetchedSource, Pip, fetch_source, find_pip
from supervisor.artifacts.lock import load_lock

pytestmark = [pytest.mark.integration, pytest.mark.network]

REPO = Path(__file__).resolve().parents[2]
DEBIAN_PIP = "23.0.1"
# Interpreters that may lack tarfile filters; the first one that does is used.
OLD_PYTHONS = ("/usr/bin/python3", "/usr/bin/python3.11")


class Recorder:
    def __init__(self) -> None:
        self.details: list[str] = []

    def update(self, stage: str, fraction: float | None, detail: str = "") -> None:
        self.details.append(detail)

    def done(self, stage: str, detail: str = "") -> None:
        self.details.append(detail)


@pytest.fixture(scope="module")
def old_pip(tmp_path_factory: pytest.TempPathFactory) -> Pip:
    venv = tmp_path_factory.mktemp("pip23") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    subprocess.run(
        [python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", f"pip=={DEBIAN_PIP}"],
        check=True,
    )
    return find_pip((python, "-m", "pip"))


@pytest.fixture(scope="module")
def fetched(
    old_pip: Pip, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[FetchedSource, Recorder]]:
    lock = load_lock(REPO / "llama-build.lock")
    rec = Recorder()
    got = fetch_source(lock, root=tmp_path_factory.mktemp("cache"), progress=rec, pip=old_pip)
    yield got, rec


def test_pip_23_fetches_the_sdist_without_compiling_build_dependencies(
    old_pip: Pip, fetched: tuple[FetchedSource, Recorder]
) -> None:
    assert old_pip.version == (23, 0) and not old_pip.raw_progress
    got, rec = fetched
    assert not got.cache_hit
    assert hashlib.sha256(got.tarball.read_bytes()).hexdigest() == got.source.sha256
    assert any(d.startswith("Downloading llama_cpp_python-0.3.36.tar.gz") for d in rec.details), rec.details
    # pip prepared the sdist's metadata with its build dependencies as wheels: nothing was compiled.
    assert any(d.startswith("Preparing metadata") for d in rec.details), rec.details
    assert not [d for d in rec.details if d.startswith("Building wheel")]


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


def test_the_fetched_source_unpacks_on_a_python_without_tarfile_filters(
    fetched: tuple[FetchedSource, Recorder], tmp_path: Path
) -> None:
    python = _python_without_filters()
    if python is None:
        pytest.skip(f"no Python without tarfile filters here (looked at {', '.join(OLD_PYTHONS)})")
    got, _ = fetched
    dest = tmp_path / "src"
    # supervisor.artifacts.unpack needs only the standard library and supervisor.errors.
    code = (
        "import sys; from pathlib import Path; sys.path.insert(0, sys.argv[1]);"
        "from supervisor.artifacts.unpack import safe_extract, has_filters; assert not has_filters();"
        "safe_extract(Path(sys.argv[2]), Path(sys.argv[3]))"
    )
    run = subprocess.run(
        [python, "-c", code, str(REPO), str(got.tarball), str(dest)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    assert (dest / got.source.subdir / "CMakeLists.txt").is_file()
