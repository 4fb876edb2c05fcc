"""Run ``promtool`` (Debian package ``prometheus``) from tests.

Missing promtool is a failure, not a skip: the acceptance of the metrics work is that promtool accepts
what we serve and the rules we ship, and a skipped check would pass on a machine that proves nothing.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail(
            "promtool not found: install the Debian package 'prometheus' (apt-get install -y prometheus)"
        )
    return path


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
