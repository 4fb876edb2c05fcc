from __future__ import annotations

import functools
import hashlib
import http.server
import json
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from supervisor.artifacts import fetch
from supervisor.artifacts.fetch import Pip, fetch_source, find_pip, pip_download
from supervisor.artifacts.lock import load_lock
from supervisor.errors import FetchError, ToolMissing
from supervisor.progress import NullProgress
from supervisor.subproc import RunResult
from tests.fakes.toolchain import COMMIT, VERSION_LINE, make_source_tarball, write_lock


class Recorder:
    def __init__(self) -> None:
        self.updates: list[tuple[str, float | None, str]] = []

    def update(self, stage: str, fraction: float | None, detail: str = "") -> None:
        self.updates.append((stage, fraction, detail))

    def done(self, stage: str, detail: str = "") -> None:
        self.updates.append((stage, 1.0, "done " + detail))


def _tarball(tmp_path: Path) -> tuple[Path, str]:
    tb = make_source_tarball(tmp_path / "src.tar.gz")
    return tb, hashlib.sha256(tb.read_bytes()).hexdigest()


def _lock_with_sources(path: Path, sources: str) -> Path:
    path.write_text(
        f'format = 1\n[llama_cpp]\ncommit = "{COMMIT}"\nversion_line = "{VERSION_LINE}"\n'
        f'[build]\ntarget = "llama-server"\ncmake_args = []\n{sources}'
    )
    return path


def test_a_source_with_the_wrong_sha256_is_refused_and_nothing_is_kept(tmp_path: Path) -> None:
    tb, right = _tarball(tmp_path)
    wrong = "ab" * 32
    lock = load_lock(write_lock(tmp_path / "l.lock", tb, wrong))
    root = tmp_path / "cache"
    with pytest.raises(FetchError) as info:
        fetch_source(lock, root=root, progress=NullProgress())
    message = str(info.value)
    assert f"expected {wrong}" in message and f"found {right}" in message
    assert "source[0] (file " in message
    assert list((root / "sources").iterdir()) == []  # no tarball, no temp folder


def test_sources_are_tried_in_order(tmp_path: Path) -> None:
    tb, sha = _tarball(tmp_path)
    lock = load_lock(
        _lock_with_sources(
            tmp_path / "l.lock",
            f'[[source]]\nkind = "file"\npath = "missing.tar.gz"\nsha256 = "{sha}"\nsubdir = "x"\n'
            f'[[source]]\nkind = "file"\npath = "{tb}"\nsha256 = "{sha}"\nsubdir = "x"\n',
        )
    )
    got = fetch_source(lock, root=tmp_path / "cache", progress=NullProgress())
    assert got.source is lock.sources[1]
    assert got.tarball == tmp_path / "cache" / "sources" / sha
    assert hashlib.sha256(got.tarball.read_bytes()).hexdigest() == sha


def test_all_sources_failing_lists_every_failure(tmp_path: Path) -> None:
    sha = "cd" * 32
    lock = load_lock(
        _lock_with_sources(
            tmp_path / "l.lock",
            f'[[source]]\nkind = "file"\npath = "a.tgz"\nsha256 = "{sha}"\nsubdir = "x"\n'
            f'[[source]]\nkind = "file"\npath = "b.tgz"\nsha256 = "{sha}"\nsubdir = "x"\n',
        )
    )
    with pytest.raises(FetchError, match=r"(?s)source\[0\].*a.tgz.*source\[1\].*b.tgz"):
        fetch_source(lock, root=tmp_path / "cache", progress=NullProgress())


def test_a_verified_source_is_reused_offline(tmp_path: Path) -> None:
    tb, sha = _tarball(tmp_path)
    lock = load_lock(write_lock(tmp_path / "l.lock", tb, sha))
    root = tmp_path / "cache"
    first = fetch_source(lock, root=root, progress=NullProgress())
    assert not first.cache_hit
    tb.unlink()  # the mirror is gone
    again = fetch_source(lock, root=root, progress=NullProgress())
    assert again.cache_hit and again.tarball == first.tarball


