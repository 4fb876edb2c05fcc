"""The build receipt: a JSON file next to each installed llama-server saying exactly how it was made.

``verify`` trusts nothing else: the binary must hash to ``binary_sha256`` and the receipt must belong to
the lock in use (``lock_digest``). Field by field documentation lives in docs/build.md.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from supervisor.errors import CheckFailed
from supervisor.paths import new_file_mode

RECEIPT_FORMAT = 1
RECEIPT_NAME = "receipt.json"
_OPTIONAL = {"receipt_format", "variant", "patches"}


@dataclass(frozen=True)
class Receipt:
    lock_digest: str
    llama_cpp_commit: str
    target: str
    source_kind: str
    source: str  # where the tarball came from: "pypi-sdist pkg==ver", "url ...", "file ..."
    source_sha256: str
    cmake_args: tuple[str, ...]  # as locked, placeholders unexpanded (the folders were temporary)
    compilers: tuple[str, ...]  # first `--version` line of the C and C++ compilers cmake chose
    cmake_version: str
    binary_sha256: str
    binary_size: int
    version_output: str  # everything `llama-server --version` printed
    built_at: str  # UTC, ISO 8601
    build_seconds: float
    llamagate_version: str
    platform: str
    # None when the lock names no reference digest; False is a warning, never a failure.
    reference_match: bool | None
    receipt_format: int = RECEIPT_FORMAT
    # Receipts written before build variants existed have neither: they are the default build's.
    variant: str = "cpu"
    patches: tuple[str, ...] = ()  # "name (sha256 ...)" of each patch applied to the verified source

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["cmake_args"] = list(self.cmake_args)
        out["compilers"] = list(self.compilers)
        out["patches"] = list(self.patches)
        return out


def read_receipt(path: Path) -> Receipt:
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckFailed(f"build receipt not found: {path}") from None
    except (OSError, ValueError) as exc:
        raise CheckFailed(f"build receipt unreadable: {path}: {exc}") from None
    if not isinstance(raw, dict):
        raise CheckFailed(f"build receipt malformed: {path}: not a JSON object")
    names = {f.name for f in fields(Receipt)}
    missing = sorted(names - raw.keys() - _OPTIONAL)
    unknown = sorted(raw.keys() - names)
    if missing or unknown:
        raise CheckFailed(f"build receipt malformed: {path}: missing {missing}, unknown {unknown}")
    if raw.get("receipt_format", RECEIPT_FORMAT) != RECEIPT_FORMAT:
        raise CheckFailed(f"build receipt {path}: format {raw['receipt_format']} is not supported")
    try:
        raw["cmake_args"] = tuple(str(a) for a in raw["cmake_args"])
        raw["compilers"] = tuple(str(c) for c in raw["compilers"])
        raw["patches"] = tuple(str(p) for p in raw.get("patches", ()))
        return Receipt(**raw)
    except TypeError as exc:
        raise CheckFailed(f"build receipt malformed: {path}: {exc}") from None


def write_receipt(receipt: Receipt, path: Path) -> None:
    """Write atomically: a reader sees the old receipt or the new one, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        # mkstemp makes 0600; the receipt is read by whoever runs the binary (paths.new_file_mode).
        os.fchmod(fd, new_file_mode())
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(receipt.to_json(), fh, indent=2, sort_keys=True)
            fh.write("\n")
            fh.flush()
            os.fsync(fh.fileno())
        Path(tmp).replace(path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
