"""``verify``: is the installed llama-server the one the lock pins, and does it actually serve?

Checks, in order; the first failure stops the run because later checks build on earlier ones:

  installed   a binary and a receipt exist for this lock's digest
  receipt     the receipt belongs to this lock (lock digest)
  binary      the binary hashes to the receipt's sha256 (hashed fresh: no cache is trusted here)
  version     ``--version`` prints the locked version line (which names the commit)
  reference   the lock's reference digest, when it has one: a difference is a WARNING only, because
              another compiler legitimately produces other bytes
  model       the model is a GGUF and hashes to the expected sha256
  serve       start, /health 200, the alias is listed, one token decoded, stopped (``serve=False`` skips)
"""

from __future__ import annotations

import asyncio
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from supervisor.artifacts.build import install_dir, version_output
from supervisor.artifacts.demo_model import DEFAULT_DEMO, ensure_demo_model
from supervisor.artifacts.files import sha256_fresh, verify_model
from supervisor.artifacts.lock import load_lock
from supervisor.artifacts.receipt import RECEIPT_NAME, Receipt, read_receipt
from supervisor.artifacts.smoke import smoke_decode
from supervisor.errors import BuildError, CheckFailed, DigestMismatch, StartupError
from supervisor.paths import cache_root
from supervisor.progress import Progress


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str
    expected: str | None = None
    found: str | None = None
    warning: bool = False  # ok stays True: reported, never fatal


@dataclass
class VerifyReport:
    lock_path: Path
    lock_digest: str
    binary: Path | None = None
    receipt: Receipt | None = None
    checks: list[Check] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    @property
    def failed(self) -> Check | None:
        return next((c for c in self.checks if not c.ok), None)

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "lock": str(self.lock_path),
            "lock_digest": self.lock_digest,
            "binary": None if self.binary is None else str(self.binary),
            "receipt": None if self.receipt is None else self.receipt.to_json(),
            "checks": [asdict(c) for c in self.checks],
        }


def verify(
    lock_path: Path,
    *,
    cache: Path | None = None,
    model: Path | None = None,
    model_sha256: str | None = None,
    serve: bool = True,
    progress: Progress,
) -> VerifyReport:
    lock = load_lock(lock_path)
    root = cache if cache is not None else cache_root()
    report = VerifyReport(lock_path=lock_path, lock_digest=lock.digest)
    folder = install_dir(lock, root)
    binary = folder / lock.target
    if not (binary.is_file() and (folder / RECEIPT_NAME).is_file()):
        report.checks.append(
            Check(
                "installed", False, f"no llama-server built for this lock in {folder}: run 'llamagate build'"
            )
        )
        return report
    report.binary = binary
    try:
        receipt = read_receipt(folder / RECEIPT_NAME)
    except CheckFailed as exc:
        report.checks.append(Check("receipt", False, str(exc)))
        return report
    report.receipt = receipt
    if not _add(report, _equal("receipt", "receipt belongs to this lock", lock.digest, receipt.lock_digest)):
        return report
    progress.update("hash binary", None, str(binary))
    found = sha256_fresh(binary)
    progress.done("hash binary")
    if not _add(report, _equal("binary", "binary sha256 matches its receipt", receipt.binary_sha256, found)):
        return report
    version = _version_output(binary)
    first = next((ln for ln in version.splitlines() if ln.startswith("version:")), version.strip())
    if not _add(report, _equal("version", "--version reports the locked commit", lock.version_line, first)):
        return report
    if lock.reference is not None:
        same = found == lock.reference.binary_sha256
        detail = (
            "binary identical to the lock's reference build"
            if same
            else f"binary differs from the reference build on {lock.reference.toolchain} (expected with "
            "another compiler or library version; not a failure)"
        )
        report.checks.append(
            Check("reference", True, detail, lock.reference.binary_sha256, found, warning=not same)
        )
    served, alias = _model_check(report, root, model, model_sha256, serve, progress)
    if served is None or not serve:
        return report
    progress.update("smoke test", None, f"starting llama-server with {served.name}")
    try:
        result = asyncio.run(smoke_decode(binary, served, alias=alias))
        progress.done("smoke test")
    except StartupError as exc:
        progress.done("smoke test", "failed")
        report.checks.append(Check("serve", False, str(exc)))
        return report
    report.checks.append(
        Check(
            "serve",
            True,
            f"/health 200 after {result.ready_seconds:.1f} s, one token decoded in "
            f"{result.token_seconds:.2f} s ({result.token_text!r}), stopped",
        )
    )
    return report


def _model_check(
    report: VerifyReport,
    root: Path,
    model: Path | None,
    model_sha256: str | None,
    serve: bool,
    progress: Progress,
) -> tuple[Path | None, str]:
    """Check the given model, or the demo model when serving without one. Returns (model, alias)."""
    if model is not None and model_sha256 is not None:
        path, expected, alias = model.resolve(), model_sha256, model.stem
    elif serve:
        try:
            path = ensure_demo_model(cache=root, progress=progress).resolve()
        except CheckFailed as exc:
            report.checks.append(Check("model", False, f"demo model: {exc}"))
            return None, ""
        expected, alias = DEFAULT_DEMO.sha256, DEFAULT_DEMO.name
    else:
        return None, ""
    try:
        found = verify_model(path, expected, cache=root)
    except CheckFailed as exc:
        mismatch = exc.found if isinstance(exc, DigestMismatch) else None
        report.checks.append(Check("model", False, str(exc), expected, mismatch))
        return None, ""
    report.checks.append(Check("model", True, f"{path} is a GGUF with the expected sha256", expected, found))
    return path, alias


def _equal(name: str, what: str, expected: str, found: str) -> Check:
    if expected == found:
        return Check(name, True, f"{what}: {found}", expected, found)
    return Check(name, False, f"{what}: NO (expected {expected}, found {found})", expected, found)


def _add(report: VerifyReport, check: Check) -> bool:
    report.checks.append(check)
    return check.ok


def _version_output(binary: Path) -> str:
    try:
        return version_output(binary)
    except BuildError as exc:
        return f"({exc})"
