"""``verify``: is the installed llama-server the one the lock pins, and does it actually serve?

Checks, in order; the first failure stops the run because later checks build on earlier ones:

  installed   a binary and a receipt exist for this lock's digest
  receipt     the receipt belongs to this lock (lock digest)
  binary      the binary hashes to the receipt's sha256 (hashed fresh: no cache is trusted here)
  version     ``--version`` prints the locked version line (which names the commit)
  reference   the lock's reference digest, when it has one: a difference is a WARNING only, because
              another compiler legitimately produces other bytes
  devices     a GPU variant only: ``--list-devices`` names a device (in the environment the knobs give
              the child, GGML_VK_VISIBLE_DEVICES included), with the memory its driver reports
  model       the model is a GGUF and hashes to the expected sha256
  serve       start, /health 200, the alias is listed, one token decoded, stopped (``serve=False`` skips);
              a GPU variant serves with every layer offloaded (-ngl 99)
  offload     a GPU variant only: the child's own log says every layer went to a device (not the CPU):
              a build that silently falls back to the CPU fails here
"""

from __future__ import annotations

import asyncio
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from supervisor.artifacts.build import install_dir, version_output
from supervisor.artifacts.demo_model import DEFAULT_DEMO, ensure_demo_model
from supervisor.artifacts.files import sha256_fresh, verify_model
from supervisor.artifacts.lock import DEFAULT_VARIANT, load_lock
from supervisor.artifacts.receipt import RECEIPT_NAME, Receipt, read_receipt
from supervisor.artifacts.smoke import smoke_decode
from supervisor.budget.devices import Devices, list_devices
from supervisor.errors import BuildError, CheckFailed, DigestMismatch, StartupError
from supervisor.launch.knobs import LlamaKnobs
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
    variant: str = DEFAULT_VARIANT
    devices: Devices | None = None  # a GPU variant's --list-devices

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
            "variant": self.variant,
            "devices": None if self.devices is None else [d.as_dict() for d in self.devices.listed],
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
    variant: str = DEFAULT_VARIANT,
    knobs: LlamaKnobs | None = None,
) -> VerifyReport:
    """``variant``: which of the lock's builds; ``knobs``: its device knobs (``device``,
    ``vulkan_devices``) as a config would give them to the child."""
    lock = load_lock(lock_path, variant)
    knobs = knobs if knobs is not None else LlamaKnobs(variant=variant)
    root = cache if cache is not None else cache_root()
    report = VerifyReport(lock_path=lock_path, lock_digest=lock.digest, variant=variant)
    folder = install_dir(lock, root)
    binary = folder / lock.target
    if not (binary.is_file() and (folder / RECEIPT_NAME).is_file()):
        report.checks.append(
            Check(
                "installed",
                False,
                f"no llama-server built for this lock in {folder}: run 'llamagate build --variant {variant}'",
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
    gpu = variant != DEFAULT_VARIANT
    if gpu and not _add(report, _devices_check(report, binary, knobs)):
        return report
    served, alias = _model_check(report, root, model, model_sha256, serve, progress)
    if served is None or not serve:
        return report
    progress.update("smoke test", None, f"starting llama-server with {served.name}")
    try:
        gpu_layers = ALL_LAYERS if gpu else 0
        result = asyncio.run(smoke_decode(binary, served, alias=alias, gpu_layers=gpu_layers, knobs=knobs))
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
    if gpu:
        report.checks.append(_offload_check(result.offloaded, result.devices))
    return report


# -ngl above any layer count: every repeating layer and the output layer (llama-model.cpp).
ALL_LAYERS = 99


def _devices_check(report: VerifyReport, binary: Path, knobs: LlamaKnobs) -> Check:
    devices = list_devices(binary, knobs)
    report.devices = devices
    if not devices.listed:
        return Check("devices", False, devices.note or "--list-devices lists no device")
    shown = "; ".join(
        f"{d.name}: {d.description} ({d.total_bytes >> 20} MiB, {d.free_bytes >> 20} MiB free)"
        for d in devices.listed
    )
    chosen = devices.chosen(knobs.device)
    if chosen is None:
        return Check("devices", False, f"--device {knobs.device} is not among the listed devices: {shown}")
    return Check("devices", True, f"--list-devices: {shown}", found=chosen.name)


def _offload_check(offloaded: str | None, devices: tuple[str, ...]) -> Check:
    """Every layer on a device, by the child's own log; anything else is a CPU fallback."""
    if offloaded is None:
        return Check("offload", False, "the child's log says nothing of offloaded layers: not a GPU load")
    done, of = (int(n) for n in offloaded.split("/"))
    if done < of or not devices:
        where = ", ".join(devices) or "no device buffer"
        return Check(
            "offload",
            False,
            f"only {offloaded} layers offloaded ({where}): the rest ran on the CPU",
            expected=f"{of}/{of}",
            found=offloaded,
        )
    return Check("offload", True, f"offloaded {offloaded} layers to {', '.join(devices)}", found=devices[0])


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