def test_a_corrupted_cached_source_is_fetched_again(tmp_path: Path) -> None:
    tb, sha = _tarball(tmp_path)
    lock = load_lock(write_lock(tmp_path / "l.lock", tb, sha))
    root = tmp_path / "cache"
    cached = fetch_source(lock, root=root, progress=NullProgress()).tarball
    cached.write_bytes(b"bit rot")
    got = fetch_source(lock, root=root, progress=NullProgress())
    assert not got.cache_hit
    assert hashlib.sha256(got.tarball.read_bytes()).hexdigest() == sha


@pytest.fixture
def http_dir(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    served = tmp_path / "www"
    served.mkdir()

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(Quiet, directory=str(served))
    )
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", served
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_url_source_downloads_with_progress(tmp_path: Path, http_dir: tuple[str, Path]) -> None:
    base, served = http_dir
    tb, sha = _tarball(served)
    lock = load_lock(
        _lock_with_sources(
            tmp_path / "l.lock",
            f'[[source]]\nkind = "url"\nurl = "{base}/missing.tgz"\nsha256 = "{sha}"\nsubdir = "x"\n'
            f'[[source]]\nkind = "url"\nurl = "{base}/{tb.name}"\nsha256 = "{sha}"\nsubdir = "x"\n',
        )
    )
    rec = Recorder()
    got = fetch_source(lock, root=tmp_path / "cache", progress=rec)
    assert got.source is lock.sources[1]
    assert ("download source", 1.0, f"{tb.stat().st_size >> 20} MiB") in rec.updates


