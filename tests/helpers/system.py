"""System tools some tests drive (Debian packages the README's setup line installs).

A test that needs one calls ``require_tool("promtool")`` or carries ``@pytest.mark.needs_tool("nginx")``
(tests/conftest.py turns the marker into the same call). When the tool is missing the test is skipped
with the package to install, so a newcomer who has not run the README's apt-get line sees why; under
``CI=true`` (``.ci/run``) a missing tool is a failure instead: CI installs every one of them, and a
skipped check there would pass while proving nothing.
"""

from __future__ import annotations

import os
import shutil

import pytest

# tool -> the Debian package that brings it; tests/unit/test_readme_ci.py checks that the README's
# apt-get line installs every one of these packages.
TOOL_PACKAGES: dict[str, str] = {
    "promtool": "prometheus",
    "prometheus": "prometheus",
    "systemd-analyze": "systemd",
    "nginx": "nginx",
    "chromium": "chromium",
    "chromedriver": "chromium-driver",
}

# nginx lives in /usr/sbin, which a non-root user's PATH often lacks.
_EXTRA_DIRS = ("/usr/sbin", "/sbin")


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def find_tool(name: str) -> str | None:
    path = os.environ.get("PATH", "")
    return shutil.which(name, path=os.pathsep.join([path, *_EXTRA_DIRS]))


def require_tool(name: str) -> str:
    """The tool's path; skips the test when it is missing (fails under CI=true)."""
    found = find_tool(name)
    if found is not None:
        return found
    package = TOOL_PACKAGES.get(name, name)
    message = (
        f"{name} not found: install the Debian package '{package}' "
        "(the README's setup line: sudo apt-get install ... " + package + ")"
    )
    if in_ci():
        pytest.fail(f"{message}; CI=true, so a missing tool is a failure, not a skip")
    pytest.skip(message)
