"""``ensure_binary``: the llama-server the lock describes, built once, installed atomically, reused.

The same code builds the lock's other tools from the same sources and cmake arguments
(``target="llama-quantize"``, see ``artifacts.tools``): each target has its own folder, flock and
receipt beside llama-server's, keyed by the same lock digest, so a cache hit for one never depends on
the other.

Cache layout (``<root>`` = ``paths.cache_root()`` unless given; ``<target>`` = ``llama-server`` or a
tool such as ``llama-quantize``)::

    <root>/sources/<sha256>                       verified source tarballs (content-addressed)
    <root>/<target>/<digest[:16]>/                one finished install per lock digest
        <target>  receipt.json  build.log
    <root>/<target>/<digest[:16]>.lock            flock: one builder per digest at a time
    <root>/<target>/.build-<digest[:16]>-*/       a build in progress (source, build tree, staging)

Races and interruptions: a builder holds the flock for the whole build; a second one waits, then
finds the install and returns it. The install folder appears in one ``rename`` of a fully written
staging folder, so no reader ever sees a half binary. A killed build leaves only its
``.build-*`` folder, which the next builder removes once it can take that digest's flock (a dead
process holds no lock).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import platform
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from supervisor import __version__
from supervisor.artifacts import cmake, tools
from supervisor.artifacts.fetch import fetch_source
from supervisor.artifacts.files import sha256_fresh
from supervisor.artifacts.lock import DEFAULT_VARIANT, Lock, load_lock
from supervisor.artifacts.receipt import RECEIPT_NAME, Receipt, read_receipt, write_receipt
from supervisor.artifacts.unpack import safe_extract
from supervisor.errors import BuildError, DigestMismatch
from supervisor.paths import cache_root
from supervisor.progress import Progress

log = logging.getLogger("llamagate.build")

BUILD_LOG_NAME = "build.log"


@dataclass(frozen=True)
class InstalledBinary:
    path: Path
    receipt: Receipt
    lock: Lock
    cache_hit: bool = True

    @property
    def folder(self) -> Path:
        return self.path.parent


def binaries_dir(root: Path, target: str = "llama-server") -> Path:
    return root / target


def install_dir(lock: Lock, root: Path, target: str | None = None) -> Path:
    return binaries_dir(root, target or lock.target) / lock.digest[:16]


def find_installed(
    lock_path: Path, *, cache: Path | None = None, target: str | None = None, variant: str = DEFAULT_VARIANT
) -> InstalledBinary | None:
    """The installed binary for this lock (``target``: the lock's, or one of ``tools.TOOLS``), or None.
    Never builds.

    Raises DigestMismatch when the install exists but the binary no longer hashes to its receipt:
    a tampered or corrupted binary must be noticed, never served and never silently rebuilt over.
    """
    lock = load_lock(lock_path, variant)
    return _installed(lock, cache if cache is not None else cache_root(), target or lock.target)


def _installed(lock: Lock, root: Path, target: str) -> InstalledBinary | None:
    folder = install_dir(lock, root, target)
    binary = folder / target
    receipt_path = folder / RECEIPT_NAME
    if not (binary.is_file() and receipt_path.is_file()):
        return None
    receipt = read_receipt(receipt_path)
    if receipt.lock_digest != lock.digest:
        raise BuildError(f"{receipt_path} belongs to lock digest {receipt.lock_digest}, not {lock.digest}")
    found = sha256_fresh(binary)
    if found != receipt.binary_sha256:
        raise DigestMismatch(f"installed {binary} (remove {folder} to rebuild)", receipt.binary_sha256, found)
    return InstalledBinary(path=binary, receipt=receipt, lock=lock)


def ensure_binary(
    lock_path: Path,
    *,
    cache: Path | None = None,
    progress: Progress,
    target: str | None = None,
    variant: str = DEFAULT_VARIANT,
) -> InstalledBinary:
    """The lock's llama-server (or, with ``target``, one of its tools), built on a cache miss;
    ``variant``: which of the lock's builds (``cpu``, the default, or a ``[variant.NAME]``)."""
    lock = load_lock(lock_path, variant)
    root = cache if cache is not None else cache_root()
    target = target or lock.target
    if target != lock.target and target not in tools.TOOLS:
        known = ", ".join(sorted({lock.target, *tools.TOOLS}))
        raise BuildError(f"unknown build target {target!r} (known: {known})")
    hit = _installed(lock, root, target)
    if hit is not None:
        return hit
    folder = binaries_dir(root, target)
    folder.mkdir(parents=True, exist_ok=True)
    with _digest_lock(folder, lock.digest[:16], blocking=True, progress=progress):
        hit = _installed(lock, root, target)  # another builder may have finished while we waited
        if hit is not None:
            return hit
        _clean_dead_builds(folder, own_key=lock.digest[:16])
        return _build(lock, root, progress, target)


@contextlib.contextmanager
def _digest_lock(
    folder: Path, key: str, *, blocking: bool, progress: Progress | None = None
) -> Iterator[bool]:
    with (folder / f"{key}.lock").open("a") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if not blocking:
                yield False
                return
            if progress is not None:
                progress.update("build", None, "another llamagate is building this lock; waiting for it")
            fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield True
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _clean_dead_builds(folder: Path, own_key: str) -> None:
    """Remove build folders whose builder is gone. We hold ``own_key``'s lock, so its leftovers are
    dead by definition; for other digests, a lock we can take means nobody is building them.
    (flock is per open file, so taking it again here for ``own_key`` would fail: hence the case.)"""
    for leftover in folder.glob(".build-*-*"):
        key = leftover.name.split("-")[1]
        if key == own_key:
            _remove_leftover(leftover)
            continue
        with _digest_lock(folder, key, blocking=False) as free:
            if free:
                _remove_leftover(leftover)


def _remove_leftover(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
    log.info("removed leftover of an interrupted build", extra={"fields": {"path": str(path)}})


def _build(lock: Lock, root: Path, progress: Progress, target: str) -> InstalledBinary:
    key = lock.digest[:16]
    started = time.monotonic()
    folder = binaries_dir(root, target)
    work = Path(tempfile.mkdtemp(prefix=f".build-{key}-", dir=folder)).resolve()
    # Outside ``work`` so that it survives a failed build, where the error message points to it.
    log_path = folder / f"{key}.build.log"
    log_path.write_text("", encoding="utf-8")
    try:
        env = cmake.build_env(work)
        toolchain = cmake.find_toolchain(env)
        cmake.check_requires(lock, env)
        fetched = fetch_source(lock, root=root, progress=progress)
        progress.update("unpack", None, fetched.source.describe())
        safe_extract(fetched.tarball, work / "src")
        source_dir = (work / "src" / fetched.source.subdir).resolve()
        if not (source_dir / "CMakeLists.txt").is_file():
            raise BuildError(
                f"{fetched.source.describe()}: no CMakeLists.txt under {fetched.source.subdir!r}"
            )
        # After the tarball's sha256 check (fetch_source) and before anything is configured.
        for patch in lock.patches:
            progress.update("patch", None, patch.name)
            cmake.apply_patch(patch, source_dir, env, log_path)
        build_dir = work / "build"
        args = cmake.expand_args(lock.cmake_args, source_dir, build_dir)
        if lock.target_options:
            script = work / cmake.TARGET_OPTIONS_FILE
            script.write_text(cmake.target_options_script(lock.target_options), encoding="utf-8")
            args.append(f"-DCMAKE_PROJECT_INCLUDE={script}")
        progress.update("configure", None, "cmake")
        cmake.configure(toolchain, source_dir, build_dir, args, env, log_path)
        cmake.compile_target(toolchain, build_dir, target, cmake.default_jobs(), env, log_path, progress)
        built = build_dir / "bin" / target
        if not built.is_file():
            raise BuildError(f"cmake reported success but {built} does not exist; see {log_path}")
        reported = version_output(built, tools.identity_args(target))
        if lock.version_line not in reported.splitlines():
            raise BuildError(
                f"built {target} reports the wrong version: expected a line {lock.version_line!r}, "
                f"found {reported.strip()!r}"
            )
        stage = work / "install"
        stage.mkdir()
        binary = stage / target
        shutil.copy2(built, binary)
        digest = sha256_fresh(binary)
        receipt = Receipt(
            lock_digest=lock.digest,
            llama_cpp_commit=lock.commit,
            target=target,
            source_kind=fetched.source.kind,
            source=fetched.source.describe(),
            source_sha256=fetched.source.sha256,
            cmake_args=lock.cmake_args,
            compilers=cmake.compilers_used(build_dir, env),
            cmake_version=toolchain.cmake_version,
            binary_sha256=digest,
            binary_size=binary.stat().st_size,
            version_output=reported,
            built_at=datetime.now(UTC).isoformat(timespec="seconds"),
            build_seconds=round(time.monotonic() - started, 1),
            llamagate_version=__version__,
            platform=f"{platform.system()} {platform.machine()} {platform.release()}",
            # The lock's reference digest is llama-server's; a tool has none to compare with.
            reference_match=_reference_match(lock, digest) if target == lock.target else None,
            variant=lock.variant,
            patches=tuple(f"{p.name} (sha256 {p.sha256})" for p in lock.patches),
        )
        write_receipt(receipt, stage / RECEIPT_NAME)
        shutil.move(log_path, stage / BUILD_LOG_NAME)
        final = install_dir(lock, root, target)
        # A leftover without a valid receipt (impossible through this code, possible by hand) is
        # replaced: we hold the digest's lock, so nobody else is reading it as an install.
        if final.exists():
            shutil.rmtree(final)
        stage.rename(final)
        progress.done("build", f"{final / target}")
        return InstalledBinary(path=final / target, receipt=receipt, lock=lock, cache_hit=False)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def version_output(binary: Path, args: tuple[str, ...] = ("--version",)) -> str:
    """Everything ``binary --version`` prints (llama-server writes it to stderr); ``args``: what makes
    a tool without ``--version`` print its build's version line (``tools.identity_args``)."""
    try:
        out = subprocess.run(
            [str(binary), *args],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
            errors="replace",
            # No LLAMA_ARG_* or config.ini from our environment can change what it reports.
            env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise BuildError(f"{binary} --version did not run: {exc}") from None
    return (out.stderr + out.stdout).strip()


def _reference_match(lock: Lock, digest: str) -> bool | None:
    if lock.reference is None:
        return None
    match = digest == lock.reference.binary_sha256
    if not match:
        log.warning(
            "binary differs from the lock's reference digest (expected on another toolchain)",
            extra={
                "fields": {
                    "reference_toolchain": lock.reference.toolchain,
                    "reference_sha256": lock.reference.binary_sha256,
                    "found": digest,
                }
            },
        )
    return match