def test_pip_download_reports_overall_progress(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[list[str]] = []

    def fake_run(argv: list[str], *, on_line: Any = None, **kw: Any) -> RunResult:
        seen.append([str(a) for a in argv])
        for line in [
            "Collecting a==1",
            "  Downloading a-1-py3-none-any.whl (10 MB)",
            "Progress 5 of 10",
            "Progress 10 of 10",
            "  Downloading b-1-py3-none-any.whl (10 MB)",
            "Progress 5 of 10",
        ]:
            on_line(line)
        (tmp_path / "a-1-py3-none-any.whl").write_bytes(b"")
        return RunResult(0, ())

    monkeypatch.setattr(fetch, "run_streaming", fake_run)
    rec = Recorder()
    pip = Pip(argv=(sys.executable, "-m", "pip"), version=(25, 0))
    files = pip_download(["a==1", "b==1"], tmp_path, progress=rec, stage="dl", sdist=False, pip=pip)
    assert files == [tmp_path / "a-1-py3-none-any.whl"]
    fractions = [f for s, f, _ in rec.updates if s == "dl" and f is not None]
    assert fractions == [0.0, 0.25, 0.5, 0.5, 0.75]
    argv = seen[0]
    assert argv[1:4] == ["-m", "pip", "download"] and "--no-deps" in argv and "--no-binary" not in argv


def test_pip_failure_shows_pips_last_lines(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        fetch, "run_streaming", lambda argv, **kw: RunResult(1, ("ERROR: No matching distribution",))
    )
    with pytest.raises(FetchError, match=r"(?s)exit 1.*No matching distribution"):
        pip_download(["nope==1"], tmp_path, progress=NullProgress(), stage="dl", pip=Pip(("pip",), (25, 0)))


# --- the pip a fresh venv brings (Debian 12: 23.0.1) and a current one, through a fake pip that parses
# options like that version does (tests/fakes/fake_pip.py).

FAKE_PIP = Path(__file__).resolve().parents[1] / "fakes" / "fake_pip.py"
SDIST_LOCK = """format = 1
[llama_cpp]
commit = "{commit}"
version_line = "{version_line}"
[build]
target = "llama-server"
cmake_args = []
[[source]]
kind = "pypi-sdist"
package = "llama-cpp-python"
version = "0.3.36"
sha256 = "{sha}"
subdir = "llama.cpp-fake"
"""


def _fake_pip(tmp_path: Path, version: str) -> tuple[tuple[str, ...], Path, str]:
    """argv of a fake pip of ``version`` serving a fake llama-cpp-python sdist; (argv, folder, sha)."""
    served = tmp_path / f"index-{version}"
    served.mkdir()
    tb, sha = _tarball(tmp_path)
    (served / "llama-cpp-python").write_bytes(tb.read_bytes())
    return (sys.executable, str(FAKE_PIP), "--as", version, "--serve", str(served)), served, sha


def _calls(served: Path) -> list[list[str]]:
    return [json.loads(line) for line in (served / "calls.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("version", ["23.0.1", "23.2.1", "24.0", "24.1", "25.3"])
def test_the_source_fetch_works_with_old_and_current_pip(tmp_path: Path, version: str) -> None:
    argv, served, sha = _fake_pip(tmp_path, version)
    lock_path = tmp_path / "l.lock"
    lock_path.write_text(SDIST_LOCK.format(commit=COMMIT, version_line=VERSION_LINE, sha=sha))
    lock = load_lock(lock_path)
    rec = Recorder()
    got = fetch_source(lock, root=tmp_path / "cache", progress=rec, pip=find_pip(argv))
    assert hashlib.sha256(got.tarball.read_bytes()).hexdigest() == sha and not got.cache_hit
    download = _calls(served)[-1]
    raw = version not in ("23.0.1", "23.2.1", "24.0")
    assert download[download.index("--progress-bar") + 1] == ("raw" if raw else "off")
    # Only the package itself as an sdist: its build dependencies may come as wheels.
    assert download[download.index("--no-binary") + 1] == "llama-cpp-python"
    details = [d for s, _, d in rec.updates if s == "download source"]
    assert any(d.startswith("Downloading llama-cpp-python-0.3.36.tar.gz") for d in details)
    assert any(d.startswith("Installing build dependencies") for d in details)
    assert not any("Building wheel" in d for d in details)
    byte_progress = [d for d in details if d.startswith("file 1 of 1")]
    assert bool(byte_progress) == raw
    # No byte progress: no made-up percentage either (a "0%" download would look stuck).
    fractions = {f for s, f, _ in rec.updates if s == "download source" and f != 1.0}
    if raw:
        assert None not in fractions and 0.0 in fractions and any(0 < f < 1 for f in fractions if f)
    else:
        assert fractions == {None}


def test_raw_progress_on_pip_23_is_what_pip_23_refuses(tmp_path: Path) -> None:
    """The fake is faithful: asking pip 23 for raw progress fails as it did on a fresh Debian 12."""
    argv, _, _ = _fake_pip(tmp_path, "23.0.1")
    wrong = Pip(argv=argv, version=(24, 1))  # a caller that assumed a new pip
    with pytest.raises(FetchError, match=r"invalid choice: 'raw' \(choose from 'on', 'off'\)"):
        pip_download(
            ["llama-cpp-python==0.3.36"], tmp_path / "d", progress=NullProgress(), stage="dl", pip=wrong
        )


def test_find_pip_reads_the_version_of_the_pip_it_will_run(tmp_path: Path) -> None:
    argv, _, _ = _fake_pip(tmp_path, "23.2.1")
    assert find_pip(argv) == Pip(argv=argv, version=(23, 2))
    assert find_pip().version >= (23, 0)  # this interpreter's own pip


def test_a_python_without_pip_is_named_with_the_fix(tmp_path: Path) -> None:
    with pytest.raises(ToolMissing, match=r"pip not found for .*No module named nopip_here.*ensurepip"):
        find_pip((sys.executable, "-m", "nopip_here"))
