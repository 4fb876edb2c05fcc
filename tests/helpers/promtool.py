"""Run ``promtool`` (Debian package ``prometheus``) from tests.

Missing promtool skips the test with the package to install, and fails it under ``CI=true``: the
acceptance of the metrics work is that promtool accepts what we serve and the rules we ship, and CI
installs it (tests/helpers/system.py).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from tests.helpers.system import require_tool


def promtool() -> str:
    return require_tool("promtool")


def check_metrics(exposition: bytes) -> subprocess.CompletedProcess[str]:
    """``promtool check metrics`` reads the exposition on stdin; exit 0 means no error and no lint problem."""
    return subprocess.run(
        [promtool(), "check", "metrics"],
        input=exposition.decode(),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def run(*args: str | Path, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [promtool(), *map(str, args)], capture_output=True, text=True, timeout=120, cwd=cwd, check=False
    )
